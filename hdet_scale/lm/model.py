"""Decoder-only model presets, built from a transformers config (no hub download), and their loss.

Sizes are Llama-style (RMSNorm, SwiGLU, rotary positions). Parameter counts below are for a 32,000-token
vocabulary with untied embeddings; the byte-level corpora here use 256 tokens, which makes the small presets
much smaller.

| preset | hidden | layers | heads (kv) | FFN  | parameters (32k vocab) | meant for |
|--------|--------|--------|------------|------|------------------------|-----------|
| tiny   | 64     | 2      | 4 (4)      | 176  | 4.2M                   | CPU tests, a few minutes on 2 cores |
| small  | 256    | 4      | 4 (4)      | 688  | 20M                    | CPU or one GPU |
| 125m   | 768    | 12     | 12 (12)    | 2048 | 134M                   | a GPU node |
| 350m   | 1024   | 24     | 16 (16)    | 2816 | 374M                   | a few GPU nodes |
| 1b     | 2048   | 22     | 32 (4)     | 5632 | 1.1B                   | GPU clusters (TinyLlama's shape) |
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
             "intermediate_size": 176},
    "small": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
              "intermediate_size": 688},
    "125m": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 12,
             "intermediate_size": 2048},
    "350m": {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
             "intermediate_size": 2816},
    "1b": {"hidden_size": 2048, "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
           "intermediate_size": 5632},
}


def check_preset(name: str) -> None:
    """Raises a ValueError naming the known presets when ``name`` is not one of them."""
    if name not in PRESETS:
        raise ValueError(f"--preset {name!r} does not exist; choose one of {', '.join(PRESETS)}")


def model_config(name: str, *, vocab_size: int, seq_len: int, **overrides: Any) -> Any:
    """The ``LlamaConfig`` of preset ``name`` for a vocabulary and context length (``overrides``: any
    other LlamaConfig field, e.g. ``attention_dropout``)."""
    from transformers import LlamaConfig

    check_preset(name)
    return LlamaConfig(vocab_size=vocab_size, max_position_embeddings=seq_len, **{**PRESETS[name], **overrides})


def build_model(name: str, *, vocab_size: int, seq_len: int, **overrides: Any) -> nn.Module:
    """A freshly initialized ``LlamaForCausalLM`` of preset ``name`` (seed the global RNG first)."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(model_config(name, vocab_size=vocab_size, seq_len=seq_len, **overrides))


def next_token_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, *,
                    label_smoothing: float = 0.0) -> torch.Tensor:
    """Mean cross-entropy of ``targets`` (the inputs shifted by one token) under ``model(input_ids=inputs)``.

    Computed here rather than through the model's ``labels=``, which shifts the labels once more.
    """
    logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), label_smoothing=label_smoothing)
