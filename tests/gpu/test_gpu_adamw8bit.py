"""The CUDA C++ 8-bit AdamW kernel (csrc/cuda/adamw8bit.cu) on a GPU: `python -m pytest -m gpu`.

Skipped elsewhere (conftest says why); the cuda backend also skips, with the reason, where it
cannot be built (no nvcc, or a CUDA major other than torch's). Each test would catch on the first
GPU run what the CPU-side twins cannot see (test_adamw8bit_cuda_host.py runs the kernel's
arithmetic on the host, test_adamw8bit_cuda_dispatch.py the dispatch, test_nvcc_compile_adamw8bit
the PTX):
* the op bitwise equal to the CPU op (csrc/cpu/adamw8bit_cpu.cpp) and to the reference on the
  same device, over 3 steps with the middle one skipped: fp32/fp16/bf16 grads, param_out
  none/fp16/bf16 (the cvt.rn cast-back), 1 block (a partial CTA), an odd block count (a
  half-warp group alone), and enough blocks for the grid-stride loop to wrap;
* found_inf (bool, fp32 1.0, fp32 NaN): a bitwise no-op, step included;
* misaligned views (the per-array scalar fallback, one array at a time and all at once);
* CUDA-tensor hyperparameters (the fp64 hp tensor) and int32 / float32 / float64 step counters;
* negative control: lr x 1.01 in the CUDA op is caught by the same comparison;
* ZeroAdamW(state_bits=8) on CUDA, backend="cuda" bitwise backend="triton" (params and states).
"""

from __future__ import annotations

import pytest
import torch

from tests import conftest
from zerokern.kernels.adamw8bit import adamw8bit_step_
from zerokern.kernels.quant8 import BLOCK, quantize

from ..support import models as M

pytestmark = pytest.mark.gpu
HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05)
NAMES = ("master", "m_q", "m_absmax", "v_q", "v_absmax")


# cuda_op (tests/conftest.py): the extension, skipped with the reason where it cannot be built


def _state(n, dev):
    p = torch.randn(n)
    mq, ma = quantize(torch.randn(n) * torch.logspace(-5, 0, n)[torch.randperm(n)], True)
    vq, va = quantize(torch.rand(n) * torch.logspace(-8, 0, n)[torch.randperm(n)], False)
    return [t.to(dev) for t in (p, mq, ma, vq, va)]


def _grads(n, dtype, steps, dev):
    return [(torch.randn(n) * torch.logspace(-4, 1, n)[torch.randperm(n)]).to(dev, dtype)
            for _ in range(steps)]


def _run(backend, state, grads, out, flags, hp=HP, step0=3, step_dtype=torch.int64,
         views=None):
    """Steps on clones of `state` / `out` (on their device); `views` places each clone inside
    a larger buffer at the given element offset (misaligned pointers)."""
    def place(name, t):
        k = (views or {}).get(name, 0)
        if not k:
            return t.clone()
        big = torch.empty(t.numel() + k, dtype=t.dtype, device=t.device)
        big[k:].copy_(t)
        return big[k:]

    st = [place(name, t) for name, t in zip(NAMES, state)]
    o = None if out is None else place("param_out", out)
    gs = [place("grad", g) for g in grads]
    dev = st[0].device
    step = torch.tensor(step0, dtype=step_dtype, device=dev)
    for g, f in zip(gs, flags):
        adamw8bit_step_(*st, g, o, **hp, step=step,
                        grad_scale=torch.tensor(0.5, device=dev),
                        found_inf=f.to(dev) if isinstance(f, torch.Tensor)
                        else torch.tensor(f, device=dev), backend=backend)
    return st, o, step


def _assert_same(want, got):
    for name, a, b in zip(NAMES, want[0], got[0]):
        a, b = a.cpu(), b.cpu()
        assert torch.equal(a, b), f"{name}: {int((a != b).sum())} of {a.numel()} differ"
    if want[1] is not None:
        assert torch.equal(want[1].cpu(), got[1].cpu()), "param_out"
    assert float(want[2]) == float(got[2])


DTYPES = [(torch.float32, None), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
          (torch.float32, torch.bfloat16)]
IDS = ["fp32", "bf16", "fp16", "fp32-bf16out"]


@pytest.mark.parametrize("dtypes", DTYPES, ids=IDS)
@pytest.mark.parametrize("blocks", [1, 3, 1031, 20011])
def test_cuda_op_equals_cpu_op_and_reference_bitwise(cuda_op, dtypes, blocks):
    gdt, odt = dtypes
    n = BLOCK * blocks
    state = _state(n, "cuda")
    grads = _grads(n, gdt, 3, "cuda")
    out = None if odt is None else torch.randn(n, device="cuda").to(odt)
    flags = [False, True, False]
    got = _run("cuda", state, grads, out, flags)
    cpu = _run("cpu", [t.cpu() for t in state], [g.cpu() for g in grads],
               None if out is None else out.cpu(), flags)
    _assert_same(cpu, got)
    _assert_same(_run("reference", state, grads, out, flags), got)
    assert int(got[2]) == 5 and not torch.equal(got[0][1], state[1])
    if out is not None:
        assert torch.equal(got[1], got[0][0].to(odt))  # bitwise torch's .to(dtype)


