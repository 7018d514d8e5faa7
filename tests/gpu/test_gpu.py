"""ZeroAdamW on CUDA with the compiled kernels: `python -m pytest -m gpu` (issue 14).

Every test here is marked `gpu`: conftest runs them only in a process that did not turn the
Triton interpreter on (CUDA present and `-m gpu` selected), so backend="triton" is the compiled
kernel and backend="cuda" the extension. Covered, for both backends:
* no host sync in backward + step, stages 0-3, with and without offload="cpu", under
  torch.cuda.set_sync_debug_mode("error"), and no Event/Stream.synchronize either (which that
  mode does not see) except offload's one blocking wait per chunk (issue 24);
* fp32 parity with torch AdamW, and offload against the on-device update;
* NCCL at world size 1 and gloo over CUDA tensors on 2 ranks, against torch AdamW;
* a CUDA graph capture of step() with a CUDA-tensor lr, replayed, equal to eager steps;
* pinned offload buffers: exactly the bytes reported (defect 4).
"""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch
import torch.distributed as dist

import zerokern as zk
from zerokern.state import pinned

from ..support import harness as H
from ..support import models as M

pytestmark = pytest.mark.gpu

# One tolerance table for this file.
TOL = {
    # fp32 params vs torch AdamW after 5 steps (the CPU parity bound, test_parity.py)
    "fp32": 1e-6,
    # offload vs on-device update: fp32 masters within the kernels' 1e-6 bound of each other
    "offload_master": 1e-6,
    # 16-bit params of those two runs: each is the RNE cast of its master, so they may differ
    # only where the two masters straddle a rounding tie: by one unit in the last place, at a
    # fraction of elements ~ 1e-6 / 2^-8. (The interpreter's truncating cast, which the old
    # bound of 2^-7 relative hid, differs at about half of them.)
    "offload_16bit_ulps": 1,
    "offload_16bit_frac": 1e-3,
}
STEPS = 5


def _cuda_model():
    return M.make_model().cuda()


def _tokens(s, rank=0, ws=1):
    return M.rank_tokens(s, rank, ws).cuda()


@contextlib.contextmanager
def _counting_host_waits():
    """(issue 24) torch's sync-debug mode does not see Event.synchronize / Stream.synchronize:
    count them, with the function that called each."""
    calls = []
    saved = {}
    for cls in (torch.cuda.Event, torch.cuda.Stream):
        real = cls.synchronize
        saved[cls] = real

        def wait(self, _real=real, _cls=cls.__name__):
            f = sys._getframe(1)
            calls.append((_cls, os.path.basename(f.f_code.co_filename), f.f_code.co_name))
            return _real(self)
        cls.synchronize = wait
    try:
        yield calls
    finally:
        for cls, real in saved.items():
            cls.synchronize = real


# The only host waits allowed on the step path: offload's copy of a chunk's grad and scalars
# (offload.py [Note: the one blocking wait]).
ALLOWED_WAITS = {("Event", "offload.py", "_wait")}


def _sync_free_steps(model, opt, steps=3):
    for s in range(steps):
        loss = M.loss_fn(model, _tokens(s))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with _counting_host_waits() as waits:
                opt.backward(loss)
                opt.step()
                opt.zero_grad()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        bad = [w for w in waits if w not in ALLOWED_WAITS]
        assert not bad, f"host waits on the step path: {bad}"
        if opt.offload is None:
            assert not waits, waits


STAGE_OFFLOAD = [(s, None) for s in range(4)] + [(s, "cpu") for s in (1, 2, 3)]


@pytest.mark.parametrize("stage,offload", STAGE_OFFLOAD, ids=lambda x: str(x))
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_step_does_not_sync(cuda_backend, stage, offload, precision):
    model = _cuda_model()
    opt = M.zero_opt(model, stage, precision, backend=cuda_backend, offload=offload,
                     max_grad_norm=0.5)
    opt.backward(M.loss_fn(model, _tokens(99)))  # warm-up: Triton compiles, the op builds
    opt.step()
    opt.zero_grad()
    _sync_free_steps(model, opt)
    assert torch.isfinite(opt.grad_norm).item()


