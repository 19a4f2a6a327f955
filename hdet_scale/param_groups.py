"""The paper's four optimizer groups (embedding, no_decay, non_embedding, transformer) for per-group LRs.

HDET explores every param group's LR with its own permutation, Delta and velocity (paper section 3.4 and
Figure 3, where the groups settle on different decay rates). ``paper_param_groups`` builds those groups for a
transformers decoder (or any model with an input embedding and repeated blocks).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn


def transformer_blocks(model: nn.Module, block_classes: Iterable[type[nn.Module]] | None = None) -> list[nn.Module]:
    """The model's repeated blocks (FSDP2 shards them one by one; ``paper_param_groups`` puts their weights in the
    ``transformer`` group): instances of ``block_classes``, or for transformers models the classes named in
    ``model._no_split_modules`` (the decoder layers)."""
    if block_classes is None:
        names = set(getattr(model, "_no_split_modules", None) or [])
        return [module for module in model.modules() if type(module).__name__ in names]
    classes = tuple(block_classes)
    return [module for module in model.modules() if isinstance(module, classes)]


GROUP_NAMES = ("embedding", "no_decay", "non_embedding", "transformer")


def paper_param_groups(model: nn.Module, *, weight_decay: float,
                       block_classes: Iterable[type[nn.Module]] | None = None) -> list[dict[str, Any]]:
    """Param groups for ``torch.optim`` (names in ``name``, so HDET reports ``lr/<name>``):

    * ``embedding``: the input embedding (and an output layer tied to it), with ``weight_decay``;
    * ``no_decay``: biases and normalization weights (every parameter with fewer than 2 dimensions), no decay;
    * ``transformer``: the other weights inside the transformer blocks, with ``weight_decay``;
    * ``non_embedding``: every other weight (e.g. an untied output layer), with ``weight_decay``.

    Blocks are the classes in ``block_classes`` or, for transformers models, those named in
    ``_no_split_modules``. Empty groups are left out. Each trainable parameter is in exactly one group.
    """
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embedding is None:
        embedding = next((module for module in model.modules() if isinstance(module, nn.Embedding)), None)
    embedding_ids = {id(param) for param in embedding.parameters()} if embedding is not None else set()
    block_ids = {id(param) for block in transformer_blocks(model, block_classes) for param in block.parameters()}
    groups: dict[str, list[nn.Parameter]] = {name: [] for name in GROUP_NAMES}
    seen: set[int] = set()
    for param in model.parameters():  # tied parameters appear once
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        if id(param) in embedding_ids:
            groups["embedding"].append(param)
        elif param.dim() < 2:
            groups["no_decay"].append(param)
        elif id(param) in block_ids:
            groups["transformer"].append(param)
        else:
            groups["non_embedding"].append(param)
    return [{"params": params, "name": name, "weight_decay": 0.0 if name == "no_decay" else weight_decay}
            for name, params in groups.items() if params]
