"""kvcompress: KV-cache compression (KVzip, SnapKV, H2O, Expected Attention, TOVA, KeyDiff, Knorm; KVCrush and
CriticalKV refinement) for Hugging Face transformers models."""

from .compressor import KVCacheCompressor, compress
from .context_file import ContextFileError
from .context_file import load_context as load
from .context_store import ContextStore
from .parameters import KVCacheCompressionParameters
from .presets import method_names, preset
from .scoring.base import AttentionCall, Scorer
from .scoring.registry import register
from .session import CompressionSession

__all__ = [
    "AttentionCall", "CompressionSession", "ContextFileError", "ContextStore", "KVCacheCompressionParameters",
    "KVCacheCompressor", "Scorer", "compress", "load", "method_names", "preset", "register",
]
__version__ = "0.1.0"
