"""Hyperparameters explored besides the LR (paper Remark 1): weight decay, dropout, attention scale, label
smoothing and user knobs, each with its own spread, permutation and controller.

This file holds the tests that start no process; the tests on gloo ranks are in
tests/distributed/test_knobs_distributed.py.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from settings import LR_HELD_AT_GIVEN, lr_held_at_given
from torch import nn

from hdet_scale import HDETConfig, HDETConfigError, HDETEnsemble, ReplicaTopology, multipliers
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


def sgd_ensemble(config: HDETConfig, model: nn.Module, **options) -> HDETEnsemble:
    """An ensemble on an SGD optimizer of ``model``'s parameters (``options``: HDETEnsemble's topology, state...)."""
    return HDETEnsemble(config, DDPAdapter(torch.optim.SGD(model.parameters(), lr=0.1), model), **options)


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
        config = HDETConfig.from_dict({"alpha": 0.3, "spread": "linear", "gradient_mode": "local", "explore": EXPLORE,
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


def replica_1_exploring_everything() -> tuple[HDETEnsemble, nn.Module]:
    """Replica 1 of ``REPLICAS`` on a tiny Llama exploring every knob (``EXPLORE``, alpha 0.3, the LR held), and the
    model's first attention module."""
    model = tiny_llama()
    config = HDETConfig.from_dict({"alpha": 0.3, "gradient_mode": "local", "explore": EXPLORE,
                                   "auto_lr": LR_HELD_AT_GIVEN})
    hdet = HDETEnsemble(config, DDPAdapter(two_groups(model), model),
                        topology=ReplicaTopology(rank=1, world_size=REPLICAS, ranks_per_replica=1))
    return hdet, next(module for module in model.modules() if type(module).__name__ == "LlamaAttention")


def test_after_training_every_replica_reads_and_holds_the_base_values():
    """apply_base_values (an integration's end of training) put the base into the modules, but value() still said
    the replica's own: a loss reading value("label_smoothing") evaluated each rank at its replica's."""
    hdet, attention = replica_1_exploring_everything()
    assert hdet.value("label_smoothing") != pytest.approx(0.1) and attention.scaling != pytest.approx(8 ** -0.5)
    hdet.apply_base_values()
    assert hdet.value("label_smoothing") == pytest.approx(hdet.base("label_smoothing")) == pytest.approx(0.1)
    assert attention.scaling == pytest.approx(8 ** -0.5) and attention.attention_dropout == pytest.approx(0.1)
    assert hdet.value("lr/matrices") == pytest.approx(1e-3 * expected_multiplier("lr/matrices", 1, 0.3))  # stepped


