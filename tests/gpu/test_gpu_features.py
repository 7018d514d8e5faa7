"""The features of issues 35-39 on a real GPU (`python -m pytest -m gpu`): what the fake-CUDA
harness (tests/gpu_control) cannot show, since fake tensors have no values.

* FP8 params (kernels/param_codec.py): `Float8Codec.encode_`/`decode_` on CUDA tensors are,
  bit for bit, the float64 spec (tests/kernels/test_param_codec.py `spec_param`): CUDA's
  float8_e4m3fn cast and torch's CUDA division must round as the spec does.
* FP8 params at stage 3 over NCCL (2 GPUs): NCCL has no float8 type, so the codes travel as
  uint8 views, and the per-param scales are agreed with an fp32 all-reduce MAX. After every
  step the gathered params every rank sees are bit for bit the spec applied to the whole fp32
  master (gathered with plain dist.all_gather on the device), the loss falls, and all-gathers
  really ran over NCCL.
* recover_from_replica's crc32 (checkpoint/replica.py [Note: the crc's host reads]): device
  bytes staged through a pinned chunk with non-blocking copies and one stream wait per chunk
  equal the crc of the same bytes read one tensor at a time; one flipped byte changes it.

Tolerances: none. Each comparison is our own code against our own float64 spec or zlib on
the same bytes, so bitwise.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.distributed as dist

from zerokern.tools import spawn as zk_spawn

from ..kernels.test_param_codec import spec_param
from ..support import models as M

pytestmark = pytest.mark.gpu

STEPS = 3


def _params(sizes, seed, dev):
    g = torch.Generator().manual_seed(seed)
    # magnitudes apart per param (1e-3 .. 1e2): one scale for all would lose the small ones
    return [(torch.randn(n, generator=g) * 10.0 ** (i % 6 - 3)).to(dev)
            for i, n in enumerate(sizes)]


def test_fp8_codec_on_cuda_is_the_spec(cuda_device):
    from zerokern.kernels.param_codec import FP8_DTYPE, Float8Codec

    sizes = [1, 7, 448, 1000, 4097, 3]
    params = _params(sizes, 0, cuda_device)
    params[2][5] = 0.0  # a zero code
    params[3][:] = 0.0  # amax 0: scale 1
    master = torch.cat(params)
    spans, off = [], 0
    for i, n in enumerate(sizes):
        spans.append((i, off, off + n))
        off += n
    for dtype in (torch.bfloat16, torch.float16):
        codec = Float8Codec(dtype)
        codes = torch.empty(off, dtype=FP8_DTYPE, device=cuda_device)
        scales = torch.empty(len(sizes), dtype=torch.float32, device=cuda_device)
        codec.encode_(master, codes, spans, scales)
        out = torch.empty(off, dtype=dtype, device=cuda_device)
        codec.decode_(codes, out, spans, scales)
        for (i, a, b), p in zip(spans, params):
            want_codes, want_value, want_scale = spec_param(p.cpu(), dtype)
            assert torch.equal(scales[i].cpu(), want_scale), (dtype, i)
            assert torch.equal(codes[a:b].cpu().view(torch.uint8),
                               want_codes.view(torch.uint8)), (dtype, i)
            assert torch.equal(out[a:b].cpu().view(torch.int16),
                               want_value.view(torch.int16)), (dtype, i)
    # the control: a scale 1% off gives other codes
    moved = torch.div(master[spans[4][1]:spans[4][2]], scales[4] * 1.01).to(FP8_DTYPE)
    assert not torch.equal(moved.view(torch.uint8),
                           codes[spans[4][1]:spans[4][2]].view(torch.uint8))


def _gather_master(opt, model):
    """Full fp32 master per param name, from every rank's shard (plain dist.all_gather on the
    shard's device: tests/support/models.gather_state, which gathers into CPU tensors)."""
    names = {id(p): n for n, p in model.named_parameters()}
    ws = opt.comm.shard.world_size
    out = {}
    for g in opt.flat_groups:
        if g.master is None:
            continue  # frozen: no master
        L, buf = g.layout, g.master
        full = torch.empty(L.padded_numel, dtype=buf.dtype, device=buf.device)
        for k in range(L.n_buckets):
            n, off = L.piece_numel(k), L.shard_offset(k)
            parts = [torch.empty(n, dtype=buf.dtype, device=buf.device) for _ in range(ws)]
            dist.all_gather(parts, buf[off:off + n].contiguous())
            lo, hi = L.bucket_range(k)
            full[lo:hi] = torch.cat(parts)
        for p, s in zip(g.params, L.slots):
            out[names[id(p)]] = full[s.offset:s.offset + s.numel].cpu()
    return out


