"""ZeRO++'s quantized collectives (issue 22 item 4): qwZ (`quantized_weights=True`, stage 3's
param all-gathers int8 with the own piece exact) and qgZ (`quantized_gradients`, the grad
reduce-scatter as an int8/int4 all-to-all reduced in fp32; two hops with hpZ on a 2x2 mesh).

The references are independent: each rank rebuilds every rank's input (seeded) and evaluates
the exact result in float64 (the collectives), or runs the torch model on every rank's batch
(DDP's summed grads, the exact params gathered with plain dist.all_gather). The bounds are the
documented ones (comm/quantized.py): a gathered element of another rank's block is off by at
most absmax(block)/254; a reduced grad element by at most the sum over the other ranks of
absmax(block)/(2Q) (Q = 127 int8, 7 int4), summed over the two hops with hpZ. Each check
reports err/bound (<= 1 passes) and is shown to fail on a broken variant: the scales read one
block off, the own piece quantized too, an int4 reduction judged by the int8 bound, the hops'
chunk order not regrouped. 2 ranks, and 4 as 2 nodes x 2 for the hierarchical path.
"""

from __future__ import annotations

import functools
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import zerokern as zk
from zerokern.comm import quantized as Q
from zerokern.comm.collectives import GroupComm
from zerokern.comm.mesh import make_comm
from zerokern.kernels import blockquant
from zerokern.kernels.blockquant import codec_for

from ..support import models as M
from ..support.harness import cached, case, run_cases

QMAX = {8: 127, 4: 7}
STEPS = 4
# Training with qwZ / qgZ against plain stage 3 over STEPS steps of the tiny model (M.rel_err,
# the worst param's relative difference). Measured on 2 ranks: qwZ 1.0e-3, qgZ int8 2.7e-3,
# both 1.8e-3, int4 3.8e-2; hpZ+qwZ+qgZ on 2x2 (see the 4-rank case). The quantization error
# dwarfs an lr x 1.01 change (1.8e-4), so the negative control is a broken codec instead
# (scales one block off), which must exceed the tolerance.
TOL_TRAIN = {8: 6e-3, 4: 8e-2}
LONG_STEPS = 300


# ---- helpers ---------------------------------------------------------------------------------
def _pieces(seed: int, n: int, c: int) -> torch.Tensor:
    """(n, c) fp32 values whose 128-blocks span magnitudes 1e-3..1e3 (per-block scales matter)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c // 128, 128, generator=g)
    mag = 10.0 ** (torch.rand(n, c // 128, 1, generator=g) * 6 - 3)
    return (x * mag).view(n, c)


def _amax(x: torch.Tensor) -> torch.Tensor:
    """Per element, the absmax of its 128-block (x (..., c))."""
    b = x.double().reshape(*x.shape[:-1], -1, 128).abs().amax(-1, keepdim=True)
    return b.expand(*b.shape[:-1], 128).reshape(x.shape)


def _ratio(err: torch.Tensor, bound: torch.Tensor) -> float:
    return float((err / bound.clamp_min(1e-30)).max())


# ---- the collectives ---------------------------------------------------------------------------
def _qwz_collective(rank, ws, memo):
    c = 1024
    every = torch.stack([_pieces(100 + r, 1, c)[0] for r in range(ws)])
    gc = memo["gc"]
    gc.stats.reset()
    full = torch.empty(ws * c)
    Q.all_gather_quantized_(gc, full, every[rank].clone(), codec_for).wait()
    got = full.view(ws, c).double()
    others = [r for r in range(ws) if r != rank]
    err = (got[others] - every[others].double()).abs()
    return {"ratio": _ratio(err, _amax(every[others]) / 254),
            "max_err": float(err.max()),
            "own_exact": torch.equal(full.view(ws, c)[rank], every[rank]),
            "bytes": gc.stats.as_dict()["all_gather"]}


def _roll_scales(unpack):
    """Negative control: the scales read one block off."""
    def bad(payload, numel, bits, block=128):
        codes, scale = unpack(payload, numel, bits, block)
        return codes, scale.roll(1)
    return bad


def _own_quantized_too(full, rank, src):
    """Negative control: the own piece round-tripped through the codec like the others'."""
    full[rank].copy_(blockquant.dequantize(*blockquant.quantize(src, 128, 8), 128, 8,
                                           full.dtype))