def test_knob_guard_rails_and_clear_errors():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.6))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # SGD has weight_decay; 0 stays 0
    config = HDETConfig.from_dict({"spread": "linear", "gradient_mode": "local", "explore": {"dropout": {"alpha": 0.5}},
                                   "auto_lr": LR_HELD_AT_GIVEN})
    values = set()
    for replica in range(REPLICAS):
        topology = ReplicaTopology(rank=replica, world_size=REPLICAS, ranks_per_replica=1)
        hdet = HDETEnsemble(config, DDPAdapter(optimizer, model), topology=topology)
        values.add(model[1].p)
        hdet.close()
    assert sorted(values) == pytest.approx([0.6 * rho for rho in multipliers(REPLICAS, 0.5, "linear")])
    # 0.9 x 1.5: the top replica would drop every unit (its p held just below 1), and two replicas trained alike
    with pytest.raises(HDETConfigError, match=r"explore.dropout: the replica at the top of its spread \(x1.5\) would "
                                              r"train with Dropout.p = 0.9 x 1.5 = 1.35, a probability of 1 or more .*"
                                              r"lower explore.dropout.alpha, or the value it multiplies"):
        HDETEnsemble(config, DDPAdapter(optimizer, nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.9))),
                     topology=topology)
    smoothing = HDETConfig.from_dict({"spread": "linear", "gradient_mode": "local", "auto_lr": LR_HELD_AT_GIVEN,
                                      "explore": {"label_smoothing": {"base": 0.8, "alpha": 0.5}}})
    with pytest.raises(HDETConfigError, match=r"would train with a label smoothing of 1.2, a probability of 1 or more"):
        HDETEnsemble(smoothing, DDPAdapter(optimizer, model), topology=topology)
    resting = torch.optim.SGD(model.parameters(), lr=0.0)  # e.g. a warm-up's first step: 0 stays 0
    assert HDETEnsemble(HDETConfig(sync_interval=5, auto_lr={"range_test": 0}), DDPAdapter(resting),
                        topology=topology, total_steps=100).current_lrs() == [0.0]
    with pytest.raises(HDETConfigError, match="explore.attention_scale cannot apply to Sequential"):
        HDETEnsemble(HDETConfig.from_dict({"gradient_mode": "local", "explore": {"attention_scale": {}}}),
                     DDPAdapter(optimizer, model),
                     topology=ReplicaTopology.single_process())
    with pytest.raises(HDETConfigError, match="explore.dropout cannot apply to Linear: it has no nn.Dropout"):
        HDETEnsemble(config, DDPAdapter(optimizer, nn.Linear(2, 2)), topology=ReplicaTopology.single_process())
    with pytest.raises(HDETConfigError, match="explore.dropout needs the model"):
        HDETEnsemble(config, DDPAdapter(optimizer), topology=ReplicaTopology.single_process())
    with pytest.raises(HDETConfigError, match="explore.label_smoothing.base is required"):
        HDETConfig.from_dict({"explore": {"label_smoothing": {"alpha": 0.1}}})
    with pytest.raises(HDETConfigError, match=r"label_smoothing.base must be a number in \(0.0, 1.0\), got 0.0 \(the "
                                              r"replicas explore multiples of it, and every multiple of 0 is 0\)"):
        HDETConfig.from_dict({"explore": {"label_smoothing": {"base": 0.0}}})
    with pytest.raises(HDETConfigError, match="explore.dropout.base is not used"):
        HDETConfig.from_dict({"explore": {"dropout": {"base": 0.1}}})
    with pytest.raises(HDETConfigError, match="unknown HDET setting 'explore.temperature'"):
        HDETConfig.from_dict({"explore": {"temperature": {}}})
    with pytest.raises(HDETConfigError, match=r"explore.weight_decay.alpha must be a number in \(0.0, 1.0\)"):
        HDETConfig.from_dict({"spread": "linear", "explore": {"weight_decay": {"alpha": 1.0}}})


def test_weight_decay_is_explored_in_the_groups_that_have_one():
    """A group at weight decay 0 (the no-decay group of norms and biases) was explored: every multiple of 0 is 0,
    so the controller spent its updates on a value that never changed."""
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    optimizer = torch.optim.AdamW([{"params": model[0].parameters(), "name": "decay", "weight_decay": 0.1},
                                   {"params": model[1].parameters(), "name": "no_decay", "weight_decay": 0.0}], lr=1e-3)
    config = HDETConfig.from_dict({"explore": {"weight_decay": {"alpha": 0.5}}, "auto_lr": LR_HELD_AT_GIVEN})
    hdet = HDETEnsemble(config, DDPAdapter(optimizer, model), topology=ReplicaTopology.single_process())
    assert hdet.explores("weight_decay/decay") and not hdet.explores("weight_decay/no_decay")
    # a state of an earlier version, which explored the group without weight decay too, loads
    state = hdet.state_dict()
    state["explored"]["weight_decay/no_decay"] = state["explored"]["weight_decay/decay"]
    hdet.close()
    HDETEnsemble(config, DDPAdapter(optimizer, model), topology=ReplicaTopology.single_process(), state=state).close()
    for group in optimizer.param_groups:
        group["weight_decay"] = 0.0
    with pytest.raises(HDETConfigError, match="explore.weight_decay cannot apply: every param group's weight decay "
                                              "is 0"):
        HDETEnsemble(config, DDPAdapter(optimizer, model), topology=ReplicaTopology.single_process())


