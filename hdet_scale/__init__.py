"""hdet_scale: Hyperparameter-Divergent Ensemble Training (arXiv 2604.24708) for DDP, FSDP2 and DeepSpeed.

Data-parallel replicas train at a symmetric spread of LR multipliers, are averaged every T steps, and an
auto-LR controller moves the shared base schedule toward the replicas that did better.
"""

from hdet_scale.config import AutoLRConfig, HDETConfig, HDETConfigError, WarmInitConfig
from hdet_scale.controller import PaperDecay
from hdet_scale.ensemble import HDETEnsemble
from hdet_scale.metrics import SyncReport
from hdet_scale.resolve import add_hdet_args, load_config
from hdet_scale.schedule import HDETOneCycleLR, HDETScheduler, ReplaySchedule
from hdet_scale.spread import multipliers
from hdet_scale.topology import ReplicaTopology

__all__ = [
    "AutoLRConfig",
    "HDETConfig",
    "HDETConfigError",
    "HDETEnsemble",
    "HDETOneCycleLR",
    "HDETScheduler",
    "PaperDecay",
    "ReplaySchedule",
    "ReplicaTopology",
    "SyncReport",
    "WarmInitConfig",
    "add_hdet_args",
    "load_config",
    "multipliers",
]
