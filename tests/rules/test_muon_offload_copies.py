"""ZeroMuon with the state on the host (offload="cpu"/"nvme") and the params on a GPU: every
copy between the two is from or to pinned memory, non_blocking, and the host waits only where
it reads a device result (rules/muon.py [Note: Muon's host copies]).

No GPU here, so the device boundary is emulated around the Muon group step: the rule sees its
buffer's `device` as "cuda"; tensors that would live there are CPU tensors tagged as device
ones (the grads, found_inf and grad_scale it is given, what it makes with device="cuda", what
`.to("cuda")` returns, and everything the orthogonalization computes, which runs on the device);
page-locked host memory is what `pinned.host_empty` / `pin_memory=True` hand out (on a GPU
these are pinned; here they are recorded). A copy between a device tensor and a host tensor is
flagged when its host side is not page-locked or it is not non_blocking. The old code made five
kinds of pageable copies (found_inf and grad_scale to the host, each grad chunk to the host,
the update to the device and back: `.to()`): failed. The emulated steps must also equal the
plain CPU steps bit for bit (the grads reach the momentum pass as fp32, exactly).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import zerokern as zk
from zerokern.rules import muon
from zerokern.state import pinned

from ..support import models as M
from ..support.harness import one_thread  # noqa: F401 - the fixture

pytestmark = pytest.mark.usefixtures("one_thread")
CUDA = torch.device("cuda")
_aten = torch.ops.aten


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class FakeDevice(TorchDispatchMode):
    """The emulated boundary: which storages are on the device, which host ones are pinned,
    and the copies that cross (op, host side pinned, non_blocking)."""

    def __init__(self) -> None:
        super().__init__()
        self.dev, self.pinned = set(), set()
        self.keep = []  # tagged and pinned tensors stay alive: no address is reused
        self.crossings = []
        self.in_device_code = False
        self.watching = True  # record crossings (emulated_gpu: inside the Muon group step)

    def tag(self, t: torch.Tensor, on_dev: bool = True) -> None:
        (self.dev.add if on_dev else self.dev.discard)(_ptr(t))
        self.keep.append(t)

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        self.pinned.add(_ptr(t))
        self.keep.append(t)
        return t

    def on_dev(self, t) -> bool:
        return isinstance(t, torch.Tensor) and _ptr(t) in self.dev

    def cross(self, what: str, host: torch.Tensor, non_blocking: bool) -> None:
        if self.watching:
            self.crossings.append((what, _ptr(host) in self.pinned, bool(non_blocking)))

    @contextlib.contextmanager
    def device_code(self):
        """Everything inside runs on the device (the orthogonalization)."""
        self.in_device_code = True
        try:
            yield
        finally:
            self.in_device_code = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        dev = kwargs.get("device")
        to_dev = dev is not None and torch.device(dev).type == "cuda"
        if to_dev:
            kwargs["device"] = torch.device("cpu")
        pin = bool(kwargs.get("pin_memory"))
        if pin:
            kwargs["pin_memory"] = False
        if func is _aten.copy_.default:
            dst, src = args[0], args[1]
            if self.on_dev(dst) != self.on_dev(src) and not self.in_device_code:
                nb = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
                self.cross("H2D copy_" if self.on_dev(dst) else "D2H copy_",
                           src if self.on_dev(dst) else dst, nb)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        inputs = [a for a in args if isinstance(a, torch.Tensor)]
        for a in args:
            if isinstance(a, (list, tuple)):
                inputs += [x for x in a if isinstance(x, torch.Tensor)]
        if to_dev or self.in_device_code or any(self.on_dev(a) for a in inputs):
            for o in (out if isinstance(out, (list, tuple)) else [out]):
                if isinstance(o, torch.Tensor) and o.untyped_storage().nbytes():
                    self.tag(o)
        if pin:
            self.pin(out)
        return out


@contextlib.contextmanager
def emulated_gpu(monkeypatch, opt):
    """The Muon buffers' params "on cuda" for the rule, for the steps inside the block."""
    mode = FakeDevice()
    mode.watching = False  # the rest of the step is not the rule's (offload.py's own copies)
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is None:
            return real_to(self, *args, **kwargs)
        src_dev, dst_dev = mode.on_dev(self), device.type == "cuda"
        if src_dev == dst_dev and not dst_dev:
            return real_to(self, *args, **kwargs)
        out = real_to(self, torch.device("cpu"), dtype=dtype or self.dtype,
                      non_blocking=non_blocking, copy=True)
        mode.tag(out, dst_dev)
        if src_dev != dst_dev:  # a .to() across lands in fresh, pageable host memory
            mode.cross("H2D .to()" if dst_dev else "D2H .to()", self if dst_dev else out,
                       non_blocking)
        return out

    monkeypatch.setattr(torch.Tensor, "to", to)
    # What offload allocates page-locked on a GPU (HostState, the NVMe pool, scalars).
    real_host_empty = pinned.host_empty
    monkeypatch.setattr(pinned, "host_empty",
                        lambda n, dt, pin: mode.pin(real_host_empty(n, dt, False)))
    for st in getattr(opt.placement, "states", []):
        for t in [st.master, *st.states.values(), *st.host_tensors()]:
            if t is not None:
                mode.pin(t)
    for name in ("scalars",):
        t = getattr(opt.placement, name, None)
        if t is not None:
            mode.pin(t)
    for s in getattr(opt.placement, "pool", []):
        for t in s.tensors():
            mode.pin(t)
    waits = []

    class _Event:
        def synchronize(self):
            waits.append(1)

    monkeypatch.setattr(muon, "_recorded", lambda device: _Event(), raising=False)
    if hasattr(muon, "HostStaging"):  # (a fresh one: reserved under this emulation)
        monkeypatch.setattr(muon, "STAGING", muon.HostStaging())

    class OnCuda:
        """The rule's view of a buffer: its params on the (emulated) GPU."""

        def __init__(self, g) -> None:
            self.__dict__["_g"] = g

        device = CUDA

        def __getattr__(self, name):
            return getattr(self.__dict__["_g"], name)

    real_step = muon.MuonRule.group_step_

    def group_step_(self, g, grads, orth, *, grad_scale, found_inf, **kw):
        for t in [*grads, grad_scale, found_inf]:
            mode.tag(t)
        real_orth = orth.orthogonalize_

        def orthogonalize_(work):
            with mode.device_code():
                return real_orth(work)

        orth.orthogonalize_ = orthogonalize_
        mode.watching = True
        try:
            return real_step(self, OnCuda(g), grads, orth, grad_scale=grad_scale,
                             found_inf=found_inf, **kw)
        finally:
            mode.watching = False
            del orth.orthogonalize_

    monkeypatch.setattr(muon.MuonRule, "group_step_", group_step_)
    with mode:
        # made at construction on a GPU: the plans (and the pinned staging they reserve)
        for gi in list(opt._plans):
            opt._plans[gi] = muon.MUON.orthogonalizer(OnCuda(opt.flat_groups[gi]),
                                                      opt.comm.shard)
        yield mode, waits


