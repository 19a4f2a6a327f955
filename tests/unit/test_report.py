"""The report command: plots and summary from metrics JSON lines (hand-made, and one written by HDET itself).

This file holds the tests that start no process; the tests that start a launcher or script as a subprocess are in
tests/e2e/test_report_e2e.py.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import struct
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from hdet_scale import HDETConfig, HDETEnsemble, ReplicaTopology
from hdet_scale.engines.ddp import DDPAdapter
from hdet_scale.metrics import MetricsWriter
from hdet_scale.tools import report, report_runs

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
NAMES = ("lr/0", "lr/embedding", "weight_decay/0")


def write_lines(path: Path, records: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in records))
    return path


def hdet_run(path: Path) -> tuple[Path, dict]:
    """An HDET metrics file in the format of SyncReport.as_record: 4 replicas, syncs every 10 steps, three
    explored values; one sync with a NaN replica (written as the string "nan") and a replica without losses.
    Returns the path and the expected final numbers, computed from the inputs here."""
    records, expected = [], {}
    multipliers = [0.5, 0.8333, 1.1667, 1.5]
    for sync in range(1, 11):
        step = 10 * sync
        losses: list = [4.0 - 0.2 * sync + 0.01 * replica for replica in range(4)]
        if sync == 9:
            losses[2] = "nan"
        if sync == 10:
            losses[3] = None
        scale = 1.0 + 0.05 * sync
        values = {}
        for index, name in enumerate(NAMES):
            scheduled = (1e-3 if name.startswith("lr") else 0.1) * (1 + index) * (1 - step / 200)
            rotated = multipliers[sync % 4:] + multipliers[:sync % 4]
            values[name] = {"replica_values": [scheduled * scale * rho for rho in rotated],
                            "base": scheduled * scale, "scale": scale, "delta": 0.1, "velocity": 0.05,
                            "next_replica_values": [scheduled * scale * rho for rho in multipliers]}
            expected[name] = (scheduled * scale, scale)
        records.append({"step": step, "replica_losses": losses, "probe_losses": None, "excluded_replicas": [],
                        "weights": [0.25] * 4, "controller_updated": True, "values": values,
                        "sync_seconds": 0.01, "bytes_averaged": 1000, "bytes_gathered": 64})
        if sync == 10:
            expected["loss"] = statistics.fmean(loss for loss in losses if isinstance(loss, float))
    return write_lines(path, records), expected


def baseline_run(path: Path) -> tuple[Path, dict]:
    """The minimal format, lines out of step order, with held-out losses and an evaluation-only line."""
    records = [{"step": step, "loss": 5.0 / (1 + step / 50)} for step in range(10, 101, 10)]
    records[4]["heldout_loss"] = 3.9
    records.append({"step": 100, "heldout_loss": 2.75})
    records.reverse()  # the report sorts by step
    return write_lines(path, records), {"loss": 5.0 / 3.0, "heldout": 2.75, "lines": 11}


def real_hdet_run(path: Path) -> tuple[Path, dict]:
    """Two syncs written by HDETEnsemble itself (one process, one replica), with the LR changed in between."""
    optimizer = torch.optim.AdamW([nn.Parameter(torch.ones(2))], lr=0.1, weight_decay=0.01)
    config = HDETConfig.from_dict({"sync_interval": 2, "metrics_path": str(path), "auto_lr": {"range_test": 0},
                                   "explore": {"weight_decay": {}}})
    hdet = HDETEnsemble(config, DDPAdapter(optimizer), topology=ReplicaTopology.single_process())
    for step, loss in enumerate([1.0, 3.0, 2.0, 6.0]):
        if step == 2:
            optimizer.param_groups[0]["lr"] = 0.05  # what a scheduler does; the base follows it
        hdet.step(loss)
    hdet.close()
    return path, {"loss": (2.0 + 6.0) / 2, "lr/0": (0.05, 1.0), "weight_decay/0": (0.01, 1.0)}


def check_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 400 and height >= 300, (path, width, height)
    assert len(data) > 10_000, (path, len(data))
    import matplotlib.image

    pixels = matplotlib.image.imread(path)  # decodes the whole file: a truncated PNG fails here
    assert len({tuple(pixel) for pixel in pixels.reshape(-1, pixels.shape[-1])[::7].tolist()}) > 20


def summary_block(stdout: str, label: str) -> str:
    match = re.search(rf"^run {re.escape(label)} \(.*?(?=^run |^wrote )", stdout, re.M | re.S)
    assert match, stdout
    return match.group(0)


def number_after(text: str, prefix: str) -> float:
    match = re.search(re.escape(prefix) + r" (\S+?)[,; \n]", text + "\n")
    assert match, (prefix, text)
    return float(match.group(1))


def base_and_scale(text: str, name: str) -> tuple[float, float]:
    match = re.search(rf"^  {re.escape(name)}: final (\S+) \((\S+) x schedule, ", text, re.M)
    assert match, (name, text)
    return float(match.group(1)), float(match.group(2))


def test_report_writes_plots_and_summary(tmp_path, capsys):
    hdet_path, hdet_expected = hdet_run(tmp_path / "hdet.jsonl")
    base_path, base_expected = baseline_run(tmp_path / "base.jsonl")
    real_path, real_expected = real_hdet_run(tmp_path / "real" / "hdet_metrics.jsonl")
    out = tmp_path / "plots"

    assert report.main([str(hdet_path), str(base_path), str(real_path), "--out", str(out),
                        "--labels", "hdet high", "baseline", "real"]) == 0
    stdout = capsys.readouterr().out

    for name in ("loss.png", "schedules_hdet_high.png", "schedules_real.png"):
        check_png(out / name)
    assert not (out / "schedules_baseline.png").exists()  # no HDET values in a plain run

    block = summary_block(stdout, "hdet high")
    assert number_after(block, "last logged train loss") == pytest.approx(hdet_expected["loss"], rel=1e-5)
    assert "syncs 10 (4 replicas)" in block
    for name in NAMES:
        assert base_and_scale(block, name) == pytest.approx(hdet_expected[name], rel=1e-5)

    block = summary_block(stdout, "baseline")
    assert number_after(block, "last logged train loss") == pytest.approx(base_expected["loss"], rel=1e-5)
    assert number_after(block, "final held-out loss") == pytest.approx(base_expected["heldout"], rel=1e-5)
    assert "syncs" not in block and f"{base_expected['lines']} lines, steps 10-100" in block

    block = summary_block(stdout, "real")
    assert number_after(block, "last logged train loss") == pytest.approx(real_expected["loss"], rel=1e-5)
    assert "syncs 2 (1 replica)" in block
    for name in ("lr/0", "weight_decay/0"):
        assert base_and_scale(block, name) == pytest.approx(real_expected[name], rel=1e-5)

    summary = json.loads((out / "summary.json").read_text())
    runs = {run["label"]: run for run in summary["runs"]}
    assert runs["hdet high"]["final_loss"] == pytest.approx(hdet_expected["loss"])
    assert runs["hdet high"]["values"]["lr/embedding"]["scale"] == pytest.approx(hdet_expected["lr/embedding"][1])
    assert runs["baseline"]["final_heldout_loss"] == pytest.approx(2.75)
    assert runs["real"]["values"]["lr/0"]["base"] == pytest.approx(0.05)


def test_a_run_that_ended_on_nan_gives_a_summary_strict_json_readers_take(tmp_path):
    """summary.json held a bare NaN, which jq and JavaScript refuse (the metrics files write "nan")."""
    path = write_lines(tmp_path / "diverged.jsonl", [{"step": 1, "loss": 2.0}, {"step": 2, "loss": float("nan")}])
    report.report([path], tmp_path / "plots")

    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    summary = json.loads((tmp_path / "plots" / "summary.json").read_text(), parse_constant=refuse)
    assert summary["runs"][0]["final_loss"] == "nan"


def test_loss_of_a_sync_line():
    assert report_runs.train_loss({"step": 1, "replica_losses": [1.0, None, "nan", 2.0]}) == pytest.approx(1.5)
    assert math.isnan(report_runs.train_loss({"step": 1, "replica_losses": ["nan", None]}))
    assert report_runs.train_loss({"step": 1, "loss": 0.5, "replica_losses": [1.0]}) == 0.5
    assert report_runs.train_loss({"step": 1, "heldout_loss": 0.5}) is None


def test_default_labels_tell_same_named_files_apart(tmp_path):
    paths = [tmp_path / "a" / "hdet_metrics.jsonl", tmp_path / "b" / "hdet_metrics.jsonl"]
    assert report_runs.default_labels(paths) == ["a/hdet_metrics", "b/hdet_metrics"]
    assert report_runs.default_labels([tmp_path / "x.jsonl", tmp_path / "y.jsonl"]) == ["x", "y"]


@pytest.mark.parametrize(("content", "message"), [
    (None, "no such file"),
    ("", "no metrics lines"),
    ("\n  \n", "no metrics lines"),
    ("step,loss\n1,2.0\n", "line 1: not valid JSON (Expecting value), and no line is: not a metrics file"),
    ('{"step": 1, "loss": 2.0}\n[1, 2]\n', "line 2: expected a JSON object"),
    ('{"loss": 2.0}\n', "line 1: needs an integer 'step'"),
    ('{"step": 1, "lr": 2.0}\n', "line 1: has none of loss, replica_losses, heldout_loss"),
    ('{"step": 1, "loss": "low"}\n', "line 1: loss must be a number"),
    (b"\x89PNG\r\n\x1a\n\x00\xff", "not a text file"),
    ('{"step": 5, "replica_losses": [1.0], "values": {"lr/0": {"base": [1]}}}\n',
     "line 1: values['lr/0'].base must be a number"),
])
def test_bad_files_are_named(tmp_path, capsys, content, message):
    path = tmp_path / "metrics.jsonl"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as raised:
        report.main([str(path), "--out", str(tmp_path / "o")])
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert str(path) in err and message in err, err


def test_an_out_that_cannot_be_written_is_refused_before_any_work(tmp_path, capsys):
    path, _ = baseline_run(tmp_path / "base.jsonl")
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    for option in ("--out", "--export-schedule"):
        with pytest.raises(SystemExit) as raised:
            report.main([str(path), option, str(blocker / "sub" / "x")])
        assert raised.value.code == 2
        assert f"{blocker} is not a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a directory where the schedule's file goes
        report.main([str(path), "--export-schedule", str(tmp_path)])
    assert f"--export-schedule {tmp_path} is a directory: give a file name, e.g. {tmp_path / 'schedule.json'}" in \
        capsys.readouterr().err


def test_labels_must_match_the_files(tmp_path, capsys):
    path, _ = baseline_run(tmp_path / "base.jsonl")
    with pytest.raises(SystemExit):
        report.main([str(path), "--out", str(tmp_path / "o"), "--labels", "a", "b"])
    assert "--labels has 2 names for 1 files" in capsys.readouterr().err


def test_missing_matplotlib_names_the_extra(tmp_path, monkeypatch, capsys):
    path, _ = baseline_run(tmp_path / "base.jsonl")
    for module in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, module, None)  # None in sys.modules makes the import fail
    with pytest.raises(SystemExit):
        report.main([str(path), "--out", str(tmp_path / "o")])
    assert "pip install 'hdet_scale[plots]'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_step_written_twice_is_one_sync(tmp_path):
    """A run that resumed and appended repeats the steps after its checkpoint: the later lines count, once."""
    path, _ = hdet_run(tmp_path / "hdet.jsonl")
    lines = path.read_text().splitlines()
    repeated = [json.loads(line) for line in lines[6:]]
    for record in repeated:
        record["values"]["lr/embedding"]["scale"] += 1.0  # what the continued run wrote
    write_lines(path, [*lines, *repeated])
    run = report_runs.load_run(path)
    assert [record["step"] for record in report_runs.sync_records(run)] == list(range(10, 101, 10))
    assert report_runs.summarize(run)["syncs"] == 10
    series = report_runs.value_series(run, "lr/embedding")
    assert series["steps"] == list(range(10, 101, 10))
    assert series["scale"][-1] == pytest.approx(1.0 + 0.05 * 10 + 1.0)


def test_values_are_drawn_where_they_applied_step_by_step(tmp_path):
    """Each replica's value at each step is the base that step used times the replica's multiplier of its
    interval; a replica left out of a sync is NaN over that interval and marked; a resume with more replicas
    starts their lines there."""
    def line(step: int, bases: list[float], multipliers: list[float], excluded: list[int]) -> dict:
        entry = {"replica_values": [bases[-1] * m for m in multipliers], "base": bases[-1], "scale": 1.0,
                 "applied_bases": bases, "replica_multipliers": multipliers}
        return {"step": step, "replica_losses": [1.0] * len(multipliers), "excluded_replicas": excluded,
                "values": {"lr/0": entry}}

    path = write_lines(tmp_path / "m.jsonl", [line(2, [0.1, 0.2], [0.5, 2.0], []),
                                              line(4, [0.3, 0.4], [2.0, 0.5], [1]),
                                              line(5, [0.5], [1.0, 2.0, 0.5], [])])
    series = report_runs.applied_series(report_runs.load_run(path), "lr/0")
    nan = math.nan
    assert series["steps"] == [1, 2, 3, 4, 5]
    assert series["base"] == [0.1, 0.2, 0.3, 0.4, 0.5]
    expected = [[0.05, 0.1, 0.6, 0.8, 0.5], [0.2, 0.4, nan, nan, 1.0], [nan, nan, nan, nan, 0.25]]
    for got, want in zip(series["replicas"], expected, strict=True):
        assert got == pytest.approx(want, nan_ok=True)
    assert series["excluded"] == [(4, pytest.approx(0.2))]
    old = json.loads(path.read_text().splitlines()[0])
    del old["values"]["lr/0"]["replica_multipliers"]
    assert report_runs.applied_series(report_runs.load_run(write_lines(tmp_path / "old.jsonl", [old])), "lr/0") is None


def test_values_are_named_in_words():
    assert report_runs.value_title("lr/0") == "learning rate of param group 0"
    assert report_runs.value_title("lr/embedding") == "learning rate of the embedding group"
    assert report_runs.value_title("weight_decay/3") == "weight decay of param group 3"
    assert report_runs.value_title("label_smoothing") == "label smoothing"


def test_a_real_runs_lines_give_every_step_from_the_first(tmp_path):
    path, _ = real_hdet_run(tmp_path / "hdet_metrics.jsonl")
    run = report_runs.load_run(path)
    series = report_runs.applied_series(run, "lr/0")
    assert series["steps"] == list(range(1, report_runs.sync_records(run)[-1]["step"] + 1))
    assert not series["excluded"]


def test_a_resumed_runs_lines_replace_what_the_interrupted_run_wrote_past_its_checkpoint(tmp_path):
    """A run resumed from its checkpoint at step 8 (the Trainer, Lightning, DeepSpeed, HDETScheduler) appends to the
    file the interrupted run wrote on to step 16: both copies of steps 12 and 16 were drawn, the line running back."""
    def sync(step: int, loss: float) -> dict:
        return {"step": step, "replica_losses": [loss, loss]}

    path = write_lines(tmp_path / "run.jsonl", [sync(4, 3.0), sync(8, 2.5), sync(12, 9.0), {"step": 12,
                       "heldout_loss": 9.5}, sync(16, 9.0), sync(12, 2.0), sync(16, 1.5)])
    run = report_runs.load_run(path)
    assert report_runs.loss_curve(run) == ([4, 8, 12, 16], [3.0, 2.5, 2.0, 1.5])
    assert report_runs.heldout_curve(run) == ([], [])  # the interrupted run's evaluation at 12
    # resumed at its last line's step: a sync line repeats it
    repeated = write_lines(tmp_path / "repeated.jsonl", [sync(4, 3.0), sync(8, 9.0), sync(8, 2.5)])
    assert report_runs.loss_curve(report_runs.load_run(repeated)) == ([4, 8], [3.0, 2.5])


def test_a_last_line_cut_short_is_skipped_with_a_warning(tmp_path):
    """A run killed while writing a line (or writing it now) made its whole file unreadable."""
    path = tmp_path / "run.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    with pytest.warns(UserWarning, match=r"run\.jsonl, line 3: not valid JSON, skipped \(a line cut short"):
        run = report_runs.load_run(path)
    assert report_runs.loss_curve(run) == ([1, 2], [2.0, 1.5])


def test_a_line_cut_short_before_a_resumed_runs_lines_is_skipped(tmp_path):
    """The resumed run's writer starts on a line of its own after a line cut short (it glued its first line onto
    it), and the report reads past it (it refused the whole file)."""
    path = tmp_path / "run.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    MetricsWriter(str(path), is_writer=True).write({"step": 3, "loss": 1.25})
    assert path.read_text().splitlines()[-2:] == ['{"step": 3, "lo', '{"step": 3, "loss": 1.25}']
    with pytest.warns(UserWarning, match=r"run\.jsonl, line 3: not valid JSON, skipped"):
        run = report_runs.load_run(path)
    assert report_runs.loss_curve(run) == ([1, 2, 3], [2.0, 1.5, 1.25])


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full, a file whose every write fails")
def test_a_metrics_write_that_fails_keeps_its_lines_and_the_run_going(tmp_path):
    """A full disk (or quota) raised on rank 0 alone, in the middle of a sync: the other ranks waited in the next
    collective until their timeout, and the run ended without a checkpoint."""
    from hdet_scale.notices import HDETWarning

    path = tmp_path / "metrics.jsonl"
    path.symlink_to("/dev/full")  # every write: "No space left on device"
    writer = MetricsWriter(str(path), is_writer=True)
    with pytest.warns(HDETWarning, match=r"could not write .*metrics\.jsonl \(.*No space left on device.*\): its "
                                         r"lines wait in memory for the next write; the run goes on"):
        writer.write({"step": 1})
    writer.write({"step": 2})  # one warning only
    path.unlink()  # room again
    writer.write({"step": 3})
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]


LIMITED_WRITER = """
import json, resource, signal, sys, warnings
from hdet_scale.metrics import MetricsWriter

