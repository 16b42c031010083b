"""kvcompress: KV-cache compression (H2O, SnapKV, KVCrush, CriticalKV) for Hugging Face transformers models."""

from .compressor import CompressionSession, KVCacheCompressor
from .parameters import KVCacheCompressionMode, KVCacheCompressionParameters

__all__ = ["CompressionSession", "KVCacheCompressionMode", "KVCacheCompressionParameters", "KVCacheCompressor"]
__version__ = "0.1.0"
