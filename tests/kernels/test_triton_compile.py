"""Every Triton kernel variant compiles for Hopper without a GPU, and the PTX is what we want.

DESIGN §6: `triton.compile(..., target=GPUTarget("cuda", 90, 32))` in CI. The compiles run in
a child process without TRITON_INTERPRET (the interpreter replaces @triton.jit functions) and
report PTX opcode counts and ptxas's resource usage as JSON. Checked per variant:
* 128-bit loads and stores of the fp32 arrays (ld/st.global.v4) when n is a multiple of 16;
* IEEE sqrt and division (sqrt.rn.f32, div.rn.f32), no approximations anywhere;
* the cast-back rounds to nearest even (cvt.rn.f16* / cvt.rn.bf16*, never rz/rm/rp);
* no register spills and no stack frame (ptxas -v);
* grad_stats_ uses no atomics (DESIGN §3: no contended atomics, deterministic);
* register counts within the occupancy the launch configuration is sized for (TOL);
* no fp64 at all in the per-element Adam kernel: the fp64 set-up runs once per launch in
  `_adam_scalars_kernel` (issue 14, defect 3).
Each check has a negative control that must fail it: the scalar variants an odd n or a
misaligned view compile to (defect 7), the aligned kernel capped at 32 registers (spills), the
fp64 prologue (fp64), and a reduction with tl.atomic_add (atomics).
A last check patches the kernels' launch to record Triton's JIT cache key: changing lr, step,
grad_scale or found_inf between calls must not change it (nothing recompiles, DESIGN §6).

Every kernel (the last section): a second child finds every @triton.jit kernel of every module
of zerokern.kernels by itself, records each launch the package's launchers make (meta tensors:
the GPU path, exact signatures, constexprs and options) and compiles each distinct one once for
sm_90; a kernel no launcher reaches is compiled from a signature read off its parameter names.
Checked: no approximate division or sqrt (`div.full`, `*.approx`; a plain `/` compiles to
div.full.f32), every launch pins enable_fp_fusion, and the Lion kernels carry no FMA. Negative
controls: a planted kernel that divides with `/` (its tl.div_rn twin passes) and the Lion kernel
compiled with FP fusion on.
"""

from __future__ import annotations

import ast
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
    # Registers per thread (ptxas, sm_90; test_register_counts_report prints them). Adam:
    # <= 64 keeps 4 programs of 256 threads resident per SM (1024 threads), the CUDA kernel's
    # __launch_bounds__(256, 4); measured 56-64 aligned, 126 for the scalar variant of a
    # misaligned launch (defect 7). Stats partials: <= 32 = 8 programs/SM, full occupancy for
    # a kernel that moves 2-4 B per element; measured 30-32.
    "adam_registers": 64,
    "stats_registers": 32,
}

GRAD = {"f32": "*fp32", "f16": "*fp16", "bf16": "*bf16"}
OUT = {"none": None, "f16": "*fp16", "bf16": "*bf16"}
STEP = ["*i64", "*i32", "*fp32", "*fp64"]
FLAG = ["*i1", "*fp32"]


def adam_variants():
    out = []
    for adamw, o, g in itertools.product([True, False], OUT, GRAD):
        name = f"adam-{'adamw' if adamw else 'l2'}-out{o}-g{g}"
        out.append(dict(id=name, kind="adam", adamw=adamw, out=OUT[o], grad=GRAD[g], n="i32",
                        n_div16=True, aligned=True, block="gpu"))
    # 64-bit n (shards over 2^31 elements).
    out.append(dict(out[1], id="adam-n-i64", n="i64"))
    # What the launcher compiles for head/tail pieces of < 16 elements (issue 14, defect 7).
    out.append(dict(out[1], id="adam-edge", n_div16=False, aligned=False, block="edge"))
    # Negative controls: what a launch over an odd n or a misaligned view used to compile (the
    # scalar variant, defect 7), and the aligned kernel squeezed to 32 registers (spills).
    out.append(dict(out[1], id="control-adam-n-odd", n_div16=False, control="scalar"))
    out.append(dict(out[1], id="control-adam-unaligned", aligned=False, control="scalar"))
    out.append(dict(out[1], id="control-adam-maxnreg32", maxnreg=32, control="spill"))
    return out


def scalars_variants():
    """The once-per-launch fp64 prologue (defect 3): hyperparameters from args or a pointer."""
    return [dict(id=f"scalars-hp{'ptr' if hp else 'arg'}-{s[1:]}-{f[1:]}", kind="scalars",
                 hp_from_ptr=hp, step=s, flag=f)
            for i, (hp, s, f) in enumerate(itertools.product([False, True], STEP, FLAG))
            if i % 2 == 0 or hp]


VARIANTS = (
    adam_variants()
    + scalars_variants()
    + [
        dict(id=f"advance-{s[1:]}-{f[1:]}", kind="advance", step=s, flag=f)
        for s in STEP
        for f in FLAG
    ]
    + [dict(id=f"stats-partial-{g}", kind="partial", grad=GRAD[g]) for g in GRAD]
    + [dict(id="stats-partial-edge", kind="partial", grad="*bf16", block="edge")]
    + [
        dict(id=f"stats-final-{f[1:]}-{s[1:]}", kind="final", flag=f, sumsq=s)
        for f in FLAG
        for s in ("*fp32", "*fp64")
    ]
    # Negative control: a reduction with atomics, which the stats check must reject.
    + [dict(id="control-atomic-sum", kind="atomic", control="atomic")]
)

CHILD = r'''
import contextlib, io, json, re, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from zerokern.kernels import triton_kernels as tk

triton.knobs.nvidia.dump_ptxas_log = True  # ptxas -v output (spills, stack) on stdout

TARGET = GPUTarget("cuda", 90, 32)
variants, out_path, check_keys = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
assert type(tk._adam_step_kernel).__name__ == "JITFunction", "interpreter is on"


@triton.jit
def _control_atomic_sum(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.atomic_add(out_ptr, tl.sum(tl.load(x_ptr + offs, mask=offs < n, other=0.0), axis=0))


def build(fn, types, const, aligned, num_warps, **opts):
    """Compile for TARGET; returns the PTX and ptxas's -v log (triton runs ptxas -v itself)."""
    sig = {a: types.get(a, "constexpr") for a in fn.arg_names}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        k = triton.compile(ASTSource(fn, sig, dict(const), attrs), target=TARGET,
                           options=dict(num_warps=num_warps, **opts))
    return k.asm["ptx"], buf.getvalue()


def compile_variant(v):
    if v["kind"] == "adam":
        fn = tk._adam_step_kernel
        out = v["out"] or "*fp32"  # no param_out: the launcher passes master as a placeholder
        types = dict(master_ptr="*fp32", exp_avg_ptr="*fp32", exp_avg_sq_ptr="*fp32",
                     grad_ptr=v["grad"], out_ptr=out, n=v["n"], sc_ptr="*fp32")
        edge = v["block"] == "edge"
        const = dict(ADAMW=v["adamw"], HAS_OUT=v["out"] is not None,
                     OUT_IS_BF16=v["out"] == "*bf16", EXPLICIT_RNE=False,
                     BLOCK=tk.BLOCK_EDGE if edge else tk.BLOCK_GPU)
        aligned = ["sc_ptr"]
        if v["aligned"]:
            aligned += ["master_ptr", "exp_avg_ptr", "exp_avg_sq_ptr", "grad_ptr", "out_ptr"]
        aligned += ["n"] if v["n_div16"] else []
        opts = dict(maxnreg=v["maxnreg"]) if v.get("maxnreg") else {}
        return build(fn, types, const, aligned, 1 if edge else tk.NUM_WARPS_GPU, **opts)
    if v["kind"] == "scalars":
        fn = tk._adam_scalars_kernel
        types = dict(sc_ptr="*fp32", hp_ptr="*fp64", step_ptr=v["step"], grad_scale_ptr="*fp32",
                     found_inf_ptr=v["flag"])
        types.update({a: "fp32" for a in fn.arg_names if a.endswith(("_hi", "_lo"))})
        return build(fn, types, dict(HP_FROM_PTR=v["hp_from_ptr"]),
                     ["sc_ptr", "hp_ptr", "step_ptr", "grad_scale_ptr", "found_inf_ptr"], 1)
    if v["kind"] == "advance":
        return build(tk._advance_step_kernel, dict(step_ptr=v["step"], found_inf_ptr=v["flag"]),
                     {}, ["step_ptr", "found_inf_ptr"], 1)
    if v["kind"] == "partial":
        fn = tk._grad_stats_partial_kernel
        types = dict(grad_ptr=v["grad"], partial_ptr="*fp32", flag_ptr="*i32", n="i32",
                     iters="i32")
        if v.get("block") == "edge":
            return build(fn, types, dict(BLOCK=tk.BLOCK_EDGE), [], 1)
        return build(fn, types, dict(BLOCK=tk.BLOCK_GPU),
                     ["grad_ptr", "partial_ptr", "flag_ptr", "n"], tk.NUM_WARPS_GPU)
    if v["kind"] == "atomic":
        return build(_control_atomic_sum, dict(x_ptr="*fp32", out_ptr="*fp32", n="i32"),
                     dict(BLOCK=1024), ["x_ptr", "n"], 4)
    fn = tk._grad_stats_final_kernel
    types = dict(partial_ptr="*fp32", flag_ptr="*i32", nparts="i32", found_inf_ptr=v["flag"],
                 sumsq_ptr=v["sumsq"])
    return build(fn, types, dict(PBLOCK=2 * tk.MAX_PARTIALS), ["partial_ptr", "flag_ptr"],
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
    for jf in (tk._adam_scalars_kernel, tk._adam_step_kernel, tk._advance_step_kernel,
               tk._grad_stats_partial_kernel, tk._grad_stats_final_kernel):
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


# ---- the checks, as predicates, so that each negative control can show it fails ------------

def vector_ok(ops: dict, v: dict) -> bool:
    """128-bit loads and stores of every fp32 array (two per array per thread, BLOCK 2048)."""
    arrays = 3 + (v["grad"] == "*fp32")
    return (_count(ops, "ld.global.v4") >= arrays * TOL["min_v4_per_fp32_array"]
            and _count(ops, "st.global.v4") >= 3 * TOL["min_v4_per_fp32_array"])


def spill_free(usage: dict) -> bool:
    return (bool(usage["spill_stores"]) and max(usage["spill_stores"]) <= TOL["spill_bytes"]
            and max(usage["spill_loads"]) <= TOL["spill_bytes"]
            and max(usage["stack"]) <= TOL["stack_bytes"])


def regs_ok(usage: dict, bound: int) -> bool:
    return bool(usage["registers"]) and max(usage["registers"]) <= bound


def fp64_free(ops: dict) -> list:
    """(defect 3) fp64 instructions: arithmetic on .f64 and conversions to or from it."""
    return sorted(op for op in ops if ".f64" in op)


def atomics(ops: dict) -> list:
    return sorted(op for op in ops if op.startswith(("atom.", "red.")))


def approximations(ops: dict) -> list:
    """Approximate division and sqrt: div.full.f32 (a plain `/`), div/sqrt/rcp/ex2 .approx."""
    return sorted(op for op in ops if "approx" in op or op.startswith("div.full"))


def _common_checks(r: dict) -> None:
    ops, usage = r["ops"], r["ptxas"]
    assert not approximations(ops), sorted(ops)
    assert spill_free(usage), usage


def _ids(kind):
    return [v for v in VARIANTS if v["kind"] == kind and not v.get("control")]


def _controls(kind):
    return [v for v in VARIANTS if v.get("control") == kind]


@pytest.mark.slow  # the default run's budget (pyproject.toml [Note: the slow mark])
@pytest.mark.parametrize("v", _ids("adam"), ids=lambda v: v["id"])
def test_adam_variant(compiled, v):
    r = compiled[v["id"]]
    ops = r["ops"]
    _common_checks(r)
    if v["block"] == "gpu":
        assert vector_ok(ops, v), ops
        assert regs_ok(r["ptxas"], TOL["adam_registers"]), r["ptxas"]["registers"]
    # (defect 3) the per-element kernel carries no fp64: the set-up is the prologue's
    assert not fp64_free(ops), fp64_free(ops)
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


@pytest.mark.slow  # the default run's budget (pyproject.toml [Note: the slow mark])
@pytest.mark.parametrize("v", _ids("scalars"), ids=lambda v: v["id"])
def test_adam_scalars_prologue(compiled, v):
    """The fp64 set-up compiles (one program, 32 threads) without spills; it is the negative
    control of the fp64 check: the check does see fp64 where it is."""
    r = compiled[v["id"]]
    _common_checks(r)
    assert fp64_free(r["ops"]), "the fp64 check found no fp64 in the fp64 prologue"
    assert _count(r["ops"], "st.global") >= 11


@pytest.mark.slow  # the default run's budget (pyproject.toml [Note: the slow mark])
@pytest.mark.parametrize("v", _ids("advance"), ids=lambda v: v["id"])
def test_advance_step_variant(compiled, v):
    r = compiled[v["id"]]
    _common_checks(r)
    assert _count(r["ops"], "st.global") >= 1 and _count(r["ops"], "ld.global") >= 2


@pytest.mark.slow  # the default run's budget (pyproject.toml [Note: the slow mark])
@pytest.mark.parametrize("v", _ids("partial") + _ids("final"), ids=lambda v: v["id"])
def test_grad_stats_variant(compiled, v):
    r = compiled[v["id"]]
    ops = r["ops"]
    _common_checks(r)
    assert not atomics(ops), atomics(ops)
    if v["kind"] == "partial" and v.get("block") != "edge":  # one 128-bit load per 4 fp32
        assert _count(ops, "ld.global.v4") >= (2 if v["grad"] == "*fp32" else 1), ops
        assert regs_ok(r["ptxas"], TOL["stats_registers"]), r["ptxas"]["registers"]


# ---- negative controls: each check fails on a variant built to fail it ----------------------

@pytest.mark.slow  # the default run's budget (pyproject.toml [Note: the slow mark])
@pytest.mark.parametrize("v", _controls("scalar"), ids=lambda v: v["id"])
def test_control_scalar_variant_fails_vector_check(compiled, v):
    """An odd n or a misaligned pointer compiles to scalar accesses (what defect 7 launched)."""
    r = compiled[v["id"]]
    assert not vector_ok(r["ops"], v), r["ops"]
    assert _count(r["ops"], "ld.global.v4") == 0, r["ops"]
    if not v["aligned"]:  # the misaligned one also breaks the register bound
        assert not regs_ok(r["ptxas"], TOL["adam_registers"]), r["ptxas"]["registers"]


@pytest.mark.slow  # the default run's budget (pyproject.toml [Note: the slow mark])
@pytest.mark.parametrize("v", _controls("spill"), ids=lambda v: v["id"])
def test_control_register_cap_fails_spill_check(compiled, v):
    usage = compiled[v["id"]]["ptxas"]
    assert not spill_free(usage), usage
    assert not regs_ok(usage, 0)  # and the register check rejects a bound it exceeds


@pytest.mark.slow  # the default run's budget (pyproject.toml [Note: the slow mark])
@pytest.mark.parametrize("v", _controls("atomic"), ids=lambda v: v["id"])
def test_control_atomic_reduction_fails_atomics_check(compiled, v):
    assert atomics(compiled[v["id"]]["ops"])


@pytest.mark.slow  # the default run's budget (pyproject.toml [Note: the slow mark])
def test_register_counts_report(compiled):
    """The numbers behind the bounds, printed for the record (pytest -s shows them)."""
    rows = {k: (r["ptxas"]["registers"], max(r["ptxas"]["spill_stores"] or [0]))
            for k, r in compiled.items() if k != "__keys__"}
    print("\n".join(f"{k}: registers {regs} spill {sp}" for k, (regs, sp) in rows.items()))
    assert rows


@pytest.mark.slow  # the default run's budget (pyproject.toml [Note: the slow mark])
def test_per_step_values_do_not_recompile(compiled):
    """One JIT cache key per layout, whatever lr, step, grad_scale and found_inf are; and the
    key does see a layout change (adamw, hyperparameters as tensors), so the check can fail."""
    layouts = compiled["__keys__"]
    assert len(layouts) == 3
    for name, seen in layouts.items():
        assert len(seen) == 1, f"{name}: {len(seen)} different JIT keys across per-step values"
        kernels = [k for k, _ in seen[0]]
        assert kernels.count("_adam_step_kernel") == 1, kernels
        assert kernels.count("_adam_scalars_kernel") == 1, kernels
        assert "_advance_step_kernel" in kernels and "_grad_stats_final_kernel" in kernels
    adam_keys = {name: dict(seen[0])["_adam_step_kernel"] for name, seen in layouts.items()}
    assert len(set(adam_keys.values())) == 2, "the main kernel's key ignores adamw"
    pro_keys = {name: dict(seen[0])["_adam_scalars_kernel"] for name, seen in layouts.items()}
    assert len(set(pro_keys.values())) == 2, "the prologue's key ignores HP_FROM_PTR"


# ---- every kernel: discovered, launched as the package launches it, compiled once ------------

CHILD_ALL = r'''import ast, contextlib, importlib, inspect, io, json, pkgutil, re, sys, textwrap, time, traceback
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

TARGET = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(TARGET)
OPCODE = re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.]*)", re.M)
extra_modules, out_path = json.loads(sys.argv[1]), sys.argv[2]


def discover():
    """{qualname: JITFunction} of the kernels (not helpers: those return a value) defined in
    every module of zerokern.kernels and in the extra modules."""
    import zerokern.kernels as pkg
    names = [f"zerokern.kernels.{m.name}" for m in pkgutil.iter_modules(pkg.__path__)]
    found = {}
    for name in names + list(extra_modules):
        mod = importlib.import_module(name)
        for attr, obj in vars(mod).items():
            if isinstance(obj, JITFunction) and obj.fn.__module__ == name:
                tree = ast.parse(textwrap.dedent(inspect.getsource(obj.fn)))
                if not any(isinstance(n, ast.Return) and n.value is not None
                           for n in ast.walk(tree)):
                    found[f"{name}.{obj.fn.__name__}"] = obj
    return found


KERNELS = discover()
assert KERNELS, "no kernels found"
RECORDED = {}   # qualname -> {variant key: (signature, constexprs, attrs, options)}


def record(qual, jf):
    binder = create_function_from_signature(jf.signature, jf.params, BACKEND)
    sigkeys = [p.name for p in jf.params]

    def run(*args, grid, warmup, **kwargs):
        bound, spec, opts = binder(*args, **kwargs)
        options, signature, constexprs, attrs = jf._pack_args(BACKEND, kwargs, bound, spec, opts)
        user = {k: v for k, v in kwargs.items() if k not in sigkeys}
        key = repr((sorted(signature.items()), sorted(constexprs.items()), sorted(user.items())))
        RECORDED.setdefault(qual, {}).setdefault(key, (signature, constexprs, attrs, user))
    jf.run = run