warnings.simplefilter("ignore")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of ending the process
resource.setrlimit(resource.RLIMIT_FSIZE, (100, resource.RLIM_INFINITY))  # room for 3 lines of 30 bytes
writer = MetricsWriter(sys.argv[1], is_writer=True)
for step in range(1, 6):
    writer.write({"step": step, "pad": "x" * 8})
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))  # room again
writer.write({"step": 6, "pad": "x" * 8})
"""


def test_a_metrics_write_that_fails_part_way_leaves_no_part_of_a_line(tmp_path):
    """The 4th line fits in part: what of it was written is cut back, and the next write, with room, writes the
    waiting lines whole and once (a buffered file's truncate flushed, failed again, and left half a line)."""
    import subprocess

    path = tmp_path / "metrics.jsonl"
    subprocess.run([sys.executable, "-c", LIMITED_WRITER, str(path)], check=True, timeout=60)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4, 5, 6]


def test_a_held_out_loss_a_resumed_loop_wrote_again_counts_its_later_line(tmp_path):
    """A loop resumed from its checkpoint at step 20 evaluates step 20 again: both lines were plotted, and the
    held-out curve went back and forth at that step."""
    path = write_lines(tmp_path / "plain.jsonl", [{"step": 10, "loss": 3.0}, {"step": 20, "heldout_loss": 2.9},
                                                  {"step": 20, "loss": 2.5}, {"step": 20, "heldout_loss": 2.8},
                                                  {"step": 30, "loss": 2.0}, {"step": 30, "heldout_loss": 2.6}])
    run = report_runs.load_run(path)
    assert report_runs.heldout_curve(run) == ([20, 30], [2.8, 2.6])
    assert report_runs.loss_curve(run) == ([10, 20, 30], [3.0, 2.5, 2.0])


def test_a_step_a_loop_without_hdet_wrote_twice_counts_its_later_line(tmp_path):
    """A plain loop resumed from its checkpoint at step 20 writes step 30 again: the interrupted run's line was
    plotted beside it. Lines may come in any step order."""
    path = write_lines(tmp_path / "plain.jsonl", [{"step": 20, "loss": 2.5}, {"step": 10, "loss": 3.0},
                                                  {"step": 30, "loss": 9.0}, {"step": 30, "loss": 2.0}])
    assert report_runs.loss_curve(report_runs.load_run(path)) == ([10, 20, 30], [3.0, 2.5, 2.0])
