"""HDETCallback in real multi-process Lightning runs (torchrun, 4 CPU ranks, DDPStrategy on gloo).

Each launch runs several jobs of ``tests/lightning_job.py`` in turn (Lightning's import costs each rank more than a
job's fit); a job's record holds every rank's parameters after each optimizer step and just before each sync, so the
checks compare with averages computed here.

This file holds the tests that start a launcher or script as a subprocess; the tests that start no process are in
tests/unit/test_lightning.py.
"""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

import pytest
import torch
from launcher import launch, torchrun

JOB = Path(__file__).resolve().parents[1] / "lightning_job.py"
RANGE_JOB = JOB.parent / "lightning_range_job.py"
SYNC = 5


def run_jobs(root: Path, jobs: dict[str, list[str]], *, nproc: int = 4, job: Path = JOB) -> dict[str, dict]:
    """Runs ``jobs`` (name: arguments) in turn in one launch of ``job``, each into ``root/<name>``; gives each
    job's record with ``stdout``, every rank's output of that job."""
    outs = {name: root / name for name in jobs}
    launch_dir = root / f"launch_{next(iter(jobs))}"
    launch_dir.mkdir(parents=True)
    listing = launch_dir / "jobs.json"
    listing.write_text(json.dumps([["--out", str(outs[name]), *args] for name, args in jobs.items()]))
    result = launch([*torchrun(nproc, (str(job),)), "--jobs", str(listing)], cwd=launch_dir)
    stdout = {name: "".join(log.read_text() for log in sorted(out.glob("log.*.txt"))) for name, out in outs.items()}
    assert result.returncode == 0, (result.stdout[-5000:], {name: text[-3000:] for name, text in stdout.items()})
    return {name: {**torch.load(out / "record.pt"), "stdout": stdout[name]} for name, out in outs.items()}


def without_replica_optimizers(checkpoint: Path, copy: Path) -> Path:
    """A copy of a local-mode checkpoint without the other replicas' optimizer states, as one saved in global mode
    or with fewer replicas."""
    state = torch.load(checkpoint, weights_only=False)
    (key,) = [key for key in state["callbacks"] if key.startswith("HDETCallback")]
    del state["callbacks"][key]["replica_optimizers"]
    torch.save(state, copy)
    return copy


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lightning")
    fsdp2 = ["--strategy", "model_parallel", "--ranks_per_replica", "2"]
    first_epoch = "epoch=0-step=10.ckpt"  # each straight run's checkpoint after its first epoch
    local = ["--mode", "local", "--ranks_per_replica", "2", "--accumulate", "2"]
    replicated = run_jobs(root, {  # in this order: a resumed job after the one it resumes
        "global": ["--epochs", "2"],
        "local": [*local, "--probe"],
        "local_resumed": [*local, "--probe", "--resume", str(root / "local" / "checkpoints" / "epoch=0-step=5.ckpt")],
        "resumed": ["--epochs", "2", "--resume", str(root / "global" / "checkpoints" / first_epoch)],
        "coupled": ["--epochs", "2", "--coupled_decay"],
        "coupled_resumed": ["--epochs", "2", "--coupled_decay", "--resume",
                            str(root / "coupled" / "checkpoints" / first_epoch)],
        # epochs of 10 steps at T = 3: each epoch's validation falls between syncs
        "validated": ["--epochs", "2", "--sync_interval", "3", "--validate"],
        "explored": ["--epochs", "1", "--mode", "local", "--explore_scale"],
    })
    bare = without_replica_optimizers(root / "local" / "checkpoints" / "epoch=0-step=5.ckpt", root / "bare.ckpt")
    sharded = run_jobs(root, {  # the bare resume here: its checkpoint is made from the first launch's
        "local_resumed_bare": [*local, "--probe", "--resume", str(bare)],
        "fsdp2": [*fsdp2, "--epochs", "2"],
        "fsdp2_local": [*fsdp2, "--mode", "local", "--epochs", "2"],
        "fsdp2_resumed": [*fsdp2, "--epochs", "2", "--resume", str(root / "fsdp2" / "checkpoints" / first_epoch)],
    })
    return {**replicated, **sharded, "root": root}


def assert_syncs_average(record: dict, replicas_of: list[int]) -> None:
    """Between syncs the replicas differ (ranks of one replica agree); right after each sync every rank holds
    the mean of the replicas' parameters before it."""
    for step, rows in record["after"].items():
        if step % SYNC:
            for rank, replica in enumerate(replicas_of):
                same = [other for other, r in enumerate(replicas_of) if r == replica]
                assert all(torch.equal(rows[rank], rows[other]) for other in same)
                assert all(not torch.allclose(rows[rank], rows[other], atol=1e-6)
                           for other, r in enumerate(replicas_of) if r != replica), step
    assert sorted(record["before_sync"]) == list(range(SYNC, max(record["after"]) + 1, SYNC))
    for step, before in record["before_sync"].items():
        by_replica = torch.stack([before[replicas_of.index(r)] for r in sorted(set(replicas_of))])
        expected = by_replica.double().mean(0).float()
        for row in record["after"][step]:
            torch.testing.assert_close(row, expected, rtol=0, atol=1e-6)


