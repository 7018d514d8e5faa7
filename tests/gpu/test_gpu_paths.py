"""Issue 24's GPU paths on a real GPU: `python -m pytest -m gpu` (skipped elsewhere, with why).

* item 7: `zerokern train --device cuda` end to end (1 rank; 2 NCCL ranks with >= 2 GPUs);
* item 4: the fused compact-master kernel, compiled, bit for bit the unfused chain on CUDA
  tensors, and ZeroAdamW(master="compact") bit for bit master="fp32" on CUDA;
* item 5: stage 3 with offload_params="cpu" (the copy stream) against torch AdamW;
* item 8: _HostFlag for a flag on cuda:1 with cuda:0 current (>= 2 GPUs) waits for its copy;
  the CUDA op's kernel-image probe answers "" on this GPU, and for the current device only.
The CPU-side twins are named in each module's issue-24 tests (test_compact_triton_step.py,
test_stage3_gather_stream.py, test_gpu_order_mocks.py, tests/test_train.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zerokern as zk
from zerokern.state import compact_master as C

from ..support import models as M

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[2]
TOL = {"fp32": 1e-6}


@pytest.mark.parametrize("nproc", [1, 2])
def test_train_command_on_cuda(cuda_device, tmp_path, nproc):
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"--nproc {nproc} needs {nproc} GPUs (one rank per GPU)")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("TRITON_INTERPRET", None)
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "zerokern", "train", "--model-size", "tiny",
                        "--seq", "32", "--batch", "4", "--steps", "3", "--device", "cuda",
                        "--nproc", str(nproc), "--out", str(out)],
                       capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    m = json.loads((out / "metrics.json").read_text())
    assert m["device"] == "cuda" and m["world_size"] == nproc
    assert m["comm_backend"] == (None if nproc == 1 else "nccl")
    assert m["memory"]["estimate_matches_rank0"] is True


def test_fused_compact_step_is_the_unfused_chain_on_cuda(cuda_device):
    from zerokern.kernels import compact_triton as CT
    from zerokern.kernels import triton_kernels as tk

    n = (1 << 20) + 8 * 37
    x = torch.randn(n, device="cuda") * 3
    bits = x.view(torch.int32)
    bits[::5] = (bits[::5] & ~0xFFFF) | 0x8000  # exact ties
    low = torch.empty(n, dtype=torch.int16, device="cuda")
    ties = torch.empty(n // 8, dtype=torch.uint8, device="cuda")
    C.compact_torch_(low, ties, x)
    state = dict(low=low, ties=ties, param=x.to(torch.bfloat16),
                 m=torch.randn(n, device="cuda") * 0.1, v=torch.rand(n, device="cuda") * 0.01,
                 grad=torch.randn(n, device="cuda").bfloat16(),
                 step=torch.tensor(3, device="cuda"), nan=torch.zeros((), dtype=torch.bool,
                                                                        device="cuda"))
    ref = {k: v.clone() for k, v in state.items()}
    got = {k: v.clone() for k, v in state.items()}
    hp = dict(lr=3e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1, adamw=True)
    gs, fi = torch.tensor(0.5, device="cuda"), torch.zeros((), dtype=torch.bool, device="cuda")
    x2 = C.expand_torch_(torch.empty(n, device="cuda"), ref["low"], ref["ties"], ref["param"])
    tk.adam_step_(x2, ref["m"], ref["v"], ref["grad"], ref["param"], step=ref["step"],
                  grad_scale=gs, found_inf=fi, **hp)
    C.compact_torch_(ref["low"], ref["ties"], x2)
    CT.compact_adam_step_(got["low"], got["ties"], got["param"], got["m"], got["v"],
                          got["grad"], got["nan"], step=got["step"], grad_scale=gs,
                          found_inf=fi, **hp)
    for k in ref:
        if k != "nan":
            assert torch.equal(ref[k].view(-1).view(torch.uint8),
                               got[k].view(-1).view(torch.uint8)), k
    assert not bool(got["nan"])


def test_compact_master_trains_as_fp32_master_on_cuda(cuda_device):
    models = [M.make_model().cuda().to(torch.bfloat16) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [zk.ZeroAdamW(m, stage=2, precision="bf16", master=mm, backend="triton")
            for m, mm in zip(models, ("compact", "fp32"))]
    for s in range(5):
        for m, o in zip(models, opts):
            o.backward(M.loss_fn(m, M.rank_tokens(s, 0, 1).cuda()))
            o.step()
            o.zero_grad()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_param_offload_copy_stream_matches_torch_adamw(cuda_backend):
    """The grad statistics run on the device (cuda_backend); offload's host update runs the
    cpu kernel. (M.zero_opt's default backend="cpu" refuses the CUDA grads: ValueError.)"""
    from zerokern.stage3 import gather_stream

    ref = M.make_model().cuda()
    ref_opt = M.torch_adamw(ref)
    model = M.make_model().cuda()
    opt = M.zero_opt(model, 3, "fp32", offload="cpu", offload_params="cpu",
                     backend=cuda_backend)
    for s in range(5):
        for m, o in ((ref, None), (model, opt)):
            loss = M.loss_fn(m, M.rank_tokens(s, 0, 1).cuda())
            if o is None:
                loss.backward()
                ref_opt.step()
                ref_opt.zero_grad()
            else:
                o.backward(loss)
                o.step()
                o.zero_grad()
    assert torch.device("cuda", torch.cuda.current_device()) in gather_stream._STREAMS
    err = M.rel_err(M.full_snapshot(model, opt), M.snapshot(ref))
    assert err <= TOL["fp32"], err


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_host_flag_on_another_device_waits_for_its_copy(cuda_device):
    torch.cuda.set_device(0)
    for _ in range(3):
        with torch.cuda.device(1):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued on cuda:1
            flag = torch.ones((), dtype=torch.bool, device="cuda:1")
        hf = C._HostFlag(flag)
        assert hf.read(wait=True) is True


def test_cuda_op_has_a_kernel_image_for_this_gpu(cuda_op):
    """The probe answers for the current device only (issue 34: a probe per visible GPU made a
    CUDA context on each), and refuses another one rather than switching to it."""
    cur = torch.cuda.current_device()
    assert cuda_op.kernel_image_error() == "" and cuda_op.kernel_image_error(cur) == ""
    if torch.cuda.device_count() > 1:
        with pytest.raises(RuntimeError, match="current device"):
            cuda_op.kernel_image_error((cur + 1) % torch.cuda.device_count())