def test_an_explored_value_needs_a_spread_the_spread_allows():
    """A knob's alpha follows the spread's own range (a log spread takes any alpha, a linear one below 1), and 0,
    given or taken from the top-level alpha, is refused: the value would never differ, nor move."""
    wide = HDETConfig.from_dict({"spread": "log", "explore": {"weight_decay": {"alpha": 1.5}}})
    assert wide.explore.weight_decay.alpha == 1.5
    for settings, named in (({"explore": {"weight_decay": {"alpha": 0}}}, "explore.weight_decay.alpha"),
                            ({"alpha": 0, "explore": {"dropout": {}}}, "explore.dropout takes alpha=0"),
                            ({"spread": "linear", "explore": {"dropout": {"alpha": -0.1}}}, "explore.dropout.alpha")):
        with pytest.raises(HDETConfigError, match=named) as refused:
            HDETConfig.from_dict(settings)
        assert "explores nothing" in str(refused.value) or "got -0.1 (a spread ratio is never negative)" in str(
            refused.value)
    model = nn.Linear(2, 2)
    for config, alpha, named in ((HDETConfig(spread="linear", auto_lr=LR_HELD_AT_GIVEN), 1.5, r"alpha=\.\.\.\)"),
                                 (HDETConfig(auto_lr=LR_HELD_AT_GIVEN), -1.0, r"alpha=\.\.\.\)"),
                                 (HDETConfig(alpha=0.0, auto_lr={"enabled": False}), None,
                                  r"alpha=\.\.\.\) \(the top-level alpha\)")):
        hdet = sgd_ensemble(config, model, topology=ReplicaTopology.single_process(), total_steps=100)
        seen: list[float] = []
        with pytest.raises(HDETConfigError, match=rf"add_knob\('temperature', {named}"):
            hdet.add_knob("temperature", lambda: 1.0, seen.append, alpha=alpha)
        assert seen == [] and not hdet.explores("temperature")
    # a base of 0 (or none finite): every replica got 0, and the controller moved a scale on nothing
    hdet = sgd_ensemble(HDETConfig(auto_lr=LR_HELD_AT_GIVEN), model, topology=ReplicaTopology.single_process(),
                        total_steps=100)
    for base in (0.0, math.nan):
        with pytest.raises(HDETConfigError, match=rf"add_knob\('temperature'\): its getter gives {base}, and the "):
            hdet.add_knob("temperature", lambda: base, seen.append)  # noqa: B023
    assert seen == [] and not hdet.explores("temperature")


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


def test_metrics_line_shows_every_knob(tmp_path):
    metrics = tmp_path / "m.jsonl"
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    config = HDETConfig.from_dict({"sync_interval": 1, "metrics_path": str(metrics), "auto_lr": {"range_test": 0},
                                   "gradient_mode": "local", "explore": {"weight_decay": {}, "dropout": {}}})
    hdet = HDETEnsemble(config, DDPAdapter(optimizer, model), topology=ReplicaTopology.single_process())
    hdet.step(1.0)
    record = json.loads(metrics.read_text())
    assert set(record["values"]) == {"lr/0", "weight_decay/0", "dropout"}
    assert record["values"]["weight_decay/0"]["base"] == pytest.approx(0.01)  # AdamW's default
    assert record["values"]["dropout"]["base"] == 1.0  # a factor on each module's own probability


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
    hdet = HDETEnsemble(HDETConfig(sync_interval=1, auto_lr=lr_held_at_given()), DDPAdapter(optimizer, model),
                        topology=ReplicaTopology.single_process())
    report = hdet.step(1.0)
    assert {name for name in report.values} == {f"lr/{name}" for name in groups}  # one controller per group


