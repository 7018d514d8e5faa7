"""Input validation for the kernel entry points.

Every rule raises before any write (DESIGN §1 "Errors on bad input"), and every message names the
argument and what is allowed. Nothing here reads a device value: a CUDA tensor's contents are never
inspected (that would be a host sync), only its metadata.
"""

from __future__ import annotations

import numbers
from typing import Optional, Union

import torch
from torch._subclasses.fake_tensor import is_fake

Scalar = Union[float, int, torch.Tensor]

GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
OUT_DTYPES = (torch.float16, torch.bfloat16)
STEP_DTYPES = (torch.int64, torch.int32, torch.float32, torch.float64)
FOUND_INF_DTYPES = (torch.bool, torch.float32)
SUMSQ_DTYPES = (torch.float32, torch.float64)
BACKENDS = ("auto", "reference", "triton", "cuda", "cpu")


def _names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_buffer(name: str, t, dtypes, device: Optional[torch.device],
                 numel: Optional[int]) -> None:
    """A flat data buffer: a dense contiguous tensor of an allowed dtype, device and size."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in ({_names(dtypes)}), got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (flat shard buffers are)")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but master is on {device}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements but master has {numel}")


def check_scalar_tensor(name: str, t, dtypes, device: torch.device) -> None:
    """A per-step scalar kept on the device (step, grad_scale, found_inf, sumsq): a 0-d tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a 0-d torch.Tensor on {device}, got {type(t).__name__}")
    if t.dim() != 0:
        raise ValueError(f"{name} must be a 0-d tensor, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in ({_names(dtypes)}), got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the data is on {device}")


def check_hyper(name: str, x: Scalar, device: torch.device, lo: float, hi: float,
                lo_open: bool = False, hi_open: bool = False) -> None:
    """A hyperparameter: a real number, or a 0-d floating tensor on the data's device.

    The range is checked for numbers and for CPU tensors; a CUDA tensor's value is not read
    (that would sync the host), so its range is the caller's responsibility.
    """
    if isinstance(x, bool):
        raise TypeError(f"{name} must be a float or a 0-d tensor, got bool")
    if isinstance(x, torch.Tensor):
        if x.dim() != 0 or not x.dtype.is_floating_point:
            raise TypeError(f"{name} tensor must be a 0-d floating tensor, got shape "
                            f"{tuple(x.shape)} dtype {x.dtype}")
        if x.device != device and x.device.type != "cpu":
            raise ValueError(f"{name} is on {x.device} but the data is on {device}")
        if x.device.type != "cpu":
            return
        value = float(x)
    elif isinstance(x, numbers.Real):
        value = float(x)
    else:
        raise TypeError(f"{name} must be a float or a 0-d tensor, got {type(x).__name__}")
    bad_lo = value <= lo if lo_open else value < lo
    bad_hi = value >= hi if hi_open else value > hi
    if value != value or bad_lo or bad_hi:
        lb = "(" if lo_open else "["
        hb = ")" if hi_open else "]"
        raise ValueError(f"{name} must be in {lb}{lo}, {hi}{hb}, got {value}")


def check_backend(backend) -> None:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def check_adam_buffers(master, exp_avg, exp_avg_sq, grad, param_out):
    """The five buffers of an Adam step (dtypes, one device, one size); returns (device, n)."""
    check_buffer("master", master, (torch.float32,), None, None)
    dev, n = master.device, master.numel()
    check_buffer("exp_avg", exp_avg, (torch.float32,), dev, n)
    check_buffer("exp_avg_sq", exp_avg_sq, (torch.float32,), dev, n)
    check_buffer("grad", grad, GRAD_DTYPES, dev, n)
    if param_out is not None:
        check_buffer("param_out", param_out, OUT_DTYPES, dev, n)
    return dev, n


