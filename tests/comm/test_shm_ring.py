"""The shared-memory ring (comm/shm.py, [Note: a shared-memory ring]) at N = 2 and 3.

- Collectives against independent references: all-gather equals every rank's seeded input laid
  side by side (exactly), reduce-scatter the float64 sum (1e-6; at N = 2 the fp32 sum exactly),
  with a negative control; all-reduce leaves the same bits on every rank. Slots of 4 KiB force
  many rounds, so both slots are reused many times over (a round that overwrote a slot its
  peer still read would show as wrong values). The same calls through the TCP ring give the
  same values (bit for bit at N = 2).
- Set-up: every rank uses shared memory when each can map the others' segments; when one
  rank cannot, all of them keep the TCP ring, and the collectives stay right. No segment is left
  in /dev/shm.
- A peer that is gone, one that never comes (the group's timeout) and a stopped ring raise at
  once instead of waiting; ranks that issue collectives of different sizes, or reduce-scatters
  of different dtypes, raise (each round says what it carries) instead of mixing the data, and
  the exchange refuses every later collective.
- ZeroAdamW stages 0, 2 and 3 train to the same bits through shared memory as through the TCP
  ring at N = 2 (every sum has two terms), within 1e-6 at N = 3.
"""

import glob
import os
import subprocess
import sys
import time

import pytest
import torch

from zerokern.comm import GroupComm, shm

from ..support.harness import cached, case, fresh_rings, run_cases
from ..support.models import make_model, train_zero, zero_opt

# x86-64 Linux with /dev/shm (CI's machines): elsewhere every group keeps the TCP rings
pytestmark = pytest.mark.skipif(not shm.supported(), reason="no shared-memory ring here")

PER = 5000  # elements per rank's chunk: 20 KB of fp32, 5 rounds of a 4 KiB slot


def _inp(rank: int, ws: int, dtype=torch.float32, seed: int = 100) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + rank)
    return torch.randn(ws * PER, generator=g).to(dtype)


def _calls(comm: GroupComm, rank: int, ws: int) -> dict:
    out = {}
    for dt in (torch.float32, torch.bfloat16):
        o = torch.full((PER,), float("nan"), dtype=dt)
        comm.reduce_scatter_(o, _inp(rank, ws, dt))
        out[f"rs_apart_{dt}"] = o
    w = _inp(rank, ws)
    comm.reduce_scatter_(w[rank * PER:(rank + 1) * PER], w)  # in place (stage 1)
    out["rs_in_place"] = w[rank * PER:(rank + 1) * PER].clone()
    o64 = torch.full((PER,), float("nan"), dtype=torch.float64)
    comm.reduce_scatter_(o64, _inp(rank, ws))  # another dtype: summed in the input, copied
    out["rs_other_dtype"] = o64
    for dt in (torch.float32, torch.int8):
        full = torch.zeros(ws * PER, dtype=dt)
        mine = (_inp(rank, ws, seed=7)[:PER] * 10).to(dt)
        comm.all_gather_(full, mine)  # apart (stage 3's shard)
        out[f"ag_{dt}"] = full
    full = _inp(rank, ws, seed=9)
    comm.all_gather_(full, full[rank * PER:(rank + 1) * PER])  # in place (stages 1-2)
    out["ag_in_place"] = full
    t = _inp(rank, ws, seed=11)
    comm.all_reduce_(t)
    out["all_reduce"] = t
    return out


def _collectives(rank, ws):
    shm.SLOT_BYTES = 4096  # many rounds per collective
    fresh_rings()
    comm = GroupComm()
    res = _calls(comm, rank, ws)
    res["uses_shm"] = comm.ring.uses_shm
    fresh_rings()
    tcp = GroupComm()
    tcp.ring._shm = False  # the TCP ring on the same group
    res["tcp"] = _calls(tcp, rank, ws)
    res["tcp_uses_shm"] = tcp.ring.uses_shm
    res["left"] = glob.glob(f"/dev/shm/zerokern-ring-{os.getpid()}-*")
    return res


