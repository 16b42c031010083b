"""The scoring methods by name: what ``algorithm`` may be, and where the session finds the method's class.

Adding a method is one module under ``kvcompress/scoring/`` with a ``Scorer`` subclass and one line below (or a
``register`` call from the user's own code); parameters, presets and the tests' method matrix read this table.
"""

from __future__ import annotations

from .base import Scorer
from .expected_attention import ExpectedAttention
from .h2o import H2O
from .keydiff import KeyDiff
from .knorm import Knorm
from .kvzip import KVzip
from .snapkv import SnapKV
from .tova import TOVA

SCORERS: dict[str, type[Scorer]] = {}


def register(scorer: type[Scorer]) -> type[Scorer]:
    """Make ``scorer`` available as ``algorithm=scorer.name``; usable as a class decorator."""
    if not (isinstance(scorer, type) and issubclass(scorer, Scorer)) or not getattr(scorer, "name", None):
        raise TypeError(f"register() takes a Scorer subclass with a name, got {scorer!r}")
    existing = SCORERS.get(scorer.name)
    if existing is not None and existing is not scorer:
        raise ValueError(f"a scorer named {scorer.name!r} is already registered ({existing.__qualname__})")
    SCORERS[scorer.name] = scorer
    return scorer


def scorer_class(name: str) -> type[Scorer]:
    try:
        return SCORERS[name]
    except KeyError:
        raise ValueError(f"algorithm must be one of {', '.join(map(repr, SCORERS))}, got {name!r}") from None


for _builtin in (SnapKV, H2O, KVzip, ExpectedAttention, TOVA, KeyDiff, Knorm):
    register(_builtin)
del _builtin
