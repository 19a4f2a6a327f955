"""Engine adapters: the few engine-specific answers HDET's core needs."""

from hdet_scale.engines.base import EngineAdapter

__all__ = ["EngineAdapter"]
