"""The optional extras: DDP and FSDP2 with torch alone, and a feature whose package is missing refused in one line
with its pip command. "Not installed" is a ``None`` entry in ``sys.modules``, which is what the import system and
``importlib.util.find_spec`` read as a module that cannot be imported.

This file holds the tests that start a launcher or script as a subprocess; the tests that start no process are in
tests/unit/test_extras.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

OPTIONAL = ("deepspeed", "transformers", "accelerate", "lightning", "wandb", "matplotlib")


def test_ddp_and_fsdp2_need_torch_alone_and_the_rest_say_what_to_install(tmp_path):
    script = textwrap.dedent(f"""
        import json, sys
        for name in {OPTIONAL!r}:
            sys.modules[name] = None  # not installed
        import hdet_scale
        from hdet_scale import HDETScheduler, HDETOneCycleLR
        from hdet_scale.tools import report
        from hdet_scale.engines import ddp, fsdp
        from hdet_scale.extras import MissingExtra
        said = {{}}
        for module in ("hdet_scale.engines.deepspeed", "hdet_scale.integrations.hf_trainer",
                       "hdet_scale.integrations.lightning"):
            try:
                __import__(module)
            except MissingExtra as error:
                said[module] = str(error)
        loaded = sorted(name for name in {OPTIONAL!r} if sys.modules.get(name) is not None)
        from hdet_scale.lm import train
        for argv in ([], ["--wandb", "p"], ["--deepspeed_config", "ds.json"]):
            if argv:
                sys.modules.pop("transformers", None)  # installed from here on: the next missing package speaks
            try:
                train.plan(train.parse_args(argv))
            except MissingExtra as error:
                said[" ".join(argv)] = str(error)
        print(json.dumps({{"said": said, "loaded": loaded}}))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path,
                            env={"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                                 "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.splitlines()[-1])
    assert outcome["loaded"] == []  # before train.py, which imports transformers once it is there
    assert outcome["said"] == {
        "hdet_scale.engines.deepspeed": "hdet_scale.engines.deepspeed needs deepspeed, which is not installed: "
                                        "pip install 'hdet_scale[deepspeed]'",
        "hdet_scale.integrations.hf_trainer": "hdet_scale.integrations.hf_trainer needs transformers, which is not "
                                              "installed: pip install 'hdet_scale[trainer]'",
        "hdet_scale.integrations.lightning": "hdet_scale.integrations.lightning needs lightning, which is not "
                                            "installed: pip install 'hdet_scale[lightning]'",
        "": "hdet_scale.lm.train (its Llama model) needs transformers, which is not installed: "
            "pip install 'hdet_scale[train]'",
        "--wandb p": "--wandb needs wandb, which is not installed: pip install 'hdet_scale[wandb]'",
        "--deepspeed_config ds.json": "hdet_scale.lm.train on DeepSpeed needs deepspeed, which is not installed: "
                                      "pip install 'hdet_scale[deepspeed]'",
    }
