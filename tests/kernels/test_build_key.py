"""The native build cache key follows the GPU architecture (issue 14, defect 5).

cpp_extension compiles csrc/cuda for TORCH_CUDA_ARCH_LIST or, unset, for the capability of every
visible GPU. A cache directory shared across GPU models must therefore key on that, or the second
model imports a .so without a kernel image for it. Checked on the CPU by patching what torch
reports; the CPU op's key must not move with it (its build does not depend on the GPU).
"""

from __future__ import annotations

import pytest
import torch

from zerokern.kernels import build


def _keys(monkeypatch, arch_list=None, caps=None):
    if arch_list is None:
        monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    else:
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch_list)
    caps = caps or []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(caps))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(caps))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: caps[i])
    return build.build_key(build.OPS["cuda"]), build.build_key(build.OPS["cpu"])


def test_arch_list_changes_the_cuda_key(monkeypatch):
    a, cpu_a = _keys(monkeypatch, "8.0")
    b, cpu_b = _keys(monkeypatch, "9.0")
    c, _ = _keys(monkeypatch, "8.0;9.0")
    assert len({a, b, c}) == 3
    assert cpu_a == cpu_b
    # the same list spelt with spaces instead of semicolons is the same build
    assert _keys(monkeypatch, "8.0 9.0")[0] == c


def test_detected_capability_changes_the_cuda_key(monkeypatch):
    a100, cpu_a = _keys(monkeypatch, caps=[(8, 0)])
    h100, cpu_h = _keys(monkeypatch, caps=[(9, 0)])
    both, _ = _keys(monkeypatch, caps=[(9, 0), (8, 0)])
    assert len({a100, h100, both}) == 3
    assert cpu_a == cpu_h
    assert _keys(monkeypatch, caps=[(9, 0), (9, 0)])[0] == h100  # two H100s: the same build


@pytest.mark.parametrize("caps", [[(8, 0)], [(9, 0)]])
def test_build_dir_differs_per_arch(monkeypatch, tmp_path, caps):
    monkeypatch.setenv("ZEROKERN_CACHE_DIR", str(tmp_path))
    _keys(monkeypatch, caps=caps)
    d = build.build_dir(build.OPS["cuda"])
    _keys(monkeypatch, caps=[(7, 5)])
    assert build.build_dir(build.OPS["cuda"]) != d
