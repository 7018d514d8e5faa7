"""Compile checks for the CUDA 8-bit AdamW kernel (csrc/cuda/adamw8bit.cu), no GPU needed.

As test_nvcc_compile.py does for zk_kernels.cu, for sm_90 under cpp_extension's flags:
* it builds with no warning; all 9 (grad x param_out) instantiations and the step increment;
  ptxas: 0 spill bytes, registers within __launch_bounds__(256, 4) = 64;
* PTX of every instantiation: 128-bit accesses for the fp32 master (2 x v4 each way), the grad
  (2 x v4 fp32 or 1 x v4 16-bit) and param_out (1 x v4), 64-bit (v2) for both code arrays; no
  ld/st.local;
* [Note: 8-bit step on CUDA, operation by operation]: no fused fp32 multiply-add (fma / mad)
  and every fp32 add/sub/mul/div/sqrt is the .rn form ptxas cannot contract;
* no fp64 instruction inside any loop of the kernel's control-flow graph (the fp64 prologue runs
  once per CTA, outside the grid-stride loop);
* the binding passes a host syntax check against torch's headers (when the wheel has them);
* the host launch plan (vector mask per array, grid) through ctypes on an nvcc -shared build.
Negative controls: a kernel with a*x + b (contracted to fma.rn.f32 by default), one with fp64 in
its grid-stride loop, and a scalar copy must each fail the check meant for it.
"""

from __future__ import annotations

import ctypes
import re
import subprocess
from pathlib import Path

import pytest

from .test_nvcc_compile import (
    _BAD_WORDS,
    _SPILL,
    NVCC,
    NVCC_FLAGS,
    _binding_command,
    _ptxas_kernels,
    local_memory,
    ptx_entries,
)

REPO = Path(__file__).resolve().parents[2]
Q8_CU = REPO / "csrc" / "cuda" / "adamw8bit.cu"
Q8_BINDING = REPO / "csrc" / "cuda" / "adamw8bit_binding.cpp"
KERNEL = "zk_adamw8bit_kernel"
REG_BOUND = 64  # __launch_bounds__(256, 4): 65536 / 1024

