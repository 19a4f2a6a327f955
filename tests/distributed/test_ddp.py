"""The DDP path on 4 real gloo ranks: fan-out, converge, alpha = 0, resume, non-finite replicas."""

from __future__ import annotations

import copy
import json
import math
import warnings
import weakref

import pytest
import torch
import torch.distributed as dist
from settings import lr_held_at_given
from torch import nn
from torch.nn.utils import parameters_to_vector
from torch.optim.lr_scheduler import CosineAnnealingLR, OneCycleLR

from distributed import gather_rows, run_ranks, train_steps
from hdet_scale import (
    AutoLRConfig,
    HDETConfig,
    HDETOneCycleLR,
    HDETScheduler,
    ReplicaTopology,
    multipliers,
)
from hdet_scale.comm import shut_down
from hdet_scale.engines.ddp import attach, install_gradient_mean, wrap_model

WORLD = 4


def make_model(seed: int = 1234) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(6, 8, generator=generator), torch.randn(6, 4, generator=generator)


def loss_of(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = batch(rank, step)
    return ((model(x) - y) ** 2).mean()


def flat_params(model: nn.Module) -> torch.Tensor:
    return parameters_to_vector(model.parameters()).detach().clone()


def flat_grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()


# ------------------------------------------------------------------------------- fan-out and converge
def fanout_and_converge(rank: int, world: int, mode: str, per_replica: int, metrics_path: str) -> dict:
    config = HDETConfig(spread="linear", alpha=0.5, sync_interval=3, ranks_per_replica=per_replica, gradient_mode=mode,
                        metrics_path=metrics_path,
                        auto_lr=AutoLRConfig(mode="scale", start=0, sigma=0.01, range_test=0))
    topology = ReplicaTopology.build(config)
    model = wrap_model(make_model(seed=rank), config, topology)  # different seeds: the wrap must align them
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    hdet = attach(model, optimizer, config, topology=topology)
    replicas = topology.num_replicas
    replica_of = torch.arange(world) // per_replica
    syncs, interval_losses = 0, []
    assert torch.equal(gather_rows(flat_params(model)).std(0), torch.zeros_like(flat_params(model)))
    for step in range(1, 10):
        optimizer.zero_grad()
        loss = loss_of(model, rank, step)
        loss.backward()
        grads = gather_rows(flat_grads(model))
        for r in range(replicas):  # inside a replica gradients always agree
            assert torch.equal(grads[replica_of == r], grads[replica_of == r][:1].expand(per_replica, -1))
        if mode == "global":
            assert torch.allclose(grads, grads[:1].expand(world, -1), atol=1e-7)
        else:
            assert not torch.allclose(grads[0], grads[-1])
        # Eq. 1 with a permutation: the replicas hold the multipliers exactly once each, and every rank
        # knows which replica holds which.
        expected_lr = hdet.current_lrs()[0]
        held = gather_rows(torch.tensor([hdet.lr_multiplier()], dtype=torch.float64)).reshape(-1)
        per_replica_held = held[::per_replica].tolist()
        assert sorted(per_replica_held) == pytest.approx(multipliers(replicas, 0.5))
        assert torch.equal(held, held[::per_replica].repeat_interleave(per_replica))
        before = flat_params(model)
        grad = flat_grads(model)
        optimizer.step()
        # SGD: the update reveals the LR actually used, independently of HDET's bookkeeping.
        assert torch.allclose(before - flat_params(model), expected_lr * grad, rtol=1e-4, atol=1e-6)
        assert optimizer.param_groups[0]["lr"] == 0.05  # the scheduled LR is restored after the step
        pre = gather_rows(flat_params(model))
        report = hdet.step(loss)
        post = gather_rows(flat_params(model))
        interval_losses.append(loss.item())
        if report is None:
            distinct = [pre[replica_of == r][0] for r in range(replicas)]
            assert not torch.allclose(distinct[0], distinct[1])  # replicas differ between syncs
            continue
        syncs += 1
        rank_means = gather_rows(torch.tensor([sum(interval_losses) / len(interval_losses)], dtype=torch.float64))
        expected_losses = [rank_means[replica_of == r].mean().item() for r in range(replicas)]
        assert report.replica_losses == pytest.approx(expected_losses, rel=1e-12)
        interval_losses = []
        independent_mean = torch.stack([pre[replica_of == r][0] for r in range(replicas)]).double().mean(0)
        assert torch.allclose(post.double(), independent_mean.expand(world, -1), rtol=1e-6, atol=1e-7)
        assert torch.equal(post, post[:1].expand(world, -1))  # identical after the sync, bit for bit
        assert report.bytes_averaged == 4 * (before.numel() + 1)  # one bucket: its parameters and its count
        assert report.controller_updated and report.excluded_replicas == []
        replica_values = gather_rows(torch.tensor(hdet.current_lrs(), dtype=torch.float64)).reshape(-1)
        assert replica_values[::per_replica].tolist() == pytest.approx(
            report.values["lr/0"]["next_replica_values"])
    return {"syncs": syncs, "replica": topology.replica_index}


@pytest.mark.parametrize(("mode", "per_replica"), [("global", 1), ("global", 2), ("local", 1), ("local", 2)])
def test_replicas_fan_out_and_converge(tmp_path, mode, per_replica):
    metrics = tmp_path / "metrics.jsonl"
    results = run_ranks(fanout_and_converge, WORLD, mode, per_replica, str(metrics))
    assert [r["syncs"] for r in results] == [3] * WORLD
    assert [r["replica"] for r in results] == [rank // per_replica for rank in range(WORLD)]
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [line["step"] for line in lines] == [3, 6, 9]
    for line in lines:
        assert len(line["replica_losses"]) == WORLD // per_replica
        assert math.fsum(line["weights"]) == pytest.approx(1.0)
        assert set(line["values"]["lr/0"]) == {"base", "scale", "replica_values", "delta", "velocity",
                                                   "next_replica_values", "applied_bases", "replica_multipliers"}
        assert len(line["values"]["lr/0"]["applied_bases"]) == 3  # one base per step of the interval
        assert line["sync_seconds"] > 0 and line["bytes_averaged"] > 0


# ----------------------------------------------------------------------------- alpha = 0 is plain DDP
def alpha_zero_matches_ddp(rank: int, world: int, per_replica: int) -> None:
    config = HDETConfig(spread="linear", alpha=0.0, sync_interval=2, ranks_per_replica=per_replica,
                        auto_lr=AutoLRConfig(enabled=False))
    topology = ReplicaTopology.build(config)
    plain = nn.parallel.DistributedDataParallel(make_model())
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.01)
    plain_sched = OneCycleLR(plain_opt, max_lr=0.02, total_steps=12)
    hdet_model = wrap_model(make_model(), config, topology)
    hdet_opt = torch.optim.AdamW(hdet_model.parameters(), lr=0.01)
    hdet_sched = HDETOneCycleLR(hdet_opt, max_lr=0.02, total_steps=12, hdet_config=config, topology=topology)
    for step in range(1, 12):
        losses = []
        for model, opt in ((plain, plain_opt), (hdet_model, hdet_opt)):
            opt.zero_grad()
            loss = loss_of(model, rank, step)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        plain_sched.step()
        hdet_sched.step(losses[1])
        assert losses[0] == losses[1], f"step {step}: {losses}"
        for a, b in zip(plain.parameters(), hdet_model.parameters(), strict=True):
            assert torch.equal(a, b), f"step {step}"
        assert plain_opt.param_groups[0]["lr"] == hdet_opt.param_groups[0]["lr"]
    assert hdet_sched.hdet.global_step == 11


@pytest.mark.parametrize("per_replica", [1, 2])
def test_alpha_zero_reproduces_plain_ddp_exactly(per_replica):
    run_ranks(alpha_zero_matches_ddp, WORLD, per_replica)


# ---------------------------------------------------------------------------------------------- resume
def build_run(config: HDETConfig, topology: ReplicaTopology, seed: int):
    model = wrap_model(make_model(seed), config, topology)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    scheduler = HDETScheduler(CosineAnnealingLR(optimizer, T_max=20), hdet_config=config, model=model,
                              topology=topology)
    return model, optimizer, scheduler


def train(model, optimizer, scheduler, rank: int, steps: range) -> list[float]:
    return train_steps(model, optimizer, scheduler, loss_of, rank, steps)


def resume_matches(rank: int, world: int) -> None:
    config = HDETConfig(spread="linear", alpha=0.5, sync_interval=3, ranks_per_replica=2, gradient_mode="local",
                        auto_lr=AutoLRConfig(mode="scale", start=0, sigma=0.01, range_test=0))
    topology = ReplicaTopology.build(config)
    straight = build_run(config, topology, seed=0)
    straight_losses = train(*straight, rank, range(1, 11))

    first = build_run(config, topology, seed=0)
    resumed_losses = train(*first, rank, range(1, 6))  # stops between syncs: accumulators are non-zero
    saved = copy.deepcopy([first[0].module.state_dict(), first[1].state_dict(), first[2].state_dict()])
    del first
    second = build_run(config, topology, seed=99)  # different init: everything must come from the state
    second[0].module.load_state_dict(saved[0])
    second[1].load_state_dict(saved[1])
    second[2].load_state_dict(saved[2])
    resumed_losses += train(*second, rank, range(6, 11))

    assert resumed_losses == straight_losses
    for a, b in zip(straight[0].parameters(), second[0].parameters(), strict=True):
        assert torch.equal(a, b)
    assert plain(straight[2].hdet.state_dict()) == plain(second[2].hdet.state_dict())


def plain(state):
    """A state dict with tensors turned into lists, so states compare with ==."""
    if isinstance(state, dict):
        return {key: plain(value) for key, value in state.items()}
    return state.tolist() if isinstance(state, torch.Tensor) else state


def test_resume_continues_exactly():
    run_ranks(resume_matches, WORLD)


# ------------------------------------------------------------------------------- non-finite replicas
def non_finite_replicas(rank: int, world: int) -> None:
    config = HDETConfig(spread="linear", alpha=0.5, sync_interval=2, ranks_per_replica=2, gradient_mode="local",
                        auto_lr=AutoLRConfig(mode="scale", start=0, range_test=0))
    topology = ReplicaTopology.build(config)
    model = wrap_model(make_model(), config, topology)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    hdet = attach(model, optimizer, config, topology=topology)
    replica = topology.replica_index
    first_param = next(model.parameters())
    for step in range(1, 13):
        optimizer.zero_grad()
        loss = loss_of(model, rank, step)
        loss.backward()
        optimizer.step()
        reported_loss = loss.item()
        if step == 4 and replica == 1:
            with torch.no_grad():
                first_param[0, 0] = float("nan")  # diverged parameters on replica 1
        if step == 8 and replica == 0:
            reported_loss = float("inf")  # a non-finite loss on replica 0, its parameters finite
        pre = gather_rows(flat_params(model))
        report = hdet.step(reported_loss)
        post = gather_rows(flat_params(model))
        assert torch.isfinite(post).all(), f"step {step}"
        if step == 4:
            assert report.excluded_replicas == [1]
            assert torch.equal(post, pre[0].expand(world, -1))  # the survivor's mean, exactly
        if step == 8:  # a loss is a score, not a reason to leave a replica out: its worst, no weight
            assert report.excluded_replicas == [] and report.weights[0] == 0.0
            mean = torch.stack([pre[0], pre[2]]).double().mean(0)
            assert torch.allclose(post.double(), mean.expand(world, -1), rtol=1e-6, atol=1e-7)
    # Training went on finite everywhere; one step later every replica diverges: a clear error, nothing written.
    train_steps(model, optimizer, hdet, loss_of, rank, range(13, 14))
    with torch.no_grad():
        first_param[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="every replica has non-finite parameters or optimizer state"):
        hdet.sync()


def test_non_finite_replica_is_excluded_and_training_continues():
    run_ranks(non_finite_replicas, WORLD)


# ------------------------------------------------------------------------------------- layout errors
def bad_layout(rank: int, world: int) -> str:
    try:
        ReplicaTopology.build(HDETConfig(ranks_per_replica=3))
    except ValueError as error:
        return str(error)
    return "no error"


def test_world_size_not_divisible_fails_before_any_group():
    messages = run_ranks(bad_layout, WORLD)
    assert all("ranks_per_replica=3 does not divide the world size 4" in m for m in messages)


# ----------------------------------------------------------------------------------- paper mode, end to end
PAPER = {"alpha": 0.2, "sync_interval": 4, "start": 12, "total_steps": 40, "max_lr": 0.05,
         "beta": 0.5, "sigma": 0.05, "step_size": 0.5}


def train_under_onecycle(rank: int, config: HDETConfig, *, max_lr: float, total_steps: int,
                         first_loss_step: int = 1) -> None:
    """SGD on this rank's data through ``HDETOneCycleLR``; the loss reaches HDET from ``first_loss_step`` on."""
    topology = ReplicaTopology.build(config)
    model = wrap_model(make_model(), config, topology)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scheduler = HDETOneCycleLR(optimizer, max_lr=max_lr, total_steps=total_steps, hdet_config=config,
                               topology=topology, model=model)
    for step in range(1, total_steps + 1):
        optimizer.zero_grad()
        loss = loss_of(model, rank, step)
        loss.backward()
        optimizer.step()
        scheduler.step(loss if step >= first_loss_step else None)


def paper_mode_run(rank: int, world: int, metrics_path: str) -> None:
    config = HDETConfig(spread="linear", alpha=PAPER["alpha"], sync_interval=PAPER["sync_interval"],
                        metrics_path=metrics_path,
                        auto_lr=AutoLRConfig(mode="paper", start=PAPER["start"], beta=PAPER["beta"],
                                             sigma=PAPER["sigma"], step_size=PAPER["step_size"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no loss before the warm-up is fine: no warning, no crash
        train_under_onecycle(rank, config, max_lr=PAPER["max_lr"], total_steps=PAPER["total_steps"],
                             first_loss_step=9)


def test_paper_mode_takes_over_and_decays_to_the_floor(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    run_ranks(paper_mode_run, 2, str(metrics))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(4, 41, 4))
    assert [r["controller_updated"] for r in records] == [False, False] + [True] * 8

    # Independent recomputation of eqs. 4-8 from the recorded losses and the values each replica used.
    reference = OneCycleLR(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.01), max_lr=PAPER["max_lr"],
                           total_steps=PAPER["total_steps"])
    for _ in range(PAPER["start"] - 1):
        reference.optimizer.step()
        reference.step()
    base, velocity = reference.get_last_lr()[0], 0.0  # the LR of the takeover sync's step, eq. 5's eta at kT
    floor = PAPER["max_lr"] / 25 / 1e4
    syncs_left = (PAPER["total_steps"] - PAPER["start"]) // PAPER["sync_interval"]
    gamma = 1 - (floor / base) ** (1 / syncs_left)
    for record in records[2:]:
        values = record["values"]["lr/0"]
        losses = record["replica_losses"]
        mean = sum(losses) / len(losses)
        exps = [math.exp((mean - loss) / PAPER["sigma"]) for loss in losses]
        weights = [e / sum(exps) for e in exps]
        assert record["weights"] == pytest.approx(weights, rel=1e-9)
        rhos = [value / base for value in values["replica_values"]]
        assert sorted(rhos) == pytest.approx(multipliers(2, PAPER["alpha"]))
        mean_rho = sum(rhos) / len(rhos)  # eqs. 5-6 relative to eta bar, applied to the base
        delta = base * (sum(w * rho for w, rho in zip(weights, rhos, strict=True)) - mean_rho) / mean_rho
        velocity = PAPER["beta"] * velocity + (1 - PAPER["beta"]) * delta
        base = max(base * (1 - gamma) + PAPER["step_size"] * velocity, floor)
        assert values["delta"] == pytest.approx(delta, rel=1e-6, abs=1e-15)
        assert values["velocity"] == pytest.approx(velocity, rel=1e-6, abs=1e-15)
        assert values["base"] == pytest.approx(base, rel=1e-6)
    # Without the velocity term the base would sit exactly on OneCycleLR's floor after K syncs.
    assert reference.get_last_lr()[0] * (1 - gamma) ** syncs_left == pytest.approx(floor)


def held_controller_run(rank: int, world: int, metrics_path: str) -> None:
    """Scale mode through HDETOneCycleLR: the controller from 20% to 60% of 40 steps, T = 4."""
    config = HDETConfig.from_dict({"alpha": 0.5, "sync_interval": 4, "metrics_path": metrics_path, "auto_lr": {
        "mode": "scale", "start": 0.2, "stop": 0.6, "sigma": 0.05, "step_size": 2.0, "range_test": 0}})
    train_under_onecycle(rank, config, max_lr=0.05, total_steps=40)


def test_the_controller_moves_between_its_start_and_stop_then_holds(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    run_ranks(held_controller_run, 2, str(metrics))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    # start 0.2 x 40 = step 8, stop 0.6 x 40 = step 24: the syncs at 8 ... 24 update, the later ones hold
    assert [r["controller_updated"] for r in records] == [False] + [True] * 5 + [False] * 4
    scales = [r["values"]["lr/0"]["scale"] for r in records]
    assert scales[0] == 1.0 and scales[5] != 1.0
    assert scales[6:] == [scales[5]] * 4
    # the update at 24 moved the scale from the one at 20 by its velocity (scale mode, inside [0.1, 10]), and that
    # scale is what is held
    reached = min(max(scales[4] * (1 + 2.0 * records[5]["values"]["lr/0"]["velocity"]), 0.1), 10.0)
    assert scales[5] == pytest.approx(reached, rel=1e-12)


# ------------------------------------------------------------------------------------------- shut-down
def shut_down_in_order(rank: int, world: int) -> dict:
    """A trained HDET run dropped in one piece, then ``shut_down``: when was the run collected?"""
    config = HDETConfig(alpha=0.5, sync_interval=2, auto_lr=lr_held_at_given())
    topology = ReplicaTopology.build(config)
    model = wrap_model(make_model(), config, topology)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    hdet = attach(model, optimizer, config, topology=topology)
    train_steps(model, optimizer, hdet, loss_of, rank, range(4))
    seen = {}
    collected = weakref.finalize(hdet, lambda: seen.update(groups_alive=dist.is_initialized()))
    del model, optimizer, hdet
    in_a_cycle = collected.alive  # the optimizer's step hooks hold the ensemble: only the collector frees it
    shut_down()
    return {"in_a_cycle": in_a_cycle, "collected": not collected.alive, **seen,
            "initialized_after": dist.is_initialized()}


def test_shut_down_collects_the_run_while_its_groups_live_then_destroys_them():
    """Issue 16 item 9: a run left to interpreter exit can be torn down after its process groups, by a gloo
    thread of a finalizing interpreter (SIGABRT after a complete run). ``shut_down`` collects it first."""
    for result in run_ranks(shut_down_in_order, 2):
        assert result == {"in_a_cycle": True, "collected": True, "groups_alive": True, "initialized_after": False}


# ------------------------------------------------------------------------------------------- misuse
def ddp_built_elsewhere(rank: int, world: int) -> dict[str, str]:
    from hdet_scale.config import HDETConfigError

    config = HDETConfig(ranks_per_replica=1, gradient_mode="local", sync_interval=2,
                        auto_lr=AutoLRConfig(mode="scale", start=0, range_test=0))
    topology = ReplicaTopology.build(config)
    own = nn.parallel.DistributedDataParallel(make_model())
    other_mode = wrap_model(make_model(), HDETConfig(ranks_per_replica=1), topology)
    one_replica = HDETConfig(ranks_per_replica=2, gradient_mode="local")
    other_size = wrap_model(make_model(), one_replica, ReplicaTopology.build(one_replica))
    errors = {}
    for name, build in {"own": lambda: attach(own, torch.optim.SGD(own.parameters(), lr=0.1), config,
                                              topology=topology),
                        "other mode": lambda: HDETScheduler(
                            CosineAnnealingLR(torch.optim.SGD(other_mode.parameters(), lr=0.1), T_max=4),
                            hdet_config=config, model=other_mode, topology=topology),
                        "one cycle": lambda: HDETOneCycleLR(torch.optim.SGD(own.parameters(), lr=0.1), max_lr=0.1,
                                                            total_steps=4, hdet_config=config, model=own,
                                                            topology=topology),
                        "other size": lambda: attach(other_size, torch.optim.SGD(other_size.parameters(), lr=0.1),
                                                     config, topology=topology),
                        "rewrapped": lambda: install_gradient_mean(other_mode, config, topology)}.items():
        try:
            build()
            errors[name] = ""
        except HDETConfigError as error:
            errors[name] = str(error)
    wrapped = wrap_model(make_model(), config, topology)
    install_gradient_mean(wrapped, config, topology)  # a framework's second run on the same model: as it was
    attach(wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.1), config, topology=topology)  # the right way
    return errors


def test_a_ddp_model_not_built_for_the_runs_gradient_mode_is_refused():
    """Local mode over a DistributedDataParallel of the user's own averaged every gradient over all ranks."""
    errors = run_ranks(ddp_built_elsewhere, 2)[0]
    assert "built without HDET's gradient mean" in errors["own"] and "wrap_model" in errors["own"]
    assert "built to average its gradients for gradient_mode 'global'" in errors["other mode"]
    assert "this run averages them for gradient_mode 'local', ranks_per_replica=1" in errors["other mode"]
    # local mode over replicas of 2 ranks, where this run's replicas are single ranks: they would share gradients
    assert "gradient_mode 'local', ranks_per_replica=2, and this run" in errors["other size"]
    assert "built without HDET's gradient mean" in errors["one cycle"]
    assert "averages its gradients for gradient_mode 'global' already" in errors["rewrapped"]


def sync_under_inference_mode(rank: int, world: int) -> bool:
    config = HDETConfig(spread="linear", alpha=0.5, sync_interval=2, ranks_per_replica=1,
                        auto_lr=AutoLRConfig(mode="scale", start=0, range_test=0))
    topology = ReplicaTopology.build(config)
    model = wrap_model(make_model(), config, topology)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    hdet = attach(model, optimizer, config, topology=topology)
    train_steps(model, optimizer, hdet, loss_of, rank, range(1, 2))
    with torch.inference_mode():  # as Lightning's validation loop runs its hooks on an accelerator
        hdet.sync()
    train_steps(model, optimizer, hdet, loss_of, rank, range(2, 5))  # the regular syncs at steps 2 and 4
    return hdet.last_report.step == 4 and bool(torch.equal(*gather_rows(flat_params(model))[:2]))


def test_a_sync_under_inference_mode_leaves_nothing_the_next_sync_cannot_write():
    """Lightning runs its validation hooks (where a sync ends an interval early) under torch.inference_mode on an
    accelerator: the sync's bucket memory was allocated there, as inference tensors, and the next regular sync,
    writing into it outside inference mode, failed."""
    assert run_ranks(sync_under_inference_mode, 2) == [True, True]


def extra_sync_run(rank: int, world: int) -> tuple[list[tuple], list[int]]:
    """T = 4, the controller moving up to step 8: extra syncs at steps 5 (inside its window) and 10 (past it)."""
    config = HDETConfig(spread="linear", alpha=0.5, sync_interval=4, ranks_per_replica=1,
                        auto_lr=AutoLRConfig(mode="scale", start=0, stop=8, range_test=0, sigma=0.05, step_size=2.0,
                                             beta=0.5))
    topology = ReplicaTopology.build(config)
    model = wrap_model(make_model(), config, topology)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    hdet = attach(model, optimizer, config, topology=topology)
    reports, kept = [], []
    for step in range(1, 13):
        train_steps(model, optimizer, hdet, loss_of, rank, range(step, step + 1))
        if hdet.last_report is not None and hdet.last_report.step == step:
            reports.append(hdet.last_report)
        if step in (5, 10):
            reports.append(hdet.sync())  # as before a preemption checkpoint
            kept.append(hdet.state_dict()["explored"]["lr/0"]["parts_steps"])
    return [(report.step, report.controller_updated, report.values["lr/0"]["scale"],
             report.values["lr/0"]["velocity"], report.replica_losses, report.values["lr/0"]["replica_multipliers"])
            for report in reports], kept


def test_an_extra_sync_averages_but_the_controller_moves_at_regular_syncs_only():
    """An extra sync (a checkpoint's, an export's) also moved the controller, from the losses of part of an
    interval: a run checkpointed more often made more controller updates (in paper mode, one more decay each).
    Then the regular update rested on the 3 steps after the extra sync alone, as strong as a whole interval's: it
    weighs each part's Delta by its steps, computed here from the reports' losses and multipliers. An extra sync
    whose next regular sync is past the controller's window keeps nothing."""
    ((regular, extra, after, late, last), kept), _ = run_ranks(extra_sync_run, 2)
    assert [entry[:2] for entry in (regular, extra, after, late, last)] == [
        (4, True), (5, False), (8, True), (10, False), (12, False)]
    assert extra[2] == regular[2] != 1.0  # the scale held at the extra sync
    assert kept == [1, 0]

    def delta(losses: list[float], rhos: list[float]) -> float:  # eqs. 4-6, sigma 0.05, mean rho 1
        scores = [math.exp((sum(losses) / 2 - loss) / 0.05) for loss in losses]
        return sum(score / sum(scores) * (rho - 1.0) for score, rho in zip(scores, rhos, strict=True))

    first, rest = delta(*extra[4:]), delta(*after[4:])  # 1 step, then 3
    weighed = (first + 3 * rest) / 4
    assert abs(weighed - rest) > 1e-3 and abs(weighed - (first + rest) / 2) > 1e-3  # the weighing shows
    velocity = 0.5 * regular[3] + 0.5 * weighed
    assert after[3] == pytest.approx(velocity, rel=1e-9)
    assert after[2] == pytest.approx(regular[2] * (1 + 2.0 * velocity), rel=1e-9)


# ------------------------------------------------------------------------------------------ a loss scaler
def scaled_steps(rank: int, world: int) -> dict:
    """DDP with HDET's gradient mean (global mode) and a GradScaler, as with fp16: a step where every rank's
    gradients overflow, then one where rank 0's alone do."""
    config = HDETConfig(alpha=0.5, sync_interval=100, ranks_per_replica=1, auto_lr=AutoLRConfig(range_test=0,
                                                                                               enabled=False))
    topology = ReplicaTopology.build(config)
    model = wrap_model(make_model(), config, topology)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hdet = attach(model, optimizer, config, topology=topology)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    seen = []
    for step, overflowing in enumerate(([0, 1], [0])):
        before = flat_params(model)
        loss = loss_of(model, rank, step) * (1e39 if rank in overflowing else 1.0)  # past fp32: inf gradients
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        grads = flat_grads(model)
        scaler.step(optimizer)
        scaler.update()
        hdet.step(loss)
        seen.append({"stepped": not torch.equal(before, flat_params(model)), "scale": scaler.get_scale(),
                     "grads_finite": bool(grads.isfinite().all())})
    shut_down()
    return {"seen": seen}


def test_a_loss_scaler_sees_an_overflow_on_every_rank_and_steps_past_one_on_some():
    """Where every rank's gradients overflowed, HDET's mean (which leaves a non-finite rank out) wrote zeros: the
    scaler found them finite, stepped on zeros and kept its scale, so the overflow came back at every step."""
    for result in run_ranks(scaled_steps, 2):
        every_rank, rank_0_only = result["seen"]
        assert every_rank == {"stepped": False, "scale": 2.0**15, "grads_finite": False}  # skipped, scale halved
        assert rank_0_only == {"stepped": True, "scale": 2.0**15, "grads_finite": True}  # rank 1's gradient


def refused_sync(rank: int, world: int, per_replica: int, sizes: tuple[int, ...],
                 reached: tuple[tuple[int, ...], ...]) -> str:
    """The error of the first sync of a local-mode run averaging its optimizer state, where ``reached[r]`` names
    the parameters (of ``sizes``) whose gradient replica r's steps reach: the others get no state there."""
    config = HDETConfig(sync_interval=2, ranks_per_replica=per_replica, gradient_mode="local",
                        average_optimizer_state=True, auto_lr=lr_held_at_given())
    params = [nn.Parameter(torch.ones(size)) for size in sizes]
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    hdet = attach(None, optimizer, config, topology=ReplicaTopology.build(config))
    for step in (1, 2):
        for index in reached[rank // per_replica]:
            params[index].grad = torch.ones(sizes[index])
        optimizer.step()
        if step == 1:
            hdet.step(1.0)
    with pytest.raises(ValueError) as refused:
        hdet.step(1.0)
    return str(refused.value)


@pytest.mark.parametrize("per_replica", [1, 2])
def test_replicas_with_different_optimizer_state_are_refused_on_every_rank(per_replica):
    """The optimizer makes a parameter's state at its first step: where one replica had not taken it, the ranks
    averaged buckets of different sizes (gloo failed, NCCL hangs or mixes unrelated values)."""
    # no gradient reaches the second parameter in replica 1
    messages = run_ranks(refused_sync, 2 * per_replica, per_replica, (3, 5), ((0, 1), (0,)), timeout=60)
    assert all(message.startswith("HDET sync at step 2: the replicas hold different tensors to average (rank 0: "
                                  "16 elements, rank") for message in messages)


def test_replicas_with_optimizer_states_of_different_parameters_alike_in_size_are_refused():
    """Counting elements let them through: the average mixed one parameter's momentum with another's."""
    # replica 0's gradient reaches the first parameter only, replica 1's the second: alike in size
    for message in run_ranks(refused_sync, 2, 1, (3, 3), ((0,), (1,)), timeout=60):
        assert "(as many elements, the optimizer state of other parameters); nothing was averaged" in message