def test_a_run_that_continues_a_checkpoint_adds_its_own_knobs_after_loading_its_state():
    """attach(state=...), DeepSpeed's load_checkpoint and the integrations load HDET's state where it is built, and
    add_knob comes after: it was refused there (the state's names did not match, then the step count was past 0)."""
    model = nn.Linear(2, 2)
    config = HDETConfig(sync_interval=10, auto_lr=LR_HELD_AT_GIVEN)
    topology = ReplicaTopology(rank=1, world_size=REPLICAS, ranks_per_replica=1)  # no sync: no process group

    def ensemble(state=None) -> HDETEnsemble:
        return sgd_ensemble(config, model, topology=topology, state=state, total_steps=100)

    first, seen = ensemble(), []
    first.add_knob("temperature", lambda: 2.0, seen.append, alpha=0.5)
    for _ in range(3):
        first.step(1.0)
    saved = first.state_dict()
    # as a later sync would have left it: replica 1 on another multiplier
    permutation = saved["explored"]["temperature"]["permutation"]
    saved["explored"]["temperature"]["permutation"] = permutation = permutation[2:] + permutation[:2]
    expected = 2.0 * multipliers(REPLICAS, 0.5, "log")[permutation[1]]
    assert seen != [expected]
    resumed, seen_again = ensemble(saved), []
    with pytest.raises(RuntimeError, match=r"explores \['temperature'\] with add_knob: call add_knob"):
        resumed.step(1.0)
    resumed.add_knob("temperature", lambda: 2.0, seen_again.append, alpha=0.5)
    assert seen_again == [pytest.approx(expected)] and resumed.value("temperature") == pytest.approx(expected)
    restored, kept = resumed.state_dict()["explored"]["temperature"], saved["explored"]["temperature"]
    assert (restored["permutation"], restored["controller"]) == (kept["permutation"], kept["controller"])
    assert torch.equal(restored["stream"]["generator"], kept["stream"]["generator"])  # the same draws to come
    resumed.step(1.0)
    assert resumed.global_step == 4
    with pytest.raises(RuntimeError, match=r"add_knob\('other'\) after 4 steps"):
        resumed.add_knob("other", lambda: 1.0, seen_again.append)
    with pytest.raises(ValueError, match="explore settings must match the checkpoint's"):  # a configured value
        sgd_ensemble(config, model, topology=topology,
                     state={**saved, "explored": {**saved["explored"], "dropout": saved["explored"]["temperature"]}},
                     total_steps=100)


@pytest.mark.parametrize("name", ["dropout", "attention_scale", "label_smoothing"])
def test_a_value_of_the_forward_pass_is_explored_in_local_gradient_mode_only(name):
    """In global mode every replica steps with the mean gradient of all replicas: its own dropout, attention scale
    or label smoothing only changed its share of that mean, so the replicas' weights never differed by it (with the
    LR held, they stayed bit-identical and the probe scored them alike: the value never moved)."""
    knob = {"base": 0.1} if name == "label_smoothing" else {}
    with pytest.raises(HDETConfigError, match=rf"explore.{name} needs \"gradient_mode\": \"local\": in 'global' "
                                              r"mode every replica steps with the mean gradient"):
        HDETConfig.from_dict({"explore": {name: knob}})
    assert HDETConfig.from_dict({"gradient_mode": "local", "explore": {name: knob}}).gradient_mode == "local"
    assert HDETConfig.from_dict({"explore": {"weight_decay": {}}})  # applied in each replica's own optimizer step


def test_dropout_and_label_smoothing_are_scored_on_the_probe_alone():
    """A replica's training loss rises with its own dropout or smoothing whatever they are worth: the interval
    losses in the signal drove both to their floors."""
    local = {"gradient_mode": "local", "explore": {"dropout": {}}}
    with pytest.raises(HDETConfigError, match=r"explore.dropout is scored on the probe batch alone .* set "
                                              r"auto_lr.probe_weight to 1, not 0.5"):
        HDETConfig.from_dict({**local, "auto_lr": {"probe_weight": 0.5}})
    assert HDETConfig.from_dict({**local, "auto_lr": {"probe_weight": 0.5, "enabled": False}})  # nothing moves it
    HDETConfig.from_dict({"gradient_mode": "local", "explore": {"attention_scale": {}},
                          "auto_lr": {"probe_weight": 0.5}})  # acts alike in training and in the probe