def _qgz_collective(rank, ws, memo, bits, levels_key="flat", judge_bits=None):
    c = 512
    contrib = torch.stack([_pieces(200 + r, ws, c).view(-1) for r in range(ws)])  # (ws, ws*c)
    out = torch.empty(c)
    Q.reduce_scatter_quantized_(memo[levels_key], out, contrib[rank].clone(), bits, codec_for)
    chunks = contrib.view(ws, ws, c)[:, rank].double()  # every rank's chunk for me
    exact = chunks.sum(0)
    q = QMAX[judge_bits or bits]
    if levels_key in ("flat", "flat4"):
        bound = sum(_amax(chunks[r]) for r in range(ws) if r != rank) / (2 * q)
    else:
        bound = _two_hop_bound(contrib, rank, c, q)
    bound = bound + 1e-6 * chunks.abs().sum(0)
    err = (out.double() - exact).abs()
    return {"ratio": _ratio(err, bound), "max_err": float(err.max())}


def _two_hop_bound(contrib, rank, c, q):
    """[Note: qgZ hierarchical over nodes] on the 2x2 mesh [[0, 1], [2, 3]]: hop 1 sums my
    chunk's contributions inside each node i at the rank (i, j) (my j); hop 2 brings node i's
    partial to me, quantized again."""
    i0, j0 = divmod(rank, 2)
    total = 0
    for i in range(2):
        holder = 2 * i + j0
        parts = contrib[[2 * i, 2 * i + 1]].view(2, 4, c)[:, rank].double()
        e1 = sum(_amax(parts[k]) for k in range(2) if 2 * i + k != holder) / (2 * q)
        total = total + e1
        if i != i0:  # sent across, quantized: its absmax grows by at most e1's
            total = total + (_amax(parts.sum(0)) + e1.amax()) / (2 * q)
    return total


def _nonfinite(rank, ws, memo):
    """An inf in one rank's grads makes the whole block non-finite at the receiver."""
    c = 256
    x = _pieces(300 + rank, ws, c).view(-1)
    if rank == 1:
        x[5] = float("inf")  # element 5 of rank 0's chunk
    out = torch.empty(c)
    Q.reduce_scatter_quantized_(memo["flat"], out, x, 8, codec_for)
    return int((~torch.isfinite(out[:128])).sum()), int((~torch.isfinite(out[128:])).sum())


# ---- the engine ----------------------------------------------------------------------------------
def _exact_full(f) -> torch.Tensor:
    """A stage-3 buffer's exact params gathered with plain dist.all_gather."""
    parts = [torch.empty_like(f.param_shard) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, f.param_shard)
    return torch.cat(parts)


