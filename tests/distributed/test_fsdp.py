"""The FSDP2 adapter on 4 real gloo ranks = 2 replicas x 2 shards, with a tiny transformers decoder."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from distributed import gather_rows, run_ranks
from hdet_scale import AutoLRConfig, HDETConfig, multipliers
from hdet_scale.engines.fsdp import build_mesh, wrap

WORLD, PER_REPLICA = 4, 2


def tiny_llama(seed: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=40, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(config)


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(100 * rank + step))


def loss_of(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    tokens = batch(rank, step)
    return model(input_ids=tokens, labels=tokens).loss


def full(tensors) -> torch.Tensor:
    """The full (unsharded) values of DTensors or plain tensors, flattened into one vector."""
    return torch.cat([(t.full_tensor() if hasattr(t, "full_tensor") else t).detach().reshape(-1) for t in tensors])


def fanout(rank: int, world: int, mode: str) -> int:
    config = HDETConfig(spread="linear", alpha=0.5, sync_interval=3, ranks_per_replica=PER_REPLICA, gradient_mode=mode,
                        average_optimizer_state=True,
                        auto_lr=AutoLRConfig(mode="scale", start=0, sigma=0.01, range_test=0))
    model, hdet = wrap(tiny_llama(seed=rank), config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
    with pytest.raises(RuntimeError, match=r"call hdet.attach\(optimizer\) first"):
        hdet.step(1.0)
    hdet.attach(optimizer)
    replica_of = torch.arange(world) // PER_REPLICA
    syncs = 0
    for step in range(1, 8):
        optimizer.zero_grad()
        loss = loss_of(model, rank, step)
        loss.backward()
        grads = gather_rows(full(p.grad for p in model.parameters()))
        if mode == "global":
            assert torch.allclose(grads[0], grads[2], atol=1e-7)  # every replica applies the same gradient
        else:
            assert not torch.allclose(grads[0], grads[2])
        held = gather_rows(torch.tensor([hdet.ensemble.lr_multiplier()], dtype=torch.float64)).reshape(-1)
        assert sorted(held[::PER_REPLICA].tolist()) == pytest.approx(multipliers(2, 0.5))  # eq. 1
        assert torch.equal(held, held[::PER_REPLICA].repeat_interleave(PER_REPLICA))
        before = full(model.parameters())
        buffers = full(optimizer.state[p]["momentum_buffer"] for p in model.parameters()) if step > 1 else 0
        lr = hdet.ensemble.current_lrs()[0]
        optimizer.step()
        # SGD with momentum: the update reveals the LR used, independently of HDET's bookkeeping.
        update = full(optimizer.state[p]["momentum_buffer"] for p in model.parameters())
        assert torch.allclose(before - full(model.parameters()), lr * update, rtol=1e-4, atol=1e-6)
        assert torch.allclose(update, 0.5 * buffers + full(p.grad for p in model.parameters()), atol=1e-6)
        pre = gather_rows(full(model.parameters()))
        pre_momentum = gather_rows(update)
        report = hdet.step(loss)
        post = gather_rows(full(model.parameters()))
        cross_bytes = hdet.gradient_bytes_across_replicas
        if mode == "global":
            assert cross_bytes > 0
        else:
            assert cross_bytes == 0  # local mode: nothing crosses replicas between syncs
        if report is None:
            assert not torch.allclose(pre[0], pre[2])  # replicas differ between syncs
            continue
        momentum = gather_rows(full(optimizer.state[p]["momentum_buffer"] for p in model.parameters()))
        momentum_mean = torch.stack([pre_momentum[0], pre_momentum[2]]).double().mean(0)
        assert torch.allclose(momentum.double(), momentum_mean.expand(world, -1), rtol=1e-6, atol=1e-7)
        syncs += 1
        mean = torch.stack([pre[replica_of == r][0] for r in range(2)]).double().mean(0)
        assert torch.allclose(post.double(), mean.expand(world, -1), rtol=1e-6, atol=1e-7)
        assert torch.equal(post, post[:1].expand(world, -1))
        local_numel = sum(p.to_local().numel() for p in model.parameters())
        buffer_numel = sum(b.numel() for b in model.buffers() if b.is_floating_point())
        # This rank's shards, buffers and momentum shards (average_optimizer_state).
        assert report.bytes_averaged == 4 * (2 * local_numel + buffer_numel + 1)  # one bucket and its count
    return syncs


@pytest.mark.parametrize("mode", ["global", "local"])
def test_replicas_shard_fan_out_and_converge(mode):
    assert run_ranks(fanout, WORLD, mode) == [2] * WORLD


def alpha_zero(rank: int, world: int) -> None:
    config = HDETConfig(spread="linear", alpha=0.0, sync_interval=2, ranks_per_replica=PER_REPLICA,
                        auto_lr=AutoLRConfig(enabled=False))
    model, hdet = wrap(tiny_llama(seed=0), config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    hdet.attach(optimizer)
    ddp = nn.parallel.DistributedDataParallel(tiny_llama(seed=0))
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    flat_mesh = init_device_mesh("cpu", (world,))
    plain = tiny_llama(seed=0)
    for layer in plain.model.layers:
        fully_shard(layer, mesh=flat_mesh)
    fully_shard(plain, mesh=flat_mesh)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for step in range(1, 6):
        losses, grads = [], []
        for net, opt in ((model, optimizer), (ddp, ddp_opt), (plain, plain_opt)):
            opt.zero_grad()
            loss = loss_of(net, rank, step)
            loss.backward()
            grads.append(full(p.grad for p in net.parameters()))
            opt.step()
            losses.append(loss.item())
        hdet.step(losses[0])
        assert torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-7)  # global mode = plain data parallel
        assert losses[0] == pytest.approx(losses[1], rel=1e-5) == pytest.approx(losses[2], rel=1e-5)
        params = [full(net.parameters()) for net in (model, ddp, plain)]
        assert torch.allclose(params[0], params[1], atol=1e-6) and torch.allclose(params[0], params[2], atol=1e-6)


def test_alpha_zero_is_plain_data_parallel_and_plain_fsdp2():
    run_ranks(alpha_zero, WORLD)


def bad_inputs(rank: int, world: int) -> None:
    config = HDETConfig(ranks_per_replica=PER_REPLICA)
    frozen = nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(ValueError, match="has no trainable parameters"):
        wrap(frozen, config)
    with pytest.raises(ValueError, match=r"none of block_classes \['Conv1d'\] is in Linear: pass the classes"):
        wrap(nn.Linear(4, 4), config, block_classes=[nn.Conv1d])  # sharded as one unit, silently
    with pytest.raises(ValueError, match="Linear has tensors on the meta device: materialize it before wrap"):
        wrap(nn.Linear(4, 4, device="meta"), config)  # rank 0's broadcast of nothing, silently
    with pytest.raises(ValueError, match="ranks_per_replica=3 does not divide the world size 4"):
        wrap(nn.Linear(4, 4), HDETConfig(ranks_per_replica=3))
    mesh = build_mesh(HDETConfig(ranks_per_replica=4))
    with pytest.raises(ValueError, match="the mesh has 4 ranks per replica but the config says ranks_per_replica=2"):
        wrap(nn.Linear(4, 4), config, mesh=mesh)
    _, hdet = wrap(nn.Linear(4, 4), config, block_classes=[])
    with pytest.raises(ValueError, match=r"holds a parameter of shape \(2, 2\) that is not one of the wrapped"):
        hdet.attach(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))


def test_bad_inputs_give_clear_errors():
    run_ranks(bad_inputs, WORLD)


def frozen_base(rank: int, world: int) -> list[float]:
    config = HDETConfig(spread="linear", alpha=0.5, sync_interval=2, ranks_per_replica=PER_REPLICA,
                        auto_lr=AutoLRConfig(enabled=False))
    model = tiny_llama(seed=0)
    model.model.embed_tokens.requires_grad_(False)  # a frozen base, as under LoRA
    model, hdet = wrap(model, config)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trained, lr=0.1)
    hdet.attach(optimizer)
    embedding = model.model.embed_tokens.weight
    with torch.no_grad():  # marks replica 1's copy: an average would move both copies halfway
        embedding.to_local().add_(float(rank // PER_REPLICA))
    report = None
    for step in (1, 2):
        optimizer.zero_grad()
        loss = loss_of(model, rank, step)
        loss.backward()
        optimizer.step()
        report = hdet.step(loss)
    assert report is not None
    local_numel = sum(p.to_local().numel() for p in trained)
    buffer_numel = sum(b.numel() for b in model.buffers() if b.is_floating_point())
    assert report.bytes_averaged == 4 * (local_numel + buffer_numel + 1)  # the trained shards, buffers, a count
    return gather_rows(full([embedding]))[:, :3].sum(1).tolist()


def test_frozen_parameters_are_not_averaged():
    """Every sync averaged the whole model, frozen weights too: a LoRA run sent its whole base across nodes (and
    kept copies of it for the averaged window and the range test)."""
    sums = run_ranks(frozen_base, WORLD)[0]
    assert sums[2] - sums[0] == pytest.approx(3.0) and sums[1] == sums[0] and sums[3] == sums[2]


def mixed_precision_uneven(rank: int, world: int, optimizer_kind: str, reshard_after_forward: bool,
                           offload: bool) -> None:
    config = HDETConfig(spread="linear", alpha=0.5, sync_interval=2, ranks_per_replica=PER_REPLICA,
                        auto_lr=AutoLRConfig(mode="scale", start=0, range_test=0))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 1))  # 5 rows split 3 + 2; 1 row: 1 + empty
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload_policy = CPUOffloadPolicy(pin_memory=False) if offload else None  # pinning needs an accelerator
    model, hdet = wrap(model, config, mp_policy=policy, block_classes=[nn.Linear],
                       reshard_after_forward=reshard_after_forward, offload_policy=offload_policy)
    shards = [p.to_local() for p in model.parameters()]
    assert all(shard.device.type == "cpu" for shard in shards)
    assert all(shard.dtype == torch.float32 for shard in shards)  # the sharded master stays fp32
    assert (min(shard.numel() for shard in shards) == 0) == (rank % PER_REPLICA == 1)  # an empty shard
    kind = {"foreach": {"foreach": True}, "fused": {"fused": True}}[optimizer_kind]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, **kind)
    hdet.attach(optimizer)
    for step in range(1, 5):
        optimizer.zero_grad()
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * rank + step))
        loss = model(x).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        pre = gather_rows(full(model.parameters()))
        with torch.no_grad():
            model(x)  # an evaluation forward: without resharding after it, the parameters stay unsharded
        report = hdet.step(loss)
        post = gather_rows(full(model.parameters()))
        if report is not None:
            mean = torch.stack([pre[0], pre[2]]).double().mean(0)  # one rank per replica
            assert post.dtype == torch.float32
            assert torch.allclose(post.double(), mean.expand(world, -1), rtol=1e-6, atol=1e-7)
            assert torch.equal(post, post[:1].expand(world, -1))
        else:
            assert not torch.allclose(pre[0], pre[2])


@pytest.mark.parametrize(("optimizer_kind", "reshard_after_forward", "offload"),
                         [("foreach", True, False), ("fused", False, False), ("foreach", True, True)])
def test_bf16_policy_averages_fp32_shards_even_uneven_and_empty(optimizer_kind, reshard_after_forward, offload):
    """Also with FSDP2's CPU offload: the shards HDET averages and noises then live on the CPU."""
    run_ranks(mixed_precision_uneven, WORLD, optimizer_kind, reshard_after_forward, offload)


