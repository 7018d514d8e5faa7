"""The library asks the device handle what a device can do, not whether its type is "cuda"
(zerokern/platform/device.py, [Note: what a device can do]; issue 35's device handle).

A module outside zerokern/platform/ that compares a device type with the literal "cuda" (or
reads `.is_cuda`) is a module a new device type (ROCm answers as "cuda"; an XPU does not) would
have to touch. `ALLOWED` names the ones that may, each with its reason: the choice there is of
code built for CUDA (a kernel, a codec, an NCCL fact), or a command line whose --device choices
are cpu and cuda. A new module that compares fails `test_no_new_module_compares_a_device_type_
with_cuda`: route its pinning, stream or event choice through `handle(dev).has_streams` /
`.pins_host_memory` instead, or add it here with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from zerokern.platform.device import handle

PKG = Path(__file__).resolve().parents[1] / "zerokern"

_KERNEL_BACKEND = "`backend == \"cuda\"` picks the compiled CUDA op (a kernel backend name)"
_BENCH = ("benchmark CLI: --device cuda, and CUDA-only timing and environment records "
          "(events, an L2 flush sized for an H100, torch.version.cuda)")

ALLOWED = {
    "zerokern/kernels/dispatch.py": "kernel dispatch: backend='auto' on CUDA tensors is the "
                                    "Triton/CUDA kernel; backend='cuda' refuses other tensors",
    "zerokern/kernels/native.py": _KERNEL_BACKEND,
    "zerokern/kernels/lion.py": _KERNEL_BACKEND,
    "zerokern/kernels/adamw8bit.py": _KERNEL_BACKEND,
    "zerokern/kernels/blockquant.py": "kernel dispatch: the codec of CUDA tensors is the Triton "
                                      "op (OpCodec), of CPU tensors the native one",
    "zerokern/rules/muon_orthogonalize.py": "kernel choice: the Newton-Schulz 'gram' dtype is "
                                            "fp16 on CUDA, as DeepSpeed runs it on a GPU",
    "zerokern/layout/param_alias.py": "torch's DLPack aliasing: a view is exported through "
                                      "DLPack for cpu and cuda tensors only",
    "zerokern/comm/device_check.py": "NCCL carries CUDA tensors only: the error for params on "
                                     "another device with an NCCL group says so",
    "zerokern/train/__init__.py": "zerokern train's --device choices are cpu and cuda",
    "zerokern/train/launch.py": "zerokern train's --device choices are cpu and cuda (one rank "
                                "per GPU, nccl)",
    "zerokern/bench/common.py": _BENCH,
    "zerokern/bench/step.py": _BENCH,
    "zerokern/bench/kernels.py": _BENCH,
    "zerokern/bench/kernels_report.py": _BENCH + "; 'cuda' there is a kernel provider",
    "zerokern/bench/activations.py": _BENCH,
}


def _is_cuda_literal(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return node.value == "cuda"
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(isinstance(e, ast.Constant) and e.value == "cuda" for e in node.elts)
    return False


def cuda_compares(text: str) -> list:
    """Lines of `text` whose code (not comments or docstrings) compares something with the
    literal "cuda" (==, !=, in, not in; a tuple holding "cuda" too) or reads `.is_cuda`."""
    lines = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Attribute) and node.attr == "is_cuda":
            lines.add(node.lineno)
        elif isinstance(node, ast.Compare) and any(
                _is_cuda_literal(o) for o in [node.left, *node.comparators]):
            lines.add(node.lineno)
    return sorted(lines)


def modules_comparing_with_cuda() -> dict:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        rel = str(p.relative_to(PKG.parent))
        if rel.startswith("zerokern/platform/"):
            continue
        found = cuda_compares(p.read_text())
        if found:
            out[rel] = found
    return out


def test_no_new_module_compares_a_device_type_with_cuda():
    found = modules_comparing_with_cuda()
    new = {m: lines for m, lines in found.items() if m not in ALLOWED}
    assert not new, (
        f"{len(found)} modules compare a device type with 'cuda' (allowed: {len(ALLOWED)}); "
        f"new: {new}. Ask zerokern.platform.device.handle(dev).has_streams / "
        ".pins_host_memory, or add the module to ALLOWED with its reason")
    assert len(found) <= len(ALLOWED)


def test_the_check_can_fail():
    code = ("def f(t, dev, kinds, d):\n"
            "    a = t.is_cuda\n"
            "    b = dev.type == 'cuda'\n"
            "    c = 'cuda' in kinds\n"
            "    e = d.type not in ('cpu', 'cuda')\n"
            "    return dev.type == 'cpu'\n")
    prose = '"""dev.type == "cuda" in prose"""\n# t.is_cuda in a comment\nX = "cuda"\n'
    assert cuda_compares(code) == [2, 3, 4, 5]
    assert cuda_compares(prose) == []


def test_capabilities_answer_as_the_type_compares_did():
    """For cpu, meta and cuda the same answer as `device.type == "cuda"` gave at each call site
    routed through the handle; an XPU has streams and pinned copies; an MPS device keeps the
    CPU's path (no torch.mps.Stream). Only torch.device objects are built: nothing is placed
    on a device."""
    expected = {"cpu": False, "meta": False, "cuda": True, "cuda:1": True, "xpu": True,
                "mps": False}
    for dev, streamed in expected.items():
        h = handle(torch.device(dev))
        assert h.has_streams is streamed and h.pins_host_memory is streamed, dev
        assert h.has_streams is (torch.device(dev).type == "cuda" or dev == "xpu"), dev
