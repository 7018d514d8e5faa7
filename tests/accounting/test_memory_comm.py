"""memory_report() against the DESIGN §4 formula, and comm_stats() against the §5 volumes.

Memory (N = 2, 3, 4; stages 0-2; fp32, bf16 and bf16 with master="compact"), after two
training steps:
- measured - buckets - formula lies in [0, padding term], the padding term computed here from
  DESIGN §4 (< N*128 elements per buffer); and |measured - formula| is within the report's own
  allowed_slack (buckets + padding);
- the measurement is a measurement: it equals the storage bytes of every tensor reachable from
  the optimizer (walked here independently of memory.py);
- negative control: the stage-0 formula does not fit a stage-2 measurement (nor the reverse),
  nor the fp32-master formula a compact-master one;
- stage 2's staging buckets stay bounded, and stage 2 holds less than stage 1.

Comm (N = 2, 3, 4): the bytes of one step equal, exactly, the ring volumes computed from the
padded layout (all-reduce 2(N-1)/N, reduce-scatter and all-gather (N-1)/N of each bucket, plus
the stats all-reduce at every stage: [found_inf, sumsq] and a flag per param tensor), and are "about 2Ψ(N-1)/N" within the padding.
"""

from __future__ import annotations

import functools
from fractions import Fraction

import pytest
import torch

import zerokern as zk
from zerokern.comm import shm
from zerokern.geometry.partition import ALIGN
from zerokern.grads.grad_sync import MAX_IN_FLIGHT
from zerokern.grads.released_grad import ReleasedGrad

from ..support import models as M
from ..support.harness import cached, case, run_cases

WORLD_SIZES = [2, 3, 4]
STAGES = [0, 1, 2]
PRECISIONS = ["fp32", "bf16"]
MEM_PRECISIONS = PRECISIONS + ["compact"]  # compact: bf16 with master="compact"
ELEM = {"fp32": 4, "bf16": 2}


def stats_bytes(opt) -> int:
    """The step's stats all-reduce: [found_inf, sumsq] and one fp32 "used" flag per param
    tensor ([Note: a param no rank used] in frozen_slots.py) and the hyperparameter
    fingerprints (core/hyper_agreement.py), at every stage."""
    return opt._stats.numel() * opt._stats.element_size()


# Tolerances (bytes). Memory is compared with the slack terms below, comm exactly.
TOL = {
    # Scalars the formula leaves out and the walk below skips: tensors with fewer elements
    # than one ALIGN unit (step counters, the stats pair, the loss scale, grad_norm).
    "small_tensor_numel": ALIGN,
    # Stage-2 staging buffers: MAX_IN_FLIGHT reduce-scatters in flight, one full bucket waiting
    # for its turn in the fixed launch order, and one bucket being filled per param group (the
    # test model has 2 groups, whose grads arrive interleaved): 2 + 1 + 2 = 5. Independent of
    # model size; the failure this guards against held every bucket (8 of 8).
    "staging_buckets": MAX_IN_FLIGHT + 1 + 2,
    # comm_stats vs the layout, bytes: exact. Whole bytes are counted per call, so a 2-float
    # all-reduce at N = 3 (2*(2/3)*8 = 10.67 B) counts 10; every bucket's bytes are integers.
    "comm_bytes": 0,
}


# ---- rank side ---------------------------------------------------------------------------------
def _walk_bytes(opt) -> int:
    """Bytes of memory under every (non-scalar) tensor reachable from the optimizer's own state:
    the union of their storages' address ranges, so a param's storage that aliases its slot of
    the flat buffer (layout/param_alias.py) is not counted twice."""
    ranges, stack = {}, [opt.flat_groups, opt.grad_sync.__dict__]
    visited = set()
    while stack:
        obj = stack.pop()
        if id(obj) in visited:
            continue
        visited.add(id(obj))
        if isinstance(obj, ReleasedGrad):
            continue  # what p.grad shows at stages 1-3: no storage
        if isinstance(obj, shm._Segment):  # a transport buffer: checked on its own below
            continue
        if isinstance(obj, torch.Tensor):
            st = obj.untyped_storage()
            # (uint8: a compact master's tie bitmap, S/8 bytes, small for this tiny model)
            big = obj.numel() >= TOL["small_tensor_numel"] or obj.dtype == torch.uint8
            if big and st.nbytes():
                lo = st.data_ptr()
                ranges[lo] = max(ranges.get(lo, 0), lo + st.nbytes())
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("zerokern"):
            stack.extend(vars(obj).values())  # incl. comm: the gloo ring's work buffer
    total, end = 0, -1
    for lo in sorted(ranges):  # merge overlapping ranges
        hi = ranges[lo]
        if lo >= end:
            total += hi - lo
            end = hi
        elif hi > end:
            total += hi - end
            end = hi
    return total