def range_test_after_loading_pretrained_weights(rank: int, world: int) -> list[bool]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    config = HDETConfig(ranks_per_replica=PER_REPLICA, auto_lr=AutoLRConfig(range_test=13))
    model, hdet = wrap(tiny_llama(seed=0), config)
    hdet.attach(torch.optim.AdamW(model.parameters(), lr=1e-3), total_steps=100)
    pretrained = tiny_llama(seed=1)  # loaded after attaching, as a fine-tune's weights
    set_model_state_dict(model, pretrained.state_dict(), options=StateDictOptions(full_state_dict=True))
    assert hdet.weights_loaded()  # the run starts afresh from them
    loaded = full(model.parameters())
    step = 0
    while hdet.ramping:
        step += 1
        loss = loss_of(model, rank, step)
        loss.backward()
        hdet.ensemble.adapter.optimizer.step()
        hdet.ensemble.adapter.optimizer.zero_grad()
        hdet.step(loss)
    assert not hdet.weights_loaded() and not hdet.ramping  # once the test ran: no second test
    return [torch.equal(loaded, full(pretrained.parameters())), torch.equal(full(model.parameters()), loaded)]


def test_the_range_test_comes_back_to_weights_loaded_after_attaching():
    """The range test came back to the weights HDET attached to: a fine-tune that loaded its pretrained weights
    after attaching was back at its random start after the test."""
    assert run_ranks(range_test_after_loading_pretrained_weights, WORLD) == [[True, True]] * WORLD