pytestmark = [pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH"), pytest.mark.slow]

CONTROLS_CU = r"""
__global__ void control_fma(const float* __restrict__ x, float* __restrict__ y, float a,
                            float b, long n) {
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    y[i] = a * x[i] + b;
}
__global__ void control_fp64_loop(const float* __restrict__ x, float* __restrict__ y, long n) {
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    y[i] = (float)(0.1 * (double)x[i]);
}
__global__ void control_scalar_copy(const float* __restrict__ x, float* __restrict__ y, long n) {
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    y[i] = 2.0f * x[i];
}
"""


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zk_nvcc_q8")
    (tmp / "controls.cu").write_text(CONTROLS_CU)
    ptx_flags = [f for f in NVCC_FLAGS if f not in ("-Xcompiler", "-Wall")]
    cmds = {
        "obj": [NVCC, *NVCC_FLAGS, "-Xptxas", "-v", "-c", "-o", str(tmp / "q8.o"), str(Q8_CU)],
        "ptx": [NVCC, *ptx_flags, "-ptx", "-o", str(tmp / "q8.ptx"), str(Q8_CU)],
        "host": [NVCC, *ptx_flags, "-shared", "-Xcompiler", "-fPIC", "-o", str(tmp / "q8.so"),
                 str(Q8_CU)],
        "controls": [NVCC, "-arch=sm_90", "-O3", "-ptx", "-o", str(tmp / "controls.ptx"),
                     str(tmp / "controls.cu")],
    }
    bind_cmd, skip = _binding_command(tmp)
    if bind_cmd is not None:
        cmds["binding"] = bind_cmd[:-1] + [str(Q8_BINDING)]
    procs = {k: subprocess.Popen(c, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True) for k, c in cmds.items()}
    out = {"binding_skip": skip, "tmp": tmp}
    for k, p in procs.items():
        try:
            text, _ = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            text = p.communicate()[0] + "\n(timed out)"
        out[k] = (p.returncode, text, " ".join(p.args))
    return out


def _ok(builds, key):
    rc, text, cmd = builds[key]
    assert rc == 0, f"{cmd}\n{text}"
    return text


def _entries(builds, key="ptx", name="q8.ptx"):
    _ok(builds, key)
    return ptx_entries((builds["tmp"] / name).read_text())


def _bodies(builds, key="ptx", name="q8.ptx"):
    _ok(builds, key)
    ptx = (builds["tmp"] / name).read_text()
    marks = [(m.start(), m.group(1)) for m in
             re.finditer(r"^(?:\.visible\s+)?\.entry\s+(\S+?)\(", ptx, re.M)] + [(len(ptx), None)]
    return {n: ptx[a:b] for (a, n), (b, _) in zip(marks, marks[1:])}


# --------------------------------------------------------------- loops of a PTX entry ------

_LABEL = re.compile(r"^(\$L__\w+):")
_OP = re.compile(r"^\s*(@!?%p\d+\s+)?([a-z][\w.]*)\s*([^;]*);")


def loop_ops(body: str) -> list:
    """Opcodes of the basic blocks that lie on a cycle of the entry's control-flow graph."""
    blocks, cur = [], {"label": None, "ops": []}
    for line in body.splitlines():
        m = _LABEL.match(line)
        if m:
            blocks.append(cur)
            cur = {"label": m.group(1), "ops": []}
            continue
        m = _OP.match(line)
        if not m:
            continue
        cur["ops"].append((bool(m.group(1)), m.group(2), m.group(3).strip()))
        if m.group(2).startswith(("bra", "ret", "exit")):
            blocks.append(cur)
            cur = {"label": None, "ops": []}
    blocks.append(cur)
    index = {b["label"]: i for i, b in enumerate(blocks) if b["label"]}
    succ = []
    for i, b in enumerate(blocks):
        s, last = set(), b["ops"][-1] if b["ops"] else None
        if last and last[1].startswith("bra"):
            s.add(index[last[2]])
            if last[0]:
                s.add(i + 1)
        elif not (last and last[1].startswith(("ret", "exit")) and not last[0]):
            s.add(i + 1)
        succ.append({j for j in s if j < len(blocks)})

    def reaches(a, target):
        seen, todo = set(), list(succ[a])
        while todo:
            j = todo.pop()
            if j == target:
                return True
            if j not in seen:
                seen.add(j)
                todo.extend(succ[j])
        return False

    return [op for i, b in enumerate(blocks) if reaches(i, i) for _, op, _ in b["ops"]]


def fp64_in_loops(body: str) -> list:
    return sorted({op for op in loop_ops(body) if ".f64" in op})


def contracted_f32(ops) -> list:
    """fp32 fused multiply-adds, and fp32 arithmetic ptxas may still contract (not .rn)."""
    return sorted(op for op in ops if re.match(r"^(fma|mad)\.[\w.]*f32$", op)
                  or re.match(r"^(add|sub|mul|div|sqrt)\.(?!rn\.)[\w.]*f32$", op))


def _n(ops, pred):
    return sum(c for op, c in ops.items() if pred(op))


def vector_counts(ops: dict) -> dict:
    return {
        "ld_v4_f32": _n(ops, lambda o: o.startswith("ld.global") and o.endswith(".v4.f32")),
        "ld_v4_u32": _n(ops, lambda o: o.startswith("ld.global") and o.endswith(".v4.u32")),
        "ld_v2_u32": _n(ops, lambda o: o.startswith("ld.global") and o.endswith(".v2.u32")),
        "st_v4_f32": _n(ops, lambda o: o.startswith("st.global") and o.endswith(".v4.f32")),
        "st_v4_u32": _n(ops, lambda o: o.startswith("st.global") and o.endswith(".v4.u32")),
        "st_v2_u32": _n(ops, lambda o: o.startswith("st.global") and o.endswith(".v2.u32")),
    }


def vectors_ok(name: str, ops: dict) -> bool:
    """master 2 x v4 each way; grad 2 x v4 (fp32) or 1 x v4 (16-bit); param_out 1 x v4;
    m_q and v_q one v2 each way."""
    c = vector_counts(ops)
    g32 = f"{KERNEL}If" in name
    out16 = "NoOut" not in name
    return (c["ld_v4_f32"] >= 2 + (2 if g32 else 0) and c["ld_v4_u32"] >= (0 if g32 else 1)
            and c["ld_v2_u32"] >= 2 and c["st_v4_f32"] >= 2
            and c["st_v4_u32"] >= (1 if out16 else 0) and c["st_v2_u32"] >= 2)


# ------------------------------------------------------------------------------ tests ------

def test_compiles_sm90_clean_with_every_instantiation(builds):
    text = _ok(builds, "obj")
    bad = [ln for ln in text.splitlines() if _BAD_WORDS.search(ln)]
    assert not bad, "\n".join(bad)
    kernels = _ptxas_kernels(text)
    assert len([k for k in kernels if KERNEL in k]) == 9, sorted(kernels)
    assert len([k for k in kernels if "zk_adamw8bit_increment_kernel" in k]) == 1


def test_no_spills_and_registers_within_launch_bounds(builds):
    text = _ok(builds, "obj")
    spills = _SPILL.findall(text)
    assert spills and all(s == ("0", "0") for s in spills), text
    kernels = _ptxas_kernels(text)
    over = {k: r for k, (r, _, _) in kernels.items() if KERNEL in k and r > REG_BOUND}
    assert not over, over
    print("\n".join(f"{k}: {v[0]} registers" for k, v in kernels.items()))


def test_vector_accesses_in_every_instantiation(builds):
    entries = {k: v for k, v in _entries(builds).items() if KERNEL in k}
    assert len(entries) == 9
    for name, ops in entries.items():
        assert vectors_ok(name, ops), (name, vector_counts(ops))


def test_no_contraction_and_no_local_memory(builds):
    for name, ops in _entries(builds).items():
        if KERNEL in name:
            assert not contracted_f32(ops), (name, contracted_f32(ops))
            assert ops.get("mul.rn.f32", 0) >= 8 * 11  # 11 products per element, 8 per lane
        assert not local_memory(ops), (name, local_memory(ops))


def test_no_fp64_in_the_element_loop(builds):
    for name, body in _bodies(builds).items():
        if KERNEL not in name:
            continue
        loop = loop_ops(body)
        assert "shfl.sync.bfly.b32" in loop and "mul.rn.f32" in loop, name  # the element loop
        assert not fp64_in_loops(body), (name, fp64_in_loops(body))
        assert any(".f64" in op for op in _entries(builds)[name]), name  # the prologue's


def test_controls_fail_the_checks(builds):
    bodies = _bodies(builds, "controls", "controls.ptx")
    entries = _entries(builds, "controls", "controls.ptx")
    by = lambda stem: next(k for k in bodies if stem in k)  # noqa: E731
    assert contracted_f32(entries[by("control_fma")])
    assert fp64_in_loops(bodies[by("control_fp64_loop")])
    assert not vectors_ok(f"{KERNEL}IfNoOut", entries[by("control_scalar_copy")])


def test_binding_syntax(builds):
    if "binding" not in builds:
        pytest.skip(builds["binding_skip"])
    text = _ok(builds, "binding")
    bad = [ln for ln in text.splitlines() if _BAD_WORDS.search(ln)]
    assert not bad, "\n".join(bad)


def test_host_launch_plan(builds):
    """Per-array vector choice and grid, from the launcher's own host code (ctypes)."""
    _ok(builds, "host")
    lib = ctypes.CDLL(str(builds["tmp"] / "q8.so"))
    mask = lib.zk_adamw8bit_vector_mask
    mask.restype = ctypes.c_int
    mask.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_void_p]
    grid = lib.zk_adamw8bit_grid
    grid.restype = ctypes.c_int64
    grid.argtypes = [ctypes.c_int64, ctypes.c_int]
    master, mq, vq, g, out = 0x10000, 0x20000, 0x30000, 0x40000, 0x50000
    assert mask(master, mq, vq, g, 2, out) == 31 and mask(master, mq, vq, g, 4, None) == 31
    assert mask(master + 4, mq, vq, g, 4, out) == 31 - 1      # master off 16 B: scalar master
    assert mask(master, mq, vq, g + 2, 2, out) == 31 - 2      # a 16-bit grad one element in
    assert mask(master, mq, vq, g, 2, out + 8) == 31 - 4      # param_out 8 B off
    assert mask(master, mq + 1, vq + 8, g, 2, out) == 31 - 8  # m_q 1 B off, v_q 8 B: fine
    assert mask(master, mq, vq + 4, g, 2, None) == 31 - 16
    # one 16-lane group per block of 128, 16 per CTA, at most 4 CTAs per SM
    assert [grid(nb, 132) for nb in (0, 1, 16, 17, 528 * 16, 10 ** 9)] == [1, 1, 1, 2, 528, 528]
