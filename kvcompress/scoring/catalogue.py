"""The scoring methods by name: what ``method`` may be, and the class that implements each.

``registry.register`` fills it (the built-in methods, then any the user registers); the parameters read it to
validate a method's name and options without importing a single method, so the methods, which read the
parameters, sit above both.
"""

from __future__ import annotations

from typing import Any

SCORERS: dict[str, Any] = {}  # name -> a kvcompress.scoring.base.Scorer subclass


def scorer_class(name: str) -> Any:
    """The registered class of method ``name``; an unknown name is refused with the registered ones."""
    try:
        return SCORERS[name]
    except KeyError:
        raise ValueError(f"method must be one of {', '.join(map(repr, SCORERS))}, got {name!r}") from None
