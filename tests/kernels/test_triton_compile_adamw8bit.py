"""The Triton 8-bit AdamW kernel compiled for Hopper without a GPU, checked as the Adam kernels
are (test_triton_compile.py; issue 40): vector widths, registers and spills for sm_90.

`triton.compile(..., target=GPUTarget("cuda", 90, 32))` in a child process without
TRITON_INTERPRET, with the launch the GPU path makes (ROWS_GPU blocks of 128 per program,
4 warps, FP fusion off: triton_adamw8bit.py [Note: the Triton 8-bit step]) and 16-byte aligned
pointers (torch's allocations), for every grad dtype x param_out. Checked per variant:
* 128-bit loads and stores of the fp32 master (two each way per thread: 8 elements), of an fp32
  grad (two) or a 16-bit grad (one), of a 16-bit param_out (one); 64-bit accesses for both code
  arrays (8 bytes per thread);
* ptxas -v: no spill, no stack frame, registers <= TOL["registers"];
* no local memory (ld/st.local).
Negative controls: the same kernel with no alignment known (every access scalar) fails the
vector check, and capped at 32 registers (maxnreg) fails the spill check.
The CUDA 8-bit kernel has the same checks with nvcc (test_nvcc_compile_adamw8bit.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .test_triton_compile import _triton_and_ptxas_present

REPO = Path(__file__).resolve().parents[2]
# [Note: the slow mark] (pyproject.toml): ~8 s of compiles on 2 cores, with the nvcc checks of
# the same kernel in CI's -m slow pass (the default suite is over its time budget).
pytestmark = pytest.mark.slow

TOL = {
    # Registers per thread, sm_90: 72 measured for every variant (2026-11-29, triton 3.9);
    # <= 80 keeps 6 programs of 128 threads resident per SM. Spills and stack: none.
    "registers": 80,
    "spill_bytes": 0,
    "stack_bytes": 0,
}

GRADS = {"g32": "*fp32", "gbf16": "*bf16", "gfp16": "*fp16"}
OUTS = {"none": None, "obf16": "*bf16", "ofp16": "*fp16"}
VARIANTS = [dict(id=f"{g}-{o}", grad=GRADS[g], out=OUTS[o], aligned=True)
            for g in GRADS for o in OUTS]
CONTROLS = [dict(id="control-unaligned", grad="*bf16", out="*bf16", aligned=False,
                 control="vector"),
            dict(id="control-maxnreg32", grad="*bf16", out="*bf16", aligned=True, maxnreg=32,
                 control="spill")]

CHILD = r'''
import contextlib, io, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from zerokern.kernels import triton_adamw8bit as q8

triton.knobs.nvidia.dump_ptxas_log = True  # ptxas -v output (spills, stack) on stdout
TARGET = GPUTarget("cuda", 90, 32)
OPCODE = re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.]*)", re.M)
fn = q8._q8_step_kernel
assert type(fn).__name__ == "JITFunction", "interpreter is on"
variants, out_path = json.loads(sys.argv[1]), sys.argv[2]


def build(v):
    types = dict(master_ptr="*fp32", mq_ptr="*u8", ma_ptr="*fp32", vq_ptr="*u8",
                 va_ptr="*fp32", grad_ptr=v["grad"], out_ptr=v["out"] or "*fp32", nb="i32",
                 sc_ptr="*fp32", skip_ptr="*i8", code_s_ptr="*fp32", code_u_ptr="*fp32",
                 mid_s_ptr="*fp32", mid_u_ptr="*fp32")
    sig = {a: types.get(a, "constexpr") for a in fn.arg_names}
    const = dict(HAS_OUT=v["out"] is not None, OUT_IS_BF16=v["out"] == "*bf16",
                 EXPLICIT_RNE=False, ROWS=q8.ROWS_GPU, QB=128)
    aligned = ([a for a in types if a.endswith("_ptr")] + ["nb"] if v["aligned"]
               else ["sc_ptr", "skip_ptr"])
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    opts = dict(num_warps=4, enable_fp_fusion=False)
    if v.get("maxnreg"):
        opts["maxnreg"] = v["maxnreg"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        k = triton.compile(ASTSource(fn, sig, const, attrs), target=TARGET, options=opts)
    ops = {}
    for op in OPCODE.findall(k.asm["ptx"]):
        ops[op] = ops.get(op, 0) + 1
    log = buf.getvalue()
    grab = lambda pat: [int(x) for x in re.findall(pat, log)]
    return dict(ops=ops, ptxas=dict(stack=grab(r"(\d+) bytes stack frame"),
                                    spill_stores=grab(r"(\d+) bytes spill stores"),
                                    spill_loads=grab(r"(\d+) bytes spill loads"),
                                    registers=grab(r"Used (\d+) registers"), log=log[-2000:]))


json.dump({v["id"]: build(v) for v in variants}, open(out_path, "w"))
'''


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    why = _triton_and_ptxas_present()
    if why:
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp("triton_compile_q8")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp / "cache"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    script = tmp / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    out = tmp / "result.json"
    r = subprocess.run([sys.executable, str(script), json.dumps(VARIANTS + CONTROLS), str(out)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"compile child failed:\n{(r.stdout + r.stderr)[-6000:]}"
    return json.loads(out.read_text())


def _n(ops: dict, pred) -> int:
    return sum(c for op, c in ops.items() if pred(op))


def vectors_ok(ops: dict, v: dict) -> bool:
    """master 2 x v4 each way; grad 2 x v4 (fp32) or 1 x v4 (16-bit); param_out 1 x v4; the
    two code arrays 1 x v2 each way."""
    v4_ld = _n(ops, lambda o: o.startswith("ld.global") and ".v4." in o)
    v4_st = _n(ops, lambda o: o.startswith("st.global") and ".v4." in o)
    v2_ld = _n(ops, lambda o: o.startswith("ld.global") and ".v2." in o)
    v2_st = _n(ops, lambda o: o.startswith("st.global") and ".v2." in o)
    return (v4_ld >= 2 + (2 if v["grad"] == "*fp32" else 1)
            and v4_st >= 2 + (1 if v["out"] else 0) and v2_ld >= 2 and v2_st >= 2)


def spill_free(usage: dict) -> bool:
    return (bool(usage["spill_stores"]) and max(usage["spill_stores"]) <= TOL["spill_bytes"]
            and max(usage["spill_loads"]) <= TOL["spill_bytes"]
            and max(usage["stack"] or [0]) <= TOL["stack_bytes"])


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v["id"])
def test_variant_vectors_registers_no_spills(compiled, v):
    r = compiled[v["id"]]
    assert vectors_ok(r["ops"], v), {k: c for k, c in r["ops"].items() if "global" in k}
    assert spill_free(r["ptxas"]), r["ptxas"]
    regs = r["ptxas"]["registers"]
    assert regs and max(regs) <= TOL["registers"], regs
    assert not _n(r["ops"], lambda o: o.startswith(("ld.local", "st.local"))), r["ops"]


def test_control_unaligned_fails_the_vector_check(compiled):
    v = CONTROLS[0]
    assert not vectors_ok(compiled[v["id"]]["ops"], v)


def test_control_register_cap_fails_the_spill_check(compiled):
    assert not spill_free(compiled[CONTROLS[1]["id"]]["ptxas"])


def test_register_counts_report(compiled):
    """Prints each variant's registers (pytest -s), for TOL above."""
    rows = {k: r["ptxas"]["registers"] for k, r in compiled.items()}
    print("\n".join(f"{k}: registers {regs}" for k, regs in rows.items()))
    assert all(rows.values())