for q, jf in KERNELS.items():
    record(q, jf)


def exercise():
    """Run every launcher the way a GPU run would (meta tensors take the GPU path: 16-byte
    aligned pointers, GPU block sizes), in each layout whose constexprs change the code."""
    from zerokern.kernels import compact_triton as ct, triton_adamw8bit as q8
    from zerokern.kernels import triton_blockquant as bq, triton_kernels as tk, triton_lion as tl_
    meta = dict(device="meta")
    n = 4096
    t = lambda dt=torch.float32, k=n: torch.empty(k, dtype=dt, **meta)
    zero = lambda dt: torch.zeros((), dtype=dt, **meta)
    step, flag, gs = zero(torch.int64), zero(torch.bool), torch.ones((), **meta)
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1)
    hp_t = {k: torch.tensor(v, dtype=torch.float64, **meta) for k, v in hp.items()}
    for adamw, out, h in ((True, t(torch.bfloat16), hp), (False, None, hp_t)):
        tk.adam_step_(t(), t(), t(), t(torch.bfloat16), out, adamw=adamw, step=step,
                      grad_scale=gs, found_inf=flag, eps=1e-8, **h)
        ct.compact_adam_step_(t(torch.int16), t(torch.uint8, n // 8), t(torch.bfloat16), t(),
                              t(), t(torch.bfloat16), zero(torch.bool), adamw=adamw, step=step,
                              grad_scale=gs, found_inf=flag, eps=1e-8, **h)
        tl_.lion_step_(t(), t(), t(torch.bfloat16), out, step=step, grad_scale=gs,
                       found_inf=flag, **h)
        q8.adamw8bit_step_(t(), t(torch.uint8), t(k=n // 128), t(torch.uint8), t(k=n // 128),
                           t(torch.bfloat16), out, step=step, grad_scale=gs, found_inf=flag,
                           eps=1e-8, **h)
    tk.grad_stats_(t(torch.bfloat16), flag, torch.zeros((), **meta))
    for bits in (8, 4):
        bq.quantize(t(), 128, bits)
    for bits, dt in ((8, torch.float32), (4, torch.bfloat16), (8, torch.float16)):
        bq.dequantize(t(torch.int8 if bits == 8 else torch.uint8, n if bits == 8 else n // 2),
                      t(k=n // 128), 128, bits, dt)


def synthesize(jf):
    """A signature from the parameter names alone (STYLE: pointers `x_ptr`, constexprs in
    CAPS), for a kernel no launcher above reaches: fp32 pointers, int32 scalars, block-like
    constexprs 64, the other constexprs 0 (False)."""
    sig, const = {}, {}
    for p in jf.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
            const[(p.num,)] = 64 if re.search("BLOCK|ROWS|SIZE|^QB$", p.name) else 0
        else:
            sig[p.name] = "*fp32" if p.name.endswith("_ptr") else "i32"
    return sig, const, {}, dict(num_warps=4)


results = {}
t0 = time.time()
try:
    exercise()
except Exception:  # noqa: BLE001 - reported, the test fails on it
    results["__exercise_error__"] = traceback.format_exc()


def compile_one(jf, sig, const, attrs, user):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        k = triton.compile(ASTSource(jf, sig, const, attrs), target=TARGET, options=dict(user))
    ops = {}
    for op in OPCODE.findall(k.asm["ptx"]):
        ops[op] = ops.get(op, 0) + 1
    return ops


for qual, jf in KERNELS.items():
    variants = list(RECORDED.get(qual, {}).values())
    how = "launch" if variants else "synthesized"
    variants = variants or [synthesize(jf)]
    entry = results.setdefault(qual, dict(how=how, variants=[]))
    for sig, const, attrs, user in variants:
        v = dict(constexprs={str(k): repr(c) for k, c in const.items()},
                 options={k: repr(x) for k, x in user.items()})
        try:
            v["ops"] = compile_one(jf, sig, const, attrs, user)
        except Exception:  # noqa: BLE001
            v["error"] = traceback.format_exc()[-3000:]
        entry["variants"].append(v)
        if qual.endswith("triton_lion._lion_step_kernel") and "control" not in entry:
            # negative control of the no-fma check: the same launch with FP fusion on
            entry["control"] = compile_one(jf, sig, const, attrs,
                                           dict(user, enable_fp_fusion=True))
results["__seconds__"] = time.time() - t0
json.dump(results, open(out_path, "w"))
'''

# A planted module (written into a temporary directory on the child's path): a kernel that
# divides with `/`, which the check must reject, and its tl.div_rn twin, which must pass. No
# launcher calls them: they are compiled from their parameter names, as a new kernel would be.
PLANTED = '''
import triton
import triton.language as tl


@triton.jit
def _planted_slash_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=1.0)
    tl.store(y_ptr + offs, x / (x + 1.0), mask=offs < n)


@triton.jit
def _planted_div_rn_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=1.0)
    tl.store(y_ptr + offs, tl.div_rn(x, x + 1.0), mask=offs < n)
'''
PLANTED_MODULE = "zk_planted_kernels"


def _static_kernels() -> list:
    """Kernel qualnames found by reading the sources (test_triton_static's scan): the
    parametrization, which the child's own discovery (by import) must match."""
    from .test_triton_static import is_kernel, jit_functions, kernel_sources

    return sorted(f"zerokern.kernels.{name[:-3]}.{fn.name}" for name, src in kernel_sources()
                  for fn in jit_functions(ast.parse(src)) if is_kernel(fn))


@pytest.fixture(scope="module")
def every_kernel(tmp_path_factory):
    """{kernel qualname: dict(how, variants=[dict(ops | error, constexprs, options)])}: one
    compile per distinct launch, for the whole module."""
    why = _triton_and_ptxas_present()
    if why:
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp("every_kernel")
    (tmp / f"{PLANTED_MODULE}.py").write_text(PLANTED)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_DEFAULT_FP_FUSION="1", TRITON_CACHE_DIR=str(tmp / "cache"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), str(tmp),
                                                        env.get("PYTHONPATH")])))
    script = tmp / "child_all.py"
    script.write_text(CHILD_ALL)
    out = tmp / "result.json"
    r = subprocess.run([sys.executable, str(script), json.dumps([PLANTED_MODULE]), str(out)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"compile child failed:\n{(r.stdout + r.stderr)[-6000:]}"
    res = json.loads(out.read_text())
    assert "__exercise_error__" not in res, res["__exercise_error__"]
    return res


def test_every_kernel_is_found_and_compiled(every_kernel):
    """The child's discovery (by import) finds what the source scan finds, plus the planted
    kernels; every launcher ran on meta tensors (an error there is reported, not hidden)."""
    found = sorted(k for k in every_kernel if k.startswith("zerokern."))
    assert found == _static_kernels()
    assert {f"{PLANTED_MODULE}._planted_slash_kernel",
            f"{PLANTED_MODULE}._planted_div_rn_kernel"} <= set(every_kernel)
    print(f"compiled in {every_kernel['__seconds__']:.1f} s:",
          {k.rsplit(".", 1)[1]: (e["how"], len(e["variants"])) for k, e in every_kernel.items()
           if not k.startswith("__")})


@pytest.mark.parametrize("qual", _static_kernels())
def test_kernel_has_no_approximate_division(every_kernel, qual):
    """(GPU_CHECKLIST, Kernels) `/` compiles to div.full.f32: tl.div_rn wherever the result
    must equal the reference bit for bit; likewise no *.approx sqrt, rcp, ex2."""
    entry = every_kernel[qual]
    assert entry["variants"]
    for v in entry["variants"]:
        assert "error" not in v, f"{qual} ({entry['how']}) did not compile:\n{v.get('error')}"
        assert not approximations(v["ops"]), (qual, v["constexprs"], approximations(v["ops"]))


@pytest.mark.parametrize("qual", _static_kernels())
def test_every_launch_pins_fp_fusion(every_kernel, qual):
    """[Note: fp fusion pinned] (triton_kernels.py): each launch passes enable_fp_fusion, so
    the code does not change with Triton's default (3.10 turns it off)."""
    entry = every_kernel[qual]
    if entry["how"] != "launch":
        pytest.skip(f"{qual}: no launcher reaches it")
    for v in entry["variants"]:
        assert "enable_fp_fusion" in v["options"], (qual, v["constexprs"], v["options"])


def test_planted_slash_division_is_caught(every_kernel):
    """Negative control: the planted `/` kernel fails the check; its tl.div_rn twin passes."""
    slash = every_kernel[f"{PLANTED_MODULE}._planted_slash_kernel"]
    twin = every_kernel[f"{PLANTED_MODULE}._planted_div_rn_kernel"]
    assert slash["how"] == twin["how"] == "synthesized"
    assert all("div.full.f32" in approximations(v["ops"]) for v in slash["variants"]), slash
    assert all(not approximations(v["ops"]) and _count(v["ops"], "div.rn.f32")
               for v in twin["variants"]), twin


def fmas(ops: dict) -> list:
    return sorted(op for op in ops if op.startswith("fma."))


@pytest.mark.parametrize("kernel", ["_lion_step_kernel", "_lion_scalars_kernel"])
def test_lion_kernels_round_every_product(every_kernel, kernel):
    """(issue 36, item 4) No FMA in the Lion kernels: b1*m + (1-b1)*g rounds each product, as
    the reference (triton_lion.py's docstring); a contracted one flips sign(c) where the
    rounded products cancel (tests/kernels/test_lion_cancellation.py)."""
    entry = every_kernel[f"zerokern.kernels.triton_lion.{kernel}"]
    for v in entry["variants"]:
        assert not fmas(v["ops"]), (kernel, v["options"], fmas(v["ops"]))


def test_lion_fma_check_fails_with_fp_fusion_on(every_kernel):
    """Negative control: the Lion step kernel compiled with enable_fp_fusion=True (what it was
    launched with before) has fma.rn.f32."""
    control = every_kernel["zerokern.kernels.triton_lion._lion_step_kernel"]["control"]
    assert "fma.rn.f32" in fmas(control), control
