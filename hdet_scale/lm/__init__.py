"""The language-model pretraining script ``hdet_scale.lm.train`` and its pieces (model presets, corpora, engine
backends, checkpoints), and ``demo_ddp``: HDET on plain DDP in one file. The library itself does not import them."""
