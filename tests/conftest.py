"""Suite-wide set-up: Triton's kernels run on CPU tensors through its interpreter where no GPU is present.

``TRITON_INTERPRET`` is read when Triton compiles a kernel's decorator, so it is set before any test imports
``kvcompress.kernels.triton_attention``.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