def test_close_leaves_every_replica_at_the_value_the_controller_found_and_a_later_attach_starts_from_it():
    """close() put the attention scale back at the model's own, and the weights had trained at the scale found; once
    it left the found scale in place, a later fit's attach (the Trainer's, Lightning's) took that for the model's own
    and applied the checkpoint's scale on top of it again. After close() value() still read each replica's own."""
    model = tiny_llama()
    config = HDETConfig.from_dict({"gradient_mode": "local", "auto_lr": LR_HELD_AT_GIVEN,
                                   "explore": {"attention_scale": {}, "label_smoothing": {"base": 0.1}}})
    topology = ReplicaTopology(rank=1, world_size=2, ranks_per_replica=1)  # replica 1 of 2, no collective before a sync

    def attach(state=None) -> HDETEnsemble:
        return HDETEnsemble(config, DDPAdapter(two_groups(model), model), topology=topology, state=state)

    state = attach().state_dict()
    state["explored"]["attention_scale"]["controller"]["scale"] = 0.5  # where the controller had moved them
    state["explored"]["label_smoothing"]["controller"]["scale"] = 2.0
    attention = [module for module in model.modules() if type(module).__name__ == "LlamaAttention"]
    for fit in range(2):  # two fits of one model in one process, each resuming the checkpoint
        hdet = attach(state)
        rho = hdet._explored_named("attention_scale").multiplier(1)
        assert rho != 1.0 and all(module.scaling == pytest.approx(0.5 * rho * 8 ** -0.5) for module in attention), fit
        assert hdet.value("label_smoothing") != pytest.approx(0.2)
        hdet.close()
        assert all(module.scaling == pytest.approx(0.5 * 8 ** -0.5) for module in attention), fit
        assert hdet.value("label_smoothing") == pytest.approx(0.2)
    for call in (hdet.sync, lambda: hdet.load_state_dict(state), lambda: hdet.observe(1.0)):
        with pytest.raises(RuntimeError, match=r"\(\) after close\(\)"):  # each would put the replicas' values back
            call()
    fresh = attach()  # a new run on the model as it is: around the scale the weights trained at
    assert all(module.scaling == pytest.approx(0.5 * rho * 8 ** -0.5) for module in attention)
    assert fresh.base("attention_scale") == 1.0


def test_explored_dropout_reaches_every_dropout_field_of_a_transformers_model():
    """BART's layers read activation_dropout at every forward (F.dropout(p=self.activation_dropout)); a list of
    known names missed it, and the explored dropout left that dropout as it was. Its layerdrop is no dropout."""
    from transformers import BartConfig, BartForConditionalGeneration

    from hdet_scale.knobs import dropout_targets

    model = BartForConditionalGeneration(BartConfig(
        vocab_size=32, d_model=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=8, decoder_ffn_dim=8, max_position_embeddings=16, dropout=0.1,
        attention_dropout=0.05, activation_dropout=0.2, encoder_layerdrop=0.3))
    found = {(type(module).__name__, attribute, getattr(module, attribute))
             for module, attribute in dropout_targets(model)}
    assert {("BartEncoderLayer", "activation_dropout", 0.2), ("BartDecoderLayer", "activation_dropout", 0.2),
            ("BartAttention", "dropout", 0.05), ("BartEncoderLayer", "dropout", 0.1)} <= found
    assert not any(attribute == "layerdrop" for _, attribute, _ in found)


def test_a_model_knob_on_a_compiled_model_is_refused():
    """torch.compile guards on the attributes the knobs set at every sync: each sync recompiled, and past the
    recompile limit the model ran uncompiled for the rest of the run."""
    config = HDETConfig.from_dict({"gradient_mode": "local", "explore": {"dropout": {}}, "auto_lr": LR_HELD_AT_GIVEN})
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.compile import from_compiled

    class Lightning(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1))

    for compiled in ("method", "wrapper", "block", "lightning"):
        model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1))
        if compiled == "method":
            model.compile()
        elif compiled == "wrapper":
            model = torch.compile(model)
        elif compiled == "block":  # a block compiled in place, as torchtitan does
            model[0] = torch.compile(model[0])
        else:  # trainer.fit(torch.compile(module)) fits the module Lightning unwraps from it
            model = from_compiled(torch.compile(Lightning()))
        with pytest.raises(HDETConfigError, match="explore.dropout sets module attributes at every sync, and "
                                                  "torch.compile guards on them"):
            sgd_ensemble(config, model, topology=ReplicaTopology.single_process())


