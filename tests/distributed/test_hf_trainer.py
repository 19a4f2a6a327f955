"""HDET in transformers.Trainer on real gloo ranks: DDP (global and local) and DeepSpeed ZeRO 0-3.

Each launch trains a tiny Llama with Trainer and checks, from parameters gathered over every rank, that the
replicas start identical, train at their own LRs, drift apart between syncs and are each rank's independent
average right after a sync; the metrics file has one loss per replica, on the scale Trainer logs.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from hdet_scale import multipliers

VOCAB, SEQ = 64, 16
MAX_STEPS, SYNC_INTERVAL, ALPHA, ACCUMULATION = 7, 3, 0.5, 2


def tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    return LlamaForCausalLM(config)


def token_dataset(rows: int = 256) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [{"input_ids": row, "labels": row} for row in torch.randint(0, VOCAB, (rows, SEQ), generator=generator)]


PROBE_ROW = torch.arange(SEQ) % VOCAB
"""The one sequence of the eval dataset: whichever samples the probe batch draws, each replica's probe loss is its
model's loss on this row, computed by hand in ``train_run``."""


def zero_config(stage: int) -> dict:
    zero = {"stage": stage} | ({"stage3_gather_16bit_weights_on_model_save": True} if stage == 3 else {})
    return {"zero_optimization": zero, "train_micro_batch_size_per_gpu": "auto",
            "train_batch_size": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": 1.0}


def training_args(out_dir: str, deepspeed: dict | None = None, **overrides):
    from transformers import TrainingArguments

    values = dict(output_dir=out_dir, per_device_train_batch_size=2, gradient_accumulation_steps=ACCUMULATION,
                  max_steps=MAX_STEPS, learning_rate=3e-3, lr_scheduler_type="constant", save_strategy="no",
                  report_to=[], use_cpu=True, logging_steps=1, disable_tqdm=True, seed=0, deepspeed=deepspeed)
    values.update(overrides)
    return TrainingArguments(**values)


def gathered(tensor: torch.Tensor) -> torch.Tensor:
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, tensor.detach().float().cpu().reshape(-1))
    return torch.stack(rows)


def master_vector(hdet) -> torch.Tensor:
    """This rank's master copy: the full parameters (DDP) or its ZeRO partition (DeepSpeed)."""
    tensors = hdet.deepspeed.adapter.master_tensors() if hdet.deepspeed else hdet.ensemble.adapter.averaged_tensors()
    return torch.cat([tensor.detach().reshape(-1) for tensor in tensors])


def fresh_trainer(out_dir: str, stage: int | None = None, seed: int = 0, **overrides):
    """A Trainer on its own accelerate state: accelerate keeps one process-wide (its DeepSpeed settings
    included), so several Trainers in one process reset it first, as Trainer's hyperparameter search does."""
    from accelerate.state import AcceleratorState
    from transformers import Trainer

    AcceleratorState._reset_state(reset_partial_state=False)
    deepspeed = None if stage is None else overrides.pop("deepspeed", zero_config(stage))
    eval_dataset = overrides.pop("eval_dataset", None)
    train_dataset = overrides.pop("train_dataset", None) or token_dataset()
    return Trainer(model=tiny_llama(seed), args=training_args(out_dir, deepspeed, **overrides),
                   train_dataset=train_dataset, eval_dataset=eval_dataset)


def hdet_settings(out_dir: str, mode: str, per_replica: int, metrics: str = "metrics.jsonl") -> dict:
    return {"alpha": ALPHA, "spread": "linear", "sync_interval": SYNC_INTERVAL, "ranks_per_replica": per_replica,
            "gradient_mode": mode, "metrics_path": os.path.join(out_dir, metrics),
            "auto_lr": {"mode": "scale", "start": 0, "sigma": 0.05, "range_test": 0}}


