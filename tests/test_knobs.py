"""Hyperparameters explored besides the LR (paper Remark 1): weight decay, dropout, attention scale, label
smoothing and user knobs, each with its own spread, permutation and controller."""

from __future__ import annotations

import json

import pytest
import torch
from settings import LR_HELD_AT_GIVEN
from torch import nn

from distributed import run_ranks
from hdet_scale import AutoLRConfig, HDETConfig, HDETConfigError, HDETEnsemble, ReplicaTopology, multipliers
from hdet_scale.config import ExploreConfig, KnobConfig
from hdet_scale.engines.ddp import DDPAdapter
from hdet_scale.spread import PermutationStream

REPLICAS = 4
EXPLORE = {"weight_decay": {"alpha": 0.5}, "dropout": {"alpha": 0.4}, "attention_scale": {"alpha": 0.2},
           "label_smoothing": {"base": 0.1, "alpha": 0.6}}


def tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=40, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                         attention_dropout=0.1)
    return LlamaForCausalLM(config)


def two_groups(model: nn.Module) -> torch.optim.Optimizer:
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": matrices, "name": "matrices", "weight_decay": 0.1},
                              {"params": vectors, "name": "vectors", "weight_decay": 0.02}], lr=1e-3)


def record_group_values(optimizer: torch.optim.Optimizer) -> list[list[tuple[float, float]]]:
    """Per optimizer step, each group's (lr, weight_decay) inside the step (this hook runs after HDET's)."""
    used: list[list[tuple[float, float]]] = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: used.append(
        [(group["lr"], group["weight_decay"]) for group in opt.param_groups]))
    return used


def expected_multiplier(name: str, replica: int, alpha: float, replicas: int = REPLICAS) -> float:
    """rho_{pi(r)} for knob ``name`` at the start (seed 0), derived independently of the ensemble."""
    permutation = PermutationStream(name, 0).draw(replicas)
    return multipliers(replicas, alpha)[permutation[replica]]


def test_each_knob_changes_what_each_replica_computes():
    """Replica by replica (the topology of rank r of 4, no collectives before the first sync): the dropout
    probabilities and softmax scales in the modules, the weight decay the optimizer steps with, and the label
    smoothing the loss reads are the base values times this replica's own multiplier for that knob."""
    seen = {"dropout": set(), "scaling": set(), "weight_decay/matrices": set(), "label_smoothing": set()}
    for replica in range(REPLICAS):
        model = tiny_llama()
        optimizer = two_groups(model)
        config = HDETConfig.from_dict({"alpha": 0.3, "spread": "linear", "explore": EXPLORE,
                                        "auto_lr": LR_HELD_AT_GIVEN})
        topology = ReplicaTopology(rank=replica, world_size=REPLICAS, ranks_per_replica=1)
        hdet = HDETEnsemble(config, DDPAdapter(optimizer, model), topology=topology)
        attention = [module for module in model.modules() if type(module).__name__ == "LlamaAttention"]
        rho = {name: expected_multiplier(name, replica, alpha) for name, alpha in
               [("dropout", 0.4), ("attention_scale", 0.2), ("weight_decay/matrices", 0.5),
                ("weight_decay/vectors", 0.5), ("label_smoothing", 0.6), ("lr/matrices", 0.3)]}
        for module in attention:
            assert module.attention_dropout == pytest.approx(0.1 * rho["dropout"])
            assert module.scaling == pytest.approx(8 ** -0.5 * rho["attention_scale"])
        assert hdet.value("label_smoothing") == pytest.approx(0.1 * rho["label_smoothing"])
        used = record_group_values(optimizer)
        tokens = torch.randint(0, 64, (2, 8))
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        (lr_matrices, wd_matrices), (_, wd_vectors) = used[0]
        assert wd_matrices == pytest.approx(0.1 * rho["weight_decay/matrices"])
        assert wd_vectors == pytest.approx(0.02 * rho["weight_decay/vectors"])
        assert lr_matrices == pytest.approx(1e-3 * rho["lr/matrices"])
        # Outside the step the optimizer holds the base values again.
        assert [group["weight_decay"] for group in optimizer.param_groups] == [0.1, 0.02]
        seen["dropout"].add(round(attention[0].attention_dropout, 12))
        seen["scaling"].add(round(attention[0].scaling, 12))
        seen["weight_decay/matrices"].add(round(wd_matrices, 12))
        seen["label_smoothing"].add(round(hdet.value("label_smoothing"), 12))
        hdet.close()
    assert all(len(values) == REPLICAS for values in seen.values()), seen  # every replica its own value


