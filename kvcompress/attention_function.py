"""The attention function a session installs, so that scoring sees (and can replace) the model's attention call.

transformers' attention modules look their attention function up by name (``config._attn_implementation``)
in ``AttentionInterface``. For the duration of a session the compressed model's configs name a wrapper
(``kvcompress_<original>``, registered once per original implementation, with the original's mask function)
which hands the module's own post-RoPE queries and the updated cache to the session. That is what lets H2O
and decode steps compute the attention output and the scores in one pass, and spares every method a re-run of
the query projection and RoPE. Modules without an active session get the original function unchanged.
"""

from __future__ import annotations

import sys
import weakref
from typing import Callable

from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

PREFIX = "kvcompress_"

# attention module -> the session's attend(module, query, key, value, attention_mask, original, **kwargs)
_ATTEND: "weakref.WeakKeyDictionary[nn.Module, Callable]" = weakref.WeakKeyDictionary()


def install(attention_modules: list[nn.Module], attend: Callable) -> Callable[[], None]:
    """Route the modules' attention through ``attend``; returns the function that undoes it exactly."""
    configs = {id(module.config): module.config for module in attention_modules}
    originals = {key: config._attn_implementation for key, config in configs.items()}
    try:
        for key, config in configs.items():
            config._attn_implementation = _registered_wrapper(originals[key])
        for module in attention_modules:
            _ATTEND[module] = attend
    except BaseException:
        _restore(attention_modules, configs, originals)
        raise
    return lambda: _restore(attention_modules, configs, originals)


def _restore(attention_modules, configs, originals) -> None:
    for module in attention_modules:
        _ATTEND.pop(module, None)
    for key, config in configs.items():
        config._attn_implementation = originals[key]


def _registered_wrapper(original: str | None) -> str:
    if original is None or original.startswith(PREFIX):
        raise ValueError(f"kvcompress cannot wrap the attention implementation {original!r} of this model")
    name = PREFIX + original
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _wrapper(original))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
    return name


def original_function(module: nn.Module, original: str) -> Callable:
    """The function the module would call without kvcompress; "eager" is each model file's own function."""
    if original == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[original]


def _wrapper(original: str) -> Callable:
    def attention(module, query, key, value, attention_mask, **kwargs):
        function = original_function(module, original)
        attend = _ATTEND.get(module)
        if attend is None:
            return function(module, query, key, value, attention_mask, **kwargs)
        return attend(module, query, key, value, attention_mask, function, **kwargs)

    attention.__name__ = f"{PREFIX}{original}_attention"
    return attention
