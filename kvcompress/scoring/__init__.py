"""Scoring methods: one module per method behind a registry (``registry.py``), on ``kvcompress.kernels``."""
