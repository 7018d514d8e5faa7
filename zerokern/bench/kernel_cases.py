"""What the kernel microbenchmarks measure: the cases, the providers, the byte floors, the
targets and the timed-row record, shared by the measuring side (kernels.py) and the rendering
side (kernels_report.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from zerokern import kernels
from zerokern.options.args import PRECISIONS as DTYPES  # the precision names and dtypes

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
ZK_BACKENDS = ("cpu", "triton", "cuda", "reference")
TORCH_PROVIDERS = ("torch-fused", "torch-foreach", "torch-norm")
PROVIDERS = ZK_BACKENDS + TORCH_PROVIDERS
# The reference backend allocates ~10 temporaries and makes as many passes; beyond 2^22 it only
# slows the run down, so it is timed there only when asked for by name.
REFERENCE_MAX_LOG2 = 22
TARGET_CPU_MIXED = 1.3  # cpu backend vs torch mixed fused path, bf16, at 2^24 and 2^26
TARGET_CPU_FP32 = 1.0   # cpu backend vs AdamW(fused=True), fp32
TARGET_GPU_COPY = 0.90  # adam_step_ fraction of copy bandwidth at >= 2^28


def adam_bytes(grad_dtype: torch.dtype, param_out_dtype: torch.dtype | None) -> int:
    """Byte floor per element of one adam_step_: master, m, v read and written (24) + grad read
    + param_out written."""
    po = param_out_dtype.itemsize if param_out_dtype is not None else 0
    return 24 + grad_dtype.itemsize + po


@dataclass(frozen=True)
class Case:
    name: str                    # "bf16" | "fp16" | "fp32"
    grad_dtype: torch.dtype
    param_out_dtype: torch.dtype | None

    @property
    def mixed(self) -> bool:
        return self.param_out_dtype is not None

    def describe(self) -> str:
        g, total = self.name, adam_bytes(self.grad_dtype, self.param_out_dtype)
        if self.mixed:
            return (f"{g} grad + {g} param_out: read master, m, v (12) + grad (2), write master, "
                    f"m, v (12) + param_out (2) = {total} B/elem")
        return (f"{g} grad, no param_out: read master, m, v, grad (16), write master, m, v (12) "
                f"= {total} B/elem")


def make_case(name: str) -> Case:
    dt = DTYPES[name]
    return Case(name, dt, dt if dt != torch.float32 else None)


@dataclass
class Timed:
    """One timed callable and how its row is labelled."""

    op: str                      # "adam_step_" | "grad_stats_" | "ceiling"
    case: str
    provider: str
    bytes_per_elem: int
    fn: Callable[[], None]
    baseline: str | None = None  # provider whose time this row's speedup is relative to

    @property
    def key(self) -> str:
        return f"{self.op}/{self.case}/{self.provider}"


def _zk_adam(backend: str, master, m, v, grad, param_out, device) -> Callable[[], None]:
    step = torch.ones((), dtype=torch.int64, device=device)  # one step already taken
    grad_scale = torch.ones((), dtype=torch.float32, device=device)
    found_inf = torch.zeros((), dtype=torch.bool, device=device)
    b1, b2 = HYPER["betas"]
    kw = dict(lr=HYPER["lr"], beta1=b1, beta2=b2, eps=HYPER["eps"],
              weight_decay=HYPER["weight_decay"], step=step, grad_scale=grad_scale,
              found_inf=found_inf, backend=backend)

    def fn():
        kernels.adam_step_(master, m, v, grad, param_out, **kw)

    fn()  # builds / compiles the backend now, outside the timed reps
    return fn