def _qwz_engine(rank, ws, mesh=None, broken_order=False):
    """Inside the forward: the other ranks' pieces within the bound, the own piece exact;
    gathered_params() exact. mesh (2x2): hpZ, the forward gathers in two hops;
    broken_order: their rows placed in hop order, not by world rank (negative control)."""
    model = M.make_model()
    opt = M.zero_opt(model, 3, quantized_weights=True, mesh=mesh, hpz=mesh is not None)
    if broken_order:
        hg = opt.comm.q_gather
        hg.order = torch.arange(len(hg.order))
    unit = next(u for u in opt.units if u.module is model.blocks[0])
    flats = [f for f in opt.flat_groups if f.unit_index == unit.index]
    seen = []
    model.blocks[0].register_forward_pre_hook(
        lambda m, a: seen.append([f.full.clone() for f in flats]))
    M.train_zero(model, opt, rank, ws, 2)  # move the params off their init first
    seen.clear()
    loss = M.loss_fn(model, M.rank_tokens(2, rank, ws))
    exact = [_exact_full(f) for f in flats]
    opt.backward(loss)
    out = {"ratio": 0.0, "own_exact": True, "max_err": 0.0}
    for f, q, e in zip(flats, seen[0], exact):
        S = f.param_shard.numel()
        q, e = q.view(ws, S), e.view(ws, S)
        others = [r for r in range(ws) if r != rank]
        err = (q[others].double() - e[others].double()).abs()
        out["ratio"] = max(out["ratio"], _ratio(err, _amax(e[others]) / 254))
        out["max_err"] = max(out["max_err"], float(err.max()))
        out["own_exact"] &= torch.equal(q[rank], e[rank])
    opt.step()
    with opt.gathered_params():
        got = M.snapshot(model)
    ref = M.gather_state(opt, model, "master")  # trainable params, plain dist.all_gather
    ref["pos"] = M.make_model().pos.detach()  # frozen: never changes
    out["gathered_exact"] = M.bitwise_equal(got, ref)
    return out


def _flat_contrib(opt, model, rank, ws):
    """Every rank's local grads (the torch model on its batch) laid out as each buffer."""
    names = {id(p): n for n, p in model.named_parameters()}
    per_rank = []
    for r in range(ws):
        ref = M.make_model()
        M.loss_fn(ref, M.rank_tokens(0, r, ws)).backward()
        grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        bufs = []
        for g in opt.flat_groups:
            full = torch.zeros(g.layout.padded_numel, dtype=torch.float64)
            for p, s in zip(g.params, g.layout.slots):
                full[s.offset:s.offset + s.numel] = grads[names[id(p)]].double().reshape(-1)
            bufs.append(full)
        per_rank.append(bufs)
    return per_rank


def _qgz_engine(rank, ws, stage, bits, judge_bits=None, mesh=None, **kw):
    """The reduced grad shards after one backward vs the exact sum of every rank's grads."""
    model = M.make_model()
    opt = M.zero_opt(model, stage, quantized_gradients={8: "int8", 4: "int4"}[bits],
                     mesh=mesh, **kw)
    opt.backward(M.loss_fn(model, M.rank_tokens(0, rank, ws)))
    opt.clip_grad_norm_(1e9)  # waits for every reduction
    contrib = _flat_contrib(opt, model, rank, ws)
    q = QMAX[judge_bits or bits]
    me = opt.comm.shard.rank
    n = opt.comm.shard.world_size
    ratio, max_err = 0.0, 0.0
    for gi, g in enumerate(opt.flat_groups):
        L = g.layout
        for k in range(L.n_buckets):
            lo, hi = L.piece_range(k, me)
            off = L.shard_offset(k)
            if stage == 1:  # reduced in place, in the full grad buffer
                mine = opt.grad_sync.grads[gi][lo:hi].double()
            else:
                mine = opt.grad_sync.held_grads()[gi][off:off + hi - lo].double()
            xs = torch.stack([contrib[r][gi][lo:hi] for r in range(ws)])
            exact = xs.sum(0)
            if n == ws:  # one hop over every rank
                bound = sum(_amax(xs[r]) for r in range(ws) if r != rank) / (2 * q)
            else:  # HSDP: quantized inside each node (sent to the rank of my local
                # index there, mesh [[0, 1], [2, 3]]), the node sums all-reduced exactly
                bound = sum(_amax(xs[r]) for r in range(ws) if r % n != me) / (2 * q)
            bound = bound + 1e-5 * xs.abs().sum(0) + 1e-9
            err = (mine - exact).abs()
            ratio = max(ratio, _ratio(err, bound))
            max_err = max(max_err, float(err.max()))
    return {"ratio": ratio, "max_err": max_err}