def check_adam_args(master, exp_avg, exp_avg_sq, grad, param_out, *, lr, beta1, beta2, eps,
                    weight_decay, adamw, step, grad_scale, found_inf) -> None:
    """Validate `adam_step_` arguments. Raises TypeError/ValueError naming the argument."""
    dev, n = check_adam_buffers(master, exp_avg, exp_avg_sq, grad, param_out)
    # The kernels update in place element by element (and the CUDA kernel reads grad through
    # the read-only cache): overlapping buffers would be read after write.
    bufs = {"master": master, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "grad": grad}
    if param_out is not None:
        bufs["param_out"] = param_out
    check_no_overlap(bufs)
    check_scalar_tensor("step", step, STEP_DTYPES, dev)
    check_scalar_tensor("grad_scale", grad_scale, (torch.float32,), dev)
    check_scalar_tensor("found_inf", found_inf, FOUND_INF_DTYPES, dev)
    inf = float("inf")
    check_hyper("lr", lr, dev, 0.0, inf, hi_open=True)
    check_hyper("beta1", beta1, dev, 0.0, 1.0, hi_open=True)
    check_hyper("beta2", beta2, dev, 0.0, 1.0, hi_open=True)
    check_hyper("eps", eps, dev, 0.0, inf, lo_open=True, hi_open=True)
    check_hyper("weight_decay", weight_decay, dev, 0.0, inf, hi_open=True)
    if not isinstance(adamw, bool):
        raise TypeError(f"adamw must be a bool, got {type(adamw).__name__}")


def check_grad_stats_args(grad, found_inf, sumsq) -> None:
    """Validate `grad_stats_` arguments."""
    check_buffer("grad", grad, GRAD_DTYPES, None, None)
    check_scalar_tensor("found_inf", found_inf, FOUND_INF_DTYPES, grad.device)
    check_scalar_tensor("sumsq", sumsq, SUMSQ_DTYPES, grad.device)


def _span(t: torch.Tensor):
    """(address space, first byte, end byte) of t's elements, or None (meta: no memory).

    A real tensor: its data pointers. A fake one (FakeTensorMode, where the kernels' fake impls
    run, custom_ops.py) has no pointers (data_ptr() is 0 for every tensor): its storage stands
    in as the address space and its storage offset as the address, so views of one fake
    buffer that overlap are still caught."""
    if t.device.type == "meta":
        return None
    nbytes = t.numel() * t.element_size()
    if type(t) is torch.Tensor or not is_fake(t):
        lo = t.data_ptr()
        return None, lo, lo + nbytes
    lo = t.storage_offset() * t.element_size()
    return t.untyped_storage()._cdata, lo, lo + nbytes


def check_no_overlap(bufs: dict) -> None:
    """ValueError naming two of `bufs` (name -> tensor) that share memory: the kernels update in
    place element by element, so an overlap would be read after write. Meta tensors have none;
    under torch.compile there are no pointers to compare (the check is not traced)."""
    if torch.compiler.is_compiling():
        return
    spans = []
    for name, t in bufs.items():
        span = _span(t) if t.numel() else None
        if span is not None:
            spans.append((*span, name))
    for i, (sp, lo, hi, name) in enumerate(spans):
        for sp2, lo2, hi2, name2 in spans[:i]:
            if sp == sp2 and lo < hi2 and lo2 < hi:
                raise ValueError(f"{name} overlaps {name2} in memory; each buffer must be "
                                 "distinct")


# Block quantization (blockquant.py, triton_blockquant.py): the largest code per bit width and
# the block sizes (each divides the 128-element pieces).
BITS_Q = {8: 127, 4: 7}
BLOCKS = (32, 64, 128)


def check_blockquant(x: torch.Tensor, block: int, bits: int) -> None:
    """Block quantization arguments (blockquant.py): ValueError naming the bad one."""
    if bits not in BITS_Q:
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    if block not in BLOCKS:
        raise ValueError(f"block must be one of {BLOCKS} (divides the 128-element pieces), "
                         f"got {block}")
    if x.ndim != 1 or x.numel() % block:
        raise ValueError(f"x must be 1-D with a multiple of block={block} elements, "
                         f"got shape {tuple(x.shape)}")
