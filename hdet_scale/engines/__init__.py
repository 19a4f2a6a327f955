"""Engine adapters: the few engine-specific answers HDET's core needs (the interface is
``hdet_scale.adapter.EngineAdapter``)."""
