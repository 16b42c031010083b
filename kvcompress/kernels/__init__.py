"""Attention kernels that compute what scorers observe (output, per-key sums or maxima) in one pass.

``attention.py`` chooses the implementation per call and holds the torch implementation (any device, the
reference of the others); ``native.py`` builds and loads the fused CPU kernel (``fused_attention.cpp``);
``reconstruction.py`` runs KVzip's reconstruction pass on torch's flash attention (``flash.py``) where that
kernel is not available. The accelerators' kernels (Triton): ``triton_kernels.py`` the kernels,
``triton_blocks.py`` their launches per device, ``triton_attention.py`` the calls, ``ahead_of_time.py`` (with
``triton_compile.py``) compiles every launch for each NVIDIA architecture on CPU. ``value_norm.py`` projects
values through the output projection (CriticalKV).
"""
