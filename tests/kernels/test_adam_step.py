"""adam_step_ on every backend runnable here against the float64 model of DESIGN §3.

Backends: reference, cpu (the C++ extension) and triton (the Triton interpreter on CPU tensors).
Every test draws fresh random data (conftest seeds per test id), never zeros.
"""

from __future__ import annotations

import math

import pytest
import torch

from zerokern import kernels as zk

from . import f64_reference as R

# One tolerance table for this file.
TOL = {
    # DESIGN §3: fp32 relative error <= 1e-6 against float64 (about 17 fp32 ulps), applied per
    # element to the magnitude of the terms each line sums (see f64_reference.adam_f64).
    "rel": 1e-6,
    # Absolute floor: far below every scale this data produces (>= 1e-12); only guards 0/0.
    "floor": 1e-30,
}

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
# Exaggerated hyperparameters, as apex's test_dist_adam uses: a slip in any term shows.
HP_APEX = dict(lr=0.1, beta1=0.5, beta2=0.6, eps=0.25)

# (grad dtype, param_out dtype): fp32 training, the two 16-bit precisions, and a mixed pair.
DTYPES = [
    (torch.float32, None),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float16),
]
DTYPE_IDS = ["f32", "f16", "bf16", "f32-outf16"]


def _call(backend, case, hp):
    zk.adam_step_(*case.buffers(), **hp, **case.kwargs(), backend=backend)


def run_steps(backend: str, case: R.AdamCase, hp: dict, steps: int = 3) -> None:
    """`steps` consecutive steps with fresh grads; each one checked against the float64 model
    evaluated on the state before it (t = step + 1 read from the step tensor, which must advance
    by exactly one per step and keep its dtype)."""
    t0, step_dtype = int(case.step.item()), case.step.dtype
    for k in range(steps):
        if k:
            case.new_grad_()
        grad_before = case.grad.clone()
        want = R.expected_step(case, hp)
        _call(backend, case, hp)
        R.check_step(case, want, TOL)
        assert case.step.dtype == step_dtype
        assert case.step.item() == t0 + k + 1, f"step {case.step.item()} after {k + 1} steps"
        R.assert_bitwise("grad (read-only)", case.grad, grad_before)
        if case.param_out is not None:
            R.assert_bitwise("param_out", case.param_out, case.master.to(case.param_out.dtype))


@pytest.mark.parametrize("weight_decay", [0.0, 0.05], ids=["wd0", "wd"])
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "l2"])
@pytest.mark.parametrize("dtypes", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n", [1, 127, 4097])
def test_matches_f64_small(backend, n, dtypes, adamw, weight_decay):
    """The full cross product at small sizes, three consecutive steps."""
    case = R.make_case(n, *dtypes)
    run_steps(backend, case, dict(HP, weight_decay=weight_decay, adamw=adamw))


BIG = [  # a representative subset for the large sizes
    pytest.param(torch.float16, torch.float16, True, 0.01, HP, id="f16-adamw"),
    pytest.param(torch.bfloat16, torch.bfloat16, False, 0.1, HP, id="bf16-l2"),
    pytest.param(torch.float32, None, True, 0.0, HP_APEX, id="f32-apex"),
]


@pytest.mark.slow  # 9 cases, 7 s on 2 loaded cores ([Note: the slow mark])
@pytest.mark.parametrize("grad_dtype,out_dtype,adamw,weight_decay,hp", BIG)
def test_matches_f64_278011(backend, grad_dtype, out_dtype, adamw, weight_decay, hp):
    case = R.make_case(278011, grad_dtype, out_dtype)
    run_steps(backend, case, dict(hp, weight_decay=weight_decay, adamw=adamw), steps=2)


@pytest.mark.parametrize("grad_dtype,out_dtype,adamw,weight_decay,hp", BIG[:2])
@pytest.mark.parametrize("backend", ["cpu"], indirect=True)
def test_matches_f64_over_2pow20_cpu(backend, grad_dtype, out_dtype, adamw, weight_decay, hp):
    """Above 2^20 elements the CPU kernel splits the shard over its OpenMP threads."""
    case = R.make_case((1 << 20) + 3, grad_dtype, out_dtype)
    run_steps(backend, case, dict(hp, weight_decay=weight_decay, adamw=adamw), steps=2)


@pytest.mark.parametrize("start", [0, 10**5 - 1], ids=["t1", "t1e5"])
@pytest.mark.parametrize("beta2", [0.999, 0.9999])
def test_bias_correction_precision(backend, beta2, start):
    """bc2 = 1 - beta2^t must be formed in float64: at t = 1 float32 gets 1 - f32(0.9999) wrong
    by 1.7e-5 relative. At t = 1e5 the power itself must be exact for a large exponent."""
    case = R.make_case(4097, torch.bfloat16, torch.bfloat16, step=start)
    run_steps(backend, case, dict(HP, beta2=beta2, weight_decay=0.01, adamw=True), steps=2)


@pytest.mark.parametrize("step_dtype", [torch.int64, torch.int32, torch.float32, torch.float64])
def test_step_dtypes(backend, step_dtype):
    """Every allowed step dtype is read, incremented by one, and keeps its dtype."""
    case = R.make_case(127, torch.float16, torch.float16, step=41, step_dtype=step_dtype)
    run_steps(backend, case, dict(HP, weight_decay=0.01, adamw=True), steps=3)


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "l2"])
@pytest.mark.parametrize("dtypes", DTYPES[1:3], ids=DTYPE_IDS[1:3])
@pytest.mark.parametrize("n", [127, 4097])
def test_exaggerated_hyperparameters(backend, n, dtypes, adamw):
    case = R.make_case(n, *dtypes, step=2)
    run_steps(backend, case, dict(HP_APEX, weight_decay=0.5, adamw=adamw), steps=4)