def _walk_own_segments(opt) -> int:
    """Bytes of this rank's own shared-memory segments among the objects reachable from the
    optimizer (comm/shm.py; the peers' segments it maps are theirs)."""
    total, stack, visited = 0, [opt.flat_groups, opt.grad_sync.__dict__], set()
    while stack:
        obj = stack.pop()
        if id(obj) in visited or isinstance(obj, torch.Tensor):
            continue
        visited.add(id(obj))
        if isinstance(obj, shm.ShmExchange):
            total += len(obj.segs[obj.rank].map)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("zerokern"):
            stack.extend(vars(obj).values())
    return total


def _padding_term(opt) -> int:
    """DESIGN §4: fewer than N*128 padding elements per buffer, per param group (bytes)."""
    n = opt.comm.shard.world_size
    e = ELEM[opt.precision]
    g = torch.empty((), dtype=opt.reduce_dtype).element_size()
    master = 0 if opt.precision == "fp32" else 2 + 1 / 8 if opt.master == "compact" else 4
    per_group = e + g + 8 + master  # params, grads, m+v, master (compact: low halves)
    return len(opt.flat_groups) * n * ALIGN * per_group


def _memory(rank, ws, prec, stage):
    master = "fp32"
    if prec == "compact":  # master="compact": a bf16 run with the compact master
        prec, master = "bf16", "compact"
    model = M.make_model()
    opt = M.zero_opt(model, stage, prec, master=master)
    M.train_zero(model, opt, rank, ws, 2)
    rep = opt.memory_report()
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
    other = zk.estimate_memory(psi, ws, 0 if stage == 2 else 2, prec, master=master)["total"]
    bucket_bytes = max(g.layout.bucket_numel for g in opt.flat_groups) * ELEM[prec]
    return {
        "measured": rep["measured_total"],
        "formula": rep["formula_total"],
        "slack": rep["allowed_slack"],
        "padding_term": _padding_term(opt),
        "walked": _walk_bytes(opt),
        "comm_buffers": rep["comm_buffers"],
        "own_segments": _walk_own_segments(opt),
        "psi": rep["num_params"],
        "unique_psi": psi,
        "estimate": zk.estimate_memory(psi, ws, stage, prec, master=master)["total"],
        "fp32_master_formula": zk.estimate_memory(psi, ws, stage, prec)["total"],
        "other_stage_formula": other,
        "buckets": rep["measured"]["buckets"],
        "bucket_bytes": bucket_bytes,
    }


def _expected_comm(opt, micro: int) -> dict:
    """Ring bytes of one step from the padded layout, exactly (floor per call)."""
    n = opt.comm.shard.world_size
    rb = torch.empty((), dtype=opt.reduce_dtype).element_size()
    pb = ELEM[opt.precision]
    ar = rs = ag = 0
    calls = {"all_reduce": 0, "reduce_scatter": 0, "all_gather": 0}
    reduces = 1  # micro-batches but the last run under no_sync() (train_zero): one reduction
    for g in opt.flat_groups:
        for k in range(g.layout.n_buckets):
            lo, hi = g.layout.bucket_range(k)
            if opt.stage == 0:
                ar += int(Fraction(2 * (n - 1), n) * (hi - lo) * rb)
                calls["all_reduce"] += 1
            else:
                rs += reduces * int(Fraction(n - 1, n) * (hi - lo) * rb)
                ag += int(Fraction(n - 1, n) * (hi - lo) * pb)
                calls["reduce_scatter"] += reduces
                calls["all_gather"] += 1
    # the stats all-reduce: every stage (stage 0 reads 1/N of each bucket for them,
    # [Note: stage 0 reads 1/N for its stats] in grads/full_grads.py)
    ar += int(Fraction(2 * (n - 1), n) * stats_bytes(opt))
    calls["all_reduce"] += 1
    return {
        "all_reduce": ar,
        "reduce_scatter": rs,
        "all_gather": ag,
        "total": ar + rs + ag,
        "calls": calls,
    }


