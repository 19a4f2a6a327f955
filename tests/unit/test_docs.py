"""The documentation as a reader uses it: every relative link and anchor leads somewhere, and the DeepSpeed launches
it writes out pass the pretraining script's checks as written (a reader who copies one, changing only the data,
gets a run, not a refusal)."""

from __future__ import annotations

import json
import re
import shlex

from launcher import ROOT

from hdet_scale.lm import plan
from hdet_scale.lm.train import parse_args

PAGES = ("README.md", "docs/train.md", "docs/engines.md", "launch/README.md", "ds_configs/README.md",
         "hdet_scale/lm/train.py")
SCRIPT = ("hdet_scale/lm/train.py", "hdet_scale.lm.train", "launch/deepspeed.sbatch")
"""How a command names the pretraining script (a script of the user's own, ``train.py``, is not checked)."""
TEMPLATE_VARIABLES = {"DS_CONFIG": "--deepspeed_config", "HDET_CONFIG": "--hdet_config"}
"""What launch/deepspeed.sbatch passes to the script from its environment."""
COMMAND = re.compile(r"^(\w+=\S+\s+)*(deepspeed|sbatch|torchrun|\S*python\S*)\s")
"""A line that starts a command: environment assignments, then a launcher."""


def documented_deepspeed_launches() -> list[tuple[str, list[str]]]:
    """Each documented launch of the pretraining script on DeepSpeed: the page and the script's arguments, with
    those the Slurm template passes from its environment."""
    launches = []
    for page in PAGES:
        text = re.sub(r"\\{1,2}\n\s*", " ", ROOT.joinpath(page).read_text())  # continued lines (\\ in a docstring)
        for line in text.splitlines():
            line = line.strip().strip("`")
            words = shlex.split(line) if COMMAND.match(line) else []
            at = next((index for index, word in enumerate(words) if word in SCRIPT), None)
            if at is None:
                continue
            environment = dict(word.split("=", 1) for word in words[:at] if "=" in word)
            args = words[at + 1:] + [word for variable, flag in TEMPLATE_VARIABLES.items() if variable in environment
                                     for word in (flag, environment[variable])]
            if "--deepspeed_config" in args:
                launches.append((page, args))
    return launches


def test_every_documented_deepspeed_launch_runs_as_long_as_its_schedule():
    launches = documented_deepspeed_launches()
    assert {page for page, _ in launches} >= {"README.md", "docs/train.md", "launch/README.md",
                                              "ds_configs/README.md", "hdet_scale/lm/train.py"}
    for page, words in launches:
        args = parse_args(words)
        ds_config = json.loads(ROOT.joinpath(args.deepspeed_config).read_text())
        plan._check_schedule_length(args, ds_config)  # raises with the fix in its message
        plan._refuse_flags_json_sets(args, ds_config)  # no flag the JSON overrides
        assert ROOT.joinpath(args.hdet_config).is_file(), page


LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(markdown: str) -> set[str]:
    """The anchors of a page's headings, as GitHub makes them: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", markdown, flags=re.S), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_every_relative_link_and_anchor_of_the_docs_leads_somewhere():
    pages = [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("launch/*.md"), *ROOT.glob("ds_configs/*.md"),
             ROOT / "benchmarks" / "README.md"]
    broken = []
    for page in pages:
        for target in LINK.findall(re.sub(r"```.*?```", "", page.read_text(), flags=re.S)):
            if re.match(r"\w+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text())):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken
