"""Every Triton kernel variant compiles for Hopper without a GPU, and the PTX is what we want.

DESIGN §6: `triton.compile(..., target=GPUTarget("cuda", 90, 32))` in CI. The compiles run in
a child process without TRITON_INTERPRET (the interpreter replaces @triton.jit functions) and
report PTX opcode counts and ptxas's resource usage as JSON. Checked per variant:
* 128-bit loads and stores of the fp32 arrays (ld/st.global.v4) when n is a multiple of 16;
* IEEE sqrt and division (sqrt.rn.f32, div.rn.f32), no approximations anywhere;
* the cast-back rounds to nearest even (cvt.rn.f16* / cvt.rn.bf16*, never rz/rm/rp);
* no register spills and no stack frame (ptxas -v);
* grad_stats_ uses no atomics (DESIGN §3: no contended atomics, deterministic).
A last check patches the kernels' launch to record Triton's JIT cache key: changing lr, step,
grad_scale or found_inf between calls must not change it (nothing recompiles, DESIGN §6).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# One tolerance table for this file (counts, not floating-point tolerances).
TOL = {
    # BLOCK 2048 over 8 warps = 8 fp32 per thread = two 128-bit accesses per fp32 array; master,
    # exp_avg and exp_avg_sq need at least 3 x 2 vector loads (4 x 2 with an fp32 grad).
    "min_v4_per_fp32_array": 2,
    # ptxas -v: bytes of spill stores / spill loads / stack frame allowed.
    "spill_bytes": 0,
    "stack_bytes": 0,
}

GRAD = {"f32": "*fp32", "f16": "*fp16", "bf16": "*bf16"}
OUT = {"none": None, "f16": "*fp16", "bf16": "*bf16"}
STEP = ["*i64", "*i32", "*fp32", "*fp64"]
FLAG = ["*i1", "*fp32"]


def adam_variants():
    out = []
    for i, (adamw, o, g, hp) in enumerate(
        itertools.product([True, False], OUT, GRAD, [False, True])
    ):
        name = f"adam-{'adamw' if adamw else 'l2'}-out{o}-g{g}-hp{'ptr' if hp else 'arg'}"
        out.append(
            dict(
                id=name,
                kind="adam",
                adamw=adamw,
                out=OUT[o],
                grad=GRAD[g],
                hp_from_ptr=hp,
                n="i32",
                n_div16=True,
                step=STEP[i % 4],
                flag=FLAG[i % 2],
            )
        )
    # 64-bit n (shards over 2^31 elements) and an n that is not a multiple of 16.
    out.append(dict(out[1], id="adam-n-i64", n="i64"))
    out.append(dict(out[1], id="adam-n-odd", n_div16=False))
    return out


VARIANTS = (
    adam_variants()
    + [
        dict(id=f"advance-{s[1:]}-{f[1:]}", kind="advance", step=s, flag=f)
        for s in STEP
        for f in FLAG
    ]
    + [dict(id=f"stats-partial-{g}", kind="partial", grad=GRAD[g]) for g in GRAD]
    + [
        dict(id=f"stats-final-{f[1:]}-{s[1:]}", kind="final", flag=f, sumsq=s)
        for f in FLAG
        for s in ("*fp32", "*fp64")
    ]
)

CHILD = r'''
import contextlib, io, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from zerokern.kernels import triton_kernels as tk

triton.knobs.nvidia.dump_ptxas_log = True  # ptxas -v output (spills, stack) on stdout

TARGET = GPUTarget("cuda", 90, 32)
variants, out_path, check_keys = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
assert type(tk._adam_step_kernel).__name__ == "JITFunction", "interpreter is on"


def build(fn, types, const, aligned, num_warps):
    """Compile for TARGET; returns the PTX and ptxas's -v log (triton runs ptxas -v itself)."""
    sig = {a: types.get(a, "constexpr") for a in fn.arg_names}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        k = triton.compile(ASTSource(fn, sig, dict(const), attrs), target=TARGET,
                           options=dict(num_warps=num_warps))
    return k.asm["ptx"], buf.getvalue()


def compile_variant(v):
    if v["kind"] == "adam":
        fn = tk._adam_step_kernel
        out = v["out"] or "*fp32"  # no param_out: the launcher passes master as a placeholder
        types = dict(master_ptr="*fp32", exp_avg_ptr="*fp32", exp_avg_sq_ptr="*fp32",
                     grad_ptr=v["grad"], out_ptr=out, n=v["n"], hp_ptr="*fp64",
                     step_ptr=v["step"], grad_scale_ptr="*fp32", found_inf_ptr=v["flag"])
        types.update({a: "fp32" for a in fn.arg_names if a.endswith(("_hi", "_lo"))})
        const = dict(ADAMW=v["adamw"], HAS_OUT=v["out"] is not None,
                     OUT_IS_BF16=v["out"] == "*bf16", HP_FROM_PTR=v["hp_from_ptr"],
                     EXPLICIT_RNE=False, BLOCK=tk.BLOCK_GPU)
        aligned = ["master_ptr", "exp_avg_ptr", "exp_avg_sq_ptr", "grad_ptr", "out_ptr",
                   "hp_ptr", "step_ptr", "grad_scale_ptr", "found_inf_ptr"]
        aligned += ["n"] if v["n_div16"] else []
        return build(fn, types, const, aligned, tk.NUM_WARPS_GPU)
    if v["kind"] == "advance":
        return build(tk._advance_step_kernel, dict(step_ptr=v["step"], found_inf_ptr=v["flag"]),
                     {}, ["step_ptr", "found_inf_ptr"], 1)
    if v["kind"] == "partial":
        fn = tk._grad_stats_partial_kernel
        types = dict(grad_ptr=v["grad"], partial_ptr="*fp32", flag_ptr="*i32", n="i32",
                     iters="i32")
        return build(fn, types, dict(BLOCK=tk.BLOCK_GPU),
                     ["grad_ptr", "partial_ptr", "flag_ptr", "n"], tk.NUM_WARPS_GPU)
    fn = tk._grad_stats_final_kernel
    types = dict(partial_ptr="*fp32", flag_ptr="*i32", nparts="i32", found_inf_ptr=v["flag"],
                 sumsq_ptr=v["sumsq"])
    return build(fn, types, dict(PBLOCK=tk.MAX_PARTIALS), ["partial_ptr", "flag_ptr"],
                 tk.NUM_WARPS_GPU)


def ptxas_usage(log):
    grab = lambda pat: [int(x) for x in re.findall(pat, log)]
    return dict(stack=grab(r"(\d+) bytes stack frame"),
                spill_stores=grab(r"(\d+) bytes spill stores"),
                spill_loads=grab(r"(\d+) bytes spill loads"),
                registers=grab(r"Used (\d+) registers"), log=log[-2000:])


OPCODE = re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.]*)", re.M)
results = {}
for v in variants:
    ptx, log = compile_variant(v)
    ops = {}
    for op in OPCODE.findall(ptx):
        ops[op] = ops.get(op, 0) + 1
    results[v["id"]] = dict(ops=ops, ptxas=ptxas_usage(log))

