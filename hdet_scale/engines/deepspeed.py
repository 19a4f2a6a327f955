"""HDET for DeepSpeed: ``initialize`` mirrors ``deepspeed.initialize`` and attaches HDET to the engine.

A replica is a group of ranks (``ranks_per_replica``; default 1 for ZeRO-0, a node for ZeRO-1/2/3) that
ZeRO shards the model over; replicas differ only in their LR multipliers. The training loop stays
DeepSpeed's own::

    parser = hdet_scale.engines.deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args()                      # --deepspeed_config ds.json --hdet_config hdet.json
    engine, optimizer, loader, scheduler = hdet_scale.engines.deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=dataset)
    while engine.hdet.global_step < total_steps:    # the LR range test's steps come first, not counted
        for batch in loader:
            loss = engine(batch)
            engine.backward(loss)                   # HDET records the micro-batch loss here
            engine.step()                           # ... and fans out / syncs here, every T optimizer steps
            if engine.hdet.global_step == total_steps:
                break
    engine.save_checkpoint("ckpt")                  # at a sync point, with HDET's state and each replica's files

``engine.get_lr()`` stays the base schedule; ``engine.hdet.current_lrs()`` is what this replica trains with.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import os
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from hdet_scale.averaging import average_replica_gradients
from hdet_scale.comm import (
    broadcast_from_rank0,
    cpu_group,
    file_work_together,
    on_rank0,
    open_fresh_folder,
    raise_together,
)
from hdet_scale.config import HDETConfig
from hdet_scale.controller import PaperDecay
from hdet_scale.durable import (
    fsync_tree,
    recover_replaced_folder,
    replace_folder_durably,
    replacement_folders,
    start_replacement,
    write_text_durably,
)
from hdet_scale.engines.deepspeed_settings import check_version, checked_settings, per_replica_batch
from hdet_scale.engines.zero import ReplicaMPU, SaveEpilogue, ZeroAdapter
from hdet_scale.ensemble import HDETEnsemble
from hdet_scale.extras import require
from hdet_scale.handle import HDETHandle
from hdet_scale.metrics import SyncReport
from hdet_scale.notices import warn
from hdet_scale.resolve import add_hdet_args
from hdet_scale.topology import ReplicaTopology, check_world_size

require("deepspeed", "deepspeed", "hdet_scale.engines.deepspeed")
import deepspeed  # noqa: E402

DEFAULT_PORT = 29500  # deepspeed.constants.TORCH_DISTRIBUTED_DEFAULT_PORT
REPLICA_FOLDER = "hdet_replicas"
"""Inside a checkpoint tag: the optimizer-state files of replicas other than replica 0."""


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's own arguments (``deepspeed.add_config_arguments``), ``--hdet_config PATH``, and the
    ``--local_rank`` the deepspeed launcher passes to every rank (unless the parser has it already)."""
    parser = add_hdet_args(deepspeed.add_config_arguments(parser))
    try:
        parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    except argparse.ArgumentError:
        pass  # the user's parser declares it already
    return parser


