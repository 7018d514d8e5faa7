"""lion_step_ (zerokern.kernels.lion) on every backend runnable here against a float64 model of
Lion (lion-pytorch's update; the skip / step / cast-back contract of DESIGN §3).

Backends: reference, cpu (csrc/cpu/lion_cpu.cpp) and triton (the interpreter on CPU tensors);
the CUDA kernel is compile-checked by test_nvcc_compile_lion below and run by the `gpu` tests.
Fresh random data per test (log-uniform magnitudes, random signs: never zeros).

Negative control: a kernel run with lr x 1.01 must fail the same check.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from zerokern.kernels.lion import lion_step_

from . import f64_reference as R

TOL = {
    # DESIGN §3: fp32 relative error <= 1e-6 against float64, per element, relative to the
    # magnitude of the terms each line sums (f64_reference's error model).
    "rel": 1e-6,
    # A sign is ambiguous where the float64 interpolation c is within fp32 rounding of 0: there
    # either sign is a correct fp32 result. 1e-5 relative to |b1 m| + |(1-b1) g| is ~170 ulps.
    "sign_band": 1e-5,
    "floor": 1e-30,
}
HP = dict(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1)
HP_BIG = dict(lr=0.05, beta1=0.5, beta2=0.6, weight_decay=0.5)  # exaggerated: slips show
DTYPES = [(torch.float32, None), (torch.float16, torch.float16),
          (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)]
IDS = ["f32", "f16", "bf16", "f32-outbf16"]


def lion_f64(master, exp_avg, grad, grad_scale, lr, beta1, beta2, weight_decay):
    """Float64 Lion from fp32 inputs: (p, m, p's scale, m's scale, ambiguous sign mask, the
    other-sign p)."""
    p, m = master.double(), exp_avg.double()
    g = grad.double() * grad_scale
    decayed = p * (1 - lr * weight_decay)
    c = beta1 * m + (1 - beta1) * g
    c_scale = (beta1 * m).abs() + ((1 - beta1) * g).abs()
    sgn = torch.sign(c)
    p_new = decayed - lr * sgn
    m_new = beta2 * m + (1 - beta2) * g
    ambiguous = c.abs() <= TOL["sign_band"] * c_scale
    p_other = decayed + lr * torch.where(sgn == 0, torch.ones_like(sgn), sgn)
    return (p_new, m_new, decayed.abs() + lr, (beta2 * m).abs() + ((1 - beta2) * g).abs(),
            ambiguous, p_other)


def make(n, gdt, odt, device="cpu"):
    master = R.log_uniform(n, -3, 0, device)
    exp_avg = R.log_uniform(n, -4, -1, device)
    grad = R.log_uniform(n, -4, -1, device).to(gdt)
    out = None if odt is None else master.to(odt)
    return master, exp_avg, grad, out


def step_and_check(backend, n, gdt, odt, hp, steps=3, run_hp=None, device="cpu"):
    master, exp_avg, grad, out = make(n, gdt, odt, device)
    step = torch.zeros((), dtype=torch.int64, device=device)
    gs_val = R.default_grad_scale(gdt)
    gs = torch.tensor(gs_val, dtype=torch.float32, device=device)
    flag = torch.zeros((), dtype=torch.bool, device=device)
    for k in range(steps):
        if k:
            grad = R.log_uniform(n, -4, -1, device).to(gdt)
        p, m, ps, ms, amb, p_other = lion_f64(master, exp_avg, grad, gs_val, **hp)
        lion_step_(master, exp_avg, grad, out, **(run_hp or hp), step=step, grad_scale=gs,
                   found_inf=flag, backend=backend)
        err_p = (master.double() - p).abs()
        err_alt = (master.double() - p_other).abs()
        ok_p = (err_p <= TOL["rel"] * ps + TOL["floor"]) | \
            (amb & (err_alt <= TOL["rel"] * ps + TOL["floor"]))
        assert bool(ok_p.all()), f"master: {int((~ok_p).sum())}/{n} elements off at step {k}, " \
                                 f"max rel {float((err_p / ps).max()):.3g}"
        ok_m = (exp_avg.double() - m).abs() <= TOL["rel"] * ms + TOL["floor"]
        assert bool(ok_m.all()), f"exp_avg: {int((~ok_m).sum())}/{n} elements off at step {k}"
        assert int(step) == k + 1
        if out is not None:
            R.assert_bitwise("param_out", out, master.to(odt))


@pytest.mark.parametrize("dtypes", DTYPES, ids=IDS)
# 278011 (several CPU chunks and Triton blocks; 0.5-2 s a case) in CI's -m slow pass
@pytest.mark.parametrize("n", [1, 127, 4097, pytest.param(278011, marks=pytest.mark.slow)])
def test_matches_f64(backend, n, dtypes):
    step_and_check(backend, n, *dtypes, HP)


@pytest.mark.parametrize("dtypes", DTYPES[:3], ids=IDS[:3])
def test_exaggerated_hyperparameters(backend, dtypes):
    step_and_check(backend, 4097, *dtypes, HP_BIG)


@pytest.mark.gpu
@pytest.mark.parametrize("dtypes", DTYPES, ids=IDS)
@pytest.mark.parametrize("n", [1, 4097, 1 << 20])
def test_matches_f64_on_gpu(cuda_backend, n, dtypes):
    """The compiled Triton kernel and csrc/cuda/lion.cu on CUDA tensors (`-m gpu`)."""
    step_and_check(cuda_backend, n, *dtypes, HP, device="cuda")


@pytest.mark.gpu
def test_negative_control_lr_on_gpu(cuda_backend):
    with pytest.raises(AssertionError, match="master"):
        step_and_check(cuda_backend, 4097, torch.float32, None, HP, steps=1, device="cuda",
                       run_hp=dict(HP, lr=HP["lr"] * 1.01))


def test_negative_control_lr(backend):
    """lr x 1.01 in the kernel must fail the float64 check (the check can fail)."""
    with pytest.raises(AssertionError, match="master"):
        step_and_check(backend, 4097, torch.float32, None, HP, steps=1,
                       run_hp=dict(HP, lr=HP["lr"] * 1.01))


@pytest.mark.parametrize("make_flag", [lambda: torch.ones((), dtype=torch.bool),
                                       lambda: torch.tensor(float("nan"))], ids=["bool", "nan"])
def test_found_inf_is_bitwise_noop(backend, make_flag):
    master, exp_avg, grad, out = make(4097, torch.bfloat16, torch.bfloat16)
    before = [t.clone() for t in (master, exp_avg, out)]
    step = torch.tensor(7, dtype=torch.int64)
    lion_step_(master, exp_avg, grad, out, **HP, step=step, grad_scale=torch.tensor(1.0),
               found_inf=make_flag(), backend=backend)
    for name, got, want in zip(("master", "exp_avg", "param_out"), (master, exp_avg, out),
                               before):
        R.assert_bitwise(name, got, want)
    assert int(step) == 7


def test_matches_lion_pytorch(backend):
    """Three steps of lion_pytorch.Lion on one fp32 tensor: equal within fp32 rel 1e-6."""
    from lion_pytorch import Lion

    n = 4097
    master, exp_avg, _, _ = make(n, torch.float32, None)
    ref = torch.nn.Parameter(master.clone())
    opt = Lion([ref], lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    step = torch.zeros((), dtype=torch.int64)
    one, flag = torch.tensor(1.0), torch.zeros((), dtype=torch.bool)
    exp_avg.zero_()
    for _ in range(3):
        g = R.log_uniform(n, -4, -1)
        ref.grad = g.clone()
        opt.step()
        lion_step_(master, exp_avg, g, None, **HP, step=step, grad_scale=one, found_inf=flag,
                   backend=backend)
    assert float((master - ref.detach()).abs().max()) <= 1e-6 * float(ref.abs().max())
    assert float((exp_avg - opt.state[ref]["exp_avg"]).abs().max()) <= \
        1e-6 * float(exp_avg.abs().max())


def test_bad_arguments_raise_before_writing():
    master, exp_avg, grad, _ = make(16, torch.float32, None)
    kw = dict(step=torch.zeros((), dtype=torch.int64), grad_scale=torch.tensor(1.0),
              found_inf=torch.zeros((), dtype=torch.bool), backend="reference")
    with pytest.raises(ValueError, match="exp_avg"):
        lion_step_(master, exp_avg[:8], grad, None, **HP, **kw)
    with pytest.raises(ValueError, match="beta1"):
        lion_step_(master, exp_avg, grad, None, **dict(HP, beta1=1.5), **kw)
    with pytest.raises(ValueError, match="overlaps"):
        lion_step_(master, master, grad, None, **HP, **kw)


NVCC = shutil.which("nvcc")


@pytest.mark.slow  # the default run's budget (pyproject.toml [Note: the slow mark])
@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
def test_nvcc_compile_lion(tmp_path):
    """csrc/cuda/lion.cu builds alone for Hopper under cpp_extension's flags with no warning,
    and ptxas reports no spills (as test_nvcc_compile does for zk_kernels.cu)."""
    src = Path(__file__).resolve().parents[2] / "csrc" / "cuda" / "lion.cu"
    r = subprocess.run([NVCC, "-arch=sm_90", "-O3", "-std=c++17", "-D__CUDA_NO_HALF_OPERATORS__",
                        "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
                        "-D__CUDA_NO_HALF2_OPERATORS__", "--expt-relaxed-constexpr",
                        "-Xcompiler", "-Wall", "-Xptxas", "-v", "-c", str(src), "-o",
                        str(tmp_path / "lion.o")], capture_output=True, text=True, timeout=300)
    text = r.stdout + r.stderr
    assert r.returncode == 0, text
    assert "warning" not in text.lower().replace("0 bytes spill", ""), text
    assert "zk_lion_kernel" in text and " 0 bytes spill stores" in text
    assert "bytes spill stores" not in text.replace(" 0 bytes spill stores", ""), text


def _edge_case_inputs(n_copies: int = 37):
    """Elements whose interpolation c = b1 m + (1 - b1) g is exactly +0, -0, NaN, +-inf, a
    subnormal of either sign, or ordinary, with params +-0 among them (x - lr * sign(c) tells
    +0 from -0 there); repeated so the vectorized loop body, not only its tail, sees each."""
    tiny = 1e-40  # subnormal in fp32
    rows = [  # (master, exp_avg, grad)
        (0.5, 0.0, 0.0), (-0.0, -0.0, -0.0), (-0.0, 0.0, 0.0), (0.0, -0.0, -0.0),
        (0.25, 0.0, float("nan")), (0.25, float("nan"), 0.1), (0.3, 0.0, float("inf")),
        (0.3, 0.0, float("-inf")), (0.7, tiny, 0.0), (0.7, -tiny, 0.0), (-0.2, 0.1, -0.3),
        (0.9, -0.01, 0.02),
    ]
    cols = [torch.tensor([r[j] for r in rows] * n_copies, dtype=torch.float32)
            for j in range(3)]
    return cols


@pytest.mark.parametrize("backend", ["cpu", "triton",
                                     pytest.param("cuda", marks=pytest.mark.gpu)],
                         indirect=True)  # the backend fixture: the cuda toolchain skip
def test_sign_edges_match_the_reference_bitwise(backend):
    """The cpu kernel's branchless sign (csrc/cpu/lion_cpu.cpp: sign_of on the bits) and the
    Triton kernel compute torch.sign as the reference backend does, (c > 0) - (c < 0): +-1,
    and +0 for +-0 and NaN. Bit for bit against the reference (NaN positions equal; elsewhere
    the same bits, the sign of zero included). Both kernels returned c itself for +-0 and NaN
    before: p went NaN where the reference's stays finite, and -0 params came out +0."""
    if backend == "triton":
        pytest.importorskip("triton")
    dev = "cpu"
    if backend == "cuda":  # the CUDA C++ kernel (csrc/cuda/lion.cu) on the GPU
        if not torch.cuda.is_available():
            pytest.skip("no CUDA")
        dev = "cuda"
    outs = {}
    for b in ("reference", backend):
        master, exp_avg, grad = (t.to(dev) for t in _edge_case_inputs())
        lion_step_(master, exp_avg, grad, None, **HP_BIG,
                   step=torch.zeros((), dtype=torch.int64, device=dev),
                   grad_scale=torch.ones((), dtype=torch.float32, device=dev),
                   found_inf=torch.zeros((), dtype=torch.bool, device=dev), backend=b)
        outs[b] = (master.cpu(), exp_avg.cpu())
    for got, want in zip(outs[backend], outs["reference"]):
        assert torch.equal(got.isnan(), want.isnan())
        ok = ~want.isnan()
        assert torch.equal(got[ok].view(torch.int32), want[ok].view(torch.int32)), \
            (got[ok][:12], want[ok][:12])
    # the edge rows really are edges: zero params of both signs, NaN momentum
    p, m = (t[:12] for t in outs["reference"])
    assert m.isnan().any() and (p == 0).sum() >= 3 and torch.signbit(p[p == 0]).any()