@pytest.mark.parametrize("grad_scale", [1.0, 1.0 / 65536, 3.0, 0.123])
def test_grad_scale(backend, grad_scale):
    """The unscale multiplies every gradient (fp16 grads stored scaled up by 1/grad_scale)."""
    case = R.make_case(4097, torch.float16, torch.float16, grad_scale=grad_scale)
    run_steps(backend, case, dict(HP, weight_decay=0.01, adamw=True), steps=2)


# Values exactly representable in fp32, so a 0-d fp32 tensor holds the same number as the float.
DYADIC = dict(lr=2.0**-10, beta1=0.875, beta2=1 - 2.0**-10, eps=2.0**-20, weight_decay=2.0**-6)


@pytest.mark.parametrize("which", ["all", "lr", "betas"])
@pytest.mark.parametrize("tdtype", [torch.float32, torch.float64])
def test_tensor_hyperparameters_equal_floats(backend, tdtype, which):
    """0-d tensor hyperparameters give bitwise the result of the same values as floats."""
    names = {"all": list(DYADIC), "lr": ["lr"], "betas": ["beta1", "beta2"]}[which]
    a = R.make_case(4097, torch.bfloat16, torch.bfloat16, step=5)
    b = a.clone()
    as_tensors = {
        k: (torch.tensor(v, dtype=tdtype) if k in names else v) for k, v in DYADIC.items()
    }
    for _ in range(2):
        _call(backend, a, dict(DYADIC, adamw=True))
        _call(backend, b, dict(as_tensors, adamw=True))
        for name, t in a.tensors().items():
            R.assert_bitwise(name, getattr(b, name), t)
        a.new_grad_()
        b.grad.copy_(a.grad)
    R.assert_bitwise("master", a.master, b.master)


def test_tensor_lr_read_at_call_time(backend):
    """A scheduler writes the lr tensor in place; every step uses the value it holds then."""
    lr = torch.tensor(3e-3, dtype=torch.float64)
    beta2 = torch.tensor(0.995, dtype=torch.float64)
    case = R.make_case(4097, torch.float16, torch.float16)
    for new_lr in (3e-3, 7e-4, 0.05):
        lr.fill_(new_lr)
        hp = dict(HP, lr=lr, beta2=beta2, weight_decay=0.02, adamw=True)
        want = R.expected_step(
            case, dict(HP, lr=new_lr, beta2=0.995, weight_decay=0.02, adamw=True)
        )
        _call(backend, case, hp)
        R.check_step(case, want, TOL)
        case.new_grad_()


