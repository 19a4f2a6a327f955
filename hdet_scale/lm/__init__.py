"""Language-model pretraining pieces used by ``hdet_scale.train``: model presets, corpora, engine backends."""
