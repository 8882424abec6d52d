"""The floating-point dtypes fuser computes for, in one place: the engine, the patterns and the kernels import them
from here (the engine imports nothing from ``fuser.patterns`` or ``fuser.kernels``)."""

from __future__ import annotations

import torch

# half precision: what the fused ops round their results to and read without an fp32 copy
HALF_DTYPES = (torch.float16, torch.bfloat16)
# what the fused ops and their Triton kernels are written for (computing in fp32 internally); anything else (fp64,
# integers) is left to the inner compiler, or takes an op's plain-torch reference path
FLOAT_DTYPES = (*HALF_DTYPES, torch.float32)