# ---------------------------------------------------------------------------------------------
# Skipped steps: a bitwise no-op
# ---------------------------------------------------------------------------------------------

# NaN patterns no kernel produces itself: a write of any value would change them.
POISON = {torch.float16: 0x7D01, torch.bfloat16: 0x7F81}
SET_FLAGS = [
    pytest.param(lambda: torch.tensor(True), id="bool"),
    pytest.param(lambda: torch.tensor(1.0), id="f32-one"),
    pytest.param(lambda: torch.tensor(math.nan), id="f32-nan"),
    pytest.param(lambda: torch.tensor(-1e-30), id="f32-tiny-negative"),
]


def _poisoned_case(n, out_dtype, step_dtype):
    case = R.make_case(n, torch.float16, out_dtype, step=7, step_dtype=step_dtype)
    if out_dtype is not None:
        case.param_out.view(torch.int16).fill_(POISON[out_dtype])
    case.grad[:: max(1, n // 5)] = math.inf  # an overflowed fp16 grad, as in a real skipped step
    return case


@pytest.mark.parametrize(
    "out_dtype", [None, torch.float16, torch.bfloat16], ids=["noout", "f16", "bf16"]
)
@pytest.mark.parametrize("make_flag", SET_FLAGS)
def test_found_inf_is_bitwise_noop(backend, make_flag, out_dtype):
    for step_dtype in (torch.int64, torch.float32):
        case = _poisoned_case(4097, out_dtype, step_dtype)
        case.found_inf = make_flag()
        before = case.snapshot()
        for lr in (1e-3, 0.5):  # repeated skips stay no-ops
            _call(backend, case, dict(HP, lr=lr, weight_decay=0.1, adamw=True))
            for name, t in case.tensors().items():
                R.assert_bitwise(name, t, before[name])


@pytest.mark.parametrize(
    "make_flag",
    [
        pytest.param(lambda: torch.tensor(False), id="bool"),
        pytest.param(lambda: torch.tensor(0.0), id="f32-zero"),
        pytest.param(lambda: torch.tensor(-0.0), id="f32-negative-zero"),
    ],
)
def test_found_inf_clear_runs_the_step(backend, make_flag):
    """Control for the no-op test: a clear flag (zero of either sign) does write everything."""
    case = _poisoned_case(4097, torch.bfloat16, torch.int64)
    case.grad.copy_(R.make_case(4097, torch.float16).grad)  # finite again
    case.found_inf = make_flag()
    hp = dict(HP, weight_decay=0.1, adamw=True)
    want = R.expected_step(case, hp)
    _call(backend, case, hp)
    R.check_step(case, want, TOL)
    assert case.step.item() == 8
    R.assert_bitwise("param_out", case.param_out, case.master.to(torch.bfloat16))


# ---------------------------------------------------------------------------------------------
# Layout corners
# ---------------------------------------------------------------------------------------------


def _offset_copy(t):
    """A contiguous copy of `t` starting one element into its storage (4- or 2-byte aligned,
    never 16): kernels may not assume 128-bit alignment of a caller's buffer."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype)
    view = buf[1:]
    view.copy_(t)
    return view


@pytest.mark.parametrize("dtypes", DTYPES[1:], ids=DTYPE_IDS[1:])
def test_misaligned_buffers(backend, dtypes):
    case = R.make_case(4099, *dtypes)
    for name in ("master", "exp_avg", "exp_avg_sq", "grad", "param_out"):
        setattr(case, name, _offset_copy(getattr(case, name)))
        assert getattr(case, name).data_ptr() % 16 != 0
    run_steps(backend, case, dict(HP, weight_decay=0.01, adamw=True), steps=2)


def test_empty_shard_still_counts_the_step(backend):
    """A rank whose shard is empty (n = 0) keeps its step counter in line with the others."""
    case = R.make_case(0, torch.bfloat16, torch.bfloat16, step=3)
    _call(backend, case, dict(HP, weight_decay=0.01, adamw=True))
    assert case.step.item() == 4


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "l2"])
@pytest.mark.parametrize("dtypes", DTYPES, ids=DTYPE_IDS)
def test_cpu_every_isa(cpu_isa, dtypes, adamw):
    """Each instruction-set path of the CPU extension (AVX-512, AVX2, scalar) meets the bound,
    on a tail-only size and on one spanning several OpenMP chunks plus a 1-element tail."""
    for n in (7, 40961):
        case = R.make_case(n, *dtypes)
        run_steps("cpu", case, dict(HP, weight_decay=0.05, adamw=adamw), steps=2)


# ---------------------------------------------------------------------------------------------
# Negative controls: the comparison catches the mistakes it is meant to catch
# ---------------------------------------------------------------------------------------------


def _emulate_f32(case: R.AdamCase, hp: dict, t: int, bc_in_float32: bool) -> None:
    """DESIGN §3 in plain fp32 torch ops, in place; optionally with the bias corrections in
    float32 (the mistake §3 warns about)."""
    f32 = torch.float32
    lr, b1, b2, eps, wd = (float(hp[k]) for k in ("lr", "beta1", "beta2", "eps", "weight_decay"))
    if bc_in_float32:
        bc1 = float(1 - torch.tensor(b1, dtype=f32) ** t)
        bc2 = float(1 - torch.tensor(b2, dtype=f32) ** t)
    else:
        bc1, bc2 = R.bias_corrections(t, b1, b2)
    g = case.grad.to(f32) * case.grad_scale
    p = case.master
    if hp["adamw"]:
        p = p * torch.tensor(1 - lr * wd, dtype=f32)
    else:
        g = g + wd * p
    case.exp_avg.mul_(b1).add_((1 - b1) * g)
    case.exp_avg_sq.mul_(b2).add_((1 - b2) * g * g)
    denom = case.exp_avg_sq.sqrt() * torch.tensor(1 / math.sqrt(bc2), dtype=f32) + eps
    case.master.copy_(p - torch.tensor(lr / bc1, dtype=f32) * (case.exp_avg / denom))
    case.step += 1


NEG_HP = dict(HP, beta2=0.9999, weight_decay=0.05, adamw=True)


def test_negative_control_emulation_passes_and_fp32_bias_correction_fails():
    case = R.make_case(4097, torch.bfloat16, None)
    good = case.clone()
    want = R.expected_step(case, NEG_HP)
    _emulate_f32(good, NEG_HP, 1, bc_in_float32=False)
    R.check_step(good, want, TOL)  # the emulation is a correct kernel...
    _emulate_f32(case, NEG_HP, 1, bc_in_float32=True)
    with pytest.raises(AssertionError, match="master"):  # ...and fp32 bias correction is not
        R.check_step(case, want, TOL)


def test_negative_control_stale_step_counter():
    """A kernel that uses t = step instead of step + 1 (here: t = 2 for the first step)."""
    case = R.make_case(4097, torch.bfloat16, None)
    want = R.expected_step(case, NEG_HP)
    _emulate_f32(case, NEG_HP, 2, bc_in_float32=False)
    with pytest.raises(AssertionError, match="master"):
        R.check_step(case, want, TOL)


@pytest.mark.parametrize(
    "mistake,field",
    [
        (dict(beta1=HP["beta1"] + 1e-4), "exp_avg"),
        (dict(beta2=0.9999 - 1e-5), "exp_avg_sq"),
        (dict(weight_decay=0.0), "master"),
        (dict(adamw=False), "master"),
        (dict(eps=1e-7), "master"),
    ],
    ids=["beta1+1e-4", "beta2-1e-5", "no-weight-decay", "l2-not-decoupled", "eps-1e-7"],
)
@pytest.mark.parametrize("backend", ["reference", "cpu"], indirect=True)
def test_negative_control_wrong_hyperparameter(backend, mistake, field):
    """The kernel is run with one hyperparameter wrong; the model with the right one."""
    case = R.make_case(4097, torch.float16, torch.float16)
    want = R.expected_step(case, NEG_HP)
    _call(backend, case, dict(NEG_HP, **mistake))
    with pytest.raises(AssertionError, match=field):
        R.assert_within(
            field,
            getattr(case, field),
            getattr(want, field),
            want.scale[field],
            TOL["rel"],
            TOL["floor"],
        )
