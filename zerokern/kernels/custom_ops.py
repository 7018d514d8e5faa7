"""zerokern's kernels as torch custom ops (`torch.ops.zerokern.*`), with fake implementations.

[Note: kernels as custom ops] (issue 34, item 1)
Every kernel that launches Triton or a native op is one op here: a schema, the real impl (which
calls the backend code the public entry points always called: kernels/__init__.py, adamw8bit.py,
lion.py, blockquant.py, compact_triton.py) and a fake impl. Under FakeTensorMode, and while
torch.compile traces, the fake impl runs instead of the kernel: it checks what the kernel would
rely on (dtypes, sizes, and that every tensor is on the data's device, so a wrong-device tensor
is caught without a GPU) and writes nothing; the ops that make tensors return empty ones of the
right shape, dtype and device. So an optimizer step over fake `cuda` tensors runs on a CPU-only
machine without a Triton launch, and torch.compile sees one opaque op per kernel call.

Ops (`backend` is the concrete backend the entry point resolved: "reference", "triton",
"cuda" or "cpu"; the real impl runs it, the fake impl ignores it):
    adam_step_(Tensor(a!) master, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, Tensor grad,
        Tensor(d!)? param_out, float[] hyper, Tensor?[] hyper_t, bool adamw, Tensor(e!) step,
        Tensor grad_scale, Tensor found_inf, str backend) -> ()
    grad_stats_(Tensor grad, Tensor(a!) found_inf, Tensor(b!) sumsq, str backend) -> ()
    adamw8bit_step_(Tensor(a!) master, Tensor(b!) m_q, Tensor(c!) m_absmax, Tensor(d!) v_q,
        Tensor(e!) v_absmax, Tensor grad, Tensor(f!)? param_out, float[] hyper,
        Tensor?[] hyper_t, Tensor(g!) step, Tensor grad_scale, Tensor found_inf,
        str backend) -> ()
    lion_step_(Tensor(a!) master, Tensor(b!) exp_avg, Tensor grad, Tensor(c!)? param_out,
        float[] hyper, Tensor?[] hyper_t, Tensor(d!) step, Tensor grad_scale,
        Tensor found_inf, str backend) -> ()
    compact_adam_step_(Tensor(a!) low, Tensor(b!) ties, Tensor(c!) param, Tensor(d!) exp_avg,
        Tensor(e!) exp_avg_sq, Tensor grad, Tensor(f!) nan, float[] hyper, Tensor?[] hyper_t,
        bool adamw, Tensor(g!) step, Tensor grad_scale, Tensor found_inf) -> ()   (Triton only)
    blockquant_quantize(Tensor x, int block, int bits, str backend) -> (Tensor, Tensor)
    blockquant_dequantize(Tensor codes, Tensor scale, int block, int bits,
        ScalarType dtype, str backend) -> Tensor
The cast-back has no op of its own: it is the step kernels' param_out.

Hyperparameters (lr, betas, eps, weight_decay) are each a float or a 0-d tensor. A schema has no
"float or tensor" type, so `hyper_args` splits them into two lists of the same length: hyper[i]
is the float (0.0 where the value is a tensor) and hyper_t[i] the tensor (None where it is a
number). The real impl rebuilds each value as it was given (`rebuild`) and hands it to the same
backend code as before, so the numerics are untouched (bit for bit: a number goes through
float(), which every backend applied to it anyway; a tensor is passed as it is, so a CPU tensor
is still read on the host by the backend and a device tensor still read on the device). Nothing
here reads a tensor's value: no host sync and no host-to-device copy is added.

Registration: `torch.library.Library("zerokern", "DEF")`, a schema string per op, the real
impl as its CompositeExplicitAutograd kernel and `torch.library.register_fake`, rather than the
`torch.library.custom_op` decorator. Measured (torch 2.13, one thread, no-op impls with the
adam_step_ schema, median of 2000 calls): 48 us a call through a custom_op, 4 us through the
Library op. custom_op adds Python kernels at the Autograd and ADInplaceOrView keys, and the
latter rebuilds the schema's argument list once per argument (utils.fill_defaults): 12
arguments, 144 pybind objects a call. The Library op also leaves the version counters as they
were (the kernels write through pointers and never bumped them; model_sync.py reads params'
counters to see outside writes), where custom_op bumps every mutated argument's.

Routing (`use_op`, ~0.15 us): the op still costs ~9 us a call over calling the backend directly
(a CPU adam_step_ of 2^16 elements on the cpu backend, one thread, median of 15 x 200 calls:
27.1 us native.adam_step_, 35.8 us torch.ops.zerokern.adam_step_). So the entry points take the
op only where it is needed: tensors off the CPU (the GPU kernels, whose launches cost more),
tensor subclasses (FakeTensor, FunctionalTensor: the fake impl must run, and a native CPU op
must never see a FakeTensor's null data pointer), and while torch.compile traces (the op is what
it traces). Real CPU tensors in eager mode call the backend directly, as before: the public
adam_step_ there measured 44-46 us before this change and 44-46 us after (4 interleaved runs of
20 x 200 calls each, noise ~1.5 us on the shared VM).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .op_routing import _Tensor, hyper_args, rebuild, use_op  # noqa: F401 (re-exported)
from .validate import (
    FOUND_INF_DTYPES,
    GRAD_DTYPES,
    OUT_DTYPES,
    STEP_DTYPES,
    SUMSQ_DTYPES,
    check_adam_buffers,
    check_blockquant,
    check_buffer,
    check_scalar_tensor,
)

# ------------------------------------------------------------------ fake-side checks --------

def _check_hyper_t(hyper: Sequence[float], hyper_t, dev: torch.device, names) -> None:
    if len(hyper) != len(names) or len(hyper_t) != len(names):
        raise ValueError(f"expected {len(names)} hyperparameters ({', '.join(names)}), got "
                         f"{len(hyper)} floats and {len(hyper_t)} tensors")
    for name, t in zip(names, hyper_t):
        if t is None:
            continue
        if t.dim() != 0 or not t.dtype.is_floating_point:
            raise TypeError(f"{name} tensor must be a 0-d floating tensor, got shape "
                            f"{tuple(t.shape)} dtype {t.dtype}")
        if t.device != dev and t.device.type != "cpu":
            raise ValueError(f"{name} is on {t.device} but the data is on {dev}")


def _check_step_scalars(dev: torch.device, step, grad_scale, found_inf) -> None:
    check_scalar_tensor("step", step, STEP_DTYPES, dev)
    check_scalar_tensor("grad_scale", grad_scale, (torch.float32,), dev)
    check_scalar_tensor("found_inf", found_inf, FOUND_INF_DTYPES, dev)


# ------------------------------------------------------------------ registration ----------

_LIB = torch.library.Library("zerokern", "DEF")


def _op(schema: str):
    """Define zerokern::<schema> with the decorated function as its kernel on every device
    (CompositeExplicitAutograd: no autograd formula; nothing here is differentiated)."""

    def register(fn):
        _LIB.define(schema, tags=(torch.Tag.pt2_compliant_tag,))
        _LIB.impl(schema.split("(", 1)[0], fn, "CompositeExplicitAutograd")
        return fn

    return register


def _fake(name: str):
    """Register the decorated function as zerokern::<name>'s fake impl."""

    def register(fn):
        torch.library.register_fake(f"zerokern::{name}", fn, lib=_LIB)
        return fn

    return register