def _build(model, stage, offload, path, precision):
    kw = {"offload_path": str(path)} if offload == "nvme" else {}
    return zk.ZeroMuon(model, lr=0.02, momentum=0.9, adamw_lr=M.LR, stage=stage,
                       precision=precision, offload=offload, bucket_mb=M.BUCKET_MB,
                       backend="reference", **kw)


CASES = [(1, "cpu", "fp32"), (2, "cpu", "bf16"), (3, "cpu", "bf16"), (2, "nvme", "fp32")]


@pytest.mark.parametrize("stage,offload,precision", CASES,
                         ids=lambda x: str(x))
def test_host_state_copies_are_pinned_and_async(monkeypatch, tmp_path, stage, offload,
                                                precision):
    runs = []
    for emulate in (False, True):
        model = M.make_model()
        opt = _build(model, stage, offload, tmp_path, precision)
        with contextlib.ExitStack() as stack:
            if emulate:
                mode, waits = stack.enter_context(emulated_gpu(monkeypatch, opt))
            rec = M.train_zero(model, opt, 0, 1, 2)
        runs.append(rec["params"])
        opt.close()
        monkeypatch.undo()
    crossings = mode.crossings
    assert len(crossings) >= 3, crossings  # control: the grads, the update there and back
    bad = [c for c in crossings if not (c[1] and c[2])]
    assert not bad, f"pageable or blocking copies across the device boundary: {bad}"
    assert waits, "the host never waited for the device results it reads"
    assert all(M.bitwise_equal(a, b) for a, b in zip(*runs))


def test_the_emulation_flags_a_pageable_copy(monkeypatch):
    """Negative control: the checks above can fail."""
    model = M.make_model()
    opt = _build(model, 2, "cpu", None, "fp32")
    with emulated_gpu(monkeypatch, opt) as (mode, _):
        mode.watching = True
        dev = torch.zeros(4, device="cuda")
        dev.to("cpu")                                  # D2H into pageable memory
        torch.ones(4).to("cuda")                       # H2D from pageable memory
        dev.copy_(mode.pin(torch.ones(4)))             # pinned but blocking
        dev.copy_(mode.pin(torch.ones(4)), non_blocking=True)  # the one allowed
    assert [c[0] for c in mode.crossings] == ["D2H .to()", "H2D .to()", "H2D copy_",
                                              "H2D copy_"]
    assert [c[1] and c[2] for c in mode.crossings] == [False, False, False, True]
    opt.close()