def _spec_mismatch(opt, model) -> list:
    masters = _gather_master(opt, model)
    values = {k: v.cpu() for k, v in M.full_snapshot(model, opt).items()}
    bad = []
    for name, m in masters.items():
        _, want, _ = spec_param(m.reshape(-1), torch.bfloat16)
        if not torch.equal(values[name].reshape(-1).view(torch.int16), want.view(torch.int16)):
            bad.append(name)
    return bad


def _fp8_rank(rank, ws, backend, device_type="cuda"):
    """device_type="cpu": the same function over gloo (how it was dry-run without a GPU)."""
    dev = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(dev)
    model = M.make_model().to(dev)
    opt = M.zero_opt(model, 3, "bf16", param_format="fp8", backend=backend)
    assert opt.comm.shard.backend == ("nccl" if device_type == "cuda" else "gloo")
    opt.comm.stats.reset()
    bad = [_spec_mismatch(opt, model)]
    losses = []
    tokens = M.rank_tokens(0, rank, ws).to(dev)  # one batch: the loss must fall
    for _ in range(STEPS):
        loss = M.loss_fn(model, tokens)
        losses.append(float(loss.detach()))
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        bad.append(_spec_mismatch(opt, model))
    return dict(bad=bad, losses=losses, calls=opt.comm_stats()["calls"])


def test_nccl_fp8_stage3_gathers_the_spec(cuda_backend):
    if not dist.is_available() or not dist.is_nccl_available():
        pytest.skip("this torch build has no NCCL")
    if torch.cuda.device_count() < 2:
        pytest.skip(f"NCCL across ranks needs 2 GPUs (one per rank); "
                    f"{torch.cuda.device_count()} visible")
    results = zk_spawn.spawn_ranks(_fp8_rank, 2, cuda_backend, backend="nccl",
                                   device_of=lambda r: torch.device("cuda", r), timeout=600)
    for r, res in enumerate(results):
        assert all(b == [] for b in res["bad"]), (r, res["bad"])
        assert res["losses"][-1] < res["losses"][0], (r, res["losses"])
        assert res["calls"]["all_gather"] > 0 and res["calls"]["all_reduce"] > 0, res["calls"]


def test_replica_crc_stages_device_bytes(cuda_device, monkeypatch):
    from zerokern.checkpoint import replica

    g = torch.Generator().manual_seed(1)
    host = [torch.randn(1000, generator=g), torch.randint(0, 100, (37,), generator=g),
            torch.randn(3, 5, generator=g).to(torch.bfloat16), torch.tensor(7.0),
            torch.randn(5000, generator=g)]
    tensors = [t.to(cuda_device) for t in host[:3]] + [host[3]] + [host[4].to(cuda_device)]
    want = 0
    for t in host:
        want = zlib.crc32(t.contiguous().reshape(-1).view(torch.uint8).numpy(), want)
    monkeypatch.setattr(replica, "CHUNK_BYTES", 4096)  # chunks refilled, a tensor split
    assert replica._crc(tensors) == want
    tensors[4][17] += 1.0  # the control: one value changed on the device
    assert replica._crc(tensors) != want