_ADAM_HYPER = ("lr", "beta1", "beta2", "eps", "weight_decay")
_LION_HYPER = ("lr", "beta1", "beta2", "weight_decay")


# ------------------------------------------------------------------ Adam step ---------------

@_op("adam_step_(Tensor(a!) master, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, Tensor grad, "
     "Tensor(d!)? param_out, float[] hyper, Tensor?[] hyper_t, bool adamw, Tensor(e!) step, "
     "Tensor grad_scale, Tensor found_inf, str backend) -> ()")
def adam_step_(master, exp_avg, exp_avg_sq, grad, param_out, hyper, hyper_t, adamw, step,
               grad_scale, found_inf, backend) -> None:
    lr, beta1, beta2, eps, weight_decay = rebuild(hyper, hyper_t)
    kw = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, adamw=adamw,
              step=step, grad_scale=grad_scale, found_inf=found_inf)
    if backend == "reference":
        from . import reference

        reference.adam_step_(master, exp_avg, exp_avg_sq, grad, param_out, **kw)
    elif backend == "triton":
        from . import triton_kernels

        triton_kernels.adam_step_(master, exp_avg, exp_avg_sq, grad, param_out, **kw)
    else:
        from . import native

        native.adam_step_(backend, master, exp_avg, exp_avg_sq, grad, param_out, **kw)


@_fake("adam_step_")
def _(master, exp_avg, exp_avg_sq, grad, param_out, hyper, hyper_t, adamw, step, grad_scale,
      found_inf, backend) -> None:
    dev, _ = check_adam_buffers(master, exp_avg, exp_avg_sq, grad, param_out)
    _check_step_scalars(dev, step, grad_scale, found_inf)
    _check_hyper_t(hyper, hyper_t, dev, _ADAM_HYPER)


# ------------------------------------------------------------------ grad stats --------------

@_op("grad_stats_(Tensor grad, Tensor(a!) found_inf, Tensor(b!) sumsq, str backend) -> ()")
def grad_stats_(grad, found_inf, sumsq, backend) -> None:
    if backend == "reference":
        from . import reference

        reference.grad_stats_(grad, found_inf, sumsq)
    elif backend == "triton":
        from . import triton_kernels

        triton_kernels.grad_stats_(grad.reshape(-1), found_inf, sumsq)
    else:
        from . import native

        native.grad_stats_(backend, grad.reshape(-1), found_inf, sumsq)


