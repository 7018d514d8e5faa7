"""qgZ's reduce-scatter issued asynchronously off the gloo ring (the path NCCL takes), and the
hpZ index tensors of qwZ/qgZ built once (GPU checklist: "Issue collectives async and do the
decode or sum inside the handle's wait()"; "No host->device copy from pageable memory inside a
step ... Build small index tensors once, on the device, at construction").

ZEROKERN_GLOO_RING=0 puts the quantized ops on the caller's thread with torch's collectives,
as on NCCL. Checked there, on 2 gloo ranks (one hop) and 4 as 2 nodes x 2 (hpZ: two hops):
- every all-to-all is issued with async_op=True, all of them before the handle is waited for
  (each at a fixed point of the schedule, never from wait());
- the last hop's decode and the sum run only in wait(): `out` is untouched (NaN) until then;
- the result is bitwise the gloo ring's (the synchronous path, whose arithmetic is the old one);
- per call, no tensor is made from host data (aten.lift_fresh: torch.as_tensor(list)) and no
  host tensor is moved to a device (.to(device) of a CPU tensor, _to_copy/copy_ CPU->device):
  on a GPU each is a pageable host->device copy that synchronizes the stream.
"""

from __future__ import annotations

import functools
import types
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from zerokern.comm import quantized as Q
from zerokern.comm.collectives import GroupComm
from zerokern.comm.mesh import make_comm
from zerokern.kernels.blockquant import codec_for
from zerokern.platform.device import handle as device_handle

from ..support.harness import cached, case, run_cases

aten = torch.ops.aten
CALLS = 3


# ---- instruments ------------------------------------------------------------------------------
class HostToDevice(TorchDispatchMode):
    """Counts, on this thread, tensors made from host data and host tensors sent to a device:
    aten.lift_fresh (torch.tensor / torch.as_tensor of a list), _to_copy / copy_ from a CPU
    tensor to another device, and Tensor.to(device) of a CPU tensor (a no-op on the CPU, where
    the dispatcher never sees it; a pageable H2D copy on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.lift_fresh.default, aten.lift_fresh_copy.default):
            self.n += 1
        elif func is aten._to_copy.default:
            dev = kwargs.get("device")
            if args[0].device.type == "cpu" and dev is not None and \
                    torch.device(dev).type != "cpu":
                self.n += 1
        elif func is aten.copy_.default:
            if args[1].device.type == "cpu" and args[0].device.type != "cpu":
                self.n += 1
        return func(*args, **kwargs)

    def __enter__(self):
        orig = torch.Tensor.to
        mode = self

        def to(t, *a, **kw):
            dev = kw.get("device")
            for x in a:
                if isinstance(x, (torch.device, str)):
                    dev = x
                elif isinstance(x, torch.Tensor):
                    dev = x.device
            if dev is not None and t.device.type == "cpu":
                mode.n += 1
            return orig(t, *a, **kw)

        self._patch = mock.patch.object(torch.Tensor, "to", to)
        self._patch.start()
        return super().__enter__()

    def __exit__(self, *exc):
        self._patch.stop()
        return super().__exit__(*exc)


class Watch:
    """Records the all-to-alls issued (their async_op) and the decodes run, in order."""

    def __init__(self) -> None:
        self.events = []

    def patches(self):
        a2a, decode = dist.all_to_all_single, Q._decode

        def all_to_all_single(*a, **kw):
            self.events.append(("a2a", kw.get("async_op", False)))
            return a2a(*a, **kw)

        def _decode(*a, **kw):
            self.events.append(("decode", None))
            return decode(*a, **kw)

        return (mock.patch.object(dist, "all_to_all_single", all_to_all_single),
                mock.patch.object(Q, "_decode", _decode))

    def count(self, kind: str) -> int:
        return sum(1 for k, _ in self.events if k == kind)


def _inp(rank: int, n: int, c: int, call: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * call + 17 * rank + n)
    x = torch.randn(n, c // 128, 128, generator=g)
    return (x * 10.0 ** (torch.rand(n, c // 128, 1, generator=g) * 4 - 2)).view(-1)


def _no_ring():
    return mock.patch.dict("os.environ", {"ZEROKERN_GLOO_RING": "0"})


# ---- cases ---------------------------------------------------------------------------------------
def _async_case(rank, levels, ref_levels, n, bits, c=512):
    """One qgZ reduce-scatter off the ring: what was issued before wait(), what wait() did,
    and the result against the ring's."""
    inp = _inp(rank, n, c)
    out = torch.full((c,), float("nan"))
    w = Watch()
    p1, p2 = w.patches()
    with p1, p2:
        h = Q.reduce_scatter_quantized_(levels, out, inp.clone(), bits, codec_for,
                                        async_op=True)
        before = {"a2a": [a for k, a in w.events if k == "a2a"], "decodes": w.count("decode"),
                  "out_untouched": bool(out.isnan().all())}
        h.wait()
        after = {"a2a": w.count("a2a"), "decodes": w.count("decode")}
    ref = torch.empty(c)
    Q.reduce_scatter_quantized_(ref_levels, ref, inp.clone(), bits, codec_for).wait()
    return {"before": before, "after": after, "bitwise": torch.equal(out, ref),
            "finite": bool(out.isfinite().all())}


