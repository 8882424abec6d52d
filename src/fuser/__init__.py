"""fuser: fused Triton kernels for the memory-bound blocks of any language model, found by graph pattern.

model = fuser.optimize(model)                   # or torch.compile(model, backend="fuser")
fuser.optimize_(model)                          # in place, for transformers.Trainer / TRL's trainers
print(fuser.explain(model, input_ids=ids, labels=ids))
print(fuser.report(model))                      # what fused in the graphs compiled so far
"""

from typing import Any

from fuser.config import FuserConfig
from fuser.dynamo_backend import FuserError, backend, optimize, optimize_, report
from fuser.kernels.bias_activation import bias_activation
from fuser.kernels.gated_activation import geglu, swiglu
from fuser.kernels.layer_norm import layer_norm
from fuser.kernels.linear_cross_entropy import linear_cross_entropy
from fuser.kernels.lora_sum import lora_sum
from fuser.kernels.rms_norm import rms_norm
from fuser.kernels.rope import rope
from fuser.kernels.upcast_linear import upcast_linear
from fuser.patterns import DEFAULT_PATTERNS
from fuser.report import Report, explain

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_PATTERNS",
    "FuserCallback",
    "FuserConfig",
    "FuserError",
    "Report",
    "backend",
    "bias_activation",
    "explain",
    "geglu",
    "layer_norm",
    "linear_cross_entropy",
    "lora_sum",
    "optimize",
    "optimize_",
    "report",
    "rms_norm",
    "rope",
    "swiglu",
    "upcast_linear",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name == "FuserCallback":  # needs transformers, which fuser itself does not
        from fuser.trainer import FuserCallback

        return FuserCallback
    raise AttributeError(f"module 'fuser' has no attribute {name!r}")