def test_knob_guard_rails_and_clear_errors():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.9))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # SGD has weight_decay; 0 stays 0
    config = HDETConfig.from_dict({"spread": "linear", "explore": {"dropout": {"alpha": 0.5}},
                                   "auto_lr": LR_HELD_AT_GIVEN})
    values = set()
    for replica in range(REPLICAS):
        topology = ReplicaTopology(rank=replica, world_size=REPLICAS, ranks_per_replica=1)
        hdet = HDETEnsemble(config, DDPAdapter(optimizer, model), topology=topology)
        values.add(model[1].p)
        assert 0.0 <= model[1].p < 1.0  # 0.9 * 1.5 is clamped inside [0, 1)
        hdet.close()
    assert len(values) == REPLICAS - 1 and max(values) < 1.0  # the two multipliers above 1/0.9 both clamp
    resting = torch.optim.SGD(model.parameters(), lr=0.0)  # e.g. a warm-up's first step: 0 stays 0
    assert HDETEnsemble(HDETConfig(sync_interval=5), DDPAdapter(resting), topology=topology,
                        total_steps=100).current_lrs() == [0.0]
    with pytest.raises(HDETConfigError, match="explore.attention_scale cannot apply to Sequential"):
        HDETEnsemble(HDETConfig.from_dict({"explore": {"attention_scale": {}}}), DDPAdapter(optimizer, model),
                     topology=ReplicaTopology.single_process())
    with pytest.raises(HDETConfigError, match="explore.dropout cannot apply to Linear: it has no nn.Dropout"):
        HDETEnsemble(config, DDPAdapter(optimizer, nn.Linear(2, 2)), topology=ReplicaTopology.single_process())
    with pytest.raises(HDETConfigError, match="explore.dropout needs the model"):
        HDETEnsemble(config, DDPAdapter(optimizer), topology=ReplicaTopology.single_process())
    with pytest.raises(HDETConfigError, match="explore.label_smoothing.base is required"):
        HDETConfig.from_dict({"explore": {"label_smoothing": {"alpha": 0.1}}})
    with pytest.raises(HDETConfigError, match="explore.dropout.base is not used"):
        HDETConfig.from_dict({"explore": {"dropout": {"base": 0.1}}})
    with pytest.raises(HDETConfigError, match="unknown HDET setting 'explore.temperature'"):
        HDETConfig.from_dict({"explore": {"temperature": {}}})
    with pytest.raises(HDETConfigError, match=r"explore.weight_decay.alpha must be a number in \[0.0, 1.0\)"):
        HDETConfig.from_dict({"explore": {"weight_decay": {"alpha": 1.0}}})


def test_permutations_of_different_knobs_are_independent():
    """Eq. 9: one stream per knob; which multiplier slot replica 0 holds is uncorrelated across knobs."""
    names = ["lr/0", "weight_decay/0", "dropout", "attention_scale", "label_smoothing"]
    streams = {name: PermutationStream(name, 0) for name in names}
    draws = {name: torch.tensor([streams[name].draw(REPLICAS)[0] for _ in range(4000)], dtype=torch.float64)
             for name in names}
    for first in names:
        for second in names:
            if first < second:
                correlation = torch.corrcoef(torch.stack([draws[first], draws[second]]))[0, 1].item()
                assert abs(correlation) < 0.05, (first, second, correlation)
    assert sorted(draws["dropout"].unique().tolist()) == [0, 1, 2, 3]