def _comm(rank, ws, prec, stage, micro=1, reduce_dtype=None):
    model = M.make_model()
    opt = M.zero_opt(model, stage, prec, reduce_dtype=reduce_dtype)
    M.train_zero(model, opt, rank, ws, 1)  # warm: nothing of the first step is special
    opt.reset_comm_stats()
    zero_after_reset = opt.comm_stats()["total"] == 0
    M.train_zero(model, opt, rank, ws, 1, start=1, micro=micro)
    got = opt.comm_stats(reset=True)
    psi = sum(g.layout.numel for g in opt.flat_groups)
    pad = sum(g.layout.padding for g in opt.flat_groups)
    return {
        "got": got,
        "expected": _expected_comm(opt, micro),
        "after_reset": opt.comm_stats(),
        "zero_after_reset": zero_after_reset,
        "psi": psi,
        "pad": pad,
        "stats_bytes": stats_bytes(opt),
    }


def _worker(rank, ws):
    cases = {}
    for prec in MEM_PRECISIONS:
        for stage in STAGES:
            cases[f"mem_{prec}_{stage}"] = functools.partial(_memory, rank, ws, prec, stage)
    for prec in PRECISIONS:
        for stage in STAGES:
            cases[f"comm_{prec}_{stage}"] = functools.partial(_comm, rank, ws, prec, stage)
    cases["comm_bf16_2_micro3"] = functools.partial(_comm, rank, ws, "bf16", 2, micro=3)
    cases["comm_bf16_1_micro3"] = functools.partial(_comm, rank, ws, "bf16", 1, micro=3)
    for stage in STAGES:
        cases[f"comm_bf16_r32_{stage}"] = functools.partial(
            _comm, rank, ws, "bf16", stage, reduce_dtype=torch.float32
        )
    return run_cases(cases)


def _results(ws):
    return cached(_worker, ws)


# ---- memory tests ------------------------------------------------------------------------------
MEM_CASES = [(ws, p, s) for ws in WORLD_SIZES for p in MEM_PRECISIONS for s in STAGES]


@pytest.mark.parametrize("ws,prec,stage", MEM_CASES)
def test_memory_report_measured_vs_formula(ws, prec, stage):
    """DESIGN §4: measured = formula + buckets + padding terms (< N*128 elements per buffer)."""
    for r, res in enumerate(case(_results(ws), f"mem_{prec}_{stage}")):
        assert res["psi"] == res["unique_psi"] and res["formula"] == res["estimate"]
        diff = res["measured"] - res["buckets"] - res["formula"]
        assert 0 <= diff <= res["padding_term"], (
            f"rank {r}: measured - buckets - formula = {diff} B, padding term "
            f"{res['padding_term']} B"
        )


@pytest.mark.parametrize("ws,prec,stage", MEM_CASES)
def test_memory_report_allowed_slack(ws, prec, stage):
    """The report's own allowed_slack (buckets + padding) must cover measured - formula."""
    for r, res in enumerate(case(_results(ws), f"mem_{prec}_{stage}")):
        diff = res["measured"] - res["formula"]
        assert abs(diff) <= res["slack"], (
            f"rank {r}: measured - formula = {diff} B > the report's allowed_slack "
            f"{res['slack']} B (buckets + the padding this rank holds)"
        )