@_fake("grad_stats_")
def _(grad, found_inf, sumsq, backend) -> None:
    check_buffer("grad", grad, GRAD_DTYPES, None, None)
    check_scalar_tensor("found_inf", found_inf, FOUND_INF_DTYPES, grad.device)
    check_scalar_tensor("sumsq", sumsq, SUMSQ_DTYPES, grad.device)


# ------------------------------------------------------------------ 8-bit AdamW -------------

@_op("adamw8bit_step_(Tensor(a!) master, Tensor(b!) m_q, Tensor(c!) m_absmax, "
     "Tensor(d!) v_q, Tensor(e!) v_absmax, Tensor grad, Tensor(f!)? param_out, float[] hyper, "
     "Tensor?[] hyper_t, Tensor(g!) step, Tensor grad_scale, Tensor found_inf, "
     "str backend) -> ()")
def adamw8bit_step_(master, m_q, m_absmax, v_q, v_absmax, grad, param_out, hyper, hyper_t,
                    step, grad_scale, found_inf, backend) -> None:
    from . import adamw8bit as A

    lr, beta1, beta2, eps, weight_decay = rebuild(hyper, hyper_t)
    kw = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step,
              grad_scale=grad_scale, found_inf=found_inf)
    args = (master, m_q, m_absmax, v_q, v_absmax, grad, param_out)
    if backend == "reference":
        A.reference_adamw8bit_step_(*args, **kw)
    elif backend == "triton":
        from . import triton_adamw8bit

        triton_adamw8bit.adamw8bit_step_(*args, **kw)
    else:
        A._native_adamw8bit_step_(backend, *args, **kw)