def _index_case(rank, levels, ref_levels, n, ref_perm, c=256):
    """CALLS reduce-scatters over levels with a regrouping index: host->device tensor
    creations per call, and the result against the ring's on the regrouped input."""
    counts, same = [], True
    for call in range(CALLS):
        inp = _inp(rank, n, c, call)
        out = torch.empty(c)
        with HostToDevice() as m:
            Q.reduce_scatter_quantized_(levels, out, inp.clone(), 8, codec_for).wait()
        counts.append(m.n)
        ref = torch.empty(c)
        x = inp.view(n, c)
        if ref_perm is not None:
            x = x[ref_perm]
        Q.reduce_scatter_quantized_(ref_levels, ref, x.reshape(-1).clone(), 8,
                                    codec_for).wait()
        same &= torch.equal(out, ref)
    return {"counts": counts, "bitwise": same}


def _worker2(rank, ws):
    with _no_ring():
        direct = GroupComm(None)
    ring = GroupComm(None)
    assert direct.ring is None and ring.ring is not None
    cases = {
        f"flat_int{b}": functools.partial(_async_case, rank, [Q.Level(direct)],
                                          [Q.Level(ring)], ws, b) for b in (8, 4)}
    # a regrouping index on a flat group: the rows swapped, as the hpZ hop 1 regroups them
    cases["flat_perm"] = functools.partial(_index_case, rank, [Q.Level(direct, [1, 0])],
                                           [Q.Level(ring)], ws, [1, 0])
    cases["flat_perm_ring"] = functools.partial(_index_case, rank, [Q.Level(ring, [1, 0])],
                                                [Q.Level(ring)], ws, [1, 0])
    return run_cases(cases)


def _gather_case(rank, direct, ring, c=256):
    """qwZ's two-hop gather (hpZ) CALLS times: host->device tensor creations per call, and the
    result against the ring's."""
    counts, same = [], True
    for call in range(CALLS):
        src = _inp(rank, 1, c, call)
        full = torch.empty(4 * c)
        with HostToDevice() as m:
            direct.q_gather.all_gather_(full, src, codec_for).wait()
        counts.append(m.n)
        ref = torch.empty(4 * c)
        ring.q_gather.all_gather_(ref, src, codec_for).wait()
        same &= torch.equal(full, ref)
    return {"counts": counts, "bitwise": same}