@pytest.mark.e2e
def test_global_mode_every_rank_a_replica(runs):
    record = runs["global"]
    assert max(record["after"]) == 20 and record["hdet_step"] == 20
    assert_syncs_average(record, [0, 1, 2, 3])
    # The Trainer's logger (CSV here; W&B and TensorBoard alike) got each sync's scalars: the metrics lines'.
    out = runs["root"] / "global"
    lines = [json.loads(line) for line in (out / "hdet.jsonl").read_text().splitlines()]
    with open(out / "csv" / "version_0" / "metrics.csv") as table:
        logged = [row for row in csv.DictReader(table) if row.get("hdet/lr/0/base")]
    assert [int(row["step"]) for row in logged] == [line["step"] for line in lines]
    for row, line in zip(logged, lines, strict=True):
        assert float(row["hdet/lr/0/base"]) == pytest.approx(line["values"]["lr/0"]["base"], rel=1e-6)
        assert float(row["hdet/lr/0/replica_3"]) == pytest.approx(line["values"]["lr/0"]["replica_values"][3],
                                                                  rel=1e-6)


@pytest.mark.e2e
def test_local_mode_replicas_of_two_ranks_with_accumulation(runs, tmp_path):
    record = runs["local"]
    assert max(record["after"]) == 10  # 2 epochs of 10 batches, 2 batches per optimizer step
    assert_syncs_average(record, [0, 0, 1, 1])
    # The interval loss HDET recorded is the replica's mean micro-batch loss as training_step computed it (not
    # Lightning's loss divided by accumulate_grad_batches).
    lines = [json.loads(line) for line in (runs["root"] / "local" / "hdet.jsonl").read_text().splitlines()]
    per_sync = SYNC * 2
    for index, line in enumerate(lines):
        for replica, ranks in enumerate(([0, 1], [2, 3])):
            micro = [loss for rank in ranks for loss in record["losses"][rank][index * per_sync:(index + 1) * per_sync]]
            assert line["replica_losses"][replica] == pytest.approx(statistics.fmean(micro), rel=1e-5)
    # The probe the module set in on_fit_start scored each replica on the held-out batch before the sync.
    for line in lines:
        by_hand = record["held_out_before_sync"][line["step"]]
        assert line["probe_losses"] == pytest.approx([by_hand[0], by_hand[2]], rel=1e-5)
        assert by_hand[0] == by_hand[1] and by_hand[2] == by_hand[3] and by_hand[0] != by_hand[2]
    assert "HDETCallback has no probe" not in record["stdout"]
    assert "HDETCallback has no probe" in runs["global"]["stdout"]


