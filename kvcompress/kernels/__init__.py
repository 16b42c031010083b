"""Attention kernels that compute what scorers observe (output, per-key sums or maxima) in one pass.

``attention.py`` chooses the implementation per call and holds the torch implementation (any device, the
reference of the others); ``native.py`` builds and loads the fused CPU kernel (``fused_attention.cpp``);
``triton_attention.py`` holds the accelerators' kernels (Triton); ``value_norm.py`` projects values through the
output projection (CriticalKV).
"""