class HDETDeepSpeed(HDETHandle):
    """The HDET side of one DeepSpeed engine, reachable as ``engine.hdet`` after ``initialize`` (``HDETHandle``).

    It needs no calls in the training loop: ``engine.backward(loss)`` records the loss and every optimizer
    step (``engine.step()`` at a gradient-accumulation boundary) advances HDET, which syncs every
    ``sync_interval`` steps. In ``global`` gradient mode the gradients ZeRO reduced inside the replica are
    averaged across replicas before clipping and the step, so every replica applies the same gradient.
    """

    loop_feeds_hdet = "under DeepSpeed, engine.backward(loss) hands HDET each loss and engine.step() takes its steps"

    def __init__(self, engine: Any, config: HDETConfig, topology: ReplicaTopology, *,
                 paper_decay: Sequence[PaperDecay] | None = None) -> None:
        self.engine = engine
        self.config = config
        self.topology = topology
        self.adapter = ZeroAdapter(engine)
        self.gradient_bytes_across_replicas = 0
        """Payload bytes of gradients this rank all-reduced across replicas (``global`` mode, every step)."""
        self._gradient_buckets: list[torch.Tensor] = []  # the gradient average's buckets, reused every step
        self._saving = False
        self._saved_replicas_given: int | None = None  # replicas whose files the checkpoint being loaded has
        self._synced_in_step = False
        self._closed = False  # close(): the engine's steps are DeepSpeed's alone, inside the replica
        self._restore_file_names: Callable[[], None] = lambda: None  # close() gives DeepSpeed its own back
        if topology.replica_index > 0:
            # DeepSpeed names checkpoint files by the rank inside the replica, so replicas would overwrite each
            # other. Where optimizer states differ (local mode) every other replica writes its own files next to
            # replica 0's. ZeRO-1/2/3 keep it in their ZeRO files, and only replica 0 writes the model (identical
            # at syncs); ZeRO-0 keeps it in the model file itself, which every replica then writes.
            writes_model = engine.save_non_zero_checkpoint
            if engine.zero_optimization():
                engine.save_non_zero_checkpoint = False
            own_file = "_get_rank_zero_ckpt_name" if engine.zero_optimization() else "_get_ckpt_name"
            shared_name = getattr(engine, own_file)
            setattr(engine, own_file, lambda *args, **kwargs: self._replica_file(shared_name(*args, **kwargs)))

            def restore_file_names() -> None:
                engine.save_non_zero_checkpoint = writes_model
                engine.__dict__.pop(own_file, None)  # the class's method again
                self._restore_file_names = lambda: None

            self._restore_file_names = restore_file_names
        self._ensemble = HDETEnsemble(config, self.adapter, topology=topology, paper_decay=paper_decay)
        self._install(engine)

    def _attached(self) -> HDETEnsemble:
        return self._ensemble

    def _install(self, engine: Any) -> None:
        backward, step, take_model_step = engine.backward, engine.step, engine._take_model_step
        self._deepspeed_save, self._deepspeed_load = engine.save_checkpoint, engine.load_checkpoint

        def observing_backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not self._closed:
                self.ensemble.observe(loss)
            with replica_groups(engine.mpu):
                return backward(loss, *args, **kwargs)

        prologue = engine._backward_prologue

        def engine_backward_only(*args: Any, **kwargs: Any) -> Any:
            # ZeRO-1/2/3 run a loss.backward() called directly through hooks: HDET would see no loss
            if not (self._closed or engine._running_engine_backward):
                raise RuntimeError("HDET under DeepSpeed reads each micro-batch's loss in engine.backward(loss): "
                                   "call it instead of loss.backward() (or engine.scale(loss).backward())")
            return prologue(*args, **kwargs)

        def replica_step(*args: Any, **kwargs: Any) -> Any:
            self._synced_in_step = False
            with replica_groups(engine.mpu):
                return step(*args, **kwargs)

        def hdet_model_step(*args: Any, **kwargs: Any) -> Any:
            if self._closed:
                return take_model_step(*args, **kwargs)
            if self.config.gradient_mode == "global":
                self._average_gradients_across_replicas()
            scheduler = engine.lr_scheduler
            if self.ensemble.ramping:  # the range test's steps are not the run's: its schedule starts after them
                engine.lr_scheduler = None
            try:
                result = take_model_step(*args, **kwargs)
            finally:
                engine.lr_scheduler = scheduler
            # Every replica counts every step, skipped (overflow) or not, so syncs stay collective.
            if self.ensemble.step() is not None:
                self._synced_in_step = True
            return result

        # DeepSpeed's signatures stay readable (inspect.signature follows __wrapped__): the Trainer passes
        # exclude_frozen_parameters only where engine.save_checkpoint declares it
        @functools.wraps(self._deepspeed_save)
        def hdet_save_checkpoint(*args: Any, **kwargs: Any) -> Any:
            # any of DeepSpeed's arguments may come positionally, as its signature allows
            kwargs = inspect.signature(self._deepspeed_save).bind(*args, **kwargs).arguments
            save_dir, tag = kwargs.pop("save_dir"), kwargs.pop("tag", None)
            client_state, save_latest = kwargs.pop("client_state", None), kwargs.pop("save_latest", True)
            if self._closed:
                self._check_own_directory(save_dir)
                saved = self._deepspeed_save(save_dir, tag, client_state or {}, save_latest, **kwargs)
                if save_latest and self.topology.replica_index and not self.topology.position:
                    # DeepSpeed names the tag 'latest' on global rank 0 alone: in its directory only
                    write_text_durably(Path(save_dir) / "latest", _tag_or_step(tag, engine.global_steps))
                return saved
            return self.save_checkpoint(save_dir, tag, client_state, save_latest, **kwargs)

        @functools.wraps(self._deepspeed_load)
        def hdet_load_checkpoint(*args: Any, **kwargs: Any) -> tuple[str | None, dict[str, Any] | None]:
            kwargs = inspect.signature(self._deepspeed_load).bind(*args, **kwargs).arguments
            load_dir, tag = kwargs.pop("load_dir"), kwargs.pop("tag", None)
            if self._closed:
                return self._deepspeed_load(load_dir, tag, **kwargs)
            return self._load(load_dir, tag, needs_hdet_state=False, **kwargs)

        engine.backward = observing_backward
        engine._backward_prologue = engine_backward_only
        engine.step = replica_step
        engine._take_model_step = hdet_model_step
        # A training script's own checkpoint calls save and load HDET's state and each replica's files too.
        engine.save_checkpoint = hdet_save_checkpoint
        engine.load_checkpoint = hdet_load_checkpoint

    def close(self) -> None:
        """Removes HDET from the engine: its optimizer hooks and every explored value back at its base
        (``HDETEnsemble.close``), and no step records a loss, syncs or averages gradients across replicas any
        more; ``engine.save_checkpoint`` and ``load_checkpoint`` are DeepSpeed's alone. The engine goes on training
        inside its replica (its collectives stay in the replica's groups), apart from the others: each replica saves
        its own checkpoint, into a directory of its own."""
        self._closed = True
        self._restore_file_names()
        super().close()

    def _check_own_directory(self, save_dir: str | os.PathLike[str]) -> None:
        """A ValueError on every rank where replicas that train apart (after ``close``) would write DeepSpeed's files
        into one directory, over each other's (collective)."""
        if self.topology.num_replicas == 1:
            return
        directories: list[str | None] = [None] * self.topology.world_size
        dist.all_gather_object(directories, os.path.realpath(save_dir), group=cpu_group())
        for position in range(self.topology.ranks_per_replica):
            ranks = self.topology.cross_replica_ranks(position)
            if len({directories[rank] for rank in ranks}) < len(ranks):
                raise ValueError(
                    "engine.save_checkpoint after engine.hdet.close(): the replicas train apart, and two of them "
                    f"would write DeepSpeed's files into one directory ({directories[ranks[0]]}); give each replica "
                    "its own (e.g. f'{save_dir}/replica{engine.hdet.topology.replica_index}'), or save before closing")

    def _replica_file(self, shared: str) -> str:
        """This replica's optimizer-state file for replica 0's ``shared`` one: in a subfolder, so DeepSpeed's
        converters (``zero_to_fp32``, ``ds_to_universal``) see exactly one replica. When loading a checkpoint
        saved by another number of replicas, replica r reads saved replica r mod that number's file (counted by
        rank 0 for the load). Until ``close``, which gives DeepSpeed its own names back."""
        replica = self.topology.replica_index
        if not self._saving:
            replica %= self._saved_replicas_given or self._saved_replicas(Path(os.path.dirname(shared)))
        if replica == 0:
            return shared
        return os.path.join(os.path.dirname(shared), REPLICA_FOLDER, f"replica{replica}_{os.path.basename(shared)}")

    def _average_gradients_across_replicas(self) -> None:
        self.gradient_bytes_across_replicas += average_replica_gradients(
            self.adapter.gradient_tensors(), self.topology, bucket_bytes=int(self.config.bucket_mb * 2**20),
            memory=self._gradient_buckets)

    # ------------------------------------------------------------------------------------ reporting
    @property
    def synced(self) -> bool:
        """True right after the ``engine.step()`` call that synced (the last micro-batch of every
        ``sync_interval``-th optimizer step), False after every other call: once per sync, the place to
        checkpoint. ``global_step % sync_interval == 0`` stays true for all the micro-batches that follow."""
        return self._synced_in_step

    def sync(self) -> SyncReport | None:
        """An HDET sync now, between the regular ones (collective): e.g. to end on one model before a
        preemption checkpoint or an export; None where the replicas are one model already (right after a sync).
        The next regular sync stays at the next multiple of ``sync_interval``."""
        with replica_groups(self.engine.mpu):
            return self.ensemble.sync()

    # ---------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, save_dir: str | os.PathLike[str], tag: str | None = None,
                        client_state: Mapping[str, Any] | None = None, save_latest: bool = True,
                        **kwargs: Any) -> str:
        """``engine.save_checkpoint`` with the HDET state, at a sync point (collective: every rank calls it).

        Replicas are identical right after a sync: replica 0 writes the model and its optimizer state where
        DeepSpeed expects them (with ``universal_checkpoint_info``, so ``ds_to_universal`` converts ZeRO-1/2
        checkpoints, and ``zero_to_fp32`` reads them); where the replicas' optimizer states differ
        (``HDETEnsemble.optimizer_states_differ``: local gradient mode), every other replica writes its own to
        ``<tag>/hdet_replicas/`` (ZeRO-0: its model file, which holds it). With ``save_latest``, ``latest`` names
        the tag once every rank's files are on the disk. Returns the tag. A save into a tag that exists already (a
        tag reused for each save, ``"last"``) writes beside it (``<tag>.tmp``) and puts the new checkpoint in its
        place once every rank's files are on the disk: a save that fails, or a kill, leaves the one before whole
        (a load puts back what a kill between the two renames left).
        """
        apart = self.ensemble.apart_error("an HDET checkpoint")
        if apart is not None:
            raise RuntimeError(apart)
        state = dict(client_state or {})
        if "hdet" in state:
            raise ValueError("client_state key 'hdet' is reserved for HDET's own state")
        state["hdet"] = self.state_dict()
        state.setdefault("universal_checkpoint_info", {})
        tag = _tag_or_step(tag, self.engine.global_steps)
        states_differ = self.ensemble.optimizer_states_differ()  # collective: on every rank
        writes_own_state = self.topology.replica_index > 0 and states_differ
        target = Path(save_dir) / tag
        on_rank0(lambda: start_replacement(target), f"preparing the checkpoint {tag}")
        replacing = on_rank0(target.exists, f"looking for the checkpoint {tag}", share_result=True)
        written = replacement_folders(target)[0] if replacing else target
        if replacing:  # a tag saved into again stages under one name: each node first sees this save's folder there
            open_fresh_folder(written, f"the checkpoint {tag}")

        def make_folders() -> None:  # DeepSpeed makes save_dir on rank 0 alone before its first barrier: every rank
            os.makedirs(written, exist_ok=True)
            if writes_own_state:
                # DeepSpeed creates the tag folder only from ranks whose rank inside the replica equals the global
                # rank.
                os.makedirs(written / REPLICA_FOLDER, exist_ok=True)

        file_work_together(make_folders, f"preparing the checkpoint {tag}")
        failure = None  # this rank's failure to write its files
        self._saving = True
        epilogue = SaveEpilogue(self.engine)
        own_file = "save_zero_checkpoint" if self.engine.zero_optimization() else "save_non_zero_checkpoint"
        writes = getattr(self.engine, own_file)
        if self.topology.replica_index > 0 and not writes_own_state:
            setattr(self.engine, own_file, False)  # replica 0's optimizer state serves this replica too
        try:
            with replica_groups(self.engine.mpu), epilogue:
                self._deepspeed_save(str(save_dir), tag=written.name, client_state=state, save_latest=False,
                                     **kwargs)
        except Exception as error:
            # A write failed on this rank. DeepSpeed writes after its collectives but ZeRO-3's epilogue and the
            # barrier that ends the save, where the other ranks now wait: meet them there, then all stop together.
            failure = error
            with replica_groups(self.engine.mpu):
                epilogue.meet_after_failure()
            dist.barrier()
        finally:
            self._saving = False
            setattr(self.engine, own_file, writes)
        raise_together(failure, f"saving the checkpoint {tag}")
        # DeepSpeed's rank 0 writes 'latest' before the other ranks' files are written, and its torch.save leaves
        # them in the page cache: each node flushes the checkpoint (one rank a node flushes what all its ranks
        # wrote), and only then does 'latest' name it, so that a kill or a node crash cannot leave it naming
        # missing or truncated files.
        file_work_together(lambda: fsync_tree(written), f"flushing the checkpoint {tag} to the disk",
                           here=int(os.environ.get("LOCAL_RANK", 0)) == 0)
        if replacing:
            on_rank0(lambda: replace_folder_durably(written, target), f"putting the checkpoint {tag} in place")
        if save_latest:
            on_rank0(lambda: write_text_durably(Path(save_dir) / "latest", tag), f"pointing 'latest' at {tag}")
        return tag

    def load_checkpoint(self, load_dir: str | os.PathLike[str], tag: str | None = None,
                        **kwargs: Any) -> tuple[str, dict[str, Any]]:
        """``engine.load_checkpoint`` and the HDET state; returns (path, the user's client_state).

        Every replica gets its own optimizer state back. Loads into any number of replicas of the saved size:
        replica r takes saved replica ``r mod n``'s optimizer state, ``n`` the number of replicas that wrote
        theirs (1 where they were alike). A different replica size needs DeepSpeed's universal checkpoint
        (``ds_to_universal``, then ``"checkpoint": {"load_universal": true}``), which carries replica 0's
        optimizer state. A FileNotFoundError where there is no checkpoint (``engine.load_checkpoint`` returns
        ``(None, None)`` where no tag is given and there is no ``latest``, as DeepSpeed's does, raises one for a tag
        with no folder, and takes a checkpoint saved without HDET as a fresh HDET start
        from its weights). With ``load_module_only=True`` the weights alone are loaded, and HDET starts afresh.
        """
        path, client_state = self._load(load_dir, tag, needs_hdet_state=True, **kwargs)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint found in '{load_dir}' (tag {tag!r})")
        return path, client_state

    def _load(self, load_dir: str | os.PathLike[str], tag: str | None, *, needs_hdet_state: bool,
              **kwargs: Any) -> tuple[str | None, dict[str, Any] | None]:
        # DeepSpeed's load_module_only takes the weights alone, for a fresh start from them: HDET's too
        reads_state = not kwargs.get("load_module_only", False)
        needs_hdet_state = needs_hdet_state and reads_state
        # Rank 0 reads the checkpoint and every rank follows: ranks reading a network file system each for itself
        # could see different 'latest' files or replica folders and load different checkpoints, or hang.
        tag = on_rank0(lambda: self._tag_to_load(str(load_dir), tag), "reading the checkpoint's tag",
                       share_result=True)
        if tag is None:  # none found by rank 0: DeepSpeed would read 'latest' on each rank, and another may see one
            return None, None
        # a kill between the two renames of a save into this tag: the complete one in place
        on_rank0(lambda: recover_replaced_folder(Path(load_dir) / tag), f"recovering the checkpoint {tag}")
        # DeepSpeed's ZeRO-3 load without optimizer states takes its weights from the checkpoint 'latest' names
        # (load_module_only too), as its condition reads
        weights_from_latest = (self.engine.zero_optimization_partition_weights()
                               and not kwargs.get("load_optimizer_states", True)
                               and not self.engine.has_moe_layers and not self.engine.load_universal_checkpoint())
        found_replicas = on_rank0(lambda: self._read_checkpoint(str(load_dir), tag, reads_state, needs_hdet_state,
                                                                weights_from_latest),
                                  "checking the checkpoint's HDET state", share_result=True)
        self._saved_replicas_given = found_replicas
        failure, path, client_state = None, None, None
        try:
            with replica_groups(self.engine.mpu):
                path, client_state = self._deepspeed_load(str(load_dir), tag=tag, **kwargs)
        except Exception as error:  # every rank learns of it; the failing rank raises it as it is
            failure = error
        finally:
            self._saved_replicas_given = None
        # A file only some ranks read (a replica's own optimizer state) or see (a stale network file system view)
        # failing there: every rank stops here, none goes on to train and wait in a collective the failing ones never
        # reach (where DeepSpeed's own load runs no collective after the failure).
        raise_together(failure, f"loading the checkpoint {tag}")
        if path is None:
            return None, None
        client_state = dict(client_state or {})
        if reads_state and ("hdet" in client_state or needs_hdet_state):
            self.load_state_dict(_hdet_state(client_state, path))
            del client_state["hdet"]
            return path, client_state
        client_state.pop("hdet", None)
        afresh = self.ensemble.weights_loaded(f"loading the weights of '{path}'")
        if reads_state and self.topology.rank == 0:
            warn(f"the DeepSpeed checkpoint at '{path}' holds no HDET state (it was saved without HDET): "
                 + ("HDET starts afresh from its weights" if afresh else "the run goes on from its weights"))
        return path, client_state

    def _read_checkpoint(self, load_dir: str, tag: str, reads_state: bool, needs_hdet_state: bool,
                         weights_from_latest: bool) -> int:
        """Rank 0's reading of the checkpoint ``tag`` to load: how many replicas wrote it (a FileNotFoundError where
        it is not found: DeepSpeed failed an assertion). Refuses, before DeepSpeed reads a byte of its shards, a
        checkpoint whose HDET state this run cannot continue (``HDETEnsemble.check_state``; where ``reads_state``),
        or that has none where ``needs_hdet_state``: the state sits in replica 0's first model file, which is
        memory-mapped here, so only the state is read. Where that file is not found (a universal checkpoint) the state
        is checked after the load. ``weights_from_latest``: DeepSpeed will read the weights of the checkpoint
        ``latest`` names, refused where that is not ``tag``."""
        if not os.path.isdir(os.path.join(load_dir, tag)):
            raise FileNotFoundError(f"no DeepSpeed checkpoint {tag!r} in '{load_dir}' (no folder {tag} there)")
        if weights_from_latest:
            latest = Path(load_dir) / "latest"
            named = latest.read_text().strip() if latest.is_file() else None
            if named != tag:
                # a module-only load reads nothing else, and with the optimizer states no ZeRO-3 weights at all
                rest, fix = "", "load the checkpoint 'latest' names"
                if reads_state:
                    rest = f", while the rest (HDET's state, the scheduler, the step) would come from {tag!r}"
                    fix += ", or load it with load_optimizer_states=True"
                raise ValueError(f"DeepSpeed's ZeRO-3 load with load_optimizer_states=False reads its weights from the "
                                 f"checkpoint {latest} names ({named or 'no such file'}), not from tag {tag!r}{rest}: "
                                 f"{fix}")
        path = self.engine._get_ckpt_name(load_dir, tag, pp_placeholder="0")
        if reads_state and os.path.isfile(path):
            # memory-mapped where it is a zip file: not one written in torch's older format (DeepSpeed's
            # checkpoint.checkpoint_serialization false)
            saved = torch.load(path, map_location="cpu", mmap=zipfile.is_zipfile(path), weights_only=False)
            if "hdet" in saved or needs_hdet_state:
                self.ensemble.check_state(_hdet_state(saved, path))
        return self._saved_replicas(Path(load_dir) / tag)

    def _tag_to_load(self, load_dir: str, tag: str | None) -> str | None:
        """``tag``, or where none is given the one ``latest`` names (None without it)."""
        if tag is not None:
            return str(tag)  # DeepSpeed takes any tag as its string
        universal = self.engine.load_universal_checkpoint()
        latest = Path(load_dir) / ("latest_universal" if universal else "latest")
        if universal and not latest.is_file():  # as DeepSpeed's: a universal load has no checkpoint to start without
            raise ValueError(f"DeepSpeed's checkpoint.load_universal is on and {latest} does not exist: convert the "
                             "checkpoint with ds_to_universal first, or pass the tag of the converted one")
        return latest.read_text().strip() if latest.is_file() else None

    @staticmethod
    def _saved_replicas(checkpoint: Path) -> int:
        """How many replicas wrote ``checkpoint``: replica 0 and those with files in its replica folder."""
        others = {name.split("_", 1)[0] for name in os.listdir(checkpoint / REPLICA_FOLDER)} \
            if (checkpoint / REPLICA_FOLDER).is_dir() else set()
        return 1 + len(others)

    # ---------------------------------------------------------------------------------------- export
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model in fp32 on CPU from the fp32 masters (gathered inside the replica; collective over
        every rank), keyed like ``engine.module.state_dict()``. Taken at a sync point, where it is the one model of
        the ensemble: refused between syncs (it would be replica 0's alone), unless HDET was closed."""
        if not self._closed:
            self.check_one_model("the model's export")
        from deepspeed.runtime.zero import GatheredParameters
        from deepspeed.utils import safe_get_full_fp32_param

        state: dict[str, torch.Tensor] = {}
        gathered: dict[int, torch.Tensor] = {}  # a tied parameter, under each of its names, is gathered once
        masters = self.adapter.whole_masters()  # ZeRO-0, where DeepSpeed's API finds no master
        with replica_groups(self.engine.mpu):
            for name, param in self.engine.module.named_parameters(remove_duplicate=False):
                if id(param) in gathered:
                    state[name] = gathered[id(param)]
                    continue
                full = safe_get_full_fp32_param(param)
                if full is None and hasattr(param, "ds_id"):  # frozen under ZeRO-3: partitioned, no master
                    with GatheredParameters([param]):
                        full = param.detach().to("cpu", torch.float32, copy=True)  # outlives the gather
                elif full is None:  # ZeRO-0's master (bf16: its fp32 copy), or a frozen parameter as it is
                    full = masters.get(id(param), param.detach())
                state[name] = gathered[id(param)] = full.float().cpu().clone()
        saved = self.engine.module.state_dict(keep_vars=True).keys()  # persistent buffers only
        for name, buffer in self.engine.module.named_buffers():
            if name in saved:
                state.setdefault(name, buffer.detach().cpu().clone())
        return state

    def save_pretrained(self, path: str | os.PathLike[str]) -> None:
        """Writes the model with transformers' ``save_pretrained`` from global rank 0, in fp32 (collective;
        at a sync point). ``from_pretrained(path)`` loads it without DeepSpeed; an attention scale HDET explored is
        carried in the weights (``HDETEnsemble.fold_found_attention_scale``)."""
        module = self.engine.module
        if not hasattr(module, "save_pretrained"):
            raise TypeError(f"{type(module).__name__} is not a transformers model; use full_state_dict() instead")
        state = self.full_state_dict()

        def write() -> None:
            self.ensemble.fold_found_attention_scale(module, state)
            module.save_pretrained(path, state_dict=state)

        on_rank0(write, f"writing the model to {path}")


def _hdet_state(saved: Mapping[str, Any], path: str) -> Mapping[str, Any]:
    """The HDET state in a checkpoint's client state, read from ``path``; a ValueError where it has none."""
    if "hdet" not in saved:
        raise ValueError(f"the checkpoint at '{path}' has no HDET state: it was saved without HDET. Resume from a "
                         "checkpoint HDET saved (or, in your own loop, load this one with engine.load_checkpoint: HDET "
                         "then starts afresh from its weights)")
    return saved["hdet"]


def initialize(args: Any = None, model: nn.Module | None = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Dataset | None = None, lr_scheduler: Any = None,
               distributed_port: int = DEFAULT_PORT, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Callable | None = None, config: str | Mapping[str, Any] | None = None,
               mesh_param: Any = None, config_params: str | Mapping[str, Any] | None = None, *,
               hdet_config: HDETConfig | Mapping[str, Any] | str | None = None,
               paper_decay: Sequence[PaperDecay] | None = None,
               total_steps: int | None = None) -> tuple[Any, Any, DataLoader | None, Any]:
    """``deepspeed.initialize`` with HDET attached; same arguments and return values.

    The HDET settings come from ``hdet_config``, ``args.hdet_config`` or an ``"hdet"`` section of the
    DeepSpeed JSON (exactly one of them; none: the defaults). ``train_batch_size`` in the DeepSpeed JSON
    keeps its meaning, the batch of one optimizer step over all ranks; each replica takes its share.
    ``training_data`` is read through a sampler over the global rank, so every rank (and replica) reads
    different samples. The model's weights are taken from global rank 0, so replicas start identical (with
    ``warm_init`` each replica then adds its own eq. 10 noise, after DeepSpeed's own broadcast).
    ``engine.hdet`` is the ``HDETDeepSpeed`` handle. ``total_steps``, the run's length in optimizer steps
    (default: the DeepSpeed scheduler's ``total_num_steps``), places the controller's start and stop, which
    the defaults give as shares of the run.

    Everything is checked before the process group and the engine are built: a bad HDET field, an
    ``"hdet"`` section with an unknown key, a replica size that does not divide the world, and DeepSpeed
    settings HDET cannot support (offload, fp16, hpZ, qgZ, pipeline or tensor parallelism).
    """
    check_version(deepspeed.__version__)
    ds_config, args, hdet = checked_settings(args, model, config if config is not None else config_params,
                                             hdet_config, total_steps, mpu=mpu, mesh_param=mesh_param)

    deepspeed.init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    world_size = dist.get_world_size()
    ds_config = per_replica_batch(ds_config, check_world_size(hdet, world_size))
    topology = ReplicaTopology.build(hdet)
    replica_mpu = ReplicaMPU(topology)
    broadcast_from_rank0(model)  # DeepSpeed broadcasts only inside the replica (its data-parallel group)
    with replica_groups(replica_mpu):
        engine, engine_optimizer, _, scheduler = deepspeed.initialize(
            args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
            lr_scheduler=lr_scheduler, distributed_port=distributed_port, mpu=replica_mpu,
            dist_init_required=dist_init_required, config=ds_config)
        engine.hdet = HDETDeepSpeed(engine, hdet, topology, paper_decay=paper_decay)
    loader = None
    if training_data is not None:
        loader = replica_dataloader(training_data, engine.train_micro_batch_size_per_gpu(), collate_fn=collate_fn)
    return engine, engine_optimizer, loader, scheduler


@contextlib.contextmanager
def replica_groups(mpu: ReplicaMPU) -> Iterator[None]:
    """DeepSpeed keeps the last engine's model-parallel unit process-wide (``deepspeed.utils.groups.mpu``) and
    reads it during backward, step and checkpointing; HDET's engine sets its own only while it runs, so
    other DeepSpeed engines in the process keep their all-rank groups whenever they were built."""
    from deepspeed.utils import groups

    previous = groups.mpu
    groups.mpu = mpu
    try:
        yield
    finally:
        groups.mpu = previous


def replica_dataloader(dataset: Dataset, micro_batch_size: int, *, collate_fn: Callable | None = None,
                       shuffle: bool = True, seed: int = 0, **loader_kwargs: Any) -> DataLoader:
    """A DataLoader whose sampler splits ``dataset`` over every global rank, so replicas read different data
    (DeepSpeed's own loader would split it over the ranks of one replica only). Call
    ``loader.sampler.set_epoch(epoch)`` each epoch to reshuffle."""
    sampler = DistributedSampler(dataset, num_replicas=dist.get_world_size(), rank=dist.get_rank(),
                                 shuffle=shuffle, seed=seed, drop_last=True)
    return DataLoader(dataset, batch_size=micro_batch_size, sampler=sampler, collate_fn=collate_fn,
                      drop_last=True, **loader_kwargs)


def _tag_or_step(tag: Any, global_steps: int) -> str:
    """The folder a save with ``tag`` writes, as DeepSpeed names it: ``str(tag)`` (its tutorial passes numbers), or
    ``global_step<N>`` where none is given."""
    return f"global_step{global_steps}" if tag is None else str(tag)