@pytest.mark.e2e
def test_a_resumed_fit_continues_the_same_run(runs):
    """A resume from the checkpoint after the first epoch: the parameters and HDET's step end where an
    uninterrupted two-epoch run ends."""
    resumed, straight = runs["resumed"], runs["global"]
    assert resumed["hdet_step"] == 20
    assert min(resumed["after"]) == 11
    torch.testing.assert_close(resumed["final"], straight["final"], rtol=0, atol=1e-6)
    lines = [json.loads(line) for line in (runs["root"] / "resumed" / "hdet.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [15, 20]


def replica_optimizers_saved(checkpoint: Path) -> list[int]:
    """The replicas whose optimizer states the callback's state in ``checkpoint`` carries."""
    state = torch.load(checkpoint, weights_only=False)
    (key,) = [key for key in state["callbacks"] if key.startswith("HDETCallback")]
    return sorted(state["callbacks"][key].get("replica_optimizers") or {})


@pytest.mark.e2e
def test_a_resumed_global_mode_fit_gives_replicas_whose_states_differ_their_own(runs):
    """In global mode every replica steps with the same gradients, but Adam adds the weight decay to them, so each
    replica's moments are its own: the checkpoint carries them (with AdamW the replicas' are alike and it carries
    none), and the resumed run ends where the straight one does."""
    checkpoints = runs["root"] / "coupled" / "checkpoints", runs["root"] / "global" / "checkpoints"
    assert replica_optimizers_saved(checkpoints[0] / "epoch=0-step=10.ckpt") == [1, 2, 3]
    assert replica_optimizers_saved(checkpoints[1] / "epoch=0-step=10.ckpt") == []
    resumed, straight = runs["coupled_resumed"], runs["coupled"]
    assert resumed["hdet_step"] == 20
    torch.testing.assert_close(resumed["final"], straight["final"], rtol=0, atol=1e-6)


@pytest.mark.e2e
def test_a_resumed_local_mode_fit_gives_each_replica_its_own_optimizer_state(runs):
    """In local mode each replica's Adam moments follow its own gradients; Lightning saves rank 0's optimizer state
    only, so the callback's state carries the other replica's, and the resumed run ends where the straight one does
    (every replica resumed with replica 0's moments before)."""
    resumed, straight = runs["local_resumed"], runs["local"]
    assert resumed["hdet_step"] == 10 and min(resumed["after"]) == 5  # its first micro-batch: no step yet
    torch.testing.assert_close(resumed["final"], straight["final"], rtol=0, atol=1e-6)
    # without them the other replica goes on from replica 0's, and its first rank (rank 2) says so
    bare = runs["local_resumed_bare"]
    assert bare["hdet_step"] == 10 and not torch.equal(bare["final"], straight["final"])
    assert bare["stdout"].count("holds no optimizer state of replica 1") == 1


@pytest.mark.e2e
def test_model_parallel_fsdp2_replicas_of_two_shards(runs):
    """ModelParallelStrategy with shard() in configure_model: 2 replicas x 2 FSDP2 shards, global gradients."""
    record = runs["fsdp2"]
    assert record["hdet_step"] == 20
    assert_syncs_average(record, [0, 0, 1, 1])


@pytest.mark.e2e
def test_a_model_parallel_checkpoint_of_replicas_whose_optimizer_states_differ_says_so(runs):
    """Lightning's distributed checkpoint keeps one optimizer state per shard: in local mode (the replicas' states
    differ) a resumed fit would give every replica a mix of them, which the callback says once per fit; in global mode
    with AdamW they are alike and it says nothing."""
    said = "HDETCallback: the replicas' optimizer states differ"
    assert runs["fsdp2_local"]["stdout"].count(said) == 1  # two epochs' checkpoints and the last one
    assert said not in runs["fsdp2"]["stdout"]


@pytest.mark.e2e
def test_a_resumed_model_parallel_fit_continues_the_same_run(runs):
    """Lightning's distributed checkpoint of the sharded replicas, resumed: it ends where the straight run ends."""
    resumed, straight = runs["fsdp2_resumed"], runs["fsdp2"]
    assert resumed["hdet_step"] == 20 and min(resumed["after"]) == 11
    torch.testing.assert_close(resumed["final"], straight["final"], rtol=0, atol=1e-6)


@pytest.mark.e2e
def test_validation_scores_the_averaged_model_between_syncs(runs):
    """Lightning validates at the epoch's last batch, before the epoch-end hook where HDET synced, when each rank
    held its own replica (10 steps at T = 3 leave the replicas apart at steps 10 and 20): the callback averages
    them first, so every rank validates the same model."""
    validated = [(step, rows) for step, rows in runs["validated"]["validated"] if step > 0]  # not the sanity check
    assert [step for step, _ in validated] == [10, 20]
    for step, rows in validated:
        assert all(torch.equal(row, rows[0]) for row in rows), f"replicas apart at the validation of step {step}"


# ------------------------------------------------------------------------------------------- LR range test
RANGE_TEST, LR = 20, 0.02
"""The range job's test steps (at most) and its AdamW's LR, the first of its LambdaLR(1 / (1 + 0.05 step))."""


@pytest.fixture(scope="module")
def range_runs(tmp_path_factory) -> dict:
    """Two ranks, two replicas: a run of 2 epochs (20 steps, the test's batches on top) checkpointed every 5 steps,
    and a run of max_steps=12 that asks for a checkpoint during the test and at step 7, between syncs."""
    root = tmp_path_factory.mktemp("lightning_range")
    return {**run_jobs(root, {"epochs": ["--epochs", "2", "--checkpoint_every", str(SYNC)],
                              "max_steps": ["--max_steps", "12", "--ask_saves"]}, nproc=2, job=RANGE_JOB),
            "root": root}


def check_range_test_run(record: dict, out: Path, run_steps: int, extra_syncs: tuple[int, ...] = ()) -> int:
    """Checks a run of the range job that trains ``run_steps`` steps after its test (and syncs at ``extra_syncs`` too);
    returns the test's steps."""
    from hdet_scale import multipliers
    from hdet_scale.range_test import ramp_lr

    lines = [json.loads(line) for line in (out / "hdet.jsonl").read_text().splitlines()]
    test = lines[0]["range_test"]
    test_steps, pick, scale = len(test["lrs"]), test["picked_lr"], test["scale"]
    assert lines[0]["step"] == 0 and pick is not None and pick == record["pick"]
    syncs = sorted({*range(SYNC, run_steps + 1, SYNC), run_steps, *extra_syncs})
    assert [line["step"] for line in lines[1:]] == syncs
    # Every optimizer step: the test's (it may stop early, once the loss diverges), then all the run's, which
    # Lightning alone counts.
    assert record["hdet_step"] == record["trainer_step"] == run_steps
    assert record["global_steps"] == [0] * test_steps + list(range(1, run_steps + 1))
    for steps in record["steps"]:
        assert [ramping for ramping, _, _ in steps] == [True] * test_steps + [False] * run_steps
        # The test ramps the LR while the scheduler holds at its first LR; the run's schedule starts from its first.
        assert [applied for _, applied, _ in steps[:test_steps]] == pytest.approx(
            [ramp_lr(step, steps=RANGE_TEST) for step in range(test_steps)], rel=1e-6)
        assert [scheduled for _, _, scheduled in steps[:test_steps]] == [LR] * test_steps
        assert [scheduled for _, _, scheduled in steps[test_steps:]] == pytest.approx(
            [LR / (1 + 0.05 * step) for step in range(run_steps)], rel=1e-6)
    # The first run step trains each replica at the scale set from the pick times its multiplier: the replicas'
    # mean at 0.7 times the pick; hdet.value("lr/0") says so.
    first_lrs = sorted(steps[test_steps][1] for steps in record["steps"])
    assert first_lrs == pytest.approx([LR * scale * rho for rho in multipliers(2, 0.5)], rel=1e-6)
    assert sum(first_lrs) / len(first_lrs) == pytest.approx(0.7 * pick, rel=1e-6)
    assert record["run_start"]["value"] == pytest.approx(record["steps"][0][test_steps][1], rel=1e-6)
    # The run starts from the first weights (which the test had moved), with a fresh optimizer state.
    weights = record["weights"]
    assert torch.equal(weights["run_start"], weights["first"]) and not torch.equal(weights["test"], weights["first"])
    assert record["run_start"]["fresh_optimizer"]
    return test_steps


@pytest.mark.e2e
def test_a_fit_in_epochs_starts_with_an_lr_range_test_and_checkpoints_after_it(range_runs):
    """2 epochs of 10 batches, all the run's 20 steps: the test's batches come on top (the loop gets the epochs they
    take, else the run would fall short by them), and ModelCheckpoint(every_n_train_steps=5) saves at the run's steps
    5-20 only, in the data epochs the test shifted them to."""
    record = range_runs["epochs"]
    out = range_runs["root"] / "epochs"
    test_steps = check_range_test_run(record, out, 20)
    assert record["max_epochs"] == 4  # (20 run steps + up to 20 test steps) / 10 batches per epoch
    assert record["max_epochs_after"] == 2  # as given, for a later fit
    assert record["saves"] == [(step, False) for step in (5, 10, 15, 20)]
    assert sorted(path.name for path in (out / "checkpoints").iterdir()) == sorted(
        f"epoch={(test_steps + step - 1) // 10}-step={step}.ckpt" for step in (5, 10, 15, 20))


@pytest.mark.e2e
def test_a_fit_of_max_steps_starts_with_an_lr_range_test(range_runs):
    """A run of max_steps=12 whose callback asks for a checkpoint on the test's third batch (none is written: a
    resumed run could not take the test up again) and at step 7, between syncs (a sync of its own first: every rank
    holds the weights it saved, and its HDET state is a sync's)."""
    record, out = range_runs["max_steps"], range_runs["root"] / "max_steps"
    check_range_test_run(record, out, 12, extra_syncs=(7,))
    assert not (out / "asked_in_test.ckpt").exists()
    assert "no checkpoint is written during the LR range test" in record["stdout"]
    weights = record["asked_weights"]
    assert all(torch.equal(row, weights[0]) for row in weights)
    checkpoint = torch.load(out / "asked.ckpt", weights_only=False)
    saved = torch.cat([tensor.reshape(-1) for tensor in checkpoint["state_dict"].values()])
    torch.testing.assert_close(saved, weights[0], rtol=0, atol=0)
    (state,) = [value for key, value in checkpoint["callbacks"].items() if key.startswith("HDETCallback")]
    assert state["step"] == state["last_sync_step"] == 7


@pytest.mark.e2e
def test_after_fit_every_replica_scores_at_the_values_found(runs):
    """The last sync gave each replica its own value of an explored knob for the next interval: a validate() or
    test() after fit() scored each rank's share of the data at its replica's value."""
    record = runs["explored"]
    assert record["scalings"] == [pytest.approx(record["scale_found"])] * 4