def _train(rank, ws, memo, variant):
    """STEPS steps: the quantized variant against plain stage 3 (max rel param difference)."""
    kw = {"neg_scale": dict(quantized_weights=True, quantized_gradients=True),
          "qwz": dict(quantized_weights=True),
          "qgz8": dict(quantized_gradients="int8"), "qgz4": dict(quantized_gradients="int4"),
          "both": dict(quantized_weights=True, quantized_gradients=True)}[variant]
    model = M.make_model()
    opt = M.zero_opt(model, 3, mesh=memo.get("mesh"), **kw)
    if variant == "neg_scale":
        with mock.patch.object(Q, "unpack", _roll_scales(Q.unpack)):
            rec = M.train_zero(model, opt, rank, ws, STEPS)
    else:
        rec = M.train_zero(model, opt, rank, ws, STEPS)
    return M.rel_err(rec["params"][-1], memo["plain"]["params"][-1])


def _long(rank, ws, memo, steps):
    """Loss of zerokern.tools.gpt's "tiny" GPT on zerokern train's stdlib corpus after `steps` steps
    of zerokern train's schedule (warm-up, cosine; mean of the last 50 steps, over ranks):
    plain stage 3, qwZ + qgZ int8, plain at lr x 1.001 (how far a tiny perturbation alone
    moves the loss) and the negative control (plain at a quarter of the lr, which must land
    outside the 1% band)."""
    from zerokern.tools.gpt import build_gpt
    from zerokern.train.data import VOCAB, Batches, load_corpus
    from zerokern.train.loop import lr_lambda

    corpus = load_corpus(200_000)
    out = {}
    for name, kw in {"plain": {}, "all": dict(quantized_weights=True, quantized_gradients=True),
                     "nudged_lr": dict(lr=1.001e-2), "quarter_lr": dict(lr=2.5e-3)}.items():
        model = build_gpt("tiny", seed=0, vocab=VOCAB, seq=64)
        opt = zk.ZeroAdamW(model, stage=3, precision="fp32", backend=M.BACKEND,
                           **{"lr": 1e-2, **kw})
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(steps))
        data = Batches(corpus, 8, 64, 0, rank)
        losses = []
        for s in range(steps):
            x, y = data.get(s)
            loss = model.loss(x, y)
            opt.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            t = loss.detach().clone()
            dist.all_reduce(t)
            losses.append(float(t) / ws)
        out[name] = sum(losses[-50:]) / 50
    return out


# ---- workers ----------------------------------------------------------------------------------
def _worker2(rank, ws):
    memo = {"gc": GroupComm(None), "flat": [Q.Level(GroupComm(None))]}
    model = M.make_model()
    memo["plain"] = M.train_zero(model, M.zero_opt(model, 3), rank, ws, STEPS)
    cases = {
        "qwz_collective": functools.partial(_qwz_collective, rank, ws, memo),
        "qgz_int8": functools.partial(_qgz_collective, rank, ws, memo, 8),
        "qgz_int4": functools.partial(_qgz_collective, rank, ws, memo, 4),
        "nonfinite": functools.partial(_nonfinite, rank, ws, memo),
        "qwz_engine": functools.partial(_qwz_engine, rank, ws),
        "qgz_stage3_int8": functools.partial(_qgz_engine, rank, ws, 3, 8),
        "qgz_stage2_int4": functools.partial(_qgz_engine, rank, ws, 2, 4),
        "qgz_stage1_int8": functools.partial(_qgz_engine, rank, ws, 1, 8),
    }
    cases["fp16_skips"] = functools.partial(_fp16_skips, rank, ws)
    for v in ("neg_scale", "qwz", "qgz8", "qgz4", "both"):
        cases[f"train_{v}"] = functools.partial(_train, rank, ws, memo, v)
    # negative controls
    cases["neg_qwz_scale"] = functools.partial(
        _with, mock.patch.object(Q, "unpack", _roll_scales(Q.unpack)), _qwz_collective, rank,
        ws, memo)
    cases["neg_qwz_own"] = functools.partial(
        _with, mock.patch.object(Q, "_keep_own", _own_quantized_too), _qwz_collective, rank,
        ws, memo)
    cases["neg_qgz_scale"] = functools.partial(
        _with, mock.patch.object(Q, "unpack", _roll_scales(Q.unpack)), _qgz_collective, rank,
        ws, memo, 8)
    cases["neg_qgz_int4_as_int8"] = functools.partial(_qgz_engine, rank, ws, 2, 4,
                                                      judge_bits=8)
    return run_cases(cases)