# -------------------------------------------------------------------- the controller's direction
def quadratic_knob(rank: int, world: int, start: float) -> list[float]:
    """A user knob h whose best value is 1 by construction: each replica's loss is (h_r - 1)^2. From below
    the controller must raise the base, from above lower it. The LR of a quadratic f(x) = x^2 / 2 with SGD
    is explored alongside (best LR 1: one step to the minimum) and must move toward 1 the same way."""
    config = HDETConfig(spread="linear", alpha=0.5, sync_interval=1,
                        auto_lr=AutoLRConfig(mode="scale", start=0, sigma=0.05),
                        explore=ExploreConfig(label_smoothing=KnobConfig(base=0.2)))
    point = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([point], lr=start)
    hdet = HDETEnsemble(config, DDPAdapter(optimizer))
    knob = {"h": start}
    hdet.add_knob("h", lambda: knob["h"], lambda value: knob.update(h=value), low=0.0)
    bases = []
    for _ in range(30):
        # The LR: from x = 1, one SGD step on x^2 / 2 lands at 1 - lr, loss (1 - lr)^2 / 2.
        with torch.no_grad():
            point.fill_(1.0)
        optimizer.zero_grad()
        (point ** 2 / 2).sum().backward()
        optimizer.step()
        lr_loss = float(point.detach() ** 2 / 2)
        report = hdet.step((knob["h"] - 1.0) ** 2 + lr_loss)
        assert set(report.values) == {"lr/0", "label_smoothing", "h"}  # co-explored, each reported
        assert all({"delta", "velocity", "scale"} <= set(entry) for entry in report.values.values())
    bases.append(report.values["h"]["base"])
    bases.append(report.values["lr/0"]["base"])
    return bases


def from_both_sides(rank: int, world: int) -> list[list[float]]:
    return [quadratic_knob(rank, world, start) for start in STARTS]


STARTS = {0.4: 1.0, 1.6: -1.0}
"""Start value -> the direction the controller must move it (the best value is 1)."""


def test_the_controller_moves_a_knob_toward_its_best_value_from_both_sides():
    results = run_ranks(from_both_sides, REPLICAS)
    assert all(result == results[0] for result in results)  # every rank agrees
    for (start, direction), (h_base, lr_base) in zip(STARTS.items(), results[0], strict=True):
        assert direction * (h_base - start) > 0.1 and abs(h_base - 1.0) < abs(start - 1.0), (start, h_base)
        assert direction * (lr_base - start) > 0.05 and abs(lr_base - 1.0) < abs(start - 1.0), (start, lr_base)


def test_metrics_line_shows_every_knob(tmp_path):
    metrics = tmp_path / "m.jsonl"
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    config = HDETConfig.from_dict({"sync_interval": 1, "metrics_path": str(metrics),
                                   "explore": {"weight_decay": {}, "dropout": {}}})
    hdet = HDETEnsemble(config, DDPAdapter(optimizer, model), topology=ReplicaTopology.single_process())
    hdet.step(1.0)
    record = json.loads(metrics.read_text())
    assert set(record["values"]) == {"lr/0", "weight_decay/0", "dropout"}
    assert record["values"]["weight_decay/0"]["base"] == pytest.approx(0.01)  # AdamW's default
    assert record["values"]["dropout"]["base"] == 1.0  # a factor on each module's own probability


