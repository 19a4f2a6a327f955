"""The LR-finding benchmark on a matrix of settings: does the default controller hold where it was not tuned?

Runs ``lr_finding.py``'s protocol (the plain sweep, HDET from 1/10 to 10 times each setting's sweep-best LR, the
LR range test, LR transfer from a half-width proxy, schedule-free AdamW, Prodigy) on every setting of
``lr_finding_matrix_settings.json``. Design settings are where a default may be chosen; holdout settings run only
with ``--holdout``, once, with the default variant, and are reported apart. A holdout judged by an earlier
default stays judged by it; ``--seen_holdout`` runs the current default there too, reported as not held out.

    .venv/bin/python benchmarks/lr_finding_matrix.py --methods sweep                 # every design sweep first
    .venv/bin/python benchmarks/lr_finding_matrix.py --methods hdet range_test proxy
    .venv/bin/python benchmarks/lr_finding_matrix.py --only wsd_wide --methods hdet --variants some_variant
    .venv/bin/python benchmarks/lr_finding_matrix.py --holdout --methods sweep hdet range_test proxy
    .venv/bin/python benchmarks/lr_finding_matrix.py --holdout --seen_holdout --methods hdet
    .venv/bin/python benchmarks/lr_finding_matrix.py --report_only

Methods run in the order given, each on every selected setting before the next method starts, so the runs that
matter most arrive first. Results accumulate in ``results/lr_finding_matrix.json`` (written after every launch;
a recorded run is never rerun) with ``lr_finding_matrix.md`` beside it. A setting with ``import_from`` starts
from the runs of that results file that match its setting and seeds. A settings file may name another report
(``"report"``): ``weight_decay_finding.json`` runs the same protocol at several weight decays, reported by
``weight_decay_report.py``; its results come from three invocations (W: the command with its files):

    W=".venv/bin/python benchmarks/lr_finding_matrix.py --settings benchmarks/weight_decay_finding.json \
       --out benchmarks/results/weight_decay_finding --runs_dir runs/weight_decay_finding"
    $W --only weight_decay_1 weight_decay_0.01 --methods sweep hdet range_test \
       --variants default_weight_decay default --start_factors 1
    $W --only weight_decay_0.1 weight_decay_0.001 --methods sweep
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import lr_finding
from common import BENCHMARKS, REPO, RESULTS, head_commit, read_json, write_json
from lr_finding_matrix_report import judged_variant, write_matrix_report
from weight_decay_report import write_weight_decay_report

SETTINGS = BENCHMARKS / "lr_finding_matrix_settings.json"
OUT = RESULTS / "lr_finding_matrix"
REPORTS = {"matrix": write_matrix_report, "weight_decay": write_weight_decay_report}
"""The report a settings file names (``"report"``; default ``matrix``)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", type=Path, default=SETTINGS)
    parser.add_argument("--only", nargs="+", default=None, help="these settings by name (default: all design "
                                                                 "settings, or all holdout ones with --holdout)")
    parser.add_argument("--holdout", action="store_true",
                        help="run the holdout settings (once, with the default variant only; --start_factors may "
                             "split its starts over invocations)")
    parser.add_argument("--seen_holdout", action="store_true",
                        help="with --holdout: run the current default on holdout settings an earlier default was "
                             "judged on; reported in a row of its own as not held out (the setting was seen before "
                             "the current default was chosen)")
    parser.add_argument("--methods", nargs="+", default=list(lr_finding.METHODS), choices=lr_finding.METHODS)
    parser.add_argument("--variants", nargs="+", default=[lr_finding.DEFAULT_VARIANT],
                        choices=list(lr_finding.VARIANTS))
    parser.add_argument("--start_factors", type=float, nargs="+", default=None,
                        help="HDET and schedule-free starts over each setting's sweep-best LR (default: "
                             "lr_finding.py's)")
    parser.add_argument("--parallel", type=int, default=1, help="launches at a time (see lr_finding.py)")
    parser.add_argument("--runs_per_launch", type=int, default=1, help="see lr_finding.py")
    parser.add_argument("--out", type=Path, default=OUT, help="results stem (.json, .md)")
    parser.add_argument("--runs_dir", type=Path, default=REPO / "runs" / "lr_finding_matrix")
    parser.add_argument("--report_only", action="store_true")
    args = parser.parse_args(argv)
    if args.holdout and args.variants != [lr_finding.DEFAULT_VARIANT]:
        parser.error(f"--holdout runs the default variant only ({lr_finding.DEFAULT_VARIANT}); drop --variants")
    if args.seen_holdout and not args.holdout:
        parser.error("--seen_holdout runs holdout settings; add --holdout")
    if args.holdout and args.start_factors and not set(args.start_factors) <= set(lr_finding.DEFAULT_START_FACTORS):
        parser.error(f"--holdout runs the default from the starts {list(lr_finding.DEFAULT_START_FACTORS)}; "
                     "--start_factors may pick some of them (to run first), not others")
    return args