@pytest.mark.parametrize("ws,prec,stage", MEM_CASES)
def test_memory_report_is_a_measurement(ws, prec, stage):
    for r, res in enumerate(case(_results(ws), f"mem_{prec}_{stage}")):
        assert res["walked"] == res["measured"], (
            f"rank {r}: tensors held {res['walked']} B, report says {res['measured']} B"
        )


@pytest.mark.parametrize("ws,prec,stage", MEM_CASES)
def test_memory_report_counts_the_shared_memory_segments(ws, prec, stage):
    """comm_buffers: this rank's own segments, one per ring group that used shared memory
    (stage 3: two groups), 8 MiB + a 4 KiB header each."""
    for r, res in enumerate(case(_results(ws), f"mem_{prec}_{stage}")):
        assert res["comm_buffers"] == res["own_segments"], f"rank {r}"
        if shm.supported():
            seg = 2 * shm.SLOT_BYTES + 4096
            groups = 2 if stage == 3 else 1
            assert res["comm_buffers"] == groups * seg, f"rank {r}: {res['comm_buffers']}"


@pytest.mark.parametrize("ws,prec,stage", [c for c in MEM_CASES if c[2] != 1])
def test_memory_negative_control_other_stage_formula_does_not_fit(ws, prec, stage):
    """Stage 0's measurement against stage 2's formula, and stage 2's against stage 0's."""
    for res in case(_results(ws), f"mem_{prec}_{stage}"):
        diff = res["measured"] - res["buckets"] - res["other_stage_formula"]
        assert not 0 <= diff <= res["padding_term"], "the wrong formula fits too"


@pytest.mark.parametrize("ws,stage", [(ws, s) for ws in WORLD_SIZES for s in STAGES])
def test_memory_negative_control_fp32_master_formula_does_not_fit_compact(ws, stage):
    for res in case(_results(ws), f"mem_compact_{stage}"):
        diff = res["measured"] - res["buckets"] - res["fp32_master_formula"]
        assert not 0 <= diff <= res["padding_term"], "the fp32-master formula fits too"


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("prec", PRECISIONS)
def test_stage2_staging_bounded_and_below_stage1(ws, prec):
    res1 = case(_results(ws), f"mem_{prec}_1")
    for r, res in enumerate(case(_results(ws), f"mem_{prec}_2")):
        n = res["buckets"] // res["bucket_bytes"]
        assert n <= TOL["staging_buckets"], (
            f"rank {r}: stage 2 holds {n} staging buckets ({res['buckets']} B)"
        )
        assert res["measured"] < res1[r]["measured"], (
            f"rank {r}: stage 2 holds {res['measured']} B >= stage 1's {res1[r]['measured']} B"
        )


# ---- comm tests --------------------------------------------------------------------------------
COMM_CASES = (
    [f"comm_{p}_{s}" for p in PRECISIONS for s in STAGES]
    + ["comm_bf16_2_micro3", "comm_bf16_1_micro3"]
    + [f"comm_bf16_r32_{s}" for s in STAGES]
)


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("name", COMM_CASES)
def test_comm_stats_exact_from_layout(ws, name):
    for r, res in enumerate(case(_results(ws), name)):
        assert res["zero_after_reset"] and res["after_reset"]["total"] == 0
        assert res["got"]["calls"] == res["expected"]["calls"], f"rank {r}: calls"
        for kind in ("all_reduce", "reduce_scatter", "all_gather", "total"):
            assert abs(res["got"][kind] - res["expected"][kind]) <= TOL["comm_bytes"], (
                f"rank {r} {kind}: got {res['got'][kind]}, layout says {res['expected'][kind]}"
            )


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("name", [f"comm_{p}_{s}" for p in PRECISIONS for s in STAGES])
def test_comm_volume_about_2psi(ws, name):
    elem = ELEM[name.split("_")[1]]
    frac = (ws - 1) / ws
    for res in case(_results(ws), name):
        about = 2 * frac * res["psi"] * elem
        slack = 2 * frac * res["pad"] * elem + res["stats_bytes"] * 2
        assert about <= res["got"]["total"] <= about + slack