def test_a_dropout_the_user_changes_during_the_run_is_the_base_of_the_next_factor():
    """An 'early dropout' callback that turned dropout off after some steps had it back on at the next sync: each
    sync wrote the factor times the probability found when HDET attached."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = HDETConfig.from_dict({"sync_interval": 1, "gradient_mode": "local", "explore": {"dropout": {}},
                                   "auto_lr": {"enabled": False, "range_test": 0}})
    hdet = HDETEnsemble(config, DDPAdapter(optimizer, model), topology=ReplicaTopology.single_process())
    assert model[1].p == pytest.approx(0.2)

    def step() -> None:
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        hdet.step(1.0)

    step()
    model[1].p = 0.0  # the user's schedule turns dropout off
    step()
    assert model[1].p == 0.0
    model[1].p = 0.1
    step()
    assert model[1].p == pytest.approx(0.1)


def test_a_knob_whose_value_the_model_saves_keeps_its_base_over_resumes():
    """add_knob reads its base from the getter: a value the model itself saves (a buffer) holds replica 0's value
    at a resume, base x rho, and every resume multiplied the base by another multiplier."""
    model = nn.Linear(2, 2)
    config = HDETConfig(sync_interval=10, auto_lr=LR_HELD_AT_GIVEN)
    topology = ReplicaTopology(rank=0, world_size=REPLICAS, ranks_per_replica=1)  # no sync: no process group

    def ensemble(state=None) -> HDETEnsemble:
        return sgd_ensemble(config, model, topology=topology, state=state, total_steps=100)

    buffer = {"temperature": 2.0}  # what the model's checkpoint holds: the value the replica trained with
    first = ensemble()
    first.add_knob("temperature", lambda: buffer["temperature"], lambda value: buffer.update(temperature=value),
                   alpha=0.5)
    first.step(1.0)
    saved, replica_value = first.state_dict(), buffer["temperature"]
    assert replica_value != 2.0
    for order in ("state first", "knob first"):
        buffer["temperature"] = replica_value  # restored with the model's weights
        if order == "state first":
            resumed = ensemble(saved)
            resumed.add_knob("temperature", lambda: buffer["temperature"],
                             lambda value: buffer.update(temperature=value), alpha=0.5)
        else:
            resumed = ensemble()
            resumed.add_knob("temperature", lambda: buffer["temperature"],
                             lambda value: buffer.update(temperature=value), alpha=0.5)
            resumed.load_state_dict(saved)
        assert resumed.base("temperature") == 2.0 and buffer["temperature"] == pytest.approx(replica_value), order


def test_a_configured_label_smoothing_base_changed_on_resume_applies():
    """Its base is the config's, not the model's: a resume that changes it (which train.py says applies from the
    resumed step on) must not get the saved one back."""
    model = nn.Linear(2, 2)

    def ensemble(base: float, state=None) -> HDETEnsemble:
        config = HDETConfig.from_dict({"gradient_mode": "local", "auto_lr": LR_HELD_AT_GIVEN,
                                       "explore": {"label_smoothing": {"base": base}}})
        return sgd_ensemble(config, model, topology=ReplicaTopology.single_process(), state=state)

    assert ensemble(0.2, ensemble(0.1).state_dict()).base("label_smoothing") == 0.2


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi", "gemma3"])
def test_an_exported_model_computes_at_the_attention_scale_the_run_found(family, recwarn):
    """A transformers config rebuilds every attention module's own softmax scale: the exported weights carry the
    factor the controller found (in q_proj; in the query norm's weights, and a LayerNorm's bias, where the queries
    are normalized after it), so the model from_pretrained gives computes what the averaged one trained at. Gemma3's
    query norm computes (1 + weight) * normalized: no factor on its weight scales it, and the export says so."""
    import transformers

    names = {"llama": "Llama", "qwen3": "Qwen3", "phi": "Phi", "gemma3": "Gemma3"}
    config_class = getattr(transformers, f"{names[family]}{'Text' if family == 'gemma3' else ''}Config")
    model_class = getattr(transformers, f"{names[family]}ForCausalLM")
    sizes = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 32,
             **({"qk_layernorm": True} if family == "phi" else {"head_dim": 8})}
    torch.manual_seed(0)
    model = model_class(config_class(**sizes)).eval()
    for parameter in model.parameters():  # norms start at weight 1 and bias 0: make them tell factors apart
        parameter.data.add_(0.1 * torch.randn_like(parameter))
    config = HDETConfig.from_dict({"gradient_mode": "local", "auto_lr": LR_HELD_AT_GIVEN,
                                   "explore": {"attention_scale": {}}})
    state = sgd_ensemble(config, model, topology=ReplicaTopology.single_process()).state_dict()
    state["explored"]["attention_scale"]["controller"]["scale"] = 0.4  # the scale the controller found
    hdet = sgd_ensemble(config, model, topology=ReplicaTopology.single_process(), state=state)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        trained = model(tokens).logits
        exported = model.state_dict()
        recwarn.clear()
        hdet.fold_found_attention_scale(model, exported)
        loaded = model_class(config_class(**sizes)).eval()
        loaded.load_state_dict(model.state_dict())
        assert not torch.allclose(loaded(tokens).logits, trained, atol=1e-4)  # the factor matters here
        loaded.load_state_dict(exported)
        folded = loaded(tokens).logits
    said = [str(warning.message) for warning in recwarn if "softmax scale" in str(warning.message)]
    if family == "gemma3":
        assert said and "model.layers.0.self_attn, model.layers.1.self_attn" in said[0]
        assert all(torch.equal(exported[key], value) for key, value in model.state_dict().items())  # left as it is
    else:
        assert not said and torch.allclose(folded, trained, atol=1e-5)




def test_an_export_after_runs_on_one_model_carries_every_runs_attention_scale():
    """A second run on a model the first left at the scale it found (a second fit) took that scale for the model's
    own, and its export carried only its own factor: the reloaded model, at its config's scale, computed another
    function. The factor check of a query norm runs in fp32 (in bf16 the product's rounding failed it)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from hdet_scale.knobs import _scales_with_its_parameters, dropout_targets

    sizes = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 32, "head_dim": 8,
             "attention_dropout": 0.1}
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**sizes)).eval()
    config = HDETConfig.from_dict({"gradient_mode": "local", "auto_lr": LR_HELD_AT_GIVEN,
                                   "explore": {"attention_scale": {}, "dropout": {}}})

    def attach(state=None) -> HDETEnsemble:
        return sgd_ensemble(config, model, topology=ReplicaTopology.single_process(), state=state)

    targets = len(dropout_targets(model))
    state = attach().state_dict()
    state["explored"]["attention_scale"]["controller"]["scale"] = 0.5
    attach(state).close()  # the first run leaves the scale it found
    assert len(dropout_targets(model)) == targets  # what the knobs keep on the modules is no dropout
    second = attach()  # a fresh run on the model as it is
    second.close()
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        trained = model(tokens).logits
        exported = model.state_dict()
        second.fold_found_attention_scale(model, exported)
        loaded = Qwen3ForCausalLM(Qwen3Config(**sizes)).eval()
        loaded.load_state_dict(exported)
        assert torch.allclose(loaded(tokens).logits, trained, atol=1e-5)
    norm = model.model.layers[0].self_attn.q_norm
    assert _scales_with_its_parameters(norm, {"weight": norm.weight.detach().to(torch.bfloat16)}, 0.8123)