if check_keys:
    # Record the JIT cache key of every launch (what JITFunction.run would look up), for
    # meta tensors: the launcher then takes its GPU path, and data_ptr() 0 is 16-aligned.
    import torch
    from triton.compiler import make_backend
    from triton.runtime.jit import compute_cache_key, create_function_from_signature
    backend = make_backend(TARGET)
    keys = []
    def patch(jf):
        binder = create_function_from_signature(jf.signature, jf.params, backend)
        def run(*args, grid, warmup, **kwargs):
            _, spec, opts = binder(*args, **kwargs)
            keys.append((jf.fn.__name__, compute_cache_key({}, spec, opts)))
        jf.run = run
    for jf in (tk._adam_step_kernel, tk._advance_step_kernel, tk._grad_stats_partial_kernel,
               tk._grad_stats_final_kernel):
        patch(jf)
    meta = dict(device="meta")
    layouts = {}
    for adamw, tensor_hp in ((True, False), (True, True), (False, False)):
        seen = set()
        for lr, step, gs, fi in ((1e-3, 0, 1.0, False), (0.5, 1, 2.0 ** -16, True),
                                 (3e-4, 16, 0.37, False), (1.0, 10**6, 65536.0, True)):
            n = 4096
            t = lambda dt=torch.float32: torch.empty(n, dtype=dt, **meta)
            hp = dict(lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
            if tensor_hp:
                hp = {k: torch.tensor(x, dtype=torch.float64, **meta) for k, x in hp.items()}
            keys.clear()
            tk.adam_step_(t(), t(), t(), t(torch.bfloat16), t(torch.bfloat16), adamw=adamw,
                          step=torch.full((), step, dtype=torch.int64, **meta),
                          grad_scale=torch.full((), gs, **meta),
                          found_inf=torch.full((), fi, dtype=torch.bool, **meta), **hp)
            tk.grad_stats_(t(torch.bfloat16), torch.full((), fi, dtype=torch.bool, **meta),
                           torch.full((), gs, **meta))
            seen.add(tuple(keys))
        layouts[f"adamw={adamw} tensor_hp={tensor_hp}"] = [list(map(list, s)) for s in seen]
    results["__keys__"] = layouts

json.dump(results, open(out_path, "w"))
'''


def _triton_and_ptxas_present() -> str:
    """'' when triton and its bundled ptxas are there, else why not (the only skip reason)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    spec = importlib.util.find_spec("triton")
    bindir = Path(spec.origin).parent / "backends" / "nvidia" / "bin"
    if not any((bindir / p).exists() for p in ("ptxas", "ptxas-blackwell")):
        return f"triton's bundled ptxas is missing ({bindir})"
    return ""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    why = _triton_and_ptxas_present()
    if why:
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp("triton_compile")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(
        TRITON_DEFAULT_FP_FUSION="1",
        TRITON_CACHE_DIR=str(tmp / "cache"),
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
    )
    script = tmp / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    # One child: Triton's compiler is already multi-threaded, and two children on two cores
    # took longer (32 s) than one (27 s).
    out = tmp / "result.json"
    r = subprocess.run(
        [sys.executable, str(script), json.dumps(VARIANTS), str(out), "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, f"compile child failed:\n{(r.stdout + r.stderr)[-6000:]}"
    results = json.loads(out.read_text())
    return results


def _count(ops: dict, prefix: str) -> int:
    return sum(c for op, c in ops.items() if op.startswith(prefix))


def _common_checks(r: dict) -> None:
    ops, usage = r["ops"], r["ptxas"]
    assert not [op for op in ops if "approx" in op or op.startswith("div.full")], sorted(ops)
    assert usage["spill_stores"] and max(usage["spill_stores"]) <= TOL["spill_bytes"], usage
    assert max(usage["spill_loads"]) <= TOL["spill_bytes"], usage
    assert max(usage["stack"]) <= TOL["stack_bytes"], usage


def _ids(kind):
    return [v for v in VARIANTS if v["kind"] == kind]


@pytest.mark.parametrize("v", _ids("adam"), ids=lambda v: v["id"])
def test_adam_variant(compiled, v):
    r = compiled[v["id"]]
    ops = r["ops"]
    _common_checks(r)
    if v["n_div16"]:
        arrays = 3 + (v["grad"] == "*fp32")
        assert _count(ops, "ld.global.v4") >= arrays * TOL["min_v4_per_fp32_array"], ops
        assert _count(ops, "st.global.v4") >= 3 * TOL["min_v4_per_fp32_array"], ops
    assert _count(ops, "sqrt.rn.f32") >= 1 and _count(ops, "div.rn.f32") >= 1, sorted(ops)
    assert not [
        op
        for op in ops
        if op.startswith(("sqrt.", "div.", "rcp.", "rsqrt."))
        and op.endswith(".f32")
        and ".rn." not in op
    ], sorted(ops)
    narrowing = [
        op
        for op in ops
        if op.startswith("cvt.") and op.split(".")[-2] in ("f16", "bf16", "f16x2", "bf16x2")
    ]
    if v["out"] is None:
        assert not narrowing, narrowing
    else:
        want = "cvt.rn." + v["out"].lstrip("*").replace("fp16", "f16")
        assert narrowing and all(op.startswith(want) for op in narrowing), narrowing


@pytest.mark.parametrize("v", _ids("advance"), ids=lambda v: v["id"])
def test_advance_step_variant(compiled, v):
    r = compiled[v["id"]]
    _common_checks(r)
    assert _count(r["ops"], "st.global") >= 1 and _count(r["ops"], "ld.global") >= 2


@pytest.mark.parametrize("v", _ids("partial") + _ids("final"), ids=lambda v: v["id"])
def test_grad_stats_variant(compiled, v):
    r = compiled[v["id"]]
    ops = r["ops"]
    _common_checks(r)
    assert not [op for op in ops if op.startswith(("atom.", "red."))], sorted(ops)
    if v["kind"] == "partial":  # one 128-bit load per 4 fp32 / 8 16-bit grads
        assert _count(ops, "ld.global.v4") >= (2 if v["grad"] == "*fp32" else 1), ops


def test_per_step_values_do_not_recompile(compiled):
    """One JIT cache key per layout, whatever lr, step, grad_scale and found_inf are; and the
    key does see a layout change (adamw, hyperparameters as tensors), so the check can fail."""
    layouts = compiled["__keys__"]
    assert len(layouts) == 3
    for name, seen in layouts.items():
        assert len(seen) == 1, f"{name}: {len(seen)} different JIT keys across per-step values"
        kernels = [k for k, _ in seen[0]]
        assert kernels.count("_adam_step_kernel") == 1, kernels
        assert "_advance_step_kernel" in kernels and "_grad_stats_final_kernel" in kernels
    adam_keys = {name: dict(seen[0])["_adam_step_kernel"] for name, seen in layouts.items()}
    assert len(set(adam_keys.values())) == 3, "the key ignores adamw / HP_FROM_PTR"