def _fp16_skips(rank, ws):
    """fp16 with the dynamic loss scale (2^16 at first: the first steps overflow): with qwZ +
    qgZ the same steps are skipped as without (non-finite grads arrive non-finite)."""
    out = {}
    for q in (False, True):
        model = M.make_model()
        kw = dict(quantized_weights=True, quantized_gradients=True) if q else {}
        out[q] = M.train_zero(model, M.zero_opt(model, 3, precision="fp16", **kw), rank, ws,
                              STEPS)["skipped"]
    return out


def _worker2_long(rank, ws, steps):
    return run_cases({"long": functools.partial(_long, rank, ws, {}, steps)})


def _with(patch, fn, *args):
    with patch:
        return fn(*args)


def _worker4(rank, ws):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    comm = make_comm(mesh=mesh, hpz=True, qgz_bits=8, codec_for=codec_for)
    memo = {"mesh": mesh, "hier": comm.q_levels,
            "flat_perm": [Q.Level(lv.gc, None) for lv in comm.q_levels],
            # one hop over all 4 ranks: the CPU path's all_to_all_single branch (more than 2
            # ranks), and qwZ's flat gather over 4 ([Note: qgZ on the CPU ring])
            "flat4": [Q.Level(comm.shard.split(), None)], "gc": comm.shard}
    model = M.make_model()
    memo["plain"] = M.train_zero(model, M.zero_opt(model, 3), rank, ws, STEPS)
    cases = {
        "hier_int8": functools.partial(_qgz_collective, rank, ws, memo, 8, "hier"),
        "hier_int4": functools.partial(_qgz_collective, rank, ws, memo, 4, "hier"),
        "neg_hier_order": functools.partial(_qgz_collective, rank, ws, memo, 8, "flat_perm"),
        "flat4_int8": functools.partial(_qgz_collective, rank, ws, memo, 8, "flat4"),
        "flat4_int4": functools.partial(_qgz_collective, rank, ws, memo, 4, "flat4"),
        "qwz4": functools.partial(_qwz_collective, rank, ws, memo),
        "train_all": functools.partial(_train_hpz, rank, ws, memo),
        "hsdp_qgz": functools.partial(_qgz_engine, rank, ws, 2, 8, mesh=mesh),
        "debug_log": functools.partial(_debug_log, rank, ws, memo),
        "no_ring": functools.partial(_no_ring, rank, ws, memo),
        "qwz_engine_hpz": functools.partial(_qwz_engine, rank, ws, mesh),
        "neg_qwz_hop_order": functools.partial(_qwz_engine, rank, ws, mesh, True),
    }
    return run_cases(cases)


def _no_ring(rank, ws, memo):
    """ZEROKERN_GLOO_RING=0: the quantized ops issued on the caller's thread with torch's
    collectives (the path NCCL takes) train bitwise as on the ring thread."""
    recs = {}
    for ring in ("1", "0"):
        with mock.patch.dict("os.environ", {"ZEROKERN_GLOO_RING": ring}):
            model = M.make_model()
            opt = M.zero_opt(model, 3, mesh=memo["mesh"], hpz=True, quantized_weights=True,
                             quantized_gradients="int4")
            assert (opt.comm.shard.ring is None) == (ring == "0")
            recs[ring] = M.train_zero(model, opt, rank, ws, 2)["params"][-1]
    return M.bitwise_equal(recs["1"], recs["0"])


