"""Issue 24, item 8: the CUDA backend's vector path per element range, not per array.

`zk_adam_aligned_head` (csrc/cuda/zk_kernels.cu, host code) picks the scalar head after which all
five arrays are 16-byte aligned. Built with nvcc into a host library (no GPU needed) and called
through ctypes over every pointer offset a flat view can have (fp32 arrays at 4-byte steps,
16-bit arrays at 2-byte steps): the head it returns must align every pointer and be the
smallest that does, and -1 only when no head in 0..7 exists (checked by brute force here). The
old launcher had no head: any misaligned pointer sent the whole array down the scalar path
(this file failed there: no such symbol). The GPU side is tests/kernels/test_gpu.py::
test_misaligned_views (results on misaligned views equal the reference).
"""

from __future__ import annotations

import ctypes
import itertools
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
KERNELS_CU = REPO / "csrc" / "cuda" / "zk_kernels.cu"
NVCC = shutil.which("nvcc")

pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH (compile check only)")


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    so = tmp_path_factory.mktemp("zkcu") / "zk_host.so"
    r = subprocess.run([NVCC, "-arch=sm_90", "-O1", "-std=c++17", "-shared", "-Xcompiler",
                        "-fPIC", str(KERNELS_CU), "-o", str(so)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lib = ctypes.CDLL(str(so))
    f = lib.zk_adam_aligned_head
    f.restype = ctypes.c_int64
    f.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                          ctypes.c_int64]
    return f


def _brute(ptrs_sizes, n):
    for h in range(min(8, n + 1)):
        if all((p + h * s) % 16 == 0 for p, s in ptrs_sizes):
            return h
    return -1


@pytest.mark.slow  # the default run's budget (pyproject.toml [Note: the slow mark])
@pytest.mark.parametrize("gsize,osize", [(4, 0), (2, 2), (2, 0), (4, 2)],
                         ids=["fp32-noout", "16bit-out", "16bit-noout", "fp32grad-16bitout"])
def test_head_aligns_every_pointer(lib, gsize, osize):
    base = 1 << 20
    f32 = range(0, 16, 4)
    g_offs = range(0, 16, gsize)
    o_offs = range(0, 16, osize) if osize else [None]
    vector_ranges = 0
    for m, a, v, g, o in itertools.product(f32, f32, f32, g_offs, o_offs):
        for n in (3, 1000):
            ps = [(base + m, 4), (base + a, 4), (base + v, 4), (base + g, gsize)]
            if o is not None:
                ps.append((base + o, osize))
            got = lib(ps[0][0], ps[1][0], ps[2][0], ps[3][0], gsize,
                      None if o is None else base + o, osize or 2, n)
            assert got == _brute(ps, n), (m, a, v, g, o, n)
            vector_ranges += got > 0 and n == 1000
    # The case the issue names: every array shifted by the same element offset (a sliced
    # view) keeps the vector body; the old launcher ran those scalar.
    assert vector_ranges > 0
    h = lib(base + 4, base + 4, base + 4, base + gsize, gsize,
            None if not osize else base + osize, osize or 2, 1000)
    # one element in: fp32 pointers align after 3 or 7 more elements, 16-bit ones after 7
    assert h == (3 if gsize == 4 and not osize else 7)