# ----------------------------------------------------------------------------- sharded engines
def knob_values_on(rank: int, world: int, engine: str) -> list[float]:
    """FSDP2 or DeepSpeed ZeRO-2, 2 replicas x 2 ranks: this rank's dropout, softmax scale, the weight decay
    and LR inside the optimizer step, and the label smoothing, checked against its replica's multipliers."""
    import os

    os.environ["LOCAL_WORLD_SIZE"] = "2"  # 2 "nodes" of 2 ranks: one replica per node
    model = tiny_llama()
    hdet_settings = {"alpha": 0.3, "spread": "linear", "explore": EXPLORE, "ranks_per_replica": 2,
                     "auto_lr": LR_HELD_AT_GIVEN}
    if engine == "fsdp":
        from hdet_scale.engines.fsdp import wrap

        model, handle = wrap(model, HDETConfig.from_dict(hdet_settings))
        optimizer = two_groups(model)
        hdet = handle.attach(optimizer)
    else:
        from hdet_scale.engines.deepspeed import initialize

        config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}, "hdet": hdet_settings}
        engine_, _, _, _ = initialize(model=model, optimizer=two_groups(model), config=config)
        model, optimizer, hdet = engine_, engine_.basic_optimizer, engine_.hdet.ensemble
    replica = rank // 2
    rho = {name: expected_multiplier(name, replica, alpha, replicas=2) for name, alpha in
           [("dropout", 0.4), ("attention_scale", 0.2), ("weight_decay/matrices", 0.5), ("weight_decay/vectors", 0.5),
            ("label_smoothing", 0.6), ("lr/matrices", 0.3), ("lr/vectors", 0.3)]}
    attention = [module for module in model.modules() if type(module).__name__ == "LlamaAttention"]
    assert attention and all(module.attention_dropout == pytest.approx(0.1 * rho["dropout"]) for module in attention)
    assert all(module.scaling == pytest.approx(8 ** -0.5 * rho["attention_scale"]) for module in attention)
    assert hdet.value("label_smoothing") == pytest.approx(0.1 * rho["label_smoothing"])
    used = record_group_values(optimizer)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    loss = model(input_ids=tokens, labels=tokens).loss
    if engine == "fsdp":
        loss.backward()
        optimizer.step()
    else:
        model.backward(loss)
        model.step()
    # ZeRO-2 steps the base optimizer once per param group, with only that group in param_groups: each group
    # must still get its own values.
    (lr, weight_decay), (vector_lr, vector_weight_decay) = [pair for call in used for pair in call]
    assert weight_decay == pytest.approx(0.1 * rho["weight_decay/matrices"])
    assert lr == pytest.approx(1e-3 * rho["lr/matrices"])
    assert vector_weight_decay == pytest.approx(0.02 * rho["weight_decay/vectors"])
    assert vector_lr == pytest.approx(1e-3 * rho["lr/vectors"])
    return [attention[0].attention_dropout, attention[0].scaling, weight_decay, hdet.value("label_smoothing")]


@pytest.mark.parametrize("engine", ["fsdp", "deepspeed"])
def test_knobs_reach_every_replica_of_a_sharded_engine(engine):
    values = run_ranks(knob_values_on, REPLICAS, engine)
    assert values[0] == values[1] and values[2] == values[3]  # ranks of one replica agree
    assert all(first != second for first, second in zip(values[0], values[2], strict=True))  # replicas differ


# ------------------------------------------------------------------------------ per-group LRs
@pytest.mark.parametrize("tied", [False, True])
def test_paper_param_groups_cover_every_parameter_once(tied):
    from transformers import LlamaConfig, LlamaForCausalLM

    from hdet_scale.param_groups import paper_param_groups

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=40, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=tied)
    model = LlamaForCausalLM(config)
    groups = {group["name"]: group for group in paper_param_groups(model, weight_decay=0.1)}
    assert list(groups) == (["embedding", "no_decay", "transformer"] if tied
                            else ["embedding", "no_decay", "non_embedding", "transformer"])
    ids = [id(param) for group in groups.values() for param in group["params"]]
    assert len(ids) == len(set(ids)) == len({id(param) for param in model.parameters()})
    assert [id(p) for p in groups["embedding"]["params"]] == [id(model.model.embed_tokens.weight)]
    assert all(p.dim() == 1 for p in groups["no_decay"]["params"]) and groups["no_decay"]["weight_decay"] == 0.0
    layer_ids = {id(p) for p in model.model.layers.parameters() if p.dim() == 2}
    assert {id(p) for p in groups["transformer"]["params"]} == layer_ids
    if not tied:
        assert [id(p) for p in groups["non_embedding"]["params"]] == [id(model.lm_head.weight)]
    optimizer = torch.optim.AdamW(list(groups.values()), lr=1e-3)
    hdet = HDETEnsemble(HDETConfig(sync_interval=1), DDPAdapter(optimizer, model),
                        topology=ReplicaTopology.single_process())
    report = hdet.step(1.0)
    assert {name for name in report.values} == {f"lr/{name}" for name in groups}  # one controller per group
