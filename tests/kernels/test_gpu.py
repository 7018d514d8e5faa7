"""adam_step_ / grad_stats_ on CUDA tensors: compiled Triton and the CUDA extension.

Marked `gpu`: they run in `python -m pytest -m gpu` on a CUDA machine, where conftest leaves the
Triton interpreter off, so these are the real, compiled kernels (issue 14, defect 1). In any
other run on a CUDA machine `test_gpu_suite_in_child` runs that command in a child process.
Checks: the float64 model of DESIGN §3 and the reference backend on the same CUDA data, the
skipped step as a bitwise no-op, the cast-back bitwise equal to CUDA's .to(dtype), grad_stats_,
hyperparameters as device or CPU tensors, no host sync (set_sync_debug_mode("error")), no
recompilation when per-step values change, and the paths no CPU test reaches: the CUDA Adam
kernel's grid-stride second sweep, the stats kernels' 1024-block cap, misaligned views (scalar
and head/body/tail paths), n >= 2^31 (marked `large`), and a device other than the current one.
"""

from __future__ import annotations

import math

import pytest
import torch

from zerokern import kernels as zk

from . import f64_reference as R

DEV = "cuda"

pytestmark = pytest.mark.gpu

# One tolerance table for this file.
TOL = {
    # DESIGN §3: fp32 relative error <= 1e-6 against float64, per element, relative to the
    # magnitude of the summed terms (f64_reference.adam_f64).
    "rel": 1e-6,
    # absolute floor, far below any scale the data produces (>= 1e-12); only guards 0/0
    "floor": 1e-30,
    # backend vs the reference backend on the same data: each is within one bound of the
    # float64 result, so they are within two of each other
    "vs_reference_bounds": 2.0,
    # sumsq vs float64: fp32 partials of <= ~32 chained additions (u = 6e-8), float64 final
    # sum; see test_grad_stats.py. The 2^31-element case sums ~2^20 fp32 partial chains of
    # up to 1024 terms in the Triton kernel: 1024 * 6e-8 = 6e-5, bounded here at 1e-4.
    "sumsq_rel": 1e-5,
    "sumsq_rel_large": 1e-4,
}

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
DTYPES = [
    (torch.float32, None),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16),
]
DTYPE_IDS = ["f32", "f16", "bf16", "f32-outbf16"]
SIZES = [1, 127, 4097, 278011, (1 << 20) + 3]
# CUDA Adam: 132 SMs x 4 blocks x 256 threads x 8 elements = 1,081,344 elements per sweep on an
# H100 SXM; 5M + 11 takes five sweeps plus a scalar tail. Stats: min(1024, 8 x SMs) blocks of
# 4096 elements cap at n = 4,194,304; 9M + 1 makes every block stride 2-3 times (both
# backends: Triton caps at 1024 programs x 2048 elements).
SECOND_SWEEP_N = 5_000_011
STATS_CAP_N = 9_000_001