def error_of(build) -> str:
    """The message of the HDETConfigError (or other ValueError, or RuntimeError) ``build()`` raises, or '' if it
    raises none."""
    try:
        build()
    except (ValueError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return ""


def asking_to_save_at(step: int):
    """A callback, added after HDET's, that asks the Trainer for a checkpoint at ``step`` (as a preemption handler
    would), and records on every rank the weights it saved with."""
    from transformers import TrainerCallback

    class AskToSave(TrainerCallback):
        saved_weights = None

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step:
                control.should_save = True

        def on_save(self, args, state, control, **kwargs):
            self.saved_weights = gathered(torch.cat([p.detach().reshape(-1) for p in kwargs["model"].parameters()]))

    return AskToSave()


def train_run(rank: int, out_dir: str, stage: int | None, mode: str, per_replica: int, *, probed: bool = False,
              **overrides) -> dict:
    """Trains with HDET and records, on every step, this replica's LRs and every rank's master copy; ``probed``:
    with an eval dataset of ``PROBE_ROW``, and each rank's loss on that row before every sync."""
    from transformers import TrainerCallback

    from hdet_scale.integrations.hf_trainer import add_hdet

    # Each rank builds different weights: the engine must start every replica from rank 0's.
    eval_dataset = [{"input_ids": PROBE_ROW, "labels": PROBE_ROW}] * 8 if probed else None
    trainer = fresh_trainer(out_dir, stage, seed=rank, eval_dataset=eval_dataset, **overrides)
    hdet = add_hdet(trainer, hdet_settings(out_dir, mode, per_replica))
    record: dict = {"pre_sync": {}, "after_step": {}, "lrs": {}, "base_lr": {}, "probe_by_hand": {}}

    def probe_by_hand(step: int) -> None:
        model = trainer.model_wrapped
        model.eval()
        with torch.no_grad():
            loss = model(input_ids=PROBE_ROW[None], labels=PROBE_ROW[None]).loss
        model.train()
        record["probe_by_hand"][step] = gathered(loss.reshape(1))[:, 0].tolist()

    class Recorder(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            hdet.ensemble.add_pre_sync_hook(lambda step: record["pre_sync"].__setitem__(step, gathered(
                master_vector(hdet))))
            if probed:
                hdet.ensemble.add_pre_sync_hook(probe_by_hand)
            record["after_step"][0] = gathered(master_vector(hdet))

        def on_step_begin(self, args, state, control, **kwargs):
            record["lrs"][state.global_step + 1] = hdet.current_lrs()
            record["base_lr"][state.global_step + 1] = [group["lr"] for group in hdet.ensemble.adapter.optimizer
                                                        .param_groups]

        def on_step_end(self, args, state, control, **kwargs):  # runs after HDET's: syncs are done
            record["after_step"][state.global_step] = gathered(master_vector(hdet))

    trainer.add_callback(Recorder())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    record["warnings"] = [str(warning.message) for warning in caught if "HDET" in str(warning.message)]
    record["engine"] = hdet.engine
    record["engine_class"] = type(trainer.model_wrapped).__name__
    if rank != 0:  # the gathered tensors are the same on every rank
        record["pre_sync"], record["after_step"] = {}, {}
    # Tensors would travel to the parent through shared memory that dies with this process: send arrays.
    for key in ("pre_sync", "after_step"):
        record[key] = {step: rows.numpy() for step, rows in record[key].items()}
    return record


def check_run(results: list[dict], out_dir: str, world: int, per_replica: int, mode: str) -> None:
    """Checks one HDET Trainer run from every rank's record (see ``train_run``)."""
    replicas = world // per_replica
    first = results[0]
    for key in ("pre_sync", "after_step"):
        first[key] = {step: torch.from_numpy(rows) for step, rows in first[key].items()}
    spread = sorted(multipliers(replicas, ALPHA))
    # LRs: this replica's multiple of the schedule, the spread over replicas, the same inside a replica.
    for step, _lrs in first["lrs"].items():
        by_rank = [result["lrs"][step] for result in results]
        for rank, result in enumerate(results):
            ratios = [lr / base for lr, base in zip(by_rank[rank], result["base_lr"][step], strict=True)]
            assert by_rank[rank] == by_rank[(rank // per_replica) * per_replica]
            assert all(ratio > 0 for ratio in ratios)
        ratios = sorted(by_rank[r * per_replica][0] / first["base_lr"][step][0] for r in range(replicas))
        scale = ratios[0] / spread[0]  # the controller's scale on the schedule: 1 until the first sync
        assert ratios == pytest.approx([scale * rho for rho in spread], rel=1e-6)
        assert scale == pytest.approx(1.0) or step > SYNC_INTERVAL
    # Parameters: equal at the start and right after syncs (the average), apart in between.
    syncs = sorted(first["pre_sync"])
    assert syncs == [SYNC_INTERVAL, 2 * SYNC_INTERVAL, MAX_STEPS], syncs
    for step, rows in first["after_step"].items():
        for position in range(per_replica):
            column = rows[position::per_replica]  # the ranks holding the same shard in every replica
            if step == 0 or step in syncs:
                assert all(torch.equal(column[0], row) for row in column[1:]), step
                if step:
                    before = first["pre_sync"][step][position::per_replica]
                    assert (before - before[0]).abs().max() > 1e-6, step  # they had diverged
                    torch.testing.assert_close(column[0], before.mean(0), rtol=1e-5, atol=1e-6)
            else:
                assert (column - column[0]).abs().max() > 1e-6, step
        for replica in range(replicas):  # inside a replica every rank moves alike
            ranks = rows[replica * per_replica:(replica + 1) * per_replica]
            if per_replica > 1 and results[0]["engine"] == "ddp":
                assert all(torch.equal(ranks[0], row) for row in ranks[1:]), step
    # Metrics: one line per sync, one loss per replica, on the scale of the loss Trainer logs (~ln(VOCAB)).
    lines = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    assert [line["step"] for line in lines] == syncs
    for line in lines:
        assert len(line["replica_losses"]) == replicas
        assert all(abs(loss - math.log(VOCAB)) < 0.7 for loss in line["replica_losses"]), line["replica_losses"]
    # The probe: each replica scored on the eval batch, its loss the one computed by hand before the sync.
    by_hand = first["probe_by_hand"]
    if by_hand:
        for line in lines:
            ranks = by_hand[line["step"]]
            expected = [sum(ranks[r * per_replica:(r + 1) * per_replica]) / per_replica for r in range(replicas)]
            assert line["probe_losses"] == pytest.approx(expected, rel=1e-5), line["step"]
        assert len(set(expected)) == replicas  # the replicas differ: a probe that scored one model would not
        assert not first["warnings"]
    else:
        assert all(line["probe_losses"] is None for line in lines)
        assert any("the Trainer has no eval_dataset" in warning for warning in first["warnings"]), first["warnings"]


# --------------------------------------------------------------------------------------------------- DDP
def ddp_worker(rank: int, world: int, out_dir: str) -> dict:
    from hdet_scale.integrations.hf_trainer import add_hdet

    def added(name: str, hdet: dict | None = None, **overrides) -> None:
        add_hdet(fresh_trainer(os.path.join(out_dir, name), **overrides),
                 hdet or hdet_settings(out_dir, "global", 1))

    errors = {
        "fsdp": error_of(lambda: added("fsdp", fsdp=True)),
        "epoch saves": error_of(lambda: added("epoch", save_strategy="epoch")),
        "compile": error_of(lambda: added("compile", torch_compile=True)),
        "auto batch size": error_of(lambda: added("auto batch size", auto_find_batch_size=True)),
    }
    os.environ["ACCELERATE_DYNAMO_BACKEND"] = "inductor"  # compiled by accelerate's own setting
    errors["compile by accelerate"] = error_of(lambda: added("compile by accelerate"))
    del os.environ["ACCELERATE_DYNAMO_BACKEND"]
    errors |= {
        "saves between syncs": error_of(lambda: added("steps", save_strategy="steps", save_steps=4)),
        "replica size": error_of(lambda: added("size", hdet_settings(out_dir, "global", 3))),
        "bad field": error_of(lambda: added("field", {"alpha": 1.5, "spread": "linear"})),
    }
    smoothing = {**hdet_settings(out_dir, "local", 1), "explore": {"label_smoothing": {"base": 0.1, "alpha": 0.5}}}
    errors["label smoothing"] = error_of(lambda: added("smoothing", smoothing))
    reads_smoothing = fresh_trainer(os.path.join(out_dir, "smoothing_read"))
    reads_smoothing.compute_loss_func = lambda outputs, labels, num_items_in_batch=None: outputs.loss
    errors["label smoothing read"] = error_of(lambda: add_hdet(reads_smoothing, smoothing))
    twice = fresh_trainer(os.path.join(out_dir, "twice"))
    add_hdet(twice, hdet_settings(out_dir, "global", 1))
    errors["added twice"] = error_of(lambda: add_hdet(twice, hdet_settings(out_dir, "global", 1)))

    # Global mode with a checkpoint at every sync, then a run resumed from the step-6 checkpoint.
    global_dir, local_dir = os.path.join(out_dir, "global"), os.path.join(out_dir, "local")
    runs = {"global": train_run(rank, global_dir, None, "global", 1, save_strategy="steps", save_steps=SYNC_INTERVAL)}
    resumed = fresh_trainer(global_dir, seed=rank, save_strategy="steps", save_steps=SYNC_INTERVAL)
    hdet = add_hdet(resumed, hdet_settings(global_dir, "global", 1, metrics="resumed.jsonl"))
    resumed.train(resume_from_checkpoint=os.path.join(global_dir, f"checkpoint-{2 * SYNC_INTERVAL}"))
    final = gathered(master_vector(hdet)).numpy()
    # Local mode: each replica's Adam moments are its own, and each is restored from the checkpoint.
    runs["local"] = train_run(rank, local_dir, None, "local", 2, probed=True, save_strategy="steps",
                              save_steps=SYNC_INTERVAL)
    local_resumed = fresh_trainer(os.path.join(out_dir, "local_resumed"), seed=rank)
    local_hdet = add_hdet(local_resumed, hdet_settings(out_dir, "local", 2, metrics="local_resumed.jsonl"))
    local_resumed.train(resume_from_checkpoint=os.path.join(local_dir, f"checkpoint-{2 * SYNC_INTERVAL}"))
    # A checkpoint another callback asks for between syncs (a preemption handler's, say) gets a sync first.
    asked_dir = os.path.join(out_dir, "asked")
    asked = fresh_trainer(asked_dir, seed=rank)
    add_hdet(asked, hdet_settings(asked_dir, "global", 1))
    asker = asking_to_save_at(ASKED_SAVE)
    asked.add_callback(asker)
    asked.train()
    saved_state = torch.load(os.path.join(asked_dir, f"checkpoint-{ASKED_SAVE}", "hdet_state.pt"))
    return {"errors": errors, "runs": runs, "resumed_final": final, "resumed_step": hdet.ensemble.global_step,
            "local_resumed_final": gathered(master_vector(local_hdet)).numpy(),
            "asked": {"weights": asker.saved_weights.numpy(), "step": saved_state["step"],
                      "last_sync_step": saved_state["last_sync_step"],
                      "folders": sorted(path.name for path in Path(asked_dir).glob("checkpoint-*"))}}


ASKED_SAVE = 4
"""The step, between syncs, at which a callback asks the Trainer for a checkpoint."""


def test_ddp_global_and_local_mode_checkpoints_and_bad_settings(tmp_path):
    results = run_ranks(ddp_worker, 4, str(tmp_path), timeout=600)
    errors = results[0]["errors"]
    raised_in_training = ("added twice",)
    accepted = ("label smoothing read",)
    assert all(errors[name].startswith("HDETConfigError") for name in errors
               if name not in raised_in_training + accepted), errors
    # One asked for between syncs holds the one model of the ensemble: every rank saved with the same weights (the
    # Trainer writes rank 0's), and HDET's state records a sync at that step.
    asked = results[0]["asked"]
    assert asked["folders"] == [f"checkpoint-{ASKED_SAVE}"]
    assert asked["step"] == asked["last_sync_step"] == ASKED_SAVE
    assert (asked["weights"] == asked["weights"][0]).all()
    assert "fsdp" in errors["fsdp"] and "hdet_scale.engines.fsdp" in errors["fsdp"]
    assert "save_strategy='epoch'" in errors["epoch saves"]
    assert "torch_compile=True" in errors["compile"]
    assert "ACCELERATE_DYNAMO_BACKEND" in errors["compile by accelerate"]
    assert "auto_find_batch_size=True" in errors["auto batch size"]
    assert "save_steps=4" in errors["saves between syncs"] and "multiple of" in errors["saves between syncs"]
    assert "ranks_per_replica" in errors["replica size"]
    assert errors["bad field"].startswith("HDETConfigError") and "alpha" in errors["bad field"]
    assert "already" in errors["added twice"]
    # the Trainer's own loss would train every replica at one label smoothing: refused unless a loss of the user's
    assert "explore.label_smoothing" in errors["label smoothing"] and "compute_loss" in errors["label smoothing"]
    assert errors["label smoothing read"] == ""
    for name, (mode, per_replica) in {"global": ("global", 1), "local": ("local", 2)}.items():
        runs = [result["runs"][name] for result in results]
        assert {run["engine_class"] for run in runs} == {"DistributedDataParallel"}
        check_run(runs, str(tmp_path / name), 4, per_replica, mode)
    # Checkpoints hold HDET's state; a resumed run ends where the uninterrupted one did (global mode: the
    # replicas' Adam moments agree, so rank 0's optimizer state is every replica's).
    global_dir = tmp_path / "global"
    assert sorted(path.name for path in global_dir.glob("checkpoint-*/hdet_state.pt")) == ["hdet_state.pt"] * 3
    assert results[0]["resumed_step"] == MAX_STEPS
    uninterrupted = results[0]["runs"]["global"]["after_step"][MAX_STEPS]
    torch.testing.assert_close(torch.from_numpy(results[0]["resumed_final"]), uninterrupted, rtol=1e-5, atol=1e-6)
    resumed_lines = [json.loads(line) for line in open(global_dir / "resumed.jsonl")]
    assert [line["step"] for line in resumed_lines] == [MAX_STEPS]
    # Local mode: replica 1's optimizer state is saved beside the Trainer's (rank 0's), and the resumed run ends
    # where the uninterrupted one did.
    assert sorted(path.name for path in (tmp_path / "local").glob("checkpoint-*/hdet_optimizer_replica*.pt")) == [
        "hdet_optimizer_replica1.pt"] * 3
    torch.testing.assert_close(torch.from_numpy(results[0]["local_resumed_final"]),
                               results[0]["runs"]["local"]["after_step"][MAX_STEPS], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------- DeepSpeed
DEEPSPEED_RUNS = [(3, "global", 2), (2, "local", 2), (1, "global", 2), (0, "local", 1)]
PROBED_STAGE = 3
"""(ZeRO stage, gradient mode, ranks per replica) on 4 ranks: ZeRO-1/2/3 replicas of two ranks each."""


def zero3_initialized_trainer(out_dir: str):
    """The usual order of a Trainer script: TrainingArguments with ZeRO-3 first, then the model from its config,
    which transformers then builds under deepspeed.zero.Init."""
    import deepspeed
    from accelerate.state import AcceleratorState
    from transformers import Trainer

    AcceleratorState._reset_state(reset_partial_state=False)
    deepspeed.init_distributed(dist_backend="gloo")  # as the Trainer's own set-up does, before zero.Init runs
    args = training_args(out_dir, zero_config(3))
    model = type(tiny_llama(0))._from_config(tiny_llama(0).config)
    return Trainer(model=model, args=args, train_dataset=token_dataset())


def deepspeed_worker(rank: int, world: int, out_dir: str) -> dict:
    from hdet_scale.integrations.hf_trainer import add_hdet

    def added(name: str, stage: int = 2, **overrides) -> None:
        add_hdet(fresh_trainer(os.path.join(out_dir, name), stage, **overrides), hdet_settings(out_dir, "global", 2))

    offload = {**zero_config(2), "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    errors = {
        "offload": error_of(lambda: added("offload", deepspeed=offload)),
        "fp16": error_of(lambda: added("fp16", deepspeed={**zero_config(2), "fp16": {"enabled": True}})),
        "saves between syncs": error_of(lambda: added("saves", save_strategy="steps", save_steps=4)),
        "replica size": error_of(lambda: add_hdet(fresh_trainer(os.path.join(out_dir, "size"), 2),
                                                  hdet_settings(out_dir, "global", 3))),
        "zero.Init": error_of(lambda: add_hdet(zero3_initialized_trainer(os.path.join(out_dir, "init")),
                                               hdet_settings(out_dir, "global", 2))),
        "model save": error_of(lambda: added("model save", 3, deepspeed={**zero_config(3),
                                                                          "zero_optimization": {"stage": 3}})),
    }
    asked = fresh_trainer(os.path.join(out_dir, "asked"), 2)
    add_hdet(asked, hdet_settings(out_dir, "global", 2))
    asker = asking_to_save_at(1)
    asked.add_callback(asker)
    asked_save = error_of(asked.train)
    runs = {f"zero{stage}": train_run(rank, os.path.join(out_dir, f"zero{stage}"), stage, mode, per_replica,
                                      probed=stage == PROBED_STAGE)
            for stage, mode, per_replica in DEEPSPEED_RUNS}
    asked_weights = None if asker.saved_weights is None else asker.saved_weights.numpy()
    return {"errors": errors, "runs": runs, "asked_save": asked_save, "asked_weights": asked_weights}


def test_deepspeed_zero_0_to_3_and_bad_settings(tmp_path):
    results = run_ranks(deepspeed_worker, 4, str(tmp_path), timeout=600)
    errors = results[0]["errors"]
    # A checkpoint a callback asks for between syncs gets a sync first: every rank saved with the same weights.
    assert results[0]["asked_save"] == ""
    assert (tmp_path / "asked" / "checkpoint-1" / "latest").read_text() == "global_step1"
    assert (results[0]["asked_weights"] == results[0]["asked_weights"][0]).all()
    assert all(error.startswith("HDETConfigError") for error in errors.values()), errors
    assert "offload_optimizer" in errors["offload"]
    assert "stage3_gather_16bit_weights_on_model_save" in errors["model save"]
    assert "fp16" in errors["fp16"]
    assert "save_steps=4" in errors["saves between syncs"] and "multiple of" in errors["saves between syncs"]
    assert "ranks_per_replica" in errors["replica size"]
    assert "zero.Init" in errors["zero.Init"] and "before creating the TrainingArguments" in errors["zero.Init"]
    for stage, mode, per_replica in DEEPSPEED_RUNS:
        runs = [result["runs"][f"zero{stage}"] for result in results]
        assert {run["engine"] for run in runs} == {"deepspeed"}
        assert {run["engine_class"] for run in runs} == {"DeepSpeedEngine"}
        check_run(runs, str(tmp_path / f"zero{stage}"), 4, per_replica, mode)


def deepspeed_checkpoint_worker(rank: int, world: int, out_dir: str, stage: int, mode: str) -> dict:
    """A run with a Trainer checkpoint at every sync, then one resumed from the checkpoint at step 6; then a resume
    from the checkpoint of a run without HDET."""
    from hdet_scale.integrations.hf_trainer import add_hdet

    saving = {"save_strategy": "steps", "save_steps": SYNC_INTERVAL}
    run_dir = os.path.join(out_dir, "run")
    uninterrupted = train_run(rank, run_dir, stage, mode, 2, **saving)
    resumed = fresh_trainer(run_dir, stage, seed=rank, **saving)
    hdet = add_hdet(resumed, hdet_settings(run_dir, mode, 2, metrics="resumed.jsonl"))
    resumed.train(resume_from_checkpoint=os.path.join(run_dir, f"checkpoint-{2 * SYNC_INTERVAL}"))
    plain_dir = os.path.join(out_dir, "plain")
    fresh_trainer(plain_dir, 2, max_steps=SYNC_INTERVAL, **saving).train()
    from_plain = fresh_trainer(plain_dir, 2)
    add_hdet(from_plain, hdet_settings(plain_dir, "local", 2))
    import inspect

    return {"declares_exclude_frozen": "exclude_frozen_parameters" in inspect.signature(
                resumed.model_wrapped.save_checkpoint).parameters,
            "uninterrupted": uninterrupted["after_step"].get(MAX_STEPS),
            "resumed": gathered(master_vector(hdet)).numpy(), "resumed_step": hdet.ensemble.global_step,
            "from_plain": error_of(lambda: from_plain.train(resume_from_checkpoint=f"{plain_dir}/checkpoint-3"))}


@pytest.mark.parametrize("stage, mode", [(2, "local"), (3, "global")])
def test_deepspeed_trainer_checkpoints_hold_hdet_and_each_replica_and_resume_where_the_run_was(tmp_path, stage, mode):
    """ZeRO-2 in local mode (each replica's Adam moments its own: replica 1 writes its files beside replica 0's)
    and ZeRO-3 in global mode (alike: replica 0's serve both)."""
    results = run_ranks(deepspeed_checkpoint_worker, 4, str(tmp_path), stage, mode, timeout=600)
    run_dir = tmp_path / "run"
    checkpoints = sorted(run_dir.glob("checkpoint-*"), key=lambda path: int(path.name.split("-")[1]))
    assert [path.name for path in checkpoints] == [f"checkpoint-{step}" for step in (3, 6, MAX_STEPS)]
    for checkpoint in checkpoints:  # DeepSpeed's checkpoint in the Trainer's folder, HDET's state in it
        tag = (checkpoint / "latest").read_text()
        model_file = "zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
        saved = torch.load(checkpoint / tag / model_file, weights_only=False)
        assert saved["hdet"]["step"] == int(checkpoint.name.split("-")[1])
        replica_files = list((checkpoint / tag / "hdet_replicas").glob("replica1_*optim_states.pt"))
        assert len(replica_files) == (2 if mode == "local" else 0)
    # The resumed run ends where the uninterrupted one did, and writes the sync lines after its checkpoint.
    assert results[0]["resumed_step"] == MAX_STEPS
    torch.testing.assert_close(torch.from_numpy(results[0]["resumed"]),
                               torch.from_numpy(results[0]["uninterrupted"]), rtol=1e-5, atol=1e-6)
    assert [json.loads(line)["step"] for line in open(run_dir / "resumed.jsonl")] == [MAX_STEPS]
    # DeepSpeed's signature shows through HDET's save: the Trainer leaves a PEFT model's frozen weights out only
    # where it declares exclude_frozen_parameters
    assert results[0]["declares_exclude_frozen"]
    # A checkpoint without HDET's state is refused before DeepSpeed loads it, as under DDP.
    assert "has no HDET state" in results[0]["from_plain"] and "Resume from a checkpoint HDET saved" in \
        results[0]["from_plain"], results[0]["from_plain"]


def label_smoothed_probe_worker(rank: int, world: int, out_dir: str) -> list:
    """Two replicas scored on a probe batch at every sync, by a Trainer whose loss smooths the labels."""
    from hdet_scale.integrations.hf_trainer import add_hdet

    trainer = fresh_trainer(out_dir, seed=rank, label_smoothing_factor=0.1,
                            eval_dataset=[{"input_ids": PROBE_ROW, "labels": PROBE_ROW}] * 8)
    add_hdet(trainer, hdet_settings(out_dir, "global", 1))
    trainer.train()
    return [json.loads(line)["probe_losses"] for line in open(os.path.join(out_dir, "metrics.jsonl"))]


def test_the_probe_scores_every_sync_with_a_loss_that_takes_the_labels_out_of_its_batch(tmp_path):
    """Trainer.compute_loss pops the labels from the dict it gets (with a label smoother, or compute_loss_func): the
    probe handed it the same dict at every sync, so the second sync's probe had no labels and every rank crashed."""
    probes = run_ranks(label_smoothed_probe_worker, 2, str(tmp_path), timeout=600)[0]
    assert len(probes) == 3 and all(len(losses) == 2 and all(math.isfinite(x) for x in losses) for losses in probes)


# ------------------------------------------------------------------------------ the README's DeepSpeed recipe
README = Path(__file__).resolve().parents[2] / "README.md"
TRAINER_DS_CONFIG = "ds_configs/trainer_zero2.json"


def readme_recipe_worker(rank: int, world: int, out_dir: str) -> dict:
    """The README's Trainer example with its DeepSpeed line, as written (a shorter run, a tiny model)."""
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainingArguments

    from hdet_scale.integrations.hf_trainer import add_hdet

    AcceleratorState._reset_state(reset_partial_state=False)
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=8, learning_rate=3e-4,
                             deepspeed=str(README.parent / TRAINER_DS_CONFIG), save_strategy="no",
                             max_steps=4, use_cpu=True, report_to=[], disable_tqdm=True)
    trainer = Trainer(model=tiny_llama(0), args=args, train_dataset=token_dataset())
    # 4 steps: the controller's window is steps 0-1 (2% to 25%), which only a sync every step reaches
    hdet = add_hdet(trainer, {"alpha": 0.25, "sync_interval": 1, "metrics_path": os.path.join(out_dir, "hdet.jsonl")})
    trainer.train()
    trainer.save_model()
    return {"engine": type(trainer.model_wrapped).__name__, "replicas": hdet.topology.num_replicas,
            "losses": hdet.last_report.replica_losses}


def test_the_readmes_deepspeed_recipe_runs_as_written(tmp_path):
    """transformers checks the DeepSpeed JSON against TrainingArguments: the file the README names passes."""
    assert f'deepspeed="{TRAINER_DS_CONFIG}"' in README.read_text()
    results = run_ranks(readme_recipe_worker, 2, str(tmp_path), timeout=600)
    assert {result["engine"] for result in results} == {"DeepSpeedEngine"}
    assert {result["replicas"] for result in results} == {2}  # one node of 2 ranks: 2 replicas of 1
    assert len(results[0]["losses"]) == 2 and all(math.isfinite(loss) for loss in results[0]["losses"])
    assert (tmp_path / "model.safetensors").is_file()


# ------------------------------------------------------------------------------ optimizer states in global mode
def coupled_decay_worker(rank: int, world: int, out_dir: str) -> dict:
    """Global mode, 2 replicas, saved at the sync at step 3, for Adam with weight decay added to the gradient and for
    AdamW: what the checkpoint holds of replica 1, replica 1's optimizer state at the save, and (Adam) as a resumed
    run starts from that checkpoint."""
    import copy

    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainerCallback

    from hdet_scale.integrations.hf_trainer import add_hdet

    def trained(kind, folder: str, resume_from: str | None = None) -> dict:
        """The optimizer state at the start (after a resume's load) and at the checkpoint."""
        AcceleratorState._reset_state(reset_partial_state=False)
        model = tiny_llama(0)
        optimizer = kind(model.parameters(), lr=3e-3, weight_decay=0.1)
        trainer = Trainer(model=model, args=training_args(folder, save_strategy="steps", save_steps=SYNC_INTERVAL,
                                                          max_steps=SYNC_INTERVAL + 1),
                          train_dataset=token_dataset(), optimizers=(optimizer, None))
        add_hdet(trainer, hdet_settings(folder, "global", 1))
        states = {}

        class Record(TrainerCallback):  # added after HDET's callback: sees what it loaded
            def on_train_begin(self, args, state, control, **kwargs):
                states["start"] = copy.deepcopy(optimizer.state_dict()["state"])

            def on_save(self, args, state, control, **kwargs):
                if state.global_step == SYNC_INTERVAL:  # the Trainer saves at the run's end too
                    states["save"] = copy.deepcopy(optimizer.state_dict()["state"])

        trainer.add_callback(Record())
        trainer.train(resume_from_checkpoint=resume_from)
        return states

    seen = {}
    for kind in (torch.optim.Adam, torch.optim.AdamW):
        folder = os.path.join(out_dir, kind.__name__)
        own = trained(kind, folder)["save"]
        saved = Path(folder) / f"checkpoint-{SYNC_INTERVAL}" / "hdet_optimizer_replica1.pt"
        seen[kind.__name__] = {"saved": torch.load(saved)["state"] if saved.is_file() else None, "own": own}
    seen["Adam"]["resumed"] = trained(torch.optim.Adam, os.path.join(out_dir, "resumed"),
                                      os.path.join(out_dir, "Adam", f"checkpoint-{SYNC_INTERVAL}"))["start"]
    return seen


def test_replicas_whose_optimizer_states_differ_in_global_mode_save_their_own(tmp_path):
    """The Trainer's checkpoint holds rank 0's optimizer state; in global mode HDET added no other replica's, though
    Adam's weight decay, added to the gradient, makes each replica's moments its own."""
    replica1 = run_ranks(coupled_decay_worker, 2, str(tmp_path), timeout=600)[1]
    own = replica1["Adam"]["own"]
    for state in (replica1["Adam"]["saved"], replica1["Adam"]["resumed"]):  # saved, and given back at the resume
        assert state is not None and state.keys() == own.keys()
        for index, entry in own.items():
            assert all(torch.equal(state[index][key], value) for key, value in entry.items())
    assert replica1["AdamW"]["saved"] is None  # alike: rank 0's serves every replica


# ------------------------------------------------------------------------------------ a disk per node
def node_local_worker(rank: int, world: int, out_dir: str) -> list[str]:
    """Each rank the first of a node of its own with its own disk (save_on_each_node): the files of the checkpoint
    its run writes at its sync."""
    from hdet_scale.integrations.hf_trainer import add_hdet

    os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    os.chdir(Path(out_dir) / f"node{rank}")  # its own disk: the output_dir below is relative
    trainer = fresh_trainer("run", save_strategy="steps", save_steps=SYNC_INTERVAL, max_steps=SYNC_INTERVAL,
                            save_on_each_node=True)
    add_hdet(trainer, hdet_settings("run", "global", 1))
    trainer.train()
    return sorted(path.name for path in Path("run", f"checkpoint-{SYNC_INTERVAL}").iterdir())


def test_each_node_writes_hdet_state_into_its_own_checkpoint(tmp_path):
    """With save_on_each_node every node's first rank writes the Trainer's checkpoint (its optimizer and trainer
    state; transformers writes the model on global rank 0 alone), but HDET's state went to global rank 0's alone: a
    resume on node-local disks failed on the other nodes while node 0 went on into the collectives."""
    for node in range(2):
        (tmp_path / f"node{node}").mkdir()
    for files in run_ranks(node_local_worker, 2, str(tmp_path), timeout=600):
        assert {"hdet_state.pt", "optimizer.pt", "trainer_state.json"} <= set(files)


# --------------------------------------------------------------------------- a kill right after a checkpoint
class Killed(Exception):
    pass


def killed_after_save_worker(rank: int, world: int, out_dir: str) -> dict:
    """Checkpoints at each sync and keeps one (save_total_limit=1); killed right after the Trainer wrote its second
    checkpoint and deleted the first, before any callback's on_save: what the run folder holds then."""
    from transformers import TrainerCallback

    from hdet_scale.integrations.hf_trainer import add_hdet

    class KilledOnSecondSave(TrainerCallback):  # added before HDET's callback: its on_save runs first
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 2 * SYNC_INTERVAL:
                raise Killed

    trainer = fresh_trainer(out_dir, save_strategy="steps", save_steps=SYNC_INTERVAL, max_steps=2 * SYNC_INTERVAL,
                            save_total_limit=1)
    trainer.add_callback(KilledOnSecondSave())
    add_hdet(trainer, hdet_settings(out_dir, "global", 1))
    with pytest.raises(Killed):
        trainer.train()
    folders = {path.name: sorted(file.name for file in path.iterdir()) for path in Path(out_dir).glob("checkpoint-*")}
    state = Path(out_dir, f"checkpoint-{2 * SYNC_INTERVAL}", "hdet_state.pt")
    return {"folders": folders, "step": torch.load(state)["step"] if state.is_file() else None}


def test_a_kill_after_the_trainers_checkpoint_leaves_hdet_state_in_the_newest(tmp_path):
    """The Trainer deletes its older checkpoints when it has written the newest, before the callbacks' on_save, where
    HDET wrote its state: a kill there left no checkpoint that a resume could take."""
    result = run_ranks(killed_after_save_worker, 2, str(tmp_path), timeout=600)[0]
    assert list(result["folders"]) == [f"checkpoint-{2 * SYNC_INTERVAL}"]  # the first was deleted
    assert {"hdet_state.pt", "trainer_state.json"} <= set(result["folders"][f"checkpoint-{2 * SYNC_INTERVAL}"])
    assert result["step"] == 2 * SYNC_INTERVAL


# ---------------------------------------------------------------------------------------- warm init, resumed
def warm_resume_worker(rank: int, world: int, out_dir: str) -> dict:
    from transformers import TrainerCallback

    from hdet_scale.integrations.hf_trainer import add_hdet

    settings = {**hdet_settings(out_dir, "global", 1), "warm_init": {"enabled": True, "nu": 0.05}}
    seen: dict = {}

    def trainer_with(name: str, mode: str = "global"):
        trainer = fresh_trainer(os.path.join(out_dir, name), save_strategy="steps", save_steps=SYNC_INTERVAL,
                                max_steps=2 * SYNC_INTERVAL)
        hdet = add_hdet(trainer, {**settings, "gradient_mode": mode})

        class Watch(TrainerCallback):  # added after HDET's callback: sees the ensemble it made
            def on_train_begin(self, args, state, control, **kwargs):
                seen.setdefault(name, []).append({"at_sync_point": hdet.at_sync_point,
                                                  "weights": gathered(master_vector(hdet))})

            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == SYNC_INTERVAL:
                    seen["checkpointed"] = gathered(master_vector(hdet))

        trainer.add_callback(Watch())
        return trainer

    checkpoint = os.path.join(out_dir, "fresh", f"checkpoint-{SYNC_INTERVAL}")
    fresh = trainer_with("fresh")
    fresh.train()
    # from the fresh run's folder into another output_dir: HDET's state comes from the checkpoint resumed
    trainer_with("resumed").train(resume_from_checkpoint=checkpoint)
    # the same Trainer again, in the same process: its DDP model keeps the gradient mean HDET gave it
    fresh.train(resume_from_checkpoint=checkpoint)
    # local mode from a global-mode checkpoint, which holds no optimizer state of replica 1: it goes on from replica
    # 0's, and its first rank says so
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer_with("local", mode="local").train(resume_from_checkpoint=checkpoint)
    seen["warnings"] = [str(warning.message) for warning in caught if "replica 0's" in str(warning.message)]
    return seen


def test_warm_init_noises_a_fresh_start_only(tmp_path):
    results = run_ranks(warm_resume_worker, 2, str(tmp_path), timeout=600)
    seen = results[0]
    (fresh, again), (resumed,), (local,) = seen["fresh"], seen["resumed"], seen["local"]
    assert not torch.equal(fresh["weights"][0], fresh["weights"][1])  # each replica drew its own noise
    assert not fresh["at_sync_point"]  # so step 0 is no place for a checkpoint of one model
    for run in (resumed, again, local):  # not re-noised
        assert torch.equal(run["weights"], seen["checkpointed"][:1].expand_as(run["weights"]))
        assert run["at_sync_point"]
    assert seen["warnings"] == []
    assert len(results[1]["warnings"]) == 1 and "no optimizer state of replica 1" in results[1]["warnings"][0]


# ------------------------------------------------------------------------------- two runs of one Trainer
def model_init_worker(rank: int, world: int, out_dir: str) -> list[dict]:
    """One Trainer with ``model_init`` trained twice (what ``hyperparameter_search`` does for each trial): each
    ``train()`` builds a new model and optimizer."""
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_utils import HPSearchBackend

    from hdet_scale.config import HDETConfigError
    from hdet_scale.integrations.hf_trainer import add_hdet

    AcceleratorState._reset_state(reset_partial_state=False)
    trainer = Trainer(model_init=lambda: tiny_llama(rank), train_dataset=token_dataset(),
                      args=training_args(out_dir, save_strategy="steps", save_steps=SYNC_INTERVAL))
    hdet = add_hdet(trainer, hdet_settings(out_dir, "global", 1))
    runs: list[dict] = []

    class Watch(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:  # between syncs: each replica took one step at its own LR
                runs[-1]["after_first_step"] = gathered(master_vector(hdet))

    trainer.add_callback(Watch())
    class Trial(dict):  # what the Trainer reads of an optuna trial (and, as a dict, of its parameters)
        number, params = 7, {}

    # The second run as a trial of hyperparameter_search with optuna: trial.number names its folder, run-7.
    trainer.hp_space = lambda trial: dict(trial)  # the trial's own settings, which the Trainer sets on its args
    for trial in (None, Trial()):
        runs.append({})
        trainer.hp_search_backend = None if trial is None else HPSearchBackend.OPTUNA
        trainer.train(trial=trial)
        runs[-1].update(optimizer_is_hdets=hdet.ensemble.adapter.optimizer is trainer.optimizer.optimizer,
                        steps=hdet.global_step, lrs=gathered(torch.tensor(hdet.current_lrs())))
    # A trial whose search space moves save_steps off the sync points is refused before it trains.
    try:
        trainer.train(trial=Trial(save_steps=SYNC_INTERVAL + 1))
    except HDETConfigError as error:
        runs.append({"refused": str(error), "steps": trainer.state.global_step})
    return runs


def test_each_train_of_a_trainer_with_model_init_is_an_hdet_run(tmp_path):
    """The second train() used to keep the first run's ensemble: the new model trained at the plain LR, unaveraged."""
    *runs, off_sync = run_ranks(model_init_worker, 2, str(tmp_path), timeout=600)[0]
    assert f"save_steps={SYNC_INTERVAL + 1}" in off_sync["refused"] and off_sync["steps"] == 0
    for run in runs:
        assert run["optimizer_is_hdets"] and run["steps"] == MAX_STEPS
        assert not torch.equal(run["after_first_step"][0], run["after_first_step"][1])
        low, high = multipliers(2, ALPHA, "linear")  # each replica's LR: the same base times its own multiplier
        ratio = run["lrs"].max(0).values / run["lrs"].min(0).values
        torch.testing.assert_close(ratio, torch.full_like(ratio, high / low))
    # HDET's state lies in each run's own checkpoints: the trial's in its run folder, beside the Trainer's
    for folder in (tmp_path, tmp_path / "run-7"):
        checkpoints = sorted(folder.glob("checkpoint-*"))
        assert checkpoints and all((checkpoint / "hdet_state.pt").is_file() for checkpoint in checkpoints)


def epochs_worker(rank: int, world: int, out_dir: str) -> dict:
    from hdet_scale.integrations.hf_trainer import add_hdet

    trainer = fresh_trainer(out_dir, 2, max_steps=-1, num_train_epochs=1)
    hdet = add_hdet(trainer, {"sync_interval": 4, "ranks_per_replica": 1})  # the controller's start and stop: shares
    trainer.train()
    return {"max_steps": trainer.state.max_steps, "global_step": trainer.state.global_step,
            "window": (hdet.config.auto_lr.start, hdet.config.auto_lr.stop)}


def test_a_run_given_in_epochs_places_the_controller_by_trainers_own_step_count(tmp_path):
    """Under DeepSpeed the config needed the run's length before Trainer had counted it: with epochs (max_steps
    -1) it failed inside train(), telling the user to pass total_steps= to a function they never call."""
    for result in run_ranks(epochs_worker, 2, str(tmp_path), timeout=600):
        # 256 rows / (2 per rank x 2 ranks) = 64 batches, 2 per optimizer step
        assert result["max_steps"] == result["global_step"] == 32
        assert result["window"] == (round(0.02 * 32), round(0.25 * 32))


# ------------------------------------------------------------------------------------------- LR range test
RANGE_TEST = 20
RANGE_ROWS = 8 * MAX_STEPS
"""One epoch is the run's max_steps (2 ranks x 2 rows x 2 micro-batches per step): the test's batches only fit in the
epochs HDET adds to the Trainer's loop."""


def range_test_worker(rank: int, world: int, out_dir: str, stage: int | None) -> dict:
    from transformers import TrainerCallback

    from hdet_scale.integrations.hf_trainer import add_hdet

    settings = hdet_settings(out_dir, "global", 1)
    settings["auto_lr"]["range_test"] = RANGE_TEST
    trainer = fresh_trainer(out_dir, stage, seed=rank, lr_scheduler_type="linear", save_strategy="steps",
                            save_steps=SYNC_INTERVAL, eval_strategy="epoch", include_num_input_tokens_seen="all",
                            eval_dataset=[{"input_ids": PROBE_ROW, "labels": PROBE_ROW}] * 2)
    trainer.train_dataset = token_dataset(RANGE_ROWS)
    hdet = add_hdet(trainer, settings)
    record: dict = {"steps": [], "global_steps": [], "saves": [], "evaluations": [], "begun": 0}

    def optimizer_state_is_fresh(optimizer) -> bool:
        return all(not torch.is_tensor(value) or not value.any() for state in optimizer.state.values()
                   for value in state.values())

    class Recorder(TrainerCallback):  # added after HDET's callback: its hooks run after HDET's
        def on_train_begin(self, args, state, control, **kwargs):
            optimizer = hdet.ensemble.adapter.optimizer
            # A pre-hook registered after HDET's sees the LR this replica's step trains with (its first call of the
            # step: ZeRO-2 steps the optimizer once per param group); the held scheduler's LR is the schedule's.
            optimizer.register_step_pre_hook(lambda opt, *_: record["steps"].append(
                (hdet.ramping, opt.param_groups[0]["lr"], trainer.lr_scheduler.get_last_lr()[0]))
                if len(record["steps"]) < record["begun"] else None)
            record["first_weights"] = gathered(master_vector(hdet))

        def on_step_begin(self, args, state, control, **kwargs):
            record["begun"] += 1
            if not hdet.ramping and "run_start" not in record:
                record["run_start"] = {"weights": gathered(master_vector(hdet)), "value": hdet.value("lr/0"),
                                       "fresh_optimizer": optimizer_state_is_fresh(hdet.ensemble.adapter.optimizer)}

        def on_optimizer_step(self, args, state, control, **kwargs):
            if hdet.ramping:  # the last one: the weights the test left, before HDET restores the first ones
                record["test_weights"] = gathered(master_vector(hdet))

        def on_step_end(self, args, state, control, **kwargs):
            record["global_steps"].append(state.global_step)

        def on_save(self, args, state, control, **kwargs):
            record["saves"].append((state.global_step, hdet.ramping))

        def on_evaluate(self, args, state, control, **kwargs):
            record["evaluations"].append((state.global_step, hdet.ramping))

    trainer.add_callback(Recorder())
    trainer.train()
    for key in ("first_weights", "test_weights"):
        record[key] = record[key].numpy()
    record["run_start"]["weights"] = record["run_start"]["weights"].numpy()
    return {"record": record, "hdet_step": hdet.ensemble.global_step,
            "trainer_step": trainer.state.global_step, "pick": hdet.ensemble.range_test_pick,
            "lr": trainer.args.learning_rate, "logged": [log for log in trainer.state.log_history if "loss" in log],
            "tokens_seen": trainer.state.num_input_tokens_seen}


@pytest.mark.parametrize("stage", [None, 2], ids=["ddp", "zero2"])
def test_a_run_starts_with_an_lr_range_test(tmp_path, stage):
    """auto_lr.range_test under DDP and DeepSpeed (where HDET steps inside the engine's step, and the engine holds
    the scheduler): the test's steps are not counted by the Trainer, its scheduler holds through them, every replica
    starts the run again from its first weights at the picked LR, and the run trains all its max_steps (from data
    that one epoch would not hold) with checkpoints after the test only, and evaluations and counted input tokens of
    the run's steps only (the test's batches end epochs of their own)."""
    from hdet_scale.range_test import ramp_lr

    results = run_ranks(range_test_worker, 2, str(tmp_path), stage, timeout=600)
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    test = lines[0]["range_test"]
    test_steps, pick, scale, lr = len(test["lrs"]), test["picked_lr"], test["scale"], results[0]["lr"]
    assert lines[0]["step"] == 0 and pick is not None and pick == results[0]["pick"]
    # the regular syncs, the end's, and one before each evaluation between them (each epoch's end)
    evaluated = {step for step, _ in results[0]["record"]["evaluations"]}
    assert [line["step"] for line in lines[1:]] == sorted({SYNC_INTERVAL, 2 * SYNC_INTERVAL, MAX_STEPS} | evaluated)
    assert evaluated - {SYNC_INTERVAL, 2 * SYNC_INTERVAL, MAX_STEPS}  # some between syncs
    for result in results:
        record = result["record"]
        # Every optimizer step: the test's (it may stop early, once the loss diverges), then all the run's.
        steps = record["steps"]
        assert [ramping for ramping, _, _ in steps] == [True] * test_steps + [False] * MAX_STEPS
        assert result["hdet_step"] == result["trainer_step"] == MAX_STEPS
        assert record["global_steps"] == [0] * test_steps + list(range(1, MAX_STEPS + 1))
        # The test ramps the LR while the schedule holds at its first LR; the run's schedule then starts from its
        # first step and is as long as max_steps (linear decay to 0 at max_steps).
        assert [applied for _, applied, _ in steps[:test_steps]] == pytest.approx(
            [ramp_lr(step, steps=RANGE_TEST) for step in range(test_steps)], rel=1e-6)
        assert [scheduled for _, _, scheduled in steps[:test_steps]] == [lr] * test_steps
        assert [scheduled for _, _, scheduled in steps[test_steps:]] == pytest.approx(
            [lr * (1 - step / MAX_STEPS) for step in range(MAX_STEPS)], rel=1e-6)
        assert record["run_start"]["value"] == pytest.approx(steps[test_steps][1], rel=1e-6)
        # The run starts from the first weights (which the test had moved), with a fresh optimizer state.
        assert not torch.equal(torch.from_numpy(record["test_weights"]), torch.from_numpy(record["first_weights"]))
        assert torch.equal(torch.from_numpy(record["run_start"]["weights"]), torch.from_numpy(record["first_weights"]))
        assert record["run_start"]["fresh_optimizer"]
        # Checkpoints at the run's sync points only, after the test; evaluations at the run's epoch end only.
        assert record["saves"] == [(SYNC_INTERVAL, False), (2 * SYNC_INTERVAL, False), (MAX_STEPS, False)]
        # (the test's steps end epochs of their own: nothing is evaluated there)
        assert record["evaluations"][-1] == (MAX_STEPS, False)
        assert all(step > 0 and not ramping for step, ramping in record["evaluations"]), record["evaluations"]
        assert result["tokens_seen"] == MAX_STEPS * 2 * 2 * ACCUMULATION * SEQ  # the run's: 2 ranks, 2 rows
    # The first run step trains each replica at the scale set from the pick times its multiplier: the replicas'
    # mean at 0.7 times the pick.
    first_lrs = sorted(result["record"]["steps"][test_steps][1] for result in results)
    assert first_lrs == pytest.approx([lr * scale * rho for rho in sorted(multipliers(2, ALPHA))], rel=1e-6)
    assert sum(first_lrs) / len(first_lrs) == pytest.approx(0.7 * pick, rel=1e-6)
    assert sorted(path.name for path in tmp_path.glob("checkpoint-*")) == [
        f"checkpoint-{step}" for step in (SYNC_INTERVAL, 2 * SYNC_INTERVAL, MAX_STEPS)]
    # The Trainer logs the run's steps, the first one's loss that of the first weights (not the test's losses).
    logged = results[0]["logged"]
    assert [log["step"] for log in logged] == list(range(1, MAX_STEPS + 1))
    assert abs(logged[0]["loss"] - math.log(VOCAB)) < 0.7, logged[0]


def evaluated_weights_worker(rank: int, world: int, out_dir: str, strategy: str) -> list[tuple[int, bool]]:
    """DDP, 2 replicas; the Trainer evaluates every 2 steps (``strategy`` "steps"), or at each epoch's end, every 2
    steps too ("epoch": 16 rows, 2 ranks x 2 rows x 2 micro-batches), or where a callback added after HDET's asks
    ("callback"), syncs come every 3: at each evaluation, whether every rank held the same weights."""
    from transformers import TrainerCallback

    from hdet_scale.integrations.hf_trainer import add_hdet

    seen = []

    class RecordEvaluatedWeights(TrainerCallback):
        def on_evaluate(self, args, state, control, **kwargs):
            rows = gathered(torch.cat([p.detach().reshape(-1) for p in kwargs["model"].parameters()]))
            seen.append((state.global_step, bool(torch.equal(rows[0], rows[1]))))

    class AskToEvaluate(TrainerCallback):  # added after HDET's: it asks once HDET's on_step_end has run
        def on_step_end(self, args, state, control, **kwargs):
            control.should_evaluate = state.global_step % 2 == 0

    trainer = fresh_trainer(out_dir, seed=rank, eval_strategy="no" if strategy == "callback" else strategy,
                            eval_steps=2, eval_dataset=token_dataset(4),
                            train_dataset=token_dataset(16) if strategy == "epoch" else None)
    add_hdet(trainer, hdet_settings(out_dir, "global", 1))
    trainer.add_callback(RecordEvaluatedWeights())
    if strategy == "callback":
        trainer.add_callback(AskToEvaluate())
    trainer.train()
    return seen


@pytest.mark.parametrize("strategy", ["steps", "epoch", "callback"])
def test_an_evaluation_between_syncs_scores_the_one_model(tmp_path, strategy):
    """Evaluations every 2 steps and syncs every 3: the evaluation at step 2 scored each rank's own replica (and early
    stopping or the best-model choice acted on their mix); it gets a sync first, as a checkpoint does."""
    seen, _ = run_ranks(evaluated_weights_worker, 2, str(tmp_path), strategy)
    assert seen[:3] == [(2, True), (4, True), (6, True)] and all(same for _, same in seen), seen


def explored_attention_worker(rank: int, world: int, out_dir: str) -> dict:
    """DDP, 2 replicas exploring the attention scale: each rank's scaling after train()."""
    from hdet_scale.integrations.hf_trainer import add_hdet

    trainer = fresh_trainer(out_dir, seed=rank)
    settings = {**hdet_settings(out_dir, "local", 1), "explore": {"attention_scale": {"alpha": 0.5}}}
    callback = add_hdet(trainer, settings)
    trainer.train()
    scaling = next(module.scaling for module in trainer.model.modules() if isinstance(getattr(module, "scaling", None),
                                                                                       float))
    return {"scaling": gathered(torch.tensor([scaling])).reshape(-1).tolist(),
            "base": callback.ensemble.base("attention_scale") * (32 // 4) ** -0.5}


def test_after_training_every_replica_evaluates_at_the_values_found(tmp_path):
    """The last sync gave each replica its own value for the next interval: trainer.evaluate() after train() scored
    each rank's share of the data at its replica's attention scale (and save_model wrote one of them)."""
    result, _ = run_ranks(explored_attention_worker, 2, str(tmp_path))
    assert result["scaling"][0] == result["scaling"][1] == pytest.approx(result["base"])


def logged_worker(rank: int, world: int, out_dir: str) -> tuple[list, list, list[int]]:
    """DDP, 2 replicas, syncs every 3 of 7 steps: what the Trainer's loggers get of HDET's syncs."""
    from transformers import TrainerCallback

    from hdet_scale.integrations.hf_trainer import add_hdet

    logged = []

    class RecordLogs(TrainerCallback):  # as report_to's integrations see the logs
        def on_log(self, args, state, control, logs=None, **kwargs):
            if "hdet/loss" in logs:
                logged.append((state.global_step, logs["hdet/loss"], logs["hdet/lr/0/base"]))

    trainer = fresh_trainer(out_dir, seed=rank)
    callback = add_hdet(trainer, hdet_settings(out_dir, "global", 1))
    trainer.add_callback(RecordLogs())
    trainer.train()
    lines = [json.loads(line) for line in Path(callback.config.metrics_path).read_text().splitlines()]
    own = [log["step"] for log in trainer.state.log_history if "loss" in log]  # the Trainer's own, every step
    return [(line["step"], sum(line["replica_losses"]) / 2, line["values"]["lr/0"]["base"]) for line in lines], \
        logged, own


def test_the_trainers_loggers_get_each_syncs_scalars(tmp_path):
    """The Trainer's report_to (W&B, TensorBoard) got nothing of HDET: not the replicas' losses, not the LR the run
    trains at (its own learning_rate is the schedule's), not the controller's scale."""
    (synced, logged, own), _ = run_ranks(logged_worker, 2, str(tmp_path))
    assert [step for step, _, _ in synced] == [3, 6, 7]  # the last one: the end, between syncs
    assert logged == [pytest.approx(entry) for entry in synced]
    assert own == list(range(1, 8))  # beside them, not in their place (a log clears the Trainer's should_log)


def kept_apart_worker(rank: int, world: int, out_dir: str) -> bool:
    """DDP, 2 replicas, syncs every 3 of 7 steps, sync_at_end off: whether the replicas are still apart after a
    trainer.evaluate() that follows train()."""
    from hdet_scale.integrations.hf_trainer import add_hdet

    trainer = fresh_trainer(out_dir, seed=rank, eval_dataset=token_dataset(4))
    add_hdet(trainer, hdet_settings(out_dir, "global", 1), sync_at_end=False)
    trainer.train()
    trainer.evaluate()
    rows = gathered(torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()]))
    return not torch.equal(rows[0], rows[1])


def test_an_evaluation_after_training_leaves_replicas_kept_apart_as_they_are(tmp_path):
    """The evaluation sync was not limited to training: with sync_at_end=False (the replicas kept apart on purpose) an
    evaluate() after train() averaged them."""
    assert run_ranks(kept_apart_worker, 2, str(tmp_path)) == [True, True]