def test_the_scale_of_a_bounded_value_stops_where_its_top_replica_reaches_the_bound():
    """A label smoothing of 0.3 whose top replica kept winning wound its scale on to 10 while the base stayed
    pinned below 1: when the lower replica then won, the values did not move for several syncs. Its top replica
    (x3) was clamped below 1 from a base of 1/3 on, while the controller credited it with 3 times the base."""
    from hdet_scale.config import AutoLRConfig
    from hdet_scale.controller import Controller
    from hdet_scale.explored import ExploredValue
    from hdet_scale.knobs import PROBABILITY, ValueKnob

    explored = ExploredValue.start(ValueKnob("label_smoothing", 0.3, PROBABILITY), seed=0, num_replicas=2,
                                   alpha=2.0, spread="log")
    controller = Controller(AutoLRConfig(mode="log", beta=0.9, step_size=10.0, max_log_step=0.5, scale_max=10.0))
    top = explored.replica_multipliers().index(max(explored.replica_multipliers()))
    for step in range(10):
        weights = [1.0 if replica == top else 0.0 for replica in range(2)]
        explored.update(controller, weights=weights, steps=1, step=step, sync_interval=1)
    assert explored.state.scale == pytest.approx(1 / (0.3 * 3))  # the top replica at 1 - ulp: as far as it may go
    assert explored.value(top) == pytest.approx(explored.base() * 3) == pytest.approx(1.0)  # at its multiplier still
    assert explored.state.velocity == 0.0  # and no momentum outward, which would hold it there for syncs
    explored.update(controller, weights=[0.0 if replica == top else 1.0 for replica in range(2)], steps=1,
                    step=10, sync_interval=1)
    assert explored.base() < 1.0 - 0.1  # back down at once


