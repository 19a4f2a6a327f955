"""transformers' Trainer with HDET in this process (one replica): what a Trainer keeps from one train() to the next.
The tests on gloo ranks are in tests/distributed/test_hf_trainer.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": (self.net(x).squeeze(1) - labels).pow(2).mean()}


class Sums(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        x = torch.randn(4, generator=torch.Generator().manual_seed(index))
        return {"x": x, "labels": x.sum()}


@pytest.mark.filterwarnings("ignore")
def test_a_train_again_after_one_that_raised_during_the_range_test_steps_the_users_scheduler(tmp_path):
    """The range test holds the Trainer's scheduler and gives it back when the test ends or train() ends, neither of
    which comes after a train() that raised: the Trainer keeps a scheduler the user gave it, the next train() held it
    once more, and gave back one of the two holds: the whole run trained at the first LR."""
    from transformers import Trainer, TrainingArguments

    from hdet_scale.integrations.hf_trainer import add_hdet

    model = Regression()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, 1 - step / 40))
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=40, per_device_train_batch_size=4,
                             save_strategy="no", report_to=[], use_cpu=True, logging_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Sums(), optimizers=(optimizer, scheduler))
    add_hdet(trainer, {"sync_interval": 5, "auto_lr": {"range_test": 15}}, probe=False)
    computed = trainer.compute_loss
    calls = []

    def interrupted_at_the_fifth(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("interrupted during the range test")
        return computed(*args, **kwargs)

    trainer.compute_loss = interrupted_at_the_fifth
    with pytest.raises(RuntimeError, match="interrupted during the range test"):
        trainer.train()
    trainer.train()
    assert scheduler.last_epoch == 40 and trainer.lr_scheduler is scheduler


@pytest.mark.filterwarnings("ignore")
def test_a_model_transformers_loaded_sharded_is_refused_when_hdet_is_added(tmp_path):
    """transformers 5 puts a tensor-parallel model's ParallelismConfig on the Accelerator, not on the
    TrainingArguments, and wraps such a model in no DDP: it passed add_hdet and failed at train()'s start."""
    from transformers import Trainer, TrainingArguments

    from hdet_scale import HDETConfigError
    from hdet_scale.integrations.hf_trainer import add_hdet

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, report_to=[], use_cpu=True)
    for marking in ("tp_size", "loaded"):
        trainer = Trainer(model=Regression(), args=args, train_dataset=Sums())
        if marking == "tp_size":
            trainer.model.tp_size = 2
        else:
            trainer.is_distributed_loading_by_transformers = True
        with pytest.raises(HDETConfigError, match="a model loaded sharded by transformers .* is not supported"):
            add_hdet(trainer, {"sync_interval": 2})


@pytest.mark.filterwarnings("ignore")
def test_a_trainer_without_a_current_accumulation_count_gives_its_configured_one(tmp_path):
    """Older transformers releases set no ``current_gradient_accumulation_steps`` (this one sets it only once the loop
    runs): the loss share read it and raised at the first micro-batch."""
    from transformers import Trainer, TrainingArguments

    from hdet_scale.integrations.hf_trainer import add_hdet

    trainer = Trainer(model=Regression(), train_dataset=Sums(),
                      args=TrainingArguments(output_dir=str(tmp_path), gradient_accumulation_steps=4, use_cpu=True,
                                             report_to=[], max_steps=2))
    callback = add_hdet(trainer, {"sync_interval": 1})
    assert not hasattr(trainer, "current_gradient_accumulation_steps")
    assert float(callback._step_share(torch.tensor(0.25))) == 1.0  # a quarter of the step's loss, observed whole


def test_a_checkpoint_a_callback_asks_for_during_the_range_test_is_skipped_with_a_warning(tmp_path):
    """A callback setting ``control.should_save`` during the range test stopped the run with an error (Lightning's
    callback skips such a checkpoint with a warning): the Trainer now writes no checkpoint then, and the run goes
    on to save its own after the test."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from hdet_scale.integrations.hf_trainer import add_hdet
    from hdet_scale.notices import HDETWarning

    class SavesEveryStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_save = True

    model = Regression()
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=20, per_device_train_batch_size=4,
                             save_strategy="no", report_to=[], use_cpu=True, logging_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Sums())
    trainers_save, saved_while_ramping = trainer._save_checkpoint, []

    def save_checkpoint(*args, **kwargs):
        saved_while_ramping.append(hdet.ramping)
        return trainers_save(*args, **kwargs)

    trainer._save_checkpoint = save_checkpoint  # the Trainer's own, which HDET's wraps
    hdet = add_hdet(trainer, {"sync_interval": 5, "auto_lr": {"range_test": 15}}, probe=False)
    trainer.add_callback(SavesEveryStep())  # after HDET's: it asks during the range test too
    with pytest.warns(HDETWarning, match="no checkpoint is written during the LR range test") as said:
        trainer.train()
    assert len([warning for warning in said if "no checkpoint" in str(warning.message)]) == 1  # once, not each step
    assert not hdet.ramping and trainer.state.global_step == 20
    assert saved_while_ramping == [False] * 21  # the step the test ended at (the run's step 0), then every step


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids}


@pytest.mark.filterwarnings("ignore")
def test_the_trainers_saved_model_computes_at_the_attention_scale_found_and_its_checkpoints_resume_as_they_were(
        tmp_path):
    """``trainer.save_model()`` wrote the weights as they were, and the saved config rebuilds each attention module's
    own softmax scale: the reloaded model computed at the scale the run started from, not the one it found (the
    docs asked the user to fold it in by hand). A checkpoint keeps its weights as they are (its HDET state gives the
    scale back on resume)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from hdet_scale.integrations.hf_trainer import add_hdet

    class ScaleFound(TrainerCallback):  # as a controller would have moved it, before the checkpoint at step 4
        def on_step_begin(self, args, state, control, **kwargs):
            hdet.ensemble._explored_named("attention_scale").state.scale = 1.5

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=40, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32))
    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=4, per_device_train_batch_size=2,
                             save_strategy="steps", save_steps=4, report_to=[], use_cpu=True, logging_strategy="no",
                             disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    hdet = add_hdet(trainer, {"sync_interval": 2, "gradient_mode": "local", "explore": {"attention_scale": {}},
                              "auto_lr": {"enabled": False}}, probe=False)
    trainer.add_callback(ScaleFound())
    trainer.train()
    checkpoint = LlamaForCausalLM.from_pretrained(tmp_path / "run" / "checkpoint-4")
    assert all(torch.equal(saved, now) for saved, now in zip(checkpoint.state_dict().values(),
                                                            model.state_dict().values(), strict=True))
    attention = model.model.layers[0].self_attn
    assert attention.scaling == pytest.approx(1.5 * 8 ** -0.5)
    trainer.save_model(str(tmp_path / "exported"))
    exported = LlamaForCausalLM.from_pretrained(tmp_path / "exported")
    assert exported.model.layers[0].self_attn.scaling == pytest.approx(8 ** -0.5)  # the config's own
    tokens = torch.arange(8).unsqueeze(0)
    model.eval()
    with torch.no_grad():
        assert torch.allclose(exported(tokens).logits, model(tokens).logits, atol=1e-5)