def _debug_log(rank, ws, memo):
    """ZEROKERN_DEBUG_COLLECTIVES=1: every rank records the same quantized collectives (the
    check at each step() raises otherwise), and a rank that records another one is caught."""
    out = {}
    with mock.patch.dict("os.environ", {"ZEROKERN_DEBUG_COLLECTIVES": "1"}):
        for name in ("same", "differ"):
            model = M.make_model()
            opt = M.zero_opt(model, 3, mesh=memo["mesh"], hpz=True, quantized_weights=True,
                             quantized_gradients=True)
            if name == "differ" and rank == 1:  # one rank's qgZ payload record differs
                opt.grad_sync.rs_comm.q_levels[1].gc.log.add("cross", "reduce_scatter",
                                                              torch.empty(1), "extra")
            try:
                M.train_zero(model, opt, rank, ws, 2)
                out[name] = "ok"
            except RuntimeError as e:
                out[name] = str(e)[:200]
    return out


def _train_hpz(rank, ws, memo):
    model = M.make_model()
    opt = M.zero_opt(model, 3, mesh=memo["mesh"], hpz=True, quantized_weights=True,
                     quantized_gradients=True)
    opt.reset_comm_stats()
    rec = M.train_zero(model, opt, rank, ws, 1)
    stats = opt.comm_stats()
    rec = M.train_zero(model, opt, rank, ws, STEPS - 1, start=1)
    return {"rel": M.rel_err(rec["params"][-1], memo["plain"]["params"][-1]),
            "dims": stats["dims"], "expect": _expected_bytes(opt)}


def _expected_bytes(opt):
    """comm_stats() of one step of hpZ+qwZ+qgZ on 2x2, from the buffers' sizes: forward
    gathers int8 in two hops ([Note: qwZ over nodes]: 1 payload across, then the 2 payloads
    to the node peer), the reduce-scatter's hops (1 of 2 node payloads of 2 chunks, 1 of 2
    cross payloads of 1 chunk), plus the exact gathers of gathered_params() in train_zero's
    snapshot over the world ring (3/4 of the unit, fp32). (The backward's exact node gathers
    from the hpZ secondary are test_hpz.py's.)"""
    fwd = rs_node = rs_cross = snap = 0
    for f in opt.flat_groups + opt.grad_sync.frozen:
        E = f.layout.padded_numel
        c = E // 4
        fwd += Q.wire_bytes(c)
        snap += 3 * c * 4
        if f.trainable:
            rs_node += Q.wire_bytes(2 * c)
            rs_cross += Q.wire_bytes(c)
    return {"fwd": fwd, "rs_node": rs_node, "rs_cross": rs_cross, "snap": snap}


def _results2():
    return cached(_worker2, 2)


def _results4():
    return cached(_worker4, 4)


# ---- tests: the collectives ---------------------------------------------------------------------
def test_qwz_gather_within_bound_own_piece_exact():
    for r, v in enumerate(case(_results2(), "qwz_collective")):
        assert v["ratio"] <= 1.0 and v["max_err"] > 0 and v["own_exact"], (r, v)
        # one payload of 1024 int8 codes + 8 fp32 scales sent (the ring's 1 of 2 pieces)
        assert v["bytes"] == Q.wire_bytes(1024), (r, v)


def test_qwz_negative_controls():
    for r, v in enumerate(case(_results2(), "neg_qwz_scale")):
        assert v["ratio"] > 10, (r, v)
    for r, v in enumerate(case(_results2(), "neg_qwz_own")):
        assert not v["own_exact"], (r, v)


@pytest.mark.parametrize("bits", [8, 4])
def test_qgz_reduce_within_bound(bits):
    for r, v in enumerate(case(_results2(), f"qgz_int{bits}")):
        assert v["ratio"] <= 1.0 and v["max_err"] > 0, (r, v)


