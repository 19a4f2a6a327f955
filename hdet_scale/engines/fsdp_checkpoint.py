"""Distributed checkpoints of an FSDP2 HDET run, taken at sync points.

At a sync point every replica holds the same parameters, so the model is saved once (DCP keeps one copy of
identical shards) and consolidates into one unsharded model. Optimizer states can differ between replicas
(local gradient mode, or weight decay added to the gradient), and DCP de-duplicates identical keys across
ranks: saved under shared keys they would come back as a mix of replicas. Where they differ each replica's
optimizer state is therefore saved under its own key; where they are alike, under replica 0's, which DCP writes
once. The HDET state is identical on every rank at a sync point; rank 0 writes it
next to the shards. A checkpoint is written to ``PATH.tmp`` and renamed into place once complete (every shard
DCP's metadata names there), so a run killed mid-save leaves the previous checkpoint intact; killed between the
two renames, it leaves no ``PATH``, and the next ``has_checkpoint``, ``load_checkpoint`` or ``save_checkpoint``
puts the newer checkpoint there. Every node writes only once it sees this save's ``PATH.tmp`` (a token rank 0
writes there), not the last save's folder a network file system may still show under that name.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from hdet_scale.comm import on_rank0, open_fresh_folder
from hdet_scale.durable import (
    fsync_path,
    recover_replaced_folder,
    replace_folder_durably,
    replacement_folders,
    start_replacement,
)
from hdet_scale.engines.fsdp import HDETFSDP, handle_of

HDET_STATE_FILE = "hdet_state.pt"
EXTRA_STATE_FILE = "extra_state.pt"


def _sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer, replica: int) -> dict[str, Any]:
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, f"optimizer_replica{replica}": optimizer_state}


def save_checkpoint(path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer,
                    hdet: HDETFSDP, *, extra_state: Mapping[str, Any] | None = None,
                    finalize: Callable[[Path], None] | None = None) -> None:
    """Saves model, optimizer and HDET state to the directory ``path`` (collective: every rank calls it).

    ``extra_state``: anything else the run needs back and that is the same on every rank (an LR scheduler's
    ``state_dict()``, the data position); ``load_checkpoint`` returns it. ``finalize(directory)``: called on
    rank 0 once every file of the checkpoint is written, before it is renamed into place (e.g. to record what
    made it).
    """
    ensemble = hdet.ensemble
    apart = ensemble.apart_error("a checkpoint")
    if apart is not None:
        raise ValueError(apart)
    # Taken on every rank before anything is written (the same there: no collective), so that a state HDET
    # refuses to give (during the LR range test) stops every rank before the shards are written for nothing.
    hdet_state = ensemble.state_dict()
    saved_as = hdet.topology.replica_index if ensemble.optimizer_states_differ() else 0
    final = Path(path)
    staging = replacement_folders(final)[0]
    # every save writes through the same staging name: each node first sees this save's folder under it, not the
    # last save's, which is the checkpoint now
    open_fresh_folder(staging, f"the checkpoint {final}", prepare=lambda: start_replacement(final))
    dcp.save(_sharded_state(model, optimizer, saved_as), checkpoint_id=staging)

    def complete() -> None:
        _check_shards(staging)
        # DCP wrote its files to the disk (fsync); these too, before anything vouches for them or the older
        # checkpoint goes, so that a node crash cannot leave only a checkpoint with truncated files
        for name, state in ((HDET_STATE_FILE, hdet_state), (EXTRA_STATE_FILE, dict(extra_state or {}))):
            torch.save(state, staging / name)
            fsync_path(staging / name)
        if finalize is not None:
            finalize(staging)
        # killed between its renames: both checkpoints are complete, and the newer is found and promoted
        replace_folder_durably(staging, final)

    on_rank0(complete, f"writing the checkpoint {final}")


def _check_shards(folder: Path) -> None:
    """An OSError unless every file DCP's metadata in ``folder`` names is there, as long as it says: a rank whose
    files went elsewhere (a stale view of the folder) would leave a checkpoint that cannot be loaded."""
    for info in dcp.FileSystemReader(folder).read_metadata().storage_data.values():
        file = folder / info.relative_path
        if not file.is_file() or file.stat().st_size < info.offset + info.length:
            raise OSError(f"the checkpoint {folder} lacks {info.relative_path} (or holds less of it than was written): "
                          "a rank's files did not reach the folder every rank saved to")


def _saved_optimizer_states(path: Path) -> int:
    """How many optimizer states the checkpoint at ``path`` holds: one per replica where theirs differed, else 1."""
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return len({match.group(1) for key in keys if (match := re.match(r"optimizer_replica(\d+)\.", key))}) or 1


def has_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds a checkpoint ``save_checkpoint`` wrote (collective: every rank calls it). Ask this,
    not whether ``path`` exists: a run killed between the save's two renames left its newest checkpoint beside
    ``path``, and this puts it in place. It may move folders: call it from the run that saves there, not from
    another job reading its checkpoints while it trains."""
    path = Path(path)

    def found() -> bool:
        recover_replaced_folder(path)
        return (path / HDET_STATE_FILE).is_file()

    return bool(on_rank0(found, f"looking for a checkpoint at {path}", share_result=True))


def load_checkpoint(path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer,
                    hdet: HDETFSDP) -> dict[str, Any]:
    """Restores a checkpoint written by ``save_checkpoint`` (collective); returns its ``extra_state``.

    The replica layout may differ from the saved one: DCP reshards the model for another number of ranks per
    replica, and replica ``r`` takes saved replica ``r mod n``'s optimizer state, ``n`` the number of optimizer
    states saved (1 where the replicas' were alike)."""
    ensemble = hdet.ensemble
    path = Path(path)
    if not has_checkpoint(path):
        raise FileNotFoundError(f"no HDET checkpoint at '{path}' (expected {HDET_STATE_FILE} and DCP shards)")

    def small_states() -> tuple[dict[str, Any], dict[str, Any], int]:
        extra = path / EXTRA_STATE_FILE
        return (torch.load(path / HDET_STATE_FILE, weights_only=True),
                torch.load(extra, weights_only=True) if extra.is_file() else {}, _saved_optimizer_states(path))

    # Rank 0 reads, every rank follows: ranks reading a network file system each for itself could disagree.
    hdet_state, extra_state, saved_states = on_rank0(small_states, f"reading the HDET state in {path}",
                                                     share_result=True)
    ensemble.check_state(hdet_state)  # before the model is read: a run that cannot continue it stops at once
    source = hdet.topology.replica_index % saved_states
    state = _sharded_state(model, optimizer, source)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state[f"optimizer_replica{source}"])
    ensemble.load_state_dict(hdet_state)
    return extra_state


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded model on CPU (collective); complete on rank 0, empty elsewhere. Taken at a sync point, where
    it is the one model of the ensemble: refused between syncs (it would be rank 0's replica alone)."""
    handle = handle_of(model)
    if handle is not None:
        handle.check_one_model("the model's export")
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def save_pretrained(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Writes the consolidated model with transformers' ``save_pretrained`` from rank 0 (collective); an attention
    scale HDET explored is carried in the weights (``HDETEnsemble.fold_found_attention_scale``)."""
    if not hasattr(model, "save_pretrained"):
        raise TypeError(f"{type(model).__name__} is not a transformers model; use full_state_dict() instead")
    state = full_state_dict(model)
    handle = handle_of(model)

    def write() -> None:
        if handle is not None:
            handle.ensemble.fold_found_attention_scale(model, state)
        model.save_pretrained(path, state_dict=state)

    on_rank0(write, f"writing the model to {path}")
