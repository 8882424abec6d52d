"""Compile every Triton kernel that fuser's ops launch, at the GPU's launch configurations, to sm_90 (the H200)
on a machine without a GPU: fp32, fp16 and bf16 (the Triton interpreter cannot run bf16).

How: each op's Python implementation runs on fake CUDA tensors (``FakeTensorMode``), so every wrapper takes its
GPU path and picks its GPU launch configuration; each ``kernel[grid](...)`` is intercepted and compiled with
``triton.compile`` for ``GPUTarget("cuda", 90, 32)`` (Triton ships ptxas) instead of launched, specialized as
Triton's launcher specializes (16-byte-aligned tensors and ints divisible by 16 get ``tt.divisibility``, ints equal
to 1 become constexprs): without that, loads neither vectorise nor pipeline, and the shared memory reported is one
stage's, not a launch's (a 3-stage 128×128×64 bf16 matmul: 32 KiB unspecialized, 96 KiB as launched). Three shims stand
in for what a CPU-only torch lacks: tensor indexing (Python's ``t[...]`` takes a CUDA device guard) goes through
the equivalent aten ops, the SM count is the H200's (132), and lm_head+CE runs without its side stream (the op's
``streams=False``). Autograd
cannot run on fake CUDA tensors, so the backward ops are called directly. Run as a script without
``TRITON_INTERPRET``; prints one JSON line: kernel signature and constexprs → "ok" or the error, and each
scenario whose wrapper failed after (or before) its launches: some torch ops on fake CUDA tensors need a CUDA
device guard that a CPU-only torch lacks. ``tests/kernels/test_sm90_compile.py`` runs it and checks that every
kernel of ``src/fuser/kernels`` was compiled, in bf16 among others.

The kernels that dispatch on an activation code are also compiled as Inductor launches them for an inlined op
(``FuserConfig.inline_ops``): from the source Inductor rebuilds out of the functions the kernel's code names
(``user_defined_triton_kernel_transitive_closure_source_code``), imported from a file of its own, once per
activation of the table, with the constexprs of a launch above (results ``inductor source: ...``).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import torch
import triton
from torch._library.custom_ops import CustomOpDef
from torch._subclasses.fake_tensor import FakeTensorMode
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

import fuser.kernels._triton as T
import fuser.kernels.bias_activation as BA
import fuser.kernels.embedding_grad as E
import fuser.kernels.gated_activation as G
import fuser.kernels.layer_norm as LN
import fuser.kernels.linear_cross_entropy as L
import fuser.kernels.lora_sum as LS
import fuser.kernels.rms_norm as R
import fuser.kernels.rope as P
import fuser.kernels.upcast_linear as U
from fuser.kernels.activations import ACTIVATIONS

H200_SMS = 132
NO_STREAMS = False  # lm_head+CE's ``streams``: a CPU-only torch has no CUDA streams
H200_SHARED_PER_BLOCK = 232448  # bytes: sharedMemPerBlockOptin of sm_90
OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")
DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int64: "i64",
          torch.int32: "i32", torch.int8: "i8", torch.bool: "i1", torch.uint8: "u8"}  # fmt: skip
results: dict[str, str] = {}
FP64_SCALARS = "fp64 scalars: "  # results of fp64_arithmetic, one per kernel with float arguments
INDUCTOR_SOURCE = "inductor source: "  # results of compile_as_inductor_rebuilds, one per kernel and activation
# the kernels taking an ACTIVATION code, each with the first launch's (signature, constexprs, attrs, options)
ACTIVATION_KERNELS: dict[str, tuple] = {}


def _specialize(param, value) -> tuple[str, str]:
    """(type, attribute) as Triton's launcher specializes an argument: a tensor whose address is 16-byte aligned
    (here: its storage offset; fake storages start at 0) and an int divisible by 16 get ``tt.divisibility`` 16 —
    which is what lets loads vectorise and pipeline (cp.async), so shared memory and registers match a real
    launch — and an int equal to 1 becomes a constexpr."""
    if isinstance(value, torch.Tensor):
        aligned = value.storage_offset() * value.element_size() % 16 == 0
        return "*" + DTYPES[value.dtype], "D" if aligned and not param.do_not_specialize_on_alignment else ""
    if isinstance(value, bool):
        return "i1", ""
    if isinstance(value, int):
        if param.do_not_specialize:
            return ("i32" if -(2**31) <= value < 2**31 else "i64"), ""
        kind, attr = native_specialize_impl(BaseBackend, value, False, True, True)
        return kind, attr or ""
    if isinstance(value, float):
        return "fp32", ""
    raise TypeError(f"argument {value!r}")


def compile_instead_of_launch(self: JITFunction, *args, grid, warmup, **kwargs):
    bound = self.signature.bind(*args, **{k: v for k, v in kwargs.items() if k not in OPTIONS})
    bound.apply_defaults()
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(self.params):
        value = bound.arguments[param.name]
        kind, attr = ("constexpr", "") if param.is_constexpr or value is None else _specialize(param, value)
        if kind == "constexpr":
            signature[param.name], constexprs[param.name] = "constexpr", value
        else:
            signature[param.name] = kind
            if attr == "D":
                attrs[(index,)] = [["tt.divisibility", 16]]
    options = {k: kwargs[k] for k in OPTIONS if k in kwargs}
    divisible = {self.params[i].name for (i,) in attrs}
    types = ", ".join(f"{k}={v}{'/16' * (k in divisible)}" for k, v in signature.items() if v != "constexpr")
    key = f"{self.fn.__name__}({types}) {dict(constexprs, **options)}"
    if key not in results:
        try:
            kernel = triton.compile(ASTSource(fn=self, signature=signature, constexprs=constexprs, attrs=attrs),
                                    target=GPUTarget("cuda", 90, 32), options=options)  # fmt: skip
            shared = kernel.metadata.shared
            # what an H200 block may use (227 KiB opt-in); more fails only at launch, with OutOfResources
            results[key] = "ok" if shared <= H200_SHARED_PER_BLOCK else f"OutOfResources: {shared} B shared memory"
        except Exception as error:  # noqa: BLE001 - every failure is a result
            results[key] = f"{type(error).__name__}: {str(error)[:400]}"
    if "ACTIVATION" in constexprs:
        ACTIVATION_KERNELS.setdefault(self.fn.__name__, (self, signature, constexprs, attrs, options))
    floats = [param.name for param in self.params if isinstance(bound.arguments[param.name], float)
              and signature[param.name] != "constexpr"]  # fmt: skip
    fp64_key = f"{FP64_SCALARS}{self.fn.__name__}"
    if floats and fp64_key not in results:
        results[fp64_key] = fp64_arithmetic(self, signature, constexprs, attrs, options, floats)


def fp64_arithmetic(kernel, signature, constexprs, attrs, options, floats) -> str:
    """The kernel compiled with its float scalars typed fp64, as Inductor's launcher types Python floats (an
    inlined op's kernel, ``FuserConfig.inline_ops``): "ok" when the only fp64 in its Triton IR are those arguments
    and their casts to fp32, else the first line that computes in fp64 (which a JIT launch, typing them fp32,
    never runs: on the H200 such a build of the RMSNorm backward took 1.7x the time)."""
    signature = {k: "fp64" if k in floats else v for k, v in signature.items()}
    try:
        ttir = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=options).asm["ttir"]  # fmt: skip
    except Exception as error:  # noqa: BLE001 - every failure is a result
        return f"{type(error).__name__}: {str(error)[:400]}"
    body = [line.strip() for line in ttir.splitlines() if "f64" in line and not line.lstrip().startswith("#loc")]
    wide = [line for line in body if not line.startswith("tt.func") and "arith.truncf" not in line]
    return "ok" if not wide else f"fp64 arithmetic: {wide[0][:300]}"


def compile_as_inductor_rebuilds() -> None:
    """Each kernel of ``ACTIVATION_KERNELS`` from the source Inductor writes for it, for every activation code."""
    with tempfile.TemporaryDirectory() as folder:
        for name, launch in sorted(ACTIVATION_KERNELS.items()):
            rebuilt, failure = None, ""
            try:
                rebuilt = rebuild_as_inductor(launch[0], Path(folder))
            except Exception as error:  # noqa: BLE001 - every failure is a result
                failure = f"{type(error).__name__}: {str(error)[:400]}"
            for code, activation in enumerate(ACTIVATIONS):
                key = f"{INDUCTOR_SOURCE}{name}({activation})"
                results[key] = failure if rebuilt is None else compile_activation(rebuilt, code, *launch[1:])


def rebuild_as_inductor(kernel: JITFunction, folder: Path) -> JITFunction:
    """``kernel`` from the source Inductor's wrapper writes for it, imported from a file, as Inductor's generated
    module imports it: Triton imported, the kernel's decorator written by the wrapper."""
    from torch._inductor.codegen.wrapper import user_defined_triton_kernel_transitive_closure_source_code

    name = kernel.fn.__name__
    source = "import triton\nimport triton.language as tl\n\n@triton.jit\n"
    path = folder / f"{name}.py"
    path.write_text(source + user_defined_triton_kernel_transitive_closure_source_code(kernel))
    spec = importlib.util.spec_from_file_location(f"inductor_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def compile_activation(kernel, code, signature, constexprs, attrs, options) -> str:
    try:
        ast = ASTSource(fn=kernel, signature=signature, constexprs={**constexprs, "ACTIVATION": code}, attrs=attrs)
        triton.compile(ast, target=GPUTarget("cuda", 90, 32), options=options)
    except Exception as error:  # noqa: BLE001 - every failure is a result
        return f"{type(error).__name__}: {str(error)[:400]}"
    return "ok"


def _aten_getitem(t: torch.Tensor, index):
    """``t[index]`` for ints, slices, Ellipsis and None through aten ops (no device guard)."""
    index = index if isinstance(index, tuple) else (index,)
    if Ellipsis in index:
        at = index.index(Ellipsis)
        fill = t.dim() - sum(i is not None for i in index if i is not Ellipsis)
        index = index[:at] + (slice(None),) * fill + index[at + 1 :]
    dim = 0
    for i in index:
        if i is None:
            t = torch.ops.aten.unsqueeze(t, dim)
            dim += 1
        elif isinstance(i, int):
            t = torch.ops.aten.select(t, dim, i)
        elif isinstance(i, slice):
            t = torch.ops.aten.slice(t, dim, i.start, i.stop, i.step or 1)
            dim += 1
        else:
            raise TypeError(f"index {i!r}")
    return t


def scenarios_for(dt: torch.dtype, ops: dict) -> dict:
    """Calls of every op's implementation (forward and backward ops) on fake CUDA tensors of ``dt``."""

    def t(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, device="cuda", dtype=dtype)

    rows, hidden, inter = 128, 256, 512
    x, w = t(2, rows, hidden, dtype=dt), t(hidden, dtype=dt)
    g, u = t(2, rows, inter, dtype=dt), t(2, rows, inter, dtype=dt)
    lora = t(2, rows, inter, dtype=torch.float32)
    q, k, cos = t(2, 8, rows, 64, dtype=dt), t(2, 2, rows, 64, dtype=dt), t(1, 1, rows, 64, dtype=dt)
    h, vocab_w = t(rows * 2, hidden, dtype=dt), t(32000, hidden, dtype=dt)
    labels = torch.zeros(rows * 2, device="cuda", dtype=torch.long)
    scenarios = {
        "rms_norm": lambda: ops["rms_norm_op"](x, w, 1e-6, 0.0, None, None),
        "rms_norm, fp32 norm, gemma offset": lambda: ops["rms_norm_op"](x, w, 1e-6, 1.0, torch.float32, dt),
        "rms_norm from the fp32 sum (x_wide)": lambda: ops["rms_norm_op"](
            x, w, 1e-6, 0.0, None, dt, t(2, rows, hidden, dtype=torch.float32)
        ),
        "rms_norm backward": lambda: ops["rms_norm_backward_op"](
            x, x, w, t(2, rows, dtype=torch.float32), 1e-6, 0.0, None, True
        ),
        "rms_norm backward, fp32 dx (to x_wide)": lambda: ops["rms_norm_backward_op"](
            x, x, w, t(2, rows, dtype=torch.float32), 1e-6, 0.0, None, True, torch.float32
        ),
        "add_rms_norm, fp32 residual": lambda: ops["add_rms_norm_op"](
            x, t(2, rows, hidden, dtype=torch.float32), w, 1e-6, 0.0, None, None
        ),
        "add_rms_norm backward (two stores)": lambda: ops["add_rms_norm_backward_op"](
            x, x, x, w, t(2, rows, dtype=torch.float32), 1e-6, 0.0, None, True, torch.float32
        ),
        "layer_norm": lambda: ops["layer_norm_op"](x, w, w, 1e-5, None),
        "layer_norm, no affine": lambda: ops["layer_norm_op"](x, None, None, 1e-5, None),
        # autocast: a half-precision x, fp32 weight and bias, an fp32 result
        "layer_norm, fp32 parameters and result": lambda: ops["layer_norm_op"](
            x, w.to(torch.float32), w.to(torch.float32), 1e-5, torch.float32
        ),
        "layer_norm backward": lambda: ops["layer_norm_backward_op"](
            x, x, w, t(2, rows, dtype=torch.float32), t(2, rows, dtype=torch.float32), True, True, dt
        ),
        "layer_norm backward, no weight or bias": lambda: ops["layer_norm_backward_op"](
            x, x, None, t(2, rows, dtype=torch.float32), t(2, rows, dtype=torch.float32), False, False, None
        ),
        "bias_activation, gelu, fp32 bias": lambda: ops["bias_activation_op"](
            g, t(inter, dtype=torch.float32), "gelu", None
        ),  # fmt: skip
        "bias_activation, relu2, no bias": lambda: ops["bias_activation_op"](g, None, "relu2", None),
        "bias_activation backward, gelu_new": lambda: ops["bias_activation_backward_op"](
            g, g, t(inter, dtype=dt), "gelu_tanh", True
        ),
        "bias_activation backward, quick gelu, no bias": lambda: ops["bias_activation_backward_op"](
            g, g, None, "gelu_quick", False
        ),
        "reglu": lambda: ops["gated_activation_op"](g, u, None, None, 1.0, 1.0, "relu"),
        "gated backward, relu2": lambda: ops["gated_activation_backward_op"](
            g, g, u, 1.0, 1.0, True, True, False, False, "relu2"
        ),
        "swiglu": lambda: ops["gated_activation_op"](g, u, None, None, 1.0, 1.0, "silu"),
        "geglu, fp32 LoRA terms": lambda: ops["gated_activation_op"](g, u, lora, lora, 2.0, 2.0, "gelu_tanh"),
        "gated backward": lambda: ops["gated_activation_backward_op"](
            g, g, u, 2.0, 2.0, True, True, True, True, "silu", torch.float32, torch.float32
        ),
        "gated packed": lambda: ops["gated_activation_packed_op"](
            t(2, rows, 2 * inter, dtype=dt), None, 1.0, "gelu"
        ),  # fmt: skip
        "gated packed backward": lambda: ops["gated_activation_packed_backward_op"](
            g, t(2, rows, 2 * inter, dtype=dt), 1.0, True, False, "silu"
        ),
        "rope": lambda: ops["rope_op"](q, k, cos, cos, 64, "half"),
        "rope interleaved, partial": lambda: ops["rope_op"](
            q, k, cos[..., :32], cos[..., :32], 32, "interleaved"
        ),  # fmt: skip
        "rope backward": lambda: ops["rope_backward_op"](q, k, cos, cos, 64, "half"),
        # autocast (half q/k, fp32 cos/sin, fp32 result) and issue 16 (fp32 q/k sums, half cos/sin and result)
        "rope, mixed dtypes": lambda: ops["rope_op"](
            q, k, cos.to(torch.float32), cos.to(torch.float32), 64, "half", torch.float32
        ),  # fmt: skip
        "rope, fp32 q/k into a half result": lambda: ops["rope_op"](
            q.to(torch.float32), k.to(torch.float32), cos, cos, 64, "half", dt
        ),  # fmt: skip
        "swiglu from the wide sums": lambda: ops["gated_activation_op"](
            g, u, None, None, 1.0, 1.0, "silu", lora, lora
        ),  # fmt: skip
        "linear_cross_entropy": lambda: ops["linear_cross_entropy_op"](
            h, vocab_w, None, labels, -100, "mean", 1.0, 0.0, True, True, False, "cublas", "input", NO_STREAMS
        ),
        "linear_cross_entropy, softcap, scale": lambda: ops["linear_cross_entropy_op"](
            h, vocab_w, None, labels, -100, "sum", 0.5, 30.0, True, True, False, "cublas", "input", NO_STREAMS
        ),
        "linear_cross_entropy, Triton dW kernel, two chunks": lambda: lce_with_triton_dweight(
            ops["linear_cross_entropy_op"], h, vocab_w, labels
        ),
        "linear_cross_entropy backward's scale": lambda: L._scale_inplace(
            t(rows * 2, hidden, dtype=dt), t((), dtype=torch.float32)
        ),
        "embedding_grad, tied lm_head's scaled gradient added": lambda: ops["embedding_grad_op"](
            t(2, rows, hidden, dtype=torch.float32),
            labels.view(2, rows),
            None,
            32000,
            dt,
            vocab_w,
            t((), dtype=torch.float32),
        ),
        "embedding_grad, masked ids, no base": lambda: ops["embedding_grad_op"](
            t(2, rows, hidden, dtype=torch.float32),
            labels.view(2, rows),
            t(2, rows, 1, dtype=torch.bool),
            32000,
            dt,
        ),
    }
    if dt != torch.float32:
        a32, b32, x32 = (
            t(16, hidden, dtype=torch.float32),
            t(hidden, 16, dtype=torch.float32),
            t(2, rows, 16, dtype=torch.float32),
        )
        scenarios |= {
            "upcast_linear": lambda: ops["upcast_linear_op"](x, a32, None),
            "upcast_linear grads": lambda: ops["upcast_linear_grads"](x32, x, a32, True, True),
            "upcast_linear_gated grads (recomputes x)": lambda: ops["upcast_linear_gated_grads"](
                x32, x, x, a32, 1.0, 1.0, "silu", True, True
            ),
            "lora_sum": lambda: ops["lora_sum_op"](x, x32, b32, 2.0, False),
            "lora_sum, QLoRA order": lambda: ops["lora_sum_op"](x, x32, b32, 2.0, True),
            "lora_sum grads": lambda: ops["lora_sum_grads"](x, x32, b32, 2.0, True, True),
            "lora_sum grads from an fp32 g": lambda: ops["lora_sum_grads"](
                t(2, rows, hidden, dtype=torch.float32), x32, b32, 2.0, True, True
            ),
            "lora_sum, fp32 out": lambda: ops["lora_sum_op"](x, x32, b32, 2.0, False, torch.float32),
            "lora_sum_wide (rounded and fp32 sums)": lambda: ops["lora_sum_wide_op"](x, x32, b32, 2.0),
        }
        # an adapter autocast rounded to the half dtype: the dots take both operands in it (native half dots)
        a16, b16, x16 = (v.to(dt) for v in (a32, b32, x32))
        scenarios |= {
            "upcast_linear, half adapter": lambda: ops["upcast_linear_op"](x, a16, None),
            "upcast_linear grads, half adapter": lambda: ops["upcast_linear_grads"](x16, x, a16, True, True),
            "lora_sum, half adapter": lambda: ops["lora_sum_op"](x, x16, b16, 2.0, False),
            "lora_sum grads, half adapter": lambda: ops["lora_sum_grads"](x, x16, b16, 2.0, True, True),
        }
    return scenarios


def lce_with_triton_dweight(op, h, w, labels) -> None:
    """lm_head+CE with ``dw_kernel="triton"`` and chunks of half the rows: both kernel variants."""
    saved = L.LOGITS_BUDGET_BYTES
    L.LOGITS_BUDGET_BYTES = h.shape[0] // 2 * w.shape[0] * h.element_size()
    try:
        op(h, w, None, labels, -100, "mean", 1.0, 0.0, True, True, False, "triton", "input", NO_STREAMS)
    finally:
        L.LOGITS_BUDGET_BYTES = saved


def main() -> None:
    JITFunction.run = compile_instead_of_launch
    T.num_programs_for = lambda t, programs_per_sm=4: programs_per_sm * H200_SMS
    for module in (BA, E, G, L, LN, LS, R, P, U):
        if hasattr(module, "num_programs_for"):
            module.num_programs_for = T.num_programs_for
    getitem = torch.Tensor.__getitem__
    torch.Tensor.__getitem__ = lambda t, index: _aten_getitem(t, index) if t.is_cuda else getitem(t, index)
    ops = {
        n: v._init_fn for m in (BA, E, G, L, LN, LS, R, P, U) for n, v in vars(m).items() if isinstance(v, CustomOpDef)
    }
    with FakeTensorMode(allow_non_fake_inputs=True):
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            for name, run in scenarios_for(dt, ops).items():
                try:
                    run()
                except Exception as error:  # noqa: BLE001 - a wrapper that cannot run on fake tensors is a result
                    results[f"scenario {name} {dt}"] = f"{type(error).__name__}: {str(error)[:400]}"
    torch.Tensor.__getitem__ = getitem
    compile_as_inductor_rebuilds()
    json.dump(results, sys.stdout)
    print()


if __name__ == "__main__":
    main()