def test_qgz_negative_control_scale_off_by_one_block():
    for r, v in enumerate(case(_results2(), "neg_qgz_scale")):
        assert v["ratio"] > 10, (r, v)


def test_fp16_overflow_skips_the_same_steps():
    for r, v in enumerate(case(_results2(), "fp16_skips")):
        assert v[True] == v[False] and any(v[False]) and not all(v[False]), (r, v)


def test_qgz_keeps_nonfinite_grads_nonfinite():
    # rank 0 receives rank 1's block with the inf: the whole block non-finite (so found_inf,
    # all-reduced over the world, skips the step everywhere), the next block finite
    assert case(_results2(), "nonfinite") == [(128, 0), (0, 0)]


@pytest.mark.parametrize("bits", [8, 4])
def test_qgz_hierarchical_two_hops_within_bound(bits):
    for r, v in enumerate(case(_results4(), f"hier_int{bits}")):
        assert v["ratio"] <= 1.0 and v["max_err"] > 0, (r, v)


@pytest.mark.parametrize("bits", [8, 4])
def test_qgz_one_hop_over_four_ranks_within_bound(bits):
    for r, v in enumerate(case(_results4(), f"flat4_int{bits}")):
        assert v["ratio"] <= 1.0 and v["max_err"] > 0, (r, v)


def test_qwz_gather_over_four_ranks_within_bound_own_piece_exact():
    for r, v in enumerate(case(_results4(), "qwz4")):
        assert v["ratio"] <= 1.0 and v["own_exact"], (r, v)
        assert v["bytes"] == 3 * (1024 + 32), (r, v)  # 3 of the 4 payloads sent per rank


def test_qgz_hierarchical_negative_control_chunk_order():
    # hop 1 without the regrouping: ranks 1 and 2 reduce the wrong chunks (on 0 and 3 the two
    # orders happen to agree)
    got = [v["ratio"] for v in case(_results4(), "neg_hier_order")]
    assert got[1] > 10 and got[2] > 10, got


# ---- tests: the engine --------------------------------------------------------------------------
def test_qwz_engine_gathers_within_bound_and_gathered_params_exact():
    for r, v in enumerate(case(_results2(), "qwz_engine")):
        assert v["ratio"] <= 1.0 and v["max_err"] > 0 and v["own_exact"], (r, v)
        assert v["gathered_exact"], (r, v)


def test_qwz_with_hpz_two_hop_gathers_within_bound():
    for r, v in enumerate(case(_results4(), "qwz_engine_hpz")):
        assert v["ratio"] <= 1.0 and v["max_err"] > 0 and v["own_exact"], (r, v)
        assert v["gathered_exact"], (r, v)
    # negative control: the hops' rows not put back in world-rank order
    assert max(v["ratio"] for v in case(_results4(), "neg_qwz_hop_order")) > 10


@pytest.mark.parametrize("name", ["qgz_stage3_int8", "qgz_stage2_int4", "qgz_stage1_int8"])
def test_qgz_engine_grads_within_bound_of_ddp(name):
    for r, v in enumerate(case(_results2(), name)):
        assert v["ratio"] <= 1.0 and v["max_err"] > 0, (r, v)


def test_qgz_engine_negative_control_int4_judged_as_int8():
    for r, v in enumerate(case(_results2(), "neg_qgz_int4_as_int8")):
        assert v["ratio"] > 1.0, (r, v)


def test_qgz_hsdp_grads_within_bound():
    for r, v in enumerate(case(_results4(), "hsdp_qgz")):
        assert v["ratio"] <= 1.0 and v["max_err"] > 0, (r, v)


@pytest.mark.parametrize("variant,bits", [("qwz", 8), ("qgz8", 8), ("qgz4", 4), ("both", 8)])
def test_training_follows_plain(variant, bits):
    for r, rel in enumerate(case(_results2(), f"train_{variant}")):
        assert 0 < rel <= TOL_TRAIN[bits], (r, variant, rel)