class FakeStreams:
    """torch.cuda's streams and events as a log, so the side-stream orchestration of qgZ's two
    hops on a GPU ([Note: qgZ issued async]) runs on the CPU: what waits for what, in which
    order, and which tensors are marked for which stream."""

    def __init__(self, log: list, inp: torch.Tensor) -> None:
        self.log, self.inp = log, inp
        outer = self

        class Stream:
            def __init__(self, name):
                self.name = name

            def wait_stream(self, other):
                outer.log.append(("wait_stream", self.name, other.name))

            def wait_event(self, ev):
                outer.log.append(("wait_event", self.name, ev.on))

        class Event:
            on = None

            def record(self, stream):
                self.on = stream.name
                outer.log.append(("record_event", stream.name))

        class Context:
            def __init__(self, stream):
                self.stream = stream

            def __enter__(self):
                outer.log.append(("enter", self.stream.name))
                outer.current = self.stream

            def __exit__(self, *exc):
                outer.log.append(("exit", self.stream.name))
                outer.current = outer.compute

        self.compute, self.side = Stream("compute"), Stream("side")
        self.current = self.compute

        def record_stream(t, stream):
            what = "inp" if t.data_ptr() == outer.inp.data_ptr() else "hop"
            outer.log.append(("record_stream", what, stream.name))

        self._patches = [
            mock.patch.object(Q, "_side_stream_for", lambda levels, inp: self.side),
            # the inputs are CPU tensors standing in for CUDA ones: the device handle is CUDA's
            mock.patch.object(Q, "handle", lambda *a, **k: device_handle("cuda")),
            mock.patch.object(torch.cuda, "current_stream", lambda device=None: self.current),
            mock.patch.object(torch.cuda, "stream", Context),
            mock.patch.object(torch.cuda, "Event", Event),
            mock.patch.object(torch.Tensor, "record_stream", record_stream),
        ]

    def __enter__(self):
        for p in self._patches:
            p.start()
        return self

    def __exit__(self, *exc):
        for p in reversed(self._patches):
            p.stop()


def _side_stream_case(rank, levels, ref_levels, ws, c=512):
    inp = _inp(rank, ws, c)
    out = torch.full((c,), float("nan"))
    w = Watch()
    p1, p2 = w.patches()
    with p1, p2, FakeStreams(w.events, inp):
        h = Q.reduce_scatter_quantized_(levels, out, inp, 8, codec_for, async_op=True)
        issue = list(w.events)
        del w.events[:]
        h.wait()
        waited = list(w.events)
    ref = torch.empty(c)
    Q.reduce_scatter_quantized_(ref_levels, ref, inp.clone(), 8, codec_for).wait()
    return {"issue": issue, "wait": waited, "bitwise": torch.equal(out, ref)}


def _worker4(rank, ws):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    kw = dict(mesh=mesh, hpz=True, qwz=True, qgz_bits=8, codec_for=codec_for)
    with _no_ring():
        direct = make_comm(**kw)
    ring = make_comm(**kw)
    assert direct.shard.ring is None and ring.shard.ring is not None
    cases = {f"hier_int{b}": functools.partial(_async_case, rank, direct.q_levels,
                                               ring.q_levels, ws, b) for b in (8, 4)}
    cases["hier_index"] = functools.partial(_index_case, rank, direct.q_levels,
                                            ring.q_levels, ws, None)
    cases["hier_index_ring"] = functools.partial(_index_case, rank, ring.q_levels,
                                                 ring.q_levels, ws, None)
    cases["gather_index"] = functools.partial(_gather_case, rank, direct, ring)
    cases["side_stream"] = functools.partial(_side_stream_case, rank, direct.q_levels,
                                             ring.q_levels, ws)
    return run_cases(cases)


# ---- tests ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 4])
def test_qgz_all_to_all_is_async_and_decoded_in_wait(bits):
    for r, v in enumerate(case(cached(_worker2, 2), f"flat_int{bits}")):
        assert v["before"] == {"a2a": [True], "decodes": 0, "out_untouched": True}, (r, v)
        assert v["after"] == {"a2a": 1, "decodes": 1}, (r, v)
        assert v["bitwise"] and v["finite"], (r, v)


