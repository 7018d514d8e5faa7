"""The Triton launcher's plan, checked on the CPU (issue 14, defects 2, 3, 6, 7).

What each launch would be on a GPU is decided on the host: which device is current (2), that
the fp64 set-up is one prologue launch (3), that a CPU-tensor hyperparameter is never copied to
the device (6), and which compiled variant each piece gets: Triton specialises pointers on 16-byte
alignment and n on divisibility by 16, so every launch over 16 elements or more must have both (7).
The launches are recorded around the real kernels (run by the interpreter on CPU tensors) or,
for meta tensors, in place of them; the numbers are checked against the float64 model.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zerokern import kernels as zk
from zerokern.kernels import reference

from . import f64_reference as R

# One tolerance table for this file.
TOL = {
    # DESIGN §3: fp32 relative error <= 1e-6 against float64 (as test_adam_step.py)
    "rel": 1e-6,
    # absolute floor, far below any scale the data produces; only guards 0/0
    "floor": 1e-30,
}
HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05, adamw=True)
KERNELS = ("_adam_scalars_kernel", "_adam_step_kernel", "_advance_step_kernel",
           "_grad_stats_partial_kernel", "_grad_stats_final_kernel")


@pytest.fixture
def tk():
    from zerokern.kernels import triton_kernels

    return triton_kernels


class _Guard:
    """Stands in for tk._on_device: records the device and whether a launch is inside."""

    def __init__(self):
        self.devices, self.depth = [], 0

    @contextlib.contextmanager
    def __call__(self, dev):
        self.devices.append(torch.device(dev))
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1


def _record(monkeypatch, tk, call_through=True, guard=None):
    """Wrap every kernel: each launch appends (name, grid, args, kwargs, inside the guard)."""
    log = []
    for name in KERNELS:
        jf = getattr(tk, name, None)
        if jf is None:  # (a launcher from before the prologue, 3)
            continue

        class Rec:
            def __getitem__(self, grid, _jf=jf, _name=name):
                def launch(*args, **kw):
                    log.append(dict(name=_name, grid=grid, args=args, kw=kw,
                                    guarded=guard is not None and guard.depth > 0))
                    if call_through:
                        _jf[grid](*args, **kw)
                return launch

        monkeypatch.setattr(tk, name, Rec())
    return log


def _offset_case(case: R.AdamCase, offsets) -> R.AdamCase:
    """The same values in views that start `offsets[name]` elements into a larger buffer."""
    out = {}
    for name, t in case.tensors().items():
        k = offsets.get(name, 0)
        if t.dim() == 0:
            out[name] = t
            continue
        buf = torch.empty(t.numel() + 16, dtype=t.dtype)
        out[name] = buf[k:k + t.numel()]
        out[name].copy_(t)
    return R.AdamCase(**{f: out.get(f) for f in ("master", "exp_avg", "exp_avg_sq", "grad",
                                                  "param_out", "step", "grad_scale", "found_inf")})


def _check_variants(log, n, kernel="_adam_step_kernel"):
    """Every launch of >= 16 elements gets the vector variant; the pieces cover n exactly."""
    launches = [e for e in log if e["name"] == kernel]
    covered = 0
    for e in launches:
        ptrs = [a for a in e["args"] if isinstance(a, torch.Tensor) and a.dim() == 1]
        length = next(a for a in e["args"] if isinstance(a, int))
        covered += length
        if length >= 16:
            assert length % 16 == 0, f"a {length}-element launch: Triton's scalar variant"
            bad = [t.data_ptr() % 16 for t in ptrs if t.numel() > 16 and t.data_ptr() % 16]
            assert not bad, f"misaligned pointers {bad} in a {length}-element launch"
    assert covered == n, (covered, n)
    return launches


# --------------------------------------------------------------------------- defect 7 ------

@pytest.mark.parametrize("n", [1, 15, 17, 4097, 278011])
@pytest.mark.parametrize("offset", [0, 1, 3], ids=["aligned", "off1", "off3"])
def test_adam_body_and_tail_variants(monkeypatch, tk, n, offset):
    """Odd n and views starting off a 16-byte boundary: an aligned body with 128-bit accesses
    plus head/tail launches of < 16 elements; results within the float64 bound."""
    base = R.make_case(n, torch.bfloat16, torch.bfloat16, step=4)
    names = ("master", "exp_avg", "exp_avg_sq", "grad", "param_out")
    case = _offset_case(base, {k: offset for k in names})
    log = _record(monkeypatch, tk)
    want = R.expected_step(case, {k: v for k, v in HP.items()})
    zk.adam_step_(*case.buffers(), **HP, **case.kwargs(), backend="triton")
    launches = _check_variants(log, n)
    if n >= 32:
        assert any(e["args"][5] >= 16 for e in launches), "no vector body"
        assert all(e["args"][5] < 16 for e in launches if e["args"][5] % 16), launches
    R.check_step(case, want, TOL)
    R.assert_bitwise("param_out", case.param_out, case.master.to(torch.bfloat16))


def test_adam_views_misaligned_against_each_other(monkeypatch, tk):
    """No common aligned start (fp32 views off by 1 and 2 elements): one scalar launch, still
    correct. The plan says so rather than reading out of bounds."""
    n = 4097
    case = _offset_case(R.make_case(n, torch.float32, None), {"master": 1, "exp_avg": 2})
    log = _record(monkeypatch, tk)
    want = R.expected_step(case, {k: v for k, v in HP.items()})
    zk.adam_step_(*case.buffers(), **HP, **case.kwargs(), backend="triton")
    launches = [e for e in log if e["name"] == "_adam_step_kernel"]
    assert [e["args"][5] for e in launches] == [n]
    R.check_step(case, want, TOL)


@pytest.mark.parametrize("offset", [0, 5])
def test_grad_stats_body_and_tail_variants(monkeypatch, tk, offset):
    n = 278011
    buf = R.log_uniform(n + 16, -4, 1).to(torch.float16)
    grad = buf[offset:offset + n]
    log = _record(monkeypatch, tk)
    sumsq, found = torch.tensor(0.0, dtype=torch.float64), torch.tensor(False)
    zk.grad_stats_(grad, found, sumsq, backend="triton")
    _check_variants(log, n, "_grad_stats_partial_kernel")
    want = R.sumsq_f64(grad)
    assert abs(float(sumsq) - want) <= 1e-5 * want and not found.item()


def test_segments_plan(tk):
    f32 = torch.empty(64)
    h16 = torch.empty(64, dtype=torch.float16)
    assert tk._segments(64, [f32, h16]) == [(0, 64, True)]
    assert tk._segments(63, [f32[:63], h16[:63]]) == [(0, 48, True), (48, 15, False)]
    # fp32 off by 1 element (4 B) and fp16 off by 5 (10 B): both aligned after 3 more elements
    assert tk._segments(40, [f32[1:41], h16[5:45]]) == [(0, 3, False), (3, 32, True),
                                                       (35, 5, False)]
    assert tk._segments(40, [f32[1:41], f32[2:42]]) == [(0, 40, False)]
    assert tk._segments(0, [f32[:0]]) == []


# --------------------------------------------------------------------------- defects 2, 3 --

def test_every_launch_is_inside_the_device_guard(monkeypatch, tk):
    """(2) Triton launches on the current device: each launch runs with the data's device made
    current, and the fp64 set-up is one single-program prologue per call (3)."""
    guard = _Guard()
    monkeypatch.setattr(tk, "_on_device", guard)
    log = _record(monkeypatch, tk, guard=guard)
    case = R.make_case(4097, torch.float16, torch.float16)
    zk.adam_step_(*case.buffers(), **HP, **case.kwargs(), backend="triton")
    zk.grad_stats_(case.grad, case.found_inf, torch.tensor(0.0), backend="triton")
    assert log and all(e["guarded"] for e in log), [(e["name"], e["guarded"]) for e in log]
    assert set(guard.devices) == {torch.device("cpu")}
    prologue = [e for e in log if e["name"] == "_adam_scalars_kernel"]
    assert len(prologue) == 1 and prologue[0]["grid"] == (1,)


def test_device_guard_selects_the_tensors_device(tk):
    g = tk._on_device(torch.device("cuda", 1))
    assert isinstance(g, torch.cuda.device) and g.idx == 1
    assert isinstance(tk._on_device(torch.device("cpu")), contextlib.nullcontext)


# --------------------------------------------------------------------------- defect 6 ------

class _HostToDevice(TorchDispatchMode):
    """Records every copy of a CPU tensor to another device (a blocking H2D copy on CUDA)."""

    def __init__(self):
        super().__init__()
        self.copies = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__
        if name.startswith("_to_copy") and args[0].device.type == "cpu":
            dev = kwargs.get("device")
            if dev is not None and torch.device(dev).type != "cpu":
                self.copies.append((name, tuple(args[0].shape)))
        if name.startswith("copy_") and args[1].device.type == "cpu" \
                and args[0].device.type != "cpu":
            self.copies.append((name, tuple(args[1].shape)))
        return func(*args, **kwargs)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_cpu_tensor_hyperparameters_are_not_copied(monkeypatch, tk, backend):
    """(6) lr etc. as CPU tensors with data on another device (meta stands in for CUDA): read on
    the host, never a host-to-device copy, which on CUDA blocks once per bucket per step."""
    if backend == "triton":
        _record(monkeypatch, tk, call_through=False)  # meta tensors cannot run a kernel
    n = 4096
    meta = dict(device="meta")
    bufs = [torch.empty(n, **meta) for _ in range(3)] + [torch.empty(n, dtype=torch.bfloat16,
                                                                     **meta)]
    out = torch.empty(n, dtype=torch.bfloat16, **meta)
    hp = {k: torch.tensor(v, dtype=torch.float64) for k, v in HP.items() if k != "adamw"}
    hp["beta1"] = 0.9  # a mix of floats and CPU tensors
    # dispatch refuses triton on meta tensors, so the triton launcher is called directly
    call = tk.adam_step_ if backend == "triton" else reference.adam_step_
    with _HostToDevice() as mode:
        call(*bufs, out, **hp, adamw=True, step=torch.zeros((), dtype=torch.int64, **meta),
             grad_scale=torch.ones((), **meta),
             found_inf=torch.zeros((), dtype=torch.bool, **meta))
    assert not mode.copies, f"host-to-device copies: {mode.copies}"
