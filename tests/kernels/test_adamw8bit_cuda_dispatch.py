"""backend="cuda" for `adamw8bit_step_` on the CPU side (issue 23): what the CUDA op is handed.

No GPU here, so the op is replaced by a recorder that runs the CPU op on the very arguments the
CUDA binding receives (the two share their argument order, checked from the sources below, plus
the CUDA-only `hp`). The result must be the reference's bit for bit: wrong argument order or
maps would show. Before this change backend="cuda" raised ValueError ("no 8-bit AdamW kernel").
Also checked from the sources: the build lists every csrc/cuda file, the module registers what
cuda_toolchain.OP_FUNCTIONS names, and a prebuilt op without adamw8bit_step is rebuilt.
"""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest
import torch

from zerokern.kernels import adamw8bit as A
from zerokern.kernels import build, cuda_toolchain, dispatch
from zerokern.kernels.quant8 import BLOCK, code_map, midpoints, quantize

CSRC = Path(__file__).resolve().parents[2] / "csrc"
HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05)


class _RecordingCudaOp:
    """Stands in for the built cuda module: records each adamw8bit_step call and runs the CPU
    op on the same arguments (less `hp`, which only the CUDA op takes)."""

    def __init__(self, cpu_op):
        self.calls, self.cpu = [], cpu_op

    def adamw8bit_step(self, *args):
        self.calls.append(args)
        self.cpu.adamw8bit_step(*args[:-1])


@pytest.fixture
def cuda_op(monkeypatch, cpu_op):
    rec = _RecordingCudaOp(cpu_op)
    real = build.load_op
    monkeypatch.setattr(build, "load_op", lambda name: rec if name == "cuda" else real(name))
    # CPU tensors stand in for CUDA ones: backend="cuda" resolves to the cuda op
    monkeypatch.setattr(A, "resolve", lambda backend, device: "cuda" if backend == "cuda"
                        else dispatch.resolve(backend, device))
    return rec


def _state(n):
    p = torch.randn(n)
    mq, ma = quantize(torch.randn(n) * torch.logspace(-5, 0, n)[torch.randperm(n)], True)
    vq, va = quantize(torch.rand(n) * torch.logspace(-8, 0, n)[torch.randperm(n)], False)
    return [p, mq, ma, vq, va]


def _run(backend, state, grads, out, flags, hp=HP):
    state = [t.clone() for t in state]
    out = None if out is None else out.clone()
    step = torch.tensor(3)
    for g, f in zip(grads, flags):
        A.adamw8bit_step_(*state, g, out, **hp, step=step, grad_scale=torch.tensor(0.5),
                          found_inf=torch.tensor(f), backend=backend)
    return state, out, step


@pytest.mark.parametrize("odt", [None, torch.bfloat16, torch.float16], ids=["none", "bf16", "fp16"])
def test_backend_cuda_calls_the_cuda_op_with_the_cpu_ops_arguments(cuda_op, odt):
    n = BLOCK * 9
    state = _state(n)
    grads = [torch.randn(n).to(odt or torch.float32) for _ in range(3)]
    out = None if odt is None else torch.randn(n).to(odt)
    flags = [False, True, False]
    want = _run("reference", state, grads, out, flags)
    got = _run("cuda", state, grads, out, flags)
    assert len(cuda_op.calls) == 3  # the op itself skips (found_inf is read on the device)
    for a, b in zip(want[0], got[0]):
        assert torch.equal(a, b)
    assert (out is None) or torch.equal(want[1], got[1])
    assert int(got[2]) == int(want[2]) == 5
    args = cuda_op.calls[0]
    dev = torch.device("cpu")
    assert args[7:12] == tuple(float(HP[k]) for k in ("lr", "beta1", "beta2", "eps",
                                                      "weight_decay"))
    for got_map, want_map in zip(args[15:19], (code_map(True, dev), code_map(False, dev),
                                               midpoints(True, dev), midpoints(False, dev))):
        assert got_map is want_map  # the reference's own fp32 maps, not copies
    assert args[19] is None  # float hyperparameters: no device hp tensor


def test_negative_control_lr_through_the_cuda_path(cuda_op):
    n = BLOCK * 4
    state, grads = _state(n), [torch.randn(n)]
    want = _run("reference", state, grads, None, [False])
    got = _run("cuda", state, grads, None, [False], hp=dict(HP, lr=HP["lr"] * 1.01))
    assert not torch.equal(want[0][0], got[0][0])


def test_auto_on_cuda_tensors_without_triton_is_the_cuda_op(monkeypatch):
    monkeypatch.setattr(dispatch, "_triton_importable", lambda: False)
    assert dispatch.resolve("auto", torch.device("cuda")) == "cuda"
    assert dispatch.resolve("cuda", torch.device("cuda")) == "cuda"
    with pytest.raises(ValueError, match="cuda"):
        dispatch.resolve("cuda", torch.device("cpu"))


def _pyargs(text: str, fn: str) -> list:
    """The argument names of m.def(fn, ...) in a binding source (py::arg("x") or "x"_a)."""
    m = re.search(r'm\.def\("' + fn + r'",(.*?)\);', text, re.S)
    assert m, fn
    return re.findall(r'py::arg\("(\w+)"\)|"(\w+)"_a', m.group(1))


def test_cuda_binding_takes_the_cpu_ops_arguments_plus_hp():
    cuda = [a or b for a, b in _pyargs((CSRC / "cuda" / "binding.cpp").read_text(),
                                        "adamw8bit_step")]
    cpu = [a or b for a, b in _pyargs((CSRC / "cpu" / "adam_cpu.cpp").read_text(),
                                       "adamw8bit_step")]
    assert cuda == cpu + ["hp"], (cuda, cpu)


def test_build_lists_every_cuda_source():
    spec = build.OPS["cuda"]
    listed = {p.name for p in build._sources(spec)}
    present = {p.name for p in (CSRC / "cuda").iterdir() if p.suffix in (".cpp", ".cu")}
    assert listed == present and "adamw8bit.cu" in listed and "adamw8bit_binding.cpp" in listed
    # the header shared with the host emulation is part of the build key
    assert "adamw8bit_math.cuh" in {p.name for p in build._all_source_files(spec)}


def test_op_functions_are_what_binding_registers():
    text = (CSRC / "cuda" / "binding.cpp").read_text()
    assert set(re.findall(r'm\.def\("(\w+)"', text)) == set(cuda_toolchain.OP_FUNCTIONS)


def test_prebuilt_op_without_adamw8bit_step_is_rebuilt(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    fns = {f: (lambda *a: "") for f in cuda_toolchain.OP_FUNCTIONS}
    assert cuda_toolchain.prebuilt_problem(types.SimpleNamespace(**fns)) is None
    del fns["adamw8bit_step"]
    why = cuda_toolchain.prebuilt_problem(types.SimpleNamespace(**fns))
    assert why is not None and "adamw8bit_step" in why and "older zerokern" in why
