"""Registering scoring methods: the built-in ones below, and ``register`` for the user's own.

Adding a method is one module under ``kvcompress/scoring/`` with a ``Scorer`` subclass and one line below (or a
``register`` call from the user's own code); the table itself (``catalogue.py``) is what parameters, presets and
the tests' method matrix read.
"""

from __future__ import annotations

from .base import Scorer
from .catalogue import SCORERS, scorer_class
from .expected_attention import ExpectedAttention
from .h2o import H2O
from .keydiff import KeyDiff
from .knorm import Knorm
from .kvzap import KVzap
from .kvzip import KVzip
from .snapkv import SnapKV
from .tova import TOVA


def register(scorer: type[Scorer]) -> type[Scorer]:
    """Make ``scorer`` available as ``method=scorer.name``; usable as a class decorator."""
    if not (isinstance(scorer, type) and issubclass(scorer, Scorer)) or not getattr(scorer, "name", None):
        raise TypeError(f"register() takes a Scorer subclass with a name, got {scorer!r}")
    existing = SCORERS.get(scorer.name)
    if existing is not None and existing is not scorer:
        raise ValueError(f"a scorer named {scorer.name!r} is already registered ({existing.__qualname__})")
    SCORERS[scorer.name] = scorer
    return scorer


__all__ = ["SCORERS", "register", "scorer_class"]

for _builtin in (SnapKV, H2O, KVzip, KVzap, ExpectedAttention, TOVA, KeyDiff, Knorm):
    register(_builtin)
del _builtin