def test_an_explored_dropout_stops_where_its_highest_dropout_reaches_1():
    """The controller's scale bounds came from the factor's own bounds (any positive factor), not the dropouts it
    multiplies: a factor the top replica's evidence kept raising ended with that replica's p = 0.5 x factor x 1.5
    clamped just below 1 (every unit dropped) while the controller credited it with 1.5 times the base factor."""
    from hdet_scale.config import AutoLRConfig
    from hdet_scale.controller import Controller
    from hdet_scale.explored import ExploredValue
    from hdet_scale.knobs import PROBABILITY, ModuleFactorKnob

    model = nn.Sequential(nn.Dropout(0.2), nn.Linear(2, 2), nn.Dropout(0.5))
    knob = ModuleFactorKnob("dropout", [(model[0], "p"), (model[2], "p")], PROBABILITY)
    explored = ExploredValue.start(knob, seed=0, num_replicas=2, alpha=0.5, spread="linear")
    controller = Controller(AutoLRConfig(mode="log", beta=0.9, step_size=10.0, max_log_step=0.5, scale_max=10.0))
    top = explored.replica_multipliers().index(1.5)
    for step in range(10):
        weights = [1.0 if replica == top else 0.0 for replica in range(2)]
        explored.update(controller, weights=weights, steps=1, step=step, sync_interval=1)
    assert explored.state.scale == pytest.approx(1 / (0.5 * 1.5)) and explored.state.velocity == 0.0
    knob.apply(explored.value(top))
    assert model[2].p == pytest.approx(0.5 * explored.base() * 1.5) == pytest.approx(1.0)
    assert model[0].p == pytest.approx(0.2 * explored.base() * 1.5)


def test_an_evaluation_of_the_one_model_scores_it_at_the_base_values_on_the_plain_loss():
    """train.py's held-out loss was scored at each rank's replica's attention scale (a model none of them exports):
    inside ``one_model_values`` every replica holds the base and a loss that reads the label smoothing reads none,
    and after it each replica its own values again."""
    hdet, attention = replica_1_exploring_everything()
    own = (hdet.value("label_smoothing"), attention.scaling)
    assert own[0] != pytest.approx(0.1) and own[1] != pytest.approx(8 ** -0.5)
    with hdet.one_model_values():
        assert hdet.value("label_smoothing") == 0.0 and attention.scaling == pytest.approx(8 ** -0.5)
    assert (hdet.value("label_smoothing"), attention.scaling) == own
    hdet.apply_base_values()  # the end of training: the base stays after an evaluation
    with hdet.one_model_values():
        pass
    assert hdet.value("label_smoothing") == pytest.approx(0.1) and attention.scaling == pytest.approx(8 ** -0.5)
    hdet.close()
