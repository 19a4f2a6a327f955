"""Integrations of HDET with training frameworks (``hf_trainer``: ``transformers.Trainer``; ``lightning``:
PyTorch Lightning's ``Trainer``).

Each lives in its own module and imports its framework only there, so ``import hdet_scale`` never needs them.
"""
