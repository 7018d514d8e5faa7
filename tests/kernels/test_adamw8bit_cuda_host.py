"""The CUDA 8-bit AdamW kernel's arithmetic, run on the CPU (no GPU needed).

csrc/cuda/adamw8bit.cu does all of its element work through adamw8bit_math.cuh
([Note: 8-bit step on CUDA, operation by operation]), which also compiles as plain C++.
q8_host_emulation.cpp calls those same functions in the kernel's layout (16 lanes x 8 elements per
block, the shuffle butterfly for the absmax). Built here with g++ -ffp-contract=off, it must equal
the reference backend and the CPU op bit for bit, over several steps on fresh random data.

Negative controls: lr x 1.01 is caught; and the same source built with -mfma -ffp-contract=fast
(the compiler fuses a*b + c, as nvcc's default -fmad=true would on the device without the __*_rn
intrinsics) no longer matches, so the bitwise check sees a single contraction.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from zerokern.kernels.adamw8bit import adamw8bit_step_
from zerokern.kernels.quant8 import BLOCK, code_map, midpoints, quantize

HERE = Path(__file__).resolve().parent
CSRC = HERE.parents[1] / "csrc"
CXX = shutil.which("g++") or shutil.which("c++")
HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05)
NAMES = ("master", "m_q", "m_absmax", "v_q", "v_absmax")

pytestmark = pytest.mark.skipif(CXX is None, reason="no host C++ compiler (g++/c++) on PATH")


def _build(tmp: Path, name: str, flags: list) -> ctypes.CDLL:
    so = tmp / f"{name}.so"
    cmd = [CXX, "-O2", "-std=c++17", "-shared", "-fPIC", *flags, f"-I{CSRC}",
           str(HERE / "q8_host_emulation.cpp"), "-o", str(so)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, " ".join(cmd) + "\n" + r.stdout + r.stderr
    lib = ctypes.CDLL(str(so))
    lib.zk_q8_emulate.restype = None
    lib.zk_q8_emulate.argtypes = ([ctypes.c_void_p] * 6 + [ctypes.c_int64, ctypes.c_void_p,
                                  ctypes.c_double, ctypes.c_float] + [ctypes.c_void_p] * 4)
    return lib


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("q8_host")
    return {"exact": _build(tmp, "exact", ["-ffp-contract=off"]),
            "fused": _build(tmp, "fused", ["-mfma", "-ffp-contract=fast"])}


def _emulate(lib, state, grad, step, grad_scale, hp):
    """One step of the emulated kernel, in place on `state` (CPU tensors)."""
    dev = torch.device("cpu")
    g = grad.float().contiguous()  # 16-bit -> fp32 is exact, as the kernel's load
    hp64 = torch.tensor([hp["lr"], hp["beta1"], hp["beta2"], hp["eps"], hp["weight_decay"]],
                        dtype=torch.float64)
    maps = [code_map(True, dev), code_map(False, dev), midpoints(True, dev),
            midpoints(False, dev)]
    lib.zk_q8_emulate(*[t.data_ptr() for t in state], g.data_ptr(), state[0].numel(),
                      hp64.data_ptr(), float(step) + 1.0, float(grad_scale),
                      *[t.data_ptr() for t in maps])


def _state(n):
    p = torch.randn(n)
    mq, ma = quantize(torch.randn(n) * torch.logspace(-5, 0, n)[torch.randperm(n)], True)
    vq, va = quantize(torch.rand(n) * torch.logspace(-8, 0, n)[torch.randperm(n)], False)
    state = [p, mq, ma, vq, va]
    # one all-zero block (absmax 0: divides by 1) that stays zero: zero grad, zero master
    for t, z in ((p, slice(BLOCK, 2 * BLOCK)), (mq, slice(BLOCK, 2 * BLOCK)),
                 (vq, slice(BLOCK, 2 * BLOCK)), (ma, slice(1, 2)), (va, slice(1, 2))):
        t[z] = 0
    return state


def _grads(n, dtype, steps):
    out = []
    for _ in range(steps):
        g = torch.randn(n) * torch.logspace(-4, 1, n)[torch.randperm(n)]
        g[BLOCK:2 * BLOCK] = 0
        out.append(g.to(dtype))
    return out


def _steps(lib_or_backend, state, grads, hp, gs=0.5, step0=3):
    state = [t.clone() for t in state]
    for k, g in enumerate(grads):
        if isinstance(lib_or_backend, str):
            adamw8bit_step_(*state, g, None, **hp, step=torch.tensor(step0 + k),
                            grad_scale=torch.tensor(gs), found_inf=torch.tensor(False),
                            backend=lib_or_backend)
        else:
            _emulate(lib_or_backend, state, g, step0 + k, gs, hp)
    return state


def _mismatches(a, b):
    return {name: int((x != y).sum()) for name, x, y in zip(NAMES, a, b) if not torch.equal(x, y)}


@pytest.mark.parametrize("gdt", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
def test_kernel_arithmetic_equals_reference_and_cpu_op_bitwise(libs, gdt):
    n = BLOCK * 61
    state, grads = _state(n), _grads(n, gdt, 4)
    want = _steps("reference", state, grads, HP)
    got = _steps(libs["exact"], state, grads, HP)
    assert _mismatches(want, got) == {}
    assert _mismatches(_steps("cpu", state, grads, HP), got) == {}
    # the step really moved the state, and the zero block stayed exactly zero
    assert not torch.equal(got[1], state[1]) and not torch.equal(got[4], state[4])
    assert float(got[2][1]) == 0.0 and not got[0][BLOCK:2 * BLOCK].any()


def test_negative_control_lr_off_by_one_percent(libs):
    n = BLOCK * 16
    state, grads = _state(n), _grads(n, torch.float32, 2)
    want = _steps("reference", state, grads, HP)
    got = _steps(libs["exact"], state, grads, dict(HP, lr=HP["lr"] * 1.01))
    assert "master" in _mismatches(want, got)


def test_negative_control_fused_multiply_add_is_caught(libs):
    """The same functions with a*b + c contracted: the bitwise comparison must fail."""
    n = BLOCK * 16
    state, grads = _state(n), _grads(n, torch.float32, 2)
    want = _steps("reference", state, grads, HP)
    bad = _mismatches(want, _steps(libs["fused"], state, grads, HP))
    assert "master" in bad, bad


def test_nan_inf_and_midpoint_edge_values_equal_the_reference(libs):
    """NaN/inf grads, -0.0, moments exactly on a midpoint, a zero block: a NaN moment gives code
    255 and a NaN absmax as the reference's torch.bucketize/amax (the header used to give 0)."""
    from .test_adamw8bit_cpu_isa import _edge_case

    state, grads = _edge_case()
    want = _steps("reference", state, grads, HP)
    got = _steps(libs["exact"], state, grads, HP)
    bits = [t.view(torch.int32) if t.dtype == torch.float32 else t for t in want]
    gbits = [t.view(torch.int32) if t.dtype == torch.float32 else t for t in got]
    assert _mismatches(bits, gbits) == {}
    assert int(got[1][5]) == 255 and torch.isnan(got[2][0])