@pytest.mark.parametrize("ws", [2, 3])
def test_shm_collectives_match_references(ws):
    res = cached(_collectives, ws)
    full = sum(_inp(r, ws).double() for r in range(ws))
    missing = sum(_inp(r, ws).double() for r in range(ws - 1))
    for r in range(ws):
        got = res[r]
        assert got["uses_shm"] and not got["tcp_uses_shm"]
        assert got["left"] == []  # unlinked once every rank mapped it
        ref = full[r * PER:(r + 1) * PER]
        for name in ("rs_apart_torch.float32", "rs_in_place", "rs_other_dtype"):
            torch.testing.assert_close(got[name].double(), ref, rtol=1e-6, atol=1e-6,
                                       msg=f"rank {r} {name}")
            assert not torch.allclose(got[name].double(), missing[r * PER:(r + 1) * PER],
                                      rtol=1e-3, atol=1e-3)  # negative control
        bf = sum(_inp(q, ws, torch.bfloat16).double() for q in range(ws))[r * PER:(r + 1) * PER]
        torch.testing.assert_close(got["rs_apart_torch.bfloat16"].double(), bf, rtol=2e-2,
                                   atol=2e-2)
        for dt in (torch.float32, torch.int8):
            want = torch.cat([(_inp(q, ws, seed=7)[:PER] * 10).to(dt) for q in range(ws)])
            assert torch.equal(got[f"ag_{dt}"], want)
        want = torch.cat([_inp(q, ws, seed=9)[q * PER:(q + 1) * PER] for q in range(ws)])
        assert torch.equal(got["ag_in_place"], want)
        ar = sum(_inp(q, ws, seed=11).double() for q in range(ws))
        torch.testing.assert_close(got["all_reduce"].double(), ar, rtol=1e-6, atol=1e-6)
        assert torch.equal(got["all_reduce"], res[0]["all_reduce"])  # the same bits everywhere
        for name, t in got["tcp"].items():  # the TCP ring: the same values
            if ws == 2 or not t.is_floating_point():
                assert torch.equal(got[name], t), name
            else:  # another order of the adds: within rounding (bf16: a few ulps)
                tol = 2e-2 if t.dtype == torch.bfloat16 else 1e-5
                torch.testing.assert_close(got[name], t, rtol=tol, atol=tol, msg=name)
        if ws == 2:  # one fp32 add: the same bits as the plain sum
            exact = (_inp(0, 2) + _inp(1, 2))[r * PER:(r + 1) * PER]
            assert torch.equal(got["rs_apart_torch.float32"], exact)
            assert torch.equal(got["rs_in_place"], exact)


class _SmallDevShm:
    """A container's 64 MB /dev/shm with 36 MB in use: one more segment would leave less than
    half of it free."""
    f_frsize, f_blocks, f_bavail = 4096, 64 * 256, 28 * 256


def _one_rank_cannot(rank, ws, why):
    if rank == 1:  # this child process only
        if why == "unsupported":  # another host, no /dev/shm, ZEROKERN_SHM=0
            shm.supported = lambda: False  # noqa: E731
        else:  # "small /dev/shm"
            real = os.statvfs
            shm.os.statvfs = lambda path: _SmallDevShm() if path == "/dev/shm" else real(path)
    fresh_rings()
    comm = GroupComm()
    out = _calls(comm, rank, ws)
    out["uses_shm"] = comm.ring.uses_shm
    out["left"] = glob.glob(f"/dev/shm/zerokern-ring-{os.getpid()}-*")
    return out


@pytest.mark.parametrize("why", ["unsupported", "small /dev/shm"])
def test_one_rank_without_shared_memory_keeps_every_rank_on_tcp(why):
    res = cached(_one_rank_cannot, 2, why)
    full = _inp(0, 2) + _inp(1, 2)
    for r in range(2):
        assert res[r]["uses_shm"] is False
        assert res[r]["left"] == []
        assert torch.equal(res[r]["rs_in_place"], full[r * PER:(r + 1) * PER])
        assert torch.equal(res[r]["all_reduce"], res[0]["all_reduce"])


def _connect_raises(rank, ws):
    """A collective of the set-up raises (here the last one, on every rank): the segment this
    rank created is unlinked all the same."""
    real = shm.dist.all_reduce

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    shm.dist.all_reduce = boom
    try:
        shm.ShmExchange.connect(None, rank, ws, lambda: None)
        err = "no error"
    except RuntimeError as e:
        err = str(e)
    finally:
        shm.dist.all_reduce = real
    return err, glob.glob(f"/dev/shm/zerokern-ring-{os.getpid()}-*")