def _call(backend, case, hp):
    zk.adam_step_(*case.buffers(), **hp, **case.kwargs(), backend=backend)


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "l2"])
@pytest.mark.parametrize("dtypes", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n", SIZES + [SECOND_SWEEP_N])
def test_matches_f64_and_reference(cuda_backend, n, dtypes, adamw):
    hp = dict(HP, weight_decay=0.05, adamw=adamw)
    case = R.make_case(n, *dtypes, step=9, device=DEV)
    for k in range(3):
        if k:
            case.new_grad_()
        ref = case.clone()  # the same state: compare one step, not accumulated roundings
        want = R.expected_step(case, hp)
        _call(cuda_backend, case, hp)
        _call("reference", ref, hp)
        R.check_step(case, want, TOL)
        for name in ("master", "exp_avg", "exp_avg_sq"):
            R.assert_within(
                f"{name} vs reference",
                getattr(case, name),
                getattr(ref, name).double(),
                want.scale[name],
                TOL["vs_reference_bounds"] * TOL["rel"],
                TOL["floor"],
            )
        assert case.step.item() == 10 + k
        if case.param_out is not None:
            R.assert_bitwise("param_out", case.param_out, case.master.to(case.param_out.dtype))


@pytest.mark.parametrize("beta2,start", [(0.999, 0), (0.9999, 0), (0.9999, 10**5 - 1)])
def test_bias_correction_and_exaggerated(cuda_backend, beta2, start):
    for hp in (dict(HP, beta2=beta2), dict(lr=0.1, beta1=0.5, beta2=0.6, eps=0.25)):
        hp = dict(hp, weight_decay=0.1, adamw=True)
        case = R.make_case(4097, torch.float16, torch.float16, step=start, device=DEV)
        want = R.expected_step(case, hp)
        _call(cuda_backend, case, hp)
        R.check_step(case, want, TOL)


POISON = {torch.float16: 0x7D01, torch.bfloat16: 0x7F81}


@pytest.mark.parametrize("flag", [True, 1.0, math.nan], ids=["bool", "f32-one", "f32-nan"])
@pytest.mark.parametrize(
    "out_dtype", [None, torch.float16, torch.bfloat16], ids=["noout", "f16", "bf16"]
)
def test_found_inf_is_bitwise_noop(cuda_backend, out_dtype, flag):
    for step_dtype in (torch.int64, torch.float32):
        case = R.make_case(
            278011, torch.float16, out_dtype, step=7, step_dtype=step_dtype, device=DEV
        )
        if out_dtype is not None:
            case.param_out.view(torch.int16).fill_(POISON[out_dtype])
        case.grad[::1000] = math.inf
        case.found_inf = torch.tensor(flag, device=DEV)
        before = case.snapshot()
        _call(cuda_backend, case, dict(HP, weight_decay=0.1, adamw=True))
        torch.cuda.synchronize()
        for name, t in case.tensors().items():
            R.assert_bitwise(name, t, before[name])


def _assert_cast_of(name, got, master):
    """got is torch's own .to(got.dtype) of master: bit for bit where master is a number (RNE is
    exact, so any correct cast gives these bits), NaN where it is NaN (the payload a NaN keeps is
    the conversion's choice: torch's CUDA cast and its CPU cast already differ)."""
    want = master.to(got.dtype)
    nan = master.isnan()
    assert torch.equal(got.isnan(), nan), f"{name}: NaN positions differ"
    R.assert_bitwise(name, got[~nan], want[~nan])


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_cast_back_bitwise(cuda_backend, out_dtype):
    """After real steps, and on special values with lr = 0 (ties, subnormals, +-0, +-inf, NaN
    payloads, overflow), param_out equals CUDA's own .to(dtype) bit for bit (NaNs as NaNs)."""
    case = R.make_case((1 << 20) + 3, torch.bfloat16, out_dtype, device=DEV)
    _call(cuda_backend, case, dict(HP, lr=1e-2, weight_decay=0.01, adamw=True))
    R.assert_bitwise("param_out", case.param_out, case.master.to(out_dtype))
    for n in (331 * 3 + 13, 4096 * 3):
        case = R.make_case(n, torch.float32, out_dtype, device=DEV)
        case.master.copy_(R.spread(R.special_values(out_dtype), n).to(DEV))
        case.param_out.view(torch.int16).fill_(POISON[torch.float16])
        _call(cuda_backend, case, dict(HP, lr=0.0, weight_decay=0.0, adamw=True))
        _assert_cast_of("param_out", case.param_out, case.master)


# Exactly representable in fp32, so fp32 and fp64 device tensors hold the float's value.
DYADIC = dict(lr=2.0**-10, beta1=0.875, beta2=1 - 2.0**-10, eps=2.0**-20, weight_decay=2.0**-6)


@pytest.mark.parametrize("tdtype", [torch.float32, torch.float64])
def test_tensor_hyperparameters_on_device(cuda_backend, tdtype):
    a = R.make_case(4097, torch.bfloat16, torch.bfloat16, step=3, device=DEV)
    b = a.clone()
    _call(cuda_backend, a, dict(DYADIC, adamw=True))
    _call(
        cuda_backend,
        b,
        dict({k: torch.tensor(v, dtype=tdtype, device=DEV) for k, v in DYADIC.items()}, adamw=True),
    )
    for name, t in a.tensors().items():
        R.assert_bitwise(name, getattr(b, name), t)
    # A scheduler writing the device lr tensor in place is seen by the next step.
    lr = torch.tensor(3e-3, dtype=torch.float64, device=DEV)
    for new_lr in (3e-3, 0.05):
        lr.fill_(new_lr)
        want = R.expected_step(a, dict(DYADIC, lr=new_lr, adamw=True))
        _call(cuda_backend, a, dict(DYADIC, lr=lr, adamw=True))
        R.check_step(a, want, TOL)


NONFINITE = {
    torch.float32: (math.inf, -math.inf, math.nan),
    torch.float16: (math.inf, -math.inf, math.nan),
    torch.bfloat16: (math.inf, -math.inf, math.nan),
}


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"]
)
@pytest.mark.parametrize("n", SIZES + [1_000_003, STATS_CAP_N])
def test_grad_stats(cuda_backend, n, dtype):
    grad = R.log_uniform(n, -4, 1, device=DEV).to(dtype)
    for sumsq_dtype in (torch.float32, torch.float64):
        sumsq = torch.tensor(0.75, dtype=sumsq_dtype, device=DEV)
        found_inf = torch.tensor(False, device=DEV)
        zk.grad_stats_(grad, found_inf, sumsq, backend=cuda_backend)
        want = 0.75 + R.sumsq_f64(grad)
        assert abs(float(sumsq) - want) <= TOL["sumsq_rel"] * want, (float(sumsq), want)
        assert not found_inf.item()
        again = torch.tensor(0.75, dtype=sumsq_dtype, device=DEV)
        zk.grad_stats_(grad, torch.tensor(False, device=DEV), again, backend=cuda_backend)
        R.assert_bitwise("sumsq (deterministic)", again, sumsq)
    for pos in sorted({0, n // 2, n - 1}):
        for value in NONFINITE[dtype]:
            g = grad.clone()
            g[pos] = value
            for flag in (torch.tensor(False, device=DEV), torch.tensor(0.0, device=DEV)):
                zk.grad_stats_(g, flag, torch.tensor(0.0, device=DEV), backend=cuda_backend)
                assert flag.item(), f"{value} at [{pos}] of {n} missed"
    sticky = torch.tensor(True, device=DEV)
    zk.grad_stats_(grad, sticky, torch.tensor(0.0, device=DEV), backend=cuda_backend)
    assert sticky.item()


# The backends on CUDA tensors plus the reference there, through the cuda_backend fixture (a
# "cuda" listed directly would bypass its toolchain skip: a GPU box without a matching nvcc
# failed these instead of skipping them).
WITH_REFERENCE = ["reference", "triton", "cuda"]


@pytest.mark.parametrize("cuda_backend", WITH_REFERENCE, indirect=True)
def test_step_path_does_not_sync(cuda_backend):
    """adam_step_ and grad_stats_ with float and device-tensor hyperparameters never wait for
    the GPU: set_sync_debug_mode("error") turns any synchronising call into an error."""
    backend = cuda_backend
    case = R.make_case(4097, torch.bfloat16, torch.bfloat16, device=DEV)
    tensor_hp = {k: torch.tensor(v, dtype=torch.float64, device=DEV) for k, v in HP.items()}
    sumsq = torch.tensor(0.0, device=DEV)

    def one_step(hp):
        zk.grad_stats_(case.grad, case.found_inf, sumsq, backend=backend)
        _call(backend, case, dict(hp, weight_decay=0.01, adamw=True))

    one_step(HP)  # warm-up: JIT build / compile may synchronise, and that is allowed once
    one_step(tensor_hp)
    torch.cuda.synchronize()
    step_before = case.step.clone()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            one_step(HP)
            one_step(tensor_hp)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert case.step.item() == step_before.item() + 6


def test_triton_does_not_recompile_per_step(cuda_device):
    """The compiled-kernel caches do not grow when lr, step, grad_scale or found_inf change."""
    from zerokern.kernels import triton_kernels as tk

    kernels = (
        tk._adam_scalars_kernel,
        tk._adam_step_kernel,
        tk._advance_step_kernel,
        tk._grad_stats_partial_kernel,
        tk._grad_stats_final_kernel,
    )

    def compiled():
        return sum(len(c[0]) for jf in kernels for c in jf.device_caches.values())

    case = R.make_case(4096, torch.float16, torch.float16, device=DEV)
    sumsq = torch.tensor(0.0, device=DEV)
    zk.grad_stats_(case.grad, case.found_inf, sumsq, backend="triton")
    _call("triton", case, dict(HP, weight_decay=0.01, adamw=True))
    count = compiled()
    assert count >= 5
    for lr, gs, skip in ((0.5, 2.0**-16, True), (3e-4, 0.37, False), (1.0, 65536.0, True)):
        case.grad_scale.fill_(gs)
        case.found_inf.fill_(skip)
        case.step.add_(1000)
        zk.grad_stats_(case.grad, case.found_inf, sumsq, backend="triton")
        _call("triton", case, dict(HP, lr=lr, weight_decay=0.01, adamw=True))
    assert compiled() == count
    _call("triton", case, dict(HP, weight_decay=0.01, adamw=False))  # a new layout does compile
    assert compiled() == count + 1


# ------------------------------------------------------------------ issue 14 paths ------------

def _views(case: R.AdamCase, offsets: dict) -> R.AdamCase:
    """The case's values in views `offsets[name]` elements into larger CUDA buffers."""
    out = {}
    for name, t in case.tensors().items():
        if t.dim() == 0:
            out[name] = t
            continue
        k = offsets.get(name, 0)
        buf = torch.empty(t.numel() + 16, dtype=t.dtype, device=DEV)
        out[name] = buf[k:k + t.numel()]
        out[name].copy_(t)
    names = ("master", "exp_avg", "exp_avg_sq", "grad", "param_out", "step", "grad_scale",
             "found_inf")
    return R.AdamCase(**{f: out.get(f) for f in names})


ARRAYS = ("master", "exp_avg", "exp_avg_sq", "grad", "param_out")


@pytest.mark.parametrize("n", [4097, SECOND_SWEEP_N])
@pytest.mark.parametrize("offsets", [
    {k: 1 for k in ARRAYS},                        # all off by one: Triton head/body/tail
    {k: 3 for k in ARRAYS},
    dict(master=1, exp_avg=2, exp_avg_sq=0, grad=5, param_out=7),  # no common alignment
], ids=["off1", "off3", "mixed"])
def test_misaligned_views(cuda_backend, n, offsets):
    """The scalar paths: CUDA's whole-array scalar loop when any pointer is misaligned, Triton's
    aligned body plus head/tail launches, or its scalar fallback for mixed offsets."""
    hp = dict(HP, weight_decay=0.05, adamw=True)
    case = _views(R.make_case(n, torch.bfloat16, torch.bfloat16, step=3, device=DEV), offsets)
    want = R.expected_step(case, hp)
    _call(cuda_backend, case, hp)
    R.check_step(case, want, TOL)
    R.assert_bitwise("param_out", case.param_out, case.master.to(torch.bfloat16))
    grad = case.grad
    sumsq, found = torch.tensor(0.0, dtype=torch.float64, device=DEV), torch.tensor(False,
                                                                                  device=DEV)
    zk.grad_stats_(grad, found, sumsq, backend=cuda_backend)
    want_s = R.sumsq_f64(grad)
    assert abs(float(sumsq) - want_s) <= TOL["sumsq_rel"] * want_s and not found.item()


@pytest.mark.parametrize("cuda_backend", WITH_REFERENCE, indirect=True)
def test_cpu_tensor_hyperparameters_do_not_sync(cuda_backend):
    """(6) lr etc. as CPU tensors: read on the host, never a blocking host-to-device copy."""
    backend = cuda_backend
    case = R.make_case(4097, torch.bfloat16, torch.bfloat16, device=DEV)
    hp = {k: torch.tensor(v, dtype=torch.float64) for k, v in HP.items()}
    ref = case.clone()
    want = R.expected_step(ref, dict(HP, weight_decay=0.01, adamw=True))
    _call(backend, case, dict(hp, weight_decay=torch.tensor(0.01), adamw=True))  # warm-up
    R.check_step(case, want, TOL)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            _call(backend, case, dict(hp, weight_decay=torch.tensor(0.01), adamw=True))
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_other_device_than_current(cuda_backend):
    """(2) Data on cuda:1 while cuda:0 is current: the kernels launch on cuda:1 (a launch on
    cuda:0 would fault on cuda:1's pointers or race with its stream)."""
    torch.cuda.set_device(0)
    hp = dict(HP, weight_decay=0.05, adamw=True)
    case = R.make_case(278011, torch.bfloat16, torch.bfloat16, step=2, device="cuda:1")
    want = R.expected_step(case, hp)
    _call(cuda_backend, case, hp)
    torch.cuda.synchronize(1)
    R.check_step(case, want, TOL)
    assert case.step.item() == 3 and torch.cuda.current_device() == 0
    sumsq = torch.tensor(0.0, device="cuda:1")
    zk.grad_stats_(case.grad, case.found_inf, sumsq, backend=cuda_backend)
    assert abs(float(sumsq) - R.sumsq_f64(case.grad)) <= TOL["sumsq_rel"] * float(sumsq)


BOUNDARY = 1 << 31  # int32 element offsets wrap here
LARGE_N = BOUNDARY + 37  # 37: an odd tail past 2^31


def _need_gib(gib: float):
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    if total < gib:
        pytest.skip(f"needs {gib:.0f} GiB of GPU memory, this GPU has {total:.0f}")


@pytest.mark.large
def test_adam_past_2_31_elements(cuda_backend):
    """n >= 2^31 with 16-bit grads and params (34 GiB): windows at the start, across 2^31 and
    at the tail against the float64 model of their pre-step values."""
    _need_gib(40)
    n = LARGE_N
    hp = dict(HP, weight_decay=0.05, adamw=True)
    master = torch.rand(n, device=DEV).sub_(0.5)
    exp_avg = torch.rand(n, device=DEV).mul_(0.01)
    exp_avg_sq = torch.rand(n, device=DEV).mul_(1e-4)
    grad = torch.randn(n, device=DEV, dtype=torch.bfloat16)
    out = torch.empty(n, device=DEV, dtype=torch.bfloat16)
    scalars = R.make_case(1, torch.bfloat16, torch.bfloat16, step=5, device=DEV)
    windows = [(0, 4096), (BOUNDARY - 4096, BOUNDARY + 16), (n - 100, n)]
    before = [R.AdamCase(master[a:b].clone(), exp_avg[a:b].clone(), exp_avg_sq[a:b].clone(),
                         grad[a:b].clone(), None, scalars.step.clone(), scalars.grad_scale,
                         scalars.found_inf) for a, b in windows]
    wants = [R.expected_step(c, hp) for c in before]
    zk.adam_step_(master, exp_avg, exp_avg_sq, grad, out, **hp, **scalars.kwargs(),
                  backend=cuda_backend)
    torch.cuda.synchronize()
    for (a, b), c, want in zip(windows, before, wants):
        got = R.AdamCase(master[a:b], exp_avg[a:b], exp_avg_sq[a:b], c.grad, out[a:b], c.step,
                         c.grad_scale, c.found_inf)
        R.check_step(got, want, TOL)
        R.assert_bitwise("param_out", out[a:b], master[a:b].to(torch.bfloat16))
    assert scalars.step.item() == 6


@pytest.mark.large
def test_grad_stats_past_2_31_elements(cuda_backend):
    _need_gib(12)
    grad = torch.randn(LARGE_N, device=DEV, dtype=torch.bfloat16)
    want = sum(float(c.double().square().sum()) for c in grad.split(1 << 28))  # bounded temps
    sumsq, found = torch.tensor(0.0, dtype=torch.float64, device=DEV), torch.tensor(False,
                                                                                  device=DEV)
    zk.grad_stats_(grad, found, sumsq, backend=cuda_backend)
    assert abs(float(sumsq) - want) <= TOL["sumsq_rel_large"] * want and not found.item()
    grad[BOUNDARY + 5] = math.inf  # past 2^31: found only with 64-bit offsets
    zk.grad_stats_(grad, found, torch.tensor(0.0, device=DEV), backend=cuda_backend)
    assert found.item()