def _train(model, opt, rank=0, ws=1, steps=STEPS):
    for s in range(steps):
        opt.backward(M.loss_fn(model, _tokens(s, rank, ws)))
        opt.step()
        opt.zero_grad()


def _torch_reference(steps=STEPS):
    ref = _cuda_model()
    ref_opt = M.torch_adamw(ref)
    for s in range(steps):
        M.loss_fn(ref, _tokens(s)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return M.snapshot(ref)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp32_parity_with_torch_adamw_on_cuda(cuda_backend, stage):
    model = _cuda_model()
    opt = M.zero_opt(model, stage, "fp32", backend=cuda_backend)
    _train(model, opt)
    err = M.rel_err(M.full_snapshot(model, opt), _torch_reference())
    assert err <= TOL["fp32"], f"stage {stage}: {err:.3g}"


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_model_to_cuda_after_construction_is_followed(cuda_backend, stage):
    """Accelerate/Trainer place the model after the optimizer is built: ZeroAdamW built on the
    CPU model follows model.cuda() (buffers, state, grads move) and trains as if built there."""
    model = M.make_model()
    opt = M.zero_opt(model, stage, "fp32", backend=cuda_backend)
    model.cuda()
    _train(model, opt)
    assert opt.flat_groups[0].flat.is_cuda and opt.grad_norm.is_cuda
    err = M.rel_err(M.full_snapshot(model, opt), _torch_reference())
    assert err <= TOL["fp32"], f"stage {stage}: {err:.3g}"


def _ulps_16bit(a: torch.Tensor, b: torch.Tensor):
    """Max distance in units in the last place, and the fraction of elements that differ."""
    ia = a.view(torch.int16).to(torch.int32)
    ib = b.view(torch.int16).to(torch.int32)
    d = (ia - ib).abs()
    return int(d.max()), float((d != 0).float().mean())


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_offload_on_cuda_matches_device_update(cuda_backend, stage, precision):
    """offload="cpu" (pinned host state, the copy stream, the cpu kernel) against the same stage
    updated on the GPU by `cuda_backend`."""
    runs = []
    for off in (None, "cpu"):
        model = _cuda_model()
        # with offload the host update runs the cpu kernel; grad_stats_ runs cuda_backend
        opt = M.zero_opt(model, stage, precision, backend=cuda_backend, offload=off)
        _train(model, opt)
        runs.append((model, opt))
    (m0, o0), (m1, o1) = runs
    assert all(st.exp_avg.is_pinned() for st in o1.offloader.states)
    key = "master" if precision != "fp32" else "exp_avg"
    masters = [M.gather_state(o, m, key) for m, o in runs]
    assert M.rel_err(masters[1], masters[0]) <= TOL["offload_master"]
    a, b = M.full_snapshot(m1, o1), M.full_snapshot(m0, o0)
    if precision == "fp32":
        assert M.rel_err(a, b) <= TOL["fp32"]
        return
    for name in b:
        ulps, frac = _ulps_16bit(a[name], b[name])
        assert ulps <= TOL["offload_16bit_ulps"], f"{name}: {ulps} ulps"
        assert frac <= TOL["offload_16bit_frac"], f"{name}: {frac:.3g} of elements differ"


def test_offload_pinned_bytes_are_the_reported_bytes(cuda_device):
    """(4) The page-locked host memory is exactly what memory_report() lists, and none of it
    comes from the caching host allocator's power-of-two blocks."""
    host_stats = getattr(torch.cuda, "host_memory_stats", lambda: {})
    cached0 = host_stats().get("allocated_bytes.current", 0)
    pinned0 = pinned.pinned_bytes()
    model = _cuda_model()
    opt = M.zero_opt(model, 2, "bf16", offload="cpu")
    rep = opt.memory_report()
    locked = pinned.pinned_bytes() - pinned0
    assert locked == rep["host_measured_total"]
    # what is left in the caching allocator: a few scalars (loss scale, [grad_scale, found_inf])
    assert host_stats().get("allocated_bytes.current", 0) - cached0 <= 4096


# ---------------------------------------------------------------- process groups -------------

def test_nccl_world_size_1(cuda_backend, tmp_path):
    """Through a real NCCL process group of one rank: the same params as torch AdamW."""
    if not dist.is_nccl_available():
        pytest.skip("this torch build has no NCCL")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        want = _torch_reference()
        for stage in (0, 1, 2, 3):
            model = _cuda_model()
            opt = M.zero_opt(model, stage, "fp32", backend=cuda_backend,
                             process_group=dist.group.WORLD)
            _train(model, opt)
            err = M.rel_err(M.full_snapshot(model, opt), want)
            assert err <= TOL["fp32"], f"stage {stage}: {err:.3g}"
    finally:
        dist.destroy_process_group()


def _gloo_cuda_rank(rank, ws, backend):
    """A gloo rank given CUDA params (both ranks share cuda:0): every stage refuses them at
    construction with the ValueError of comm/device_check.py, before the model changes."""
    torch.cuda.set_device(0)
    out = {}
    for stage in (0, 1, 2, 3):
        model = _cuda_model()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            M.zero_opt(model, stage, "fp32", backend=backend)
            out[stage] = "accepted"
        except ValueError as e:
            same = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
            out[stage] = ("gloo group" in str(e) and "NCCL" in str(e), same)
    return out


def test_gloo_refuses_cuda_params(cuda_backend):
    """CUDA params on a gloo-only group: zerokern's gloo ring and shared memory carry CPU
    tensors only, so construction raises, naming the fix (an NCCL group), and changes
    nothing (issue 34 finding 9; before, this test trained CUDA tensors over gloo)."""
    results = H.spawn(_gloo_cuda_rank, 2, cuda_backend, timeout=600)
    for r, res in enumerate(results):
        for stage, got in res.items():
            assert got == (True, True), f"rank {r} stage {stage}: {got}"


# ---------------------------------------------------------------- CUDA graphs ----------------

def _fixed_grad_backward(model, opt, grads):
    """A backward whose gradients are exactly `grads` (d/dp sum(p * g) = g)."""
    loss = sum((p * g).sum() for p, g in zip(model.parameters(), grads))
    opt.backward(loss)


@pytest.mark.parametrize("stage", [0, 1])
def test_cuda_graph_replay_equals_eager(cuda_backend, stage):
    """step() captured once with a CUDA-tensor lr, replayed with new lr values written into that
    tensor: bit for bit the params of the same steps run eagerly."""
    lrs = [1e-2, 3e-3, 5e-2, 1e-3]
    proto = _cuda_model()
    grads = [torch.randn_like(p) for p in proto.parameters()]

    def make():
        model = _cuda_model()
        lr = torch.tensor(lrs[0], device="cuda")
        opt = zk.ZeroAdamW(model, stage=stage, precision="fp32", lr=lr, weight_decay=0.01,
                           backend=cuda_backend)
        return model, opt, lr

    model, opt, lr = make()
    for x in lrs:
        opt.zero_grad()
        _fixed_grad_backward(model, opt, grads)
        lr.fill_(x)
        opt.step()
    eager = M.snapshot(model)

    model, opt, lr = make()
    warm_model, warm_opt, _ = make()  # compiles and builds outside the capture
    _fixed_grad_backward(warm_model, warm_opt, grads)
    warm_opt.step()
    opt.zero_grad()
    _fixed_grad_backward(model, opt, grads)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        opt.step()
    torch.cuda.current_stream().wait_stream(side)
    for x in lrs:
        lr.fill_(x)
        graph.replay()
    torch.cuda.synchronize()
    assert M.bitwise_equal(M.snapshot(model), eager)