@pytest.mark.parametrize("bits", [8, 4])
def test_qgz_two_hops_issued_async_at_the_call_last_decode_in_wait(bits):
    """hpZ: both hops' all-to-alls are issued by the call (hop 1's result is needed on this
    host to send hop 2: on the CPU it is decoded there; on a GPU on the side stream); hop 2's
    decode and sum wait for wait()."""
    for r, v in enumerate(case(cached(_worker4, 4), f"hier_int{bits}")):
        assert v["before"] == {"a2a": [True, True], "decodes": 1, "out_untouched": True}, \
            (r, v)
        assert v["after"] == {"a2a": 2, "decodes": 2}, (r, v)
        assert v["bitwise"] and v["finite"], (r, v)


def test_qgz_two_hops_on_a_gpu_run_hop_one_on_the_side_stream():
    """[Note: qgZ issued async] with torch.cuda's streams faked (the CPU runs the collectives):
    the side stream waits for the compute stream and holds inp before hop 1 is issued on it;
    hop 2 is issued from it, then an event is recorded there; wait() makes the compute stream
    wait for that event before the last decode, then marks hop 2's tensors (made on the side
    stream) as used by the compute stream. Nothing waits on the host for a stream."""
    for r, v in enumerate(case(cached(_worker4, 4), "side_stream")):
        assert v["issue"] == [
            ("wait_stream", "side", "compute"), ("record_stream", "inp", "side"),
            ("enter", "side"), ("a2a", True), ("decode", None), ("a2a", True),
            ("record_event", "side"), ("exit", "side")], (r, v)
        assert v["wait"] == [("wait_event", "compute", "side"), ("decode", None)] + \
            [("record_stream", "hop", "compute")] * 3, (r, v)
        assert v["bitwise"], (r, v)


@pytest.mark.parametrize("name", ["flat_perm", "flat_perm_ring"])
def test_qgz_regrouping_index_is_not_rebuilt_per_call(name):
    for r, v in enumerate(case(cached(_worker2, 2), name)):
        assert v["counts"] == [0] * CALLS and v["bitwise"], (r, v)


@pytest.mark.parametrize("name", ["hier_index", "hier_index_ring"])
def test_hpz_qgz_index_is_not_rebuilt_per_call(name):
    for r, v in enumerate(case(cached(_worker4, 4), name)):
        assert v["counts"] == [0] * CALLS and v["bitwise"], (r, v)


def test_hpz_qwz_gather_order_is_not_moved_per_call():
    for r, v in enumerate(case(cached(_worker4, 4), "gather_index")):
        assert v["counts"] == [0] * CALLS and v["bitwise"], (r, v)


def test_the_instrument_counts_host_data():
    """The counter's own check: torch.as_tensor of a list and .to(device) of a CPU tensor count;
    device-side work does not."""
    x = torch.ones(4)
    with HostToDevice() as m:
        x.mul(2).index_select(0, torch.zeros(1, dtype=torch.long))
    assert m.n == 0
    with HostToDevice() as m:
        torch.as_tensor([1, 0])
        x.to(torch.device("cpu"))
        x.to(torch.float16)  # a dtype only: not a move
    assert m.n == 2


def test_cpu_tensors_to_an_nccl_group_raise_a_clear_error():
    gc = types.SimpleNamespace(world_size=2, rank=0, backend="nccl", group=None, ring=None,
                               abort=None, log=None, dim="shard",
                               stats=types.SimpleNamespace(add=lambda *a: None),
                               _ring_for=lambda t: None)
    with pytest.raises(ValueError, match="NCCL.*CPU"):
        Q.reduce_scatter_quantized_([Q.Level(gc)], torch.empty(128), torch.zeros(256), 8,
                                    codec_for)
    with pytest.raises(ValueError, match="NCCL.*CPU"):
        Q.all_gather_quantized_(gc, torch.empty(256), torch.zeros(128), codec_for)
