"""Integrations of HDET with training frameworks (``hf_trainer``: ``transformers.Trainer``).

Each lives in its own module and imports its framework only there, so ``import hdet_scale`` never needs them.
"""