def test_training_tolerance_catches_a_broken_codec():
    # Scales read one block off: 0.093 when the rows of a payload were unpacked together (the
    # roll moved a scale across rows), 0.049 since the CPU path decodes row by row (issue 40,
    # [Note: qgZ on the CPU ring]): both far outside the tolerance (6e-3).
    for r, rel in enumerate(case(_results2(), "train_neg_scale")):
        assert rel > 5 * TOL_TRAIN[8], (r, rel)


def test_hpz_qwz_qgz_trains_and_counts_bytes_per_dim():
    for r, v in enumerate(case(_results4(), "train_all")):
        assert 0 < v["rel"] <= TOL_TRAIN[8], (r, v)
        d, e = v["dims"], v["expect"]
        assert d["cross"]["reduce_scatter"] == e["rs_cross"], (r, d, e)
        assert d["hpz"]["reduce_scatter"] == e["rs_node"], (r, d, e)
        assert d["cross"]["all_gather"] == e["fwd"], (r, d, e)
        assert d["shard"]["all_gather"] == e["snap"], (r, d, e)  # exact, between steps only
        assert d["shard"]["reduce_scatter"] == 0, (r, d)


def test_without_the_gloo_ring_training_is_bitwise_the_same():
    assert case(_results4(), "no_ring") == [True] * 4


def test_debug_collectives_agree_and_a_difference_is_caught():
    for r, v in enumerate(case(_results4(), "debug_log")):
        assert v["same"] == "ok", (r, v)
        assert v["differ"] != "ok", (r, v)


@pytest.mark.slow
def test_loss_after_long_training_within_one_percent_of_plain():
    for r, v in enumerate(cached(_worker2_long, 2, LONG_STEPS)):
        v = v["long"]
        assert abs(v["all"] - v["plain"]) <= 0.01 * v["plain"], (r, v)
        assert abs(v["quarter_lr"] - v["plain"]) > 0.01 * v["plain"], (r, v)  # can fail


# ---- argument errors (one process) --------------------------------------------------------------
@pytest.mark.parametrize("kw,kind,name", [
    (dict(stage=2, quantized_weights=True), ValueError, "quantized_weights"),
    (dict(stage=3, quantized_weights="yes"), TypeError, "quantized_weights"),
    (dict(stage=3, quantized_weights=True, offload_params="cpu"), ValueError,
     "quantized_weights"),
    (dict(stage=2, quantized_gradients="int2"), ValueError, "quantized_gradients"),
    (dict(stage=2, quantized_gradients=8), TypeError, "quantized_gradients"),
    (dict(stage=0, quantized_gradients=True), ValueError, "quantized_gradients"),
])
def test_bad_arguments_raise_before_any_change(kw, kind, name):
    model = M.make_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    stage = kw.pop("stage")
    with pytest.raises(kind, match=name):
        if stage == 3:
            zk.ZeroAdamW(model, stage=3, precision="bf16", backend="reference", **kw)
        else:
            zk.ZeroAdamW(model.parameters(), stage=stage, precision="bf16",
                         backend="reference", **kw)
    assert M.bitwise_equal(before, {n: p.detach() for n, p in model.named_parameters()})
    assert not any(hasattr(p, "_zerokern_sync") for p in model.parameters())


@pytest.mark.parametrize("cls", ["ZeroLion", "ZeroMuon"])
def test_other_optimizers_take_the_keywords(cls):
    """ZeroLion and ZeroMuon forward quantized_weights / quantized_gradients to the engine (one
    process: the collectives are copies; the flags and the codec are what is checked)."""
    model = M.make_model()
    opt = getattr(zk, cls)(model, stage=3, precision="fp32", backend="reference",
                           quantized_weights=True, quantized_gradients="int4")
    assert opt.comm.qwz and opt.comm.qgz_bits == 4
    assert opt.comm.codec_for(torch.device("cpu")) is blockquant  # backend="reference"
