"""Muon optimizers as people run them, rewritten in the style of the public code they mirror.

Each module names the implementation it mirrors and the patterns it exercises;
corpus.py lists one :class:`~tests.real_world.corpus.Case` per class and
harness.py runs a case eager and compiled side by side.
"""