def test_a_set_up_that_raises_leaves_nothing_in_dev_shm():
    for r, (err, left) in enumerate(cached(_connect_raises, 2)):
        assert err == "boom", f"rank {r}: {err}"
        assert left == [], f"rank {r}: {left}"


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _mismatch(rank, ws):
    """The ranks disagree on a collective (its size; the dtype a reduce-scatter sums): every
    rank raises, none mixes the data, and the exchange refuses what comes after."""
    out = {}
    for what in ("size", "dtype"):
        fresh_rings()
        comm = GroupComm()
        t = torch.ones(8 * ws)
        comm.all_gather_(t, t[rank * 8:(rank + 1) * 8])  # sets the segments up
        ex = comm.ring._shm
        try:
            if what == "size":
                ex.all_gather(torch.zeros((16 if rank == 0 else 8) * ws))
            else:
                dt = torch.float16 if rank == 0 else torch.bfloat16
                ex.reduce_scatter(torch.zeros(8, dtype=dt), torch.ones(8 * ws, dtype=dt))
            out[what] = "no error"
        except RuntimeError as e:
            out[what] = str(e)
        try:
            ex.all_gather(torch.zeros(8 * ws))
            out[what + "_after"] = "no error"
        except RuntimeError as e:
            out[what + "_after"] = str(e)
    return out


def _stuck_peer(rank, ws):
    res = {"mismatch": _mismatch(rank, ws)}

    def rank0_waits(prepare):
        """A fresh exchange (set up by both ranks); then rank 0 starts an all-gather rank 1
        never joins: (error, seconds to raise)."""
        fresh_rings()
        comm = GroupComm()
        t = torch.ones(8 * ws)
        comm.all_gather_(t, t[rank * 8:(rank + 1) * 8])  # sets the segments up
        ex = comm.ring._shm
        assert ex
        if rank != 0:
            return None
        prepare(comm, ex)
        t0 = time.monotonic()
        try:
            ex.all_gather(torch.ones(8 * ws))
        except RuntimeError as e:
            return str(e), time.monotonic() - t0
        return "no error", 0.0

    def gone(comm, ex):  # rank 1 "exits": its pid names no process
        ex.pids[1] = _dead_pid()

    def late(comm, ex):  # rank 1 is alive but never comes: the group's timeout (here 0.3 s)
        ex.timeout_s = 0.3
        ex.pids[1] = os.getpid()

    def stopped(comm, ex):  # the ring was stopped (a failure elsewhere on the group)
        comm.ring.stop("a peer's error")

    res.update(run_cases({"gone": lambda: rank0_waits(gone), "timeout": lambda: rank0_waits(late),
                          "stopped": lambda: rank0_waits(stopped)}))
    return res


def test_a_peer_gone_late_or_stopped_raises_instead_of_waiting():
    res = cached(_stuck_peer, 2)
    for r in range(2):
        for what in ("size", "dtype"):
            got = res[r]["mismatch"]
            assert "issued different collectives" in got[what], got
            assert "earlier shared-memory collective" in got[what + "_after"], got
    msg, took = case(res, "gone")[0]
    assert "exited during a collective" in msg and took < 5.0
    msg, took = case(res, "timeout")[0]
    assert "did not reach the same collective" in msg and 0.25 < took < 5.0
    msg, _ = case(res, "stopped")[0]
    assert "a peer's error" in msg


def _train(rank, ws):
    out = {}
    for stage in (0, 2, 3):
        for mode in ("shm", "tcp"):
            os.environ["ZEROKERN_SHM"] = "1" if mode == "shm" else "0"
            fresh_rings()
            model = make_model()
            opt = zero_opt(model, stage)
            rec = train_zero(model, opt, rank, ws, steps=3)
            out[(stage, mode)] = (rec["params"][-1], rec["grad_norm"],
                                  opt.comm.shard.ring.uses_shm,
                                  opt.memory_report()["comm_buffers"])
    os.environ["ZEROKERN_SHM"] = "1"
    return out


@pytest.mark.parametrize("ws", [2, 3])
def test_zero_adamw_trains_alike_through_shared_memory_and_tcp(ws):
    res = cached(_train, ws)
    for r in range(ws):
        for stage in (0, 2, 3):
            p_shm, norms_shm, used, held = res[r][(stage, "shm")]
            p_tcp, norms_tcp, used_tcp, held_tcp = res[r][(stage, "tcp")]
            assert used and not used_tcp, stage
            # this rank's segments, each group once: stage 3's reduce-scatters have a group
            # of their own; its Comm shares the world group with the optimizer's
            seg = 2 * shm.SLOT_BYTES + 4096
            assert held == (2 if stage == 3 else 1) * seg and held_tcp == 0, (stage, held)
            for k in p_shm:
                if ws == 2:
                    assert torch.equal(p_shm[k], p_tcp[k]), (stage, k)
                else:
                    torch.testing.assert_close(p_shm[k], p_tcp[k], rtol=1e-6, atol=1e-6)
            assert norms_shm == pytest.approx(norms_tcp, rel=1e-6)