@pytest.mark.parametrize("flag", [torch.tensor(True), torch.tensor(1.0),
                                  torch.tensor(float("nan"))], ids=["bool", "one", "nan"])
def test_found_inf_is_a_bitwise_noop(cuda_op, flag):
    n = BLOCK * 37
    state = _state(n, "cuda")
    out = torch.randn(n, device="cuda").bfloat16()
    got = _run("cuda", state, _grads(n, torch.bfloat16, 1, "cuda"), out, [flag])
    for name, a, b in zip(NAMES, state, got[0]):
        assert torch.equal(a, b), name
    assert torch.equal(out, got[1]) and int(got[2]) == 3


def test_empty_piece_only_counts_the_step(cuda_op):
    """n = 0 (a rank whose piece of a group is empty): no step kernel, the increment still runs,
    as the CPU op and the reference do."""
    state = _state(0, "cuda")
    got = _run("cuda", state, _grads(0, torch.float32, 2, "cuda"), None, [False, True])
    assert int(got[2]) == 4 and all(t.numel() == 0 for t in got[0])


VIEWS = [{"master": 1}, {"grad": 1}, {"m_q": 1}, {"v_q": 4}, {"param_out": 1},
         {"master": 3, "grad": 5, "m_q": 3, "v_q": 1, "param_out": 7}]


@pytest.mark.parametrize("views", VIEWS, ids=lambda v: "+".join(f"{k}{o}" for k, o in v.items()))
def test_misaligned_views(cuda_op, views):
    n = BLOCK * 211
    state = _state(n, "cuda")
    grads = _grads(n, torch.bfloat16, 2, "cuda")
    out = torch.randn(n, device="cuda").half()
    got = _run("cuda", state, grads, out, [False, False], views=views)
    assert got[0][0].data_ptr() % 16 or got[0][1].data_ptr() % 8 or got[1].data_ptr() % 16 \
        or got[0][3].data_ptr() % 8 or views.get("grad")  # really misaligned
    _assert_same(_run("cpu", [t.cpu() for t in state], [g.cpu() for g in grads], out.cpu(),
                      [False, False]), got)


@pytest.mark.parametrize("step_dtype", [torch.int32, torch.float32, torch.float64])
def test_device_hyperparameters_and_step_dtypes(cuda_op, step_dtype):
    n = BLOCK * 129
    state = _state(n, "cuda")
    grads = _grads(n, torch.float32, 2, "cuda")
    # float64 tensors: the same values as the floats the CPU op gets (a float32 tensor of 1e-3
    # is another lr)
    dev_hp = {k: torch.tensor(v, dtype=torch.float64, device="cuda") for k, v in HP.items()}
    got = _run("cuda", state, grads, None, [False, False], hp=dev_hp, step_dtype=step_dtype)
    _assert_same(_run("cpu", [t.cpu() for t in state], [g.cpu() for g in grads], None,
                      [False, False]), got)


def test_negative_control_lr(cuda_op):
    n = BLOCK * 64
    state = _state(n, "cuda")
    grads = _grads(n, torch.float32, 1, "cuda")
    got = _run("cuda", state, grads, None, [False], hp=dict(HP, lr=HP["lr"] * 1.01))
    with pytest.raises(AssertionError, match="master"):
        _assert_same(_run("cpu", [t.cpu() for t in state], [g.cpu() for g in grads], None,
                          [False]), got)


def _states(opt):
    """Every tensor of the optimizer's state_dict, by path, on the CPU."""
    out = {}

    def walk(prefix, x):
        if isinstance(x, torch.Tensor):
            out[prefix] = x.detach().cpu()
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(f"{prefix}/{i}", v)

    walk("", opt.state_dict())
    return out


@pytest.mark.parametrize("stage,precision", [(1, "fp32"), (2, "bf16"), (3, "bf16")])
def test_zero_adamw8bit_backend_cuda_equals_triton(cuda_op, stage, precision):
    conftest.require_backend("triton")
    runs = {}
    for backend in ("triton", "cuda"):
        model = M.make_model().cuda()
        opt = M.zero_opt(model, stage, precision, backend=backend, state_bits=8)
        for s in range(4):
            opt.backward(M.loss_fn(model, M.rank_tokens(s, 0, 1).cuda()))
            opt.step()
            opt.zero_grad()
        runs[backend] = (M.full_snapshot(model, opt), _states(opt))
    assert M.bitwise_equal(runs["cuda"][0], runs["triton"][0])
    assert M.bitwise_equal(runs["cuda"][1], runs["triton"][1])
    assert any(t.dtype == torch.uint8 for t in runs["cuda"][1].values())  # really 8-bit