def selected(plan: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """The settings of ``plan`` this invocation runs."""
    names = [entry["name"] for entry in plan["settings"]]
    unknown = set(args.only or ()) - set(names)
    if unknown:
        raise SystemExit(f"lr_finding_matrix: no setting named {', '.join(sorted(unknown))} in {args.settings}; "
                         f"the settings are {', '.join(names)}")
    return [entry for entry in plan["settings"]
            if (entry["name"] in args.only if args.only else entry["holdout"] == args.holdout)]


def setting_args(plan: dict[str, Any], entry: dict[str, Any], args: argparse.Namespace,
                 methods: list[str]) -> argparse.Namespace:
    """``lr_finding.py``'s arguments for ``entry`` running ``methods``."""
    words = []
    for key, value in {**plan["common"], **entry["args"]}.items():
        words += [f"--{key}", *map(str, value if isinstance(value, list) else [value])]
    words += ["--methods", *methods] if methods else []
    words += ["--start_factors", *map(str, args.start_factors)] if args.start_factors else []
    words += ["--variants", *args.variants, "--parallel", str(args.parallel),
              "--runs_per_launch", str(args.runs_per_launch), "--runs_dir", str(args.runs_dir / entry["name"])]
    return lr_finding.parse_args(words + (["--report_only"] if args.report_only else []))


def record_of(matrix: dict[str, Any], entry: dict[str, Any], run_args: argparse.Namespace) -> dict[str, Any]:
    """The matrix's record of ``entry``, made (from its ``import_from`` file, where it names one) if missing."""
    for record in matrix["settings"]:
        if record["name"] == entry["name"]:
            if record["setting"] != lr_finding.setting(run_args):
                raise SystemExit(f"lr_finding_matrix: setting {entry['name']} of the settings file is no longer the "
                                 f"one its recorded runs ran ({record['setting']}); give the new one another name")
            return record
    record = {"name": entry["name"], "holdout": entry["holdout"], "setting": lr_finding.setting(run_args),
              "sweep_runs": [], "runs": [], "invocations": []}
    if "import_from" in entry:
        source = read_json(REPO / entry["import_from"])
        if source["setting"] != record["setting"]:
            raise SystemExit(f"lr_finding_matrix: {entry['import_from']} holds another setting than "
                             f"{entry['name']}: {source['setting']}")
        seeds = set(run_args.seeds)
        record["sweep_runs"] = [run for run in source["sweep_runs"] if run["seed"] in seeds]
        record["runs"] = [run for run in source["runs"] if run["seed"] in seeds
                          and (run["method"] != "hdet" or run["variant"] in run_args.variants)]
        record["imported_from"] = entry["import_from"]
    matrix["settings"].append(record)
    return record


def check_holdout(record: dict[str, Any], seen: bool) -> None:
    """A holdout setting is judged by one variant, the default it first ran with; the current default runs on a
    holdout an earlier default judged only when asked for (``seen``), since that setting is no longer held out."""
    judged = judged_variant(record, lr_finding.DEFAULT_VARIANT)
    if seen and judged == lr_finding.DEFAULT_VARIANT:
        raise SystemExit(f"lr_finding_matrix: holdout setting {record['name']} was not judged by an earlier default; "
                         "run it with --holdout alone")
    if not seen and judged != lr_finding.DEFAULT_VARIANT:
        raise SystemExit(f"lr_finding_matrix: holdout setting {record['name']} already ran HDET variant {judged}, "
                         f"the default it judged; the default is now {lr_finding.DEFAULT_VARIANT}, and a holdout is "
                         "run once (--seen_holdout runs the default there, reported as not held out)")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    plan = read_json(args.settings)
    path = args.out.with_suffix(".json")
    matrix = read_json(path) or {"settings": []}
    matrix["default_variant"] = lr_finding.DEFAULT_VARIANT
    matrix["settings_file"] = str(args.settings.relative_to(REPO)) if args.settings.is_relative_to(REPO) \
        else str(args.settings)
    entries = selected(plan, args)
    if not args.report_only:
        lr_finding.check_packages(args.methods)
    commit = head_commit()  # every run of this invocation runs the same code, whatever is committed meanwhile
    for method in [] if args.report_only else args.methods:
        for entry in entries:
            run_args = setting_args(plan, entry, args, [method])
            record = record_of(matrix, entry, run_args)
            if entry["holdout"] and method == "hdet":
                check_holdout(record, args.seen_holdout)
            if method != "sweep" and not record["sweep_runs"]:
                print(f"lr_finding_matrix: {entry['name']} has no sweep yet; skipping {method}", file=sys.stderr)
                continue
            print(f"== {entry['name']}: {method}", flush=True)
            lr_finding.run_setting(run_args, record, lambda: write_json(path, matrix), commit)
            write_json(path, matrix)
    for record in matrix["settings"]:  # every recorded setting, with its summary keys up to date
        if record["sweep_runs"]:
            entry = next(item for item in plan["settings"] if item["name"] == record["name"])
            lr_finding.run_setting(setting_args(plan, entry, parse_args(["--report_only"]), []), record, lambda: None)
    write_json(path, matrix)
    REPORTS[plan.get("report", "matrix")](args.out, matrix)


if __name__ == "__main__":
    main()