@_fake("adamw8bit_step_")
def _(master, m_q, m_absmax, v_q, v_absmax, grad, param_out, hyper, hyper_t, step, grad_scale,
      found_inf, backend) -> None:
    from .quant8 import BLOCK

    check_buffer("master", master, (torch.float32,), None, None)
    dev, n = master.device, master.numel()
    if n % BLOCK:
        raise ValueError(f"master must have a multiple of {BLOCK} elements (whole quantization "
                         f"blocks), got {n}")
    check_buffer("m_q", m_q, (torch.uint8,), dev, n)
    check_buffer("v_q", v_q, (torch.uint8,), dev, n)
    check_buffer("m_absmax", m_absmax, (torch.float32,), dev, n // BLOCK)
    check_buffer("v_absmax", v_absmax, (torch.float32,), dev, n // BLOCK)
    check_buffer("grad", grad, GRAD_DTYPES, dev, n)
    if param_out is not None:
        check_buffer("param_out", param_out, OUT_DTYPES, dev, n)
    _check_step_scalars(dev, step, grad_scale, found_inf)
    _check_hyper_t(hyper, hyper_t, dev, _ADAM_HYPER)


# ------------------------------------------------------------------ Lion --------------------

@_op("lion_step_(Tensor(a!) master, Tensor(b!) exp_avg, Tensor grad, Tensor(c!)? param_out, "
     "float[] hyper, Tensor?[] hyper_t, Tensor(d!) step, Tensor grad_scale, Tensor found_inf, "
     "str backend) -> ()")
def lion_step_(master, exp_avg, grad, param_out, hyper, hyper_t, step, grad_scale, found_inf,
               backend) -> None:
    from . import lion as L

    lr, beta1, beta2, weight_decay = rebuild(hyper, hyper_t)
    kw = dict(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, step=step,
              grad_scale=grad_scale, found_inf=found_inf)
    if backend == "reference":
        L.reference_lion_step_(master, exp_avg, grad, param_out, **kw)
    elif backend == "triton":
        from . import triton_lion

        triton_lion.lion_step_(master, exp_avg, grad, param_out, **kw)
    else:
        L._native_lion_step_(backend, master, exp_avg, grad, param_out, **kw)


@_fake("lion_step_")
def _(master, exp_avg, grad, param_out, hyper, hyper_t, step, grad_scale, found_inf,
      backend) -> None:
    check_buffer("master", master, (torch.float32,), None, None)
    dev, n = master.device, master.numel()
    check_buffer("exp_avg", exp_avg, (torch.float32,), dev, n)
    check_buffer("grad", grad, GRAD_DTYPES, dev, n)
    if param_out is not None:
        check_buffer("param_out", param_out, OUT_DTYPES, dev, n)
    _check_step_scalars(dev, step, grad_scale, found_inf)
    _check_hyper_t(hyper, hyper_t, dev, _LION_HYPER)


# ------------------------------------------------------------------ compact master ----------

@_op("compact_adam_step_(Tensor(a!) low, Tensor(b!) ties, Tensor(c!) param, "
     "Tensor(d!) exp_avg, Tensor(e!) exp_avg_sq, Tensor grad, Tensor(f!) nan, float[] hyper, "
     "Tensor?[] hyper_t, bool adamw, Tensor(g!) step, Tensor grad_scale, "
     "Tensor found_inf) -> ()")
def compact_adam_step_(low, ties, param, exp_avg, exp_avg_sq, grad, nan, hyper, hyper_t, adamw,
                       step, grad_scale, found_inf) -> None:
    from . import compact_triton

    lr, beta1, beta2, eps, weight_decay = rebuild(hyper, hyper_t)
    compact_triton.compact_adam_step_(low, ties, param, exp_avg, exp_avg_sq, grad, nan, lr=lr,
                                      beta1=beta1, beta2=beta2, eps=eps,
                                      weight_decay=weight_decay, adamw=adamw, step=step,
                                      grad_scale=grad_scale, found_inf=found_inf)


@_fake("compact_adam_step_")
def _(low, ties, param, exp_avg, exp_avg_sq, grad, nan, hyper, hyper_t, adamw, step, grad_scale,
      found_inf) -> None:
    check_buffer("low", low, (torch.int16,), None, None)
    dev, n = low.device, low.numel()
    if n % 8:
        raise ValueError(f"compact step: low must have a multiple of 8 elements, got {n}")
    check_buffer("ties", ties, (torch.uint8,), dev, n // 8)
    check_buffer("param", param, (torch.bfloat16,), dev, n)
    check_buffer("exp_avg", exp_avg, (torch.float32,), dev, n)
    check_buffer("exp_avg_sq", exp_avg_sq, (torch.float32,), dev, n)
    check_buffer("grad", grad, GRAD_DTYPES, dev, n)
    check_scalar_tensor("nan", nan, (torch.bool,), dev)
    _check_step_scalars(dev, step, grad_scale, found_inf)
    _check_hyper_t(hyper, hyper_t, dev, _ADAM_HYPER)


# ------------------------------------------------------------------ block quantization ------

_BQ_IN = (torch.float32, torch.bfloat16, torch.float16)


@_op("blockquant_quantize(Tensor x, int block, int bits, str backend) -> (Tensor, Tensor)")
def blockquant_quantize(x, block, bits, backend):
    from . import blockquant as B

    if backend == "triton":
        from . import triton_blockquant

        return triton_blockquant.quantize(x, block, bits)
    if backend == "cpu":
        from .build import load_op

        check_blockquant(x, block, bits)
        return B.NativeCodec(load_op("cpu")).quantize_now(x, block, bits)
    return B.quantize(x, block, bits)


@_fake("blockquant_quantize")
def _(x, block, bits, backend):
    check_blockquant(x, block, bits)
    if x.dtype not in _BQ_IN:
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    n = x.numel()
    codes = x.new_empty(n if bits == 8 else n // 2,
                        dtype=torch.int8 if bits == 8 else torch.uint8)
    scale = x.new_empty(n // block, dtype=torch.float32)
    return codes, scale


@_op("blockquant_dequantize(Tensor codes, Tensor scale, int block, int bits, "
     "ScalarType dtype, str backend) -> Tensor")
def blockquant_dequantize(codes, scale, block, bits, dtype, backend):
    from . import blockquant as B

    if backend == "triton":
        from . import triton_blockquant

        return triton_blockquant.dequantize(codes, scale, block, bits, dtype)
    if backend == "cpu":
        from .build import load_op

        return B.NativeCodec(load_op("cpu")).dequantize_now(codes, scale, block, bits, dtype)
    return B.dequantize(codes, scale, block, bits, dtype)


@_fake("blockquant_dequantize")
def _(codes, scale, block, bits, dtype, backend):
    if bits not in (4, 8):
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    if dtype not in _BQ_IN:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    want = torch.int8 if bits == 8 else torch.uint8
    if codes.dtype != want or codes.dim() != 1 or scale.dim() != 1:
        raise TypeError(f"codes must be 1-D {want} and scale 1-D float32 for bits={bits}, got "
                        f"{codes.dtype} {tuple(codes.shape)} and {tuple(scale.shape)}")
    if scale.dtype != torch.float32:
        raise TypeError(f"scale must be float32, got {scale.dtype}")
    if scale.device != codes.device:
        raise ValueError(f"scale is on {scale.device} but codes are on {codes.device}")
    n = scale.numel() * block
    if codes.numel() * (8 // bits) != n:
        raise ValueError(f"codes hold {codes.numel() * (8 // bits)} values but scale "
                         f"describes {n} (block={block})")
    return codes.new_empty(n, dtype=dtype)
