"""Static checks for GPU-only mistakes that no CPU test can run into (issue 34), on the source.

No GPU has run this code, so these read the source (ast, < 2 s for all three) for the patterns
../shared/GPU_CHECKLIST.md names:

(a) Tests that use a CUDA device without the toolchain skip. A test that names a CUDA device
    must be marked `gpu` (else, on a GPU box, it runs in the process where the Triton
    interpreter is on) and take a cuda fixture: `cuda_backend` (the triton and cuda backends),
    `cuda_op` (the CUDA extension), `cuda_device` (a GPU, no extension), or a fixture that
    calls `require_backend("cuda")` / `cuda_toolchain_skip()` or asks for one of those. A
    `"cuda"` value in a parametrize list must go through such a fixture (indirect=True): a
    direct one bypasses the skip, and a GPU box without a matching nvcc fails instead of
    skipping. Handing the cuda *backend* to code needs the toolchain fixture (not
    `cuda_device`). [Note: what names a CUDA device] says what counts. Exceptions:
    `TEST_CUDA_ALLOWED` ((path, test or "*") -> reason), or a module-level
    `CUDA_STAND_IN = "<reason>"` in a test module whose "cuda" is a fake or emulated device.
(b) Host-to-device copies of host data in the step modules: `torch.tensor(..., device=)`,
    `torch.as_tensor(..., device=)`, `.to(<device>)` and `.cuda()` (each one a pageable copy
    that synchronizes the stream when it runs inside a step, backward or gather). Flagged in
    every function but constructors; `STEP_COPY_ALLOWED` lists the legitimate ones
    (module, function, reason). A copy with `non_blocking=True` (the checklist's pinned form)
    is not flagged.
(c) Loops over `torch.cuda.device_count()`: each GPU touched gets a CUDA context (several
    hundred MB) on every rank. `DEVICE_LOOP_ALLOWED` lists set-up and diagnostic code that
    only reads device properties.

Each checker is a function of a source string, shown catching a planted case and passing on
the tree. A finding prints as `path:line: function: message`.

[Note: what names a CUDA device]
In a test, its fixtures and the module's helpers it reaches (by name, transitively): `.cuda()`;
a CUDA value as `device=` or as `.to()`'s first argument, or passed to a parameter that a
helper of the module uses so. A CUDA value is a string "cuda" / "cuda:N", a module constant or
local variable holding one (DEV = "cuda"), or torch.device of one; a torch.device that is only
built, compared or handed to library code places nothing on a GPU. The cuda backend: `backend="cuda"`,
"cuda" passed to a local helper's parameter it hands on as `backend=`, or a "cuda" value of a
parametrized argument whose name contains "backend". Strings elsewhere ("--device", "cuda" for
a subprocess, GPUTarget("cuda", 90, 32), paths) are not a device in this process.
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set, Tuple

import pytest

REPO = Path(__file__).resolve().parents[1]
CUDA_STR = re.compile(r"^cuda(:\d+)?$")


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    where: str  # test or function (qualified name)
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.where}: {self.message}"


def _rel(path: Path) -> str:
    return path.resolve().relative_to(REPO).as_posix()


def _dotted(node: ast.AST) -> str:
    """'torch.cuda.device_count' for that attribute chain, '' for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _kw(call: ast.Call, name: str) -> Optional[ast.expr]:
    for k in call.keywords:
        if k.arg == name:
            return k.value
    return None


def _is_true(node: Optional[ast.expr]) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _functions(tree: ast.AST) -> Iterable[Tuple[str, ast.AST]]:
    """(qualified name, node) of every function, nested ones as Outer.inner."""
    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                yield name, child
                yield from walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, prefix + child.name + ".")
            else:
                yield from walk(child, prefix)
    yield from walk(tree, "")


def _own_nodes(fn: ast.AST, nested: bool = False) -> Iterable[ast.AST]:
    """The nodes of a function's body (decorators and defaults excluded). Nested functions and
    classes are their own functions unless `nested`; a lambda's body is always included (it
    runs where it is called)."""
    stack = list(fn.body)
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Lambda):
                stack.append(child.body)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if nested:
                    stack.extend(child.body)
            else:
                stack.append(child)


# ============================================================================ (a) tests =======

TEST_CUDA_ALLOWED: Dict[Tuple[str, str], str] = {
    # (path, test) -> reason. Tests outside this project's gpu files that use CUDA on purpose.
    ("tests/test_loss_scale.py", "test_cuda_matches_amp_update_scale_and_pinned_diagnostic"):
        "default-suite test skipped without CUDA; plain torch ops, no Triton kernel and no "
        "cuda backend, so neither the interpreter nor nvcc matters",
    ("tests/checkpoint/test_checkpoint.py", "test_cuda_state_saves_and_loads_across_devices"):
        "default-suite test skipped without CUDA; backend='reference' (plain torch ops)",
    ("tests/kernels/test_adamw8bit_step.py", "test_compiled_triton_equals_the_reference_on_cuda"):
        "marked gpu; the compiled Triton kernel and the reference only (no cuda backend, no "
        "nvcc); owned by the 8-bit kernel tests",
    ("tests/kernels/test_adamw8bit_cuda_dispatch.py", "*"):
        "CPU tests: load_op('cuda') is monkeypatched to a recorder, CPU tensors stand in",
    ("tests/gpu/test_gpu_order_mocks.py", "test_host_flag_event_is_recorded_on_the_flags_device"):
        "CPU test: torch.device('cuda', 1) labels a stand-in flag; torch.cuda is patched",
    ("tests/kernels/test_custom_ops.py", "*"):
        "CPU tests on the fake CUDA device (tests/support/fake_cuda): FakeTensors, no GPU "
        "memory, no kernel runs",
    ("tests/kernels/test_validation.py", "test_cuda_backend_on_cpu_tensors"):
        "CPU test of the error raised for backend='cuda' on CPU tensors",
    ("tests/rules/test_muon_offload_copies.py", "*"):
        "CPU tests: an emulated device boundary (CPU tensors tagged as 'cuda' by a "
        "TorchDispatchMode); nothing reaches a GPU",
}
# A test module whose "cuda" is a stand-in throughout (a fake or emulated device) may say so
# itself instead, with its reason: a module-level `CUDA_STAND_IN = "<why>"`.
STAND_IN = "CUDA_STAND_IN"

# Fixtures that are cuda fixtures by name (conftest.py defines them); any fixture that calls
# the toolchain skip, or asks for a cuda fixture, is one too.
CUDA_FIXTURES = {"cuda_backend", "cuda_op", "cuda_device"}
TOOLCHAIN_FIXTURES = {"cuda_backend", "cuda_op"}


def _is_cuda_str(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) \
        and bool(CUDA_STR.match(node.value))


def _is_fixture(fn: ast.AST) -> bool:
    for d in fn.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        if _dotted(d).split(".")[-1] == "fixture":
            return True
    return False


def _is_gpu_mark(node: ast.AST) -> bool:
    """pytest.mark.gpu (or [.., pytest.mark.gpu, ..])."""
    if isinstance(node, (ast.List, ast.Tuple)):
        return any(_is_gpu_mark(e) for e in node.elts)
    node = node.func if isinstance(node, ast.Call) else node
    return _dotted(node).endswith("mark.gpu")


def _calls_toolchain(nodes: Iterable[ast.AST]) -> Tuple[bool, bool]:
    """(calls require_backend("cuda") / cuda_toolchain_skip(), calls
    require_backend(request.param)), over a function's nodes."""
    toolchain = routes = False
    for node in nodes:
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func).split(".")[-1]
        if name == "cuda_toolchain_skip":
            toolchain = True
        if name == "require_backend" and node.args:
            a = node.args[0]
            if isinstance(a, ast.Constant) and a.value == "cuda":
                toolchain = True
            if _dotted(a) == "request.param":
                routes = True
    return toolchain, routes


@dataclass
class _FnFacts:
    """What one function (test, fixture or helper) does by itself, its nested functions
    included."""
    device: List[int] = field(default_factory=list)  # lines naming a CUDA device
    backend: List[int] = field(default_factory=list)  # lines handing on the cuda backend
    refs: Set[str] = field(default_factory=set)  # module functions it names
    args: List[str] = field(default_factory=list)
    device_params: Set[int] = field(default_factory=set)  # parameter positions used as device
    backend_params: Set[int] = field(default_factory=set)
    toolchain: bool = False
    routes: bool = False


def _args(fn: ast.AST) -> List[str]:
    a = fn.args
    return [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]


def _fn_facts(fn: ast.AST, consts: Set[str], module_fns: Dict[str, "_FnFacts"]) -> _FnFacts:
    """Facts of `fn`; `module_fns`: facts of the module's functions so far (for the parameters
    of the helpers it calls). A nested function is a helper of `fn` as well."""
    f = _FnFacts(args=_args(fn))
    params = {name: i for i, name in enumerate(f.args)}
    nodes = list(_own_nodes(fn, nested=True))
    nested = {}
    for node in nodes:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            nested[node.name] = _fn_facts(node, consts, module_fns)
    callees = dict(module_fns)
    callees.update(nested)

    local: Set[str] = set()  # local names holding a CUDA value (dev = "cuda", torch.device)

    def cuda_value(v: ast.AST) -> bool:
        if _is_cuda_str(v) or (isinstance(v, ast.Name) and (v.id in consts or v.id in local)):
            return True
        return isinstance(v, ast.Call) and _dotted(v.func) == "torch.device" \
            and bool(v.args) and cuda_value(v.args[0])

    def param_of(v: ast.AST) -> Optional[int]:
        return params.get(v.id) if isinstance(v, ast.Name) else None

    assigns = [n for n in nodes if isinstance(n, ast.Assign)]
    for _ in range(3):  # dev = DEV; d = torch.device(dev): a few hops
        for node in assigns:
            if cuda_value(node.value):
                local.update(t.id for t in node.targets if isinstance(t, ast.Name))

    for node in nodes:
        line = getattr(node, "lineno", fn.lineno)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            if node.id in module_fns and node.id not in nested:
                f.refs.add(node.id)
        elif isinstance(node, ast.Call):
            fname = _dotted(node.func)
            method = node.func.attr if isinstance(node.func, ast.Attribute) else ""
            if method == "cuda" and fname != "torch.cuda":
                f.device.append(line)
            devs = [_kw(node, "device")]
            if method == "to" and node.args:
                devs.append(node.args[0])
            for dev in devs:
                if dev is None:
                    continue
                if cuda_value(dev):
                    f.device.append(line)
                if param_of(dev) is not None:
                    f.device_params.add(param_of(dev))
            be = _kw(node, "backend")
            if be is not None:
                if isinstance(be, ast.Constant) and be.value == "cuda":
                    f.backend.append(line)
                if param_of(be) is not None:
                    f.backend_params.add(param_of(be))
            # a helper's parameters: a CUDA string handed to one it uses as a device/backend,
            # or one of ours handed on to them
            callee = callees.get(node.func.id) if isinstance(node.func, ast.Name) else None
            if callee is not None:
                for i, arg in enumerate(node.args):
                    if i in callee.device_params:
                        if cuda_value(arg):
                            f.device.append(arg.lineno)
                        if param_of(arg) is not None:
                            f.device_params.add(param_of(arg))
                    if i in callee.backend_params:
                        if isinstance(arg, ast.Constant) and arg.value == "cuda":
                            f.backend.append(arg.lineno)
                        if param_of(arg) is not None:
                            f.backend_params.add(param_of(arg))
    f.toolchain, f.routes = _calls_toolchain(nodes)
    return f


def _parametrizes(fn: ast.AST) -> List[Tuple[ast.Call, List[str], object]]:
    """(decorator call, argnames, indirect) for each @pytest.mark.parametrize."""
    out = []
    for d in fn.decorator_list:
        if not (isinstance(d, ast.Call) and _dotted(d.func).endswith("mark.parametrize")
                and d.args):
            continue
        names = d.args[0]
        if isinstance(names, ast.Constant) and isinstance(names.value, str):
            argnames = [s.strip() for s in names.value.split(",") if s.strip()]
        elif isinstance(names, (ast.List, ast.Tuple)):
            argnames = [e.value for e in names.elts if isinstance(e, ast.Constant)]
        else:
            argnames = []
        ind = _kw(d, "indirect")
        if _is_true(ind):
            indirect: object = True
        elif isinstance(ind, (ast.List, ast.Tuple)):
            indirect = {e.value for e in ind.elts if isinstance(e, ast.Constant)}
        else:
            indirect = False
        out.append((d, argnames, indirect))
    return out


def _cuda_param_values(call: ast.Call, argnames: List[str]) -> List[Tuple[str, bool, int]]:
    """(argname, value marked gpu, line) for each CUDA string among a parametrize's values."""
    values = call.args[1] if len(call.args) > 1 else _kw(call, "argvalues")
    out = []
    if values is None:
        return out
    for v in ast.walk(values):  # the list, possibly built with + or a conditional
        gpu = False
        if isinstance(v, ast.Call) and _dotted(v.func).endswith("param"):
            gpu = any(_is_gpu_mark(k.value) for k in v.keywords if k.arg == "marks")
            items = list(v.args)
        elif isinstance(v, (ast.List, ast.Tuple)) and not (
                isinstance(v, ast.Tuple) and len(argnames) > 1):
            items = [e for e in v.elts if not isinstance(e, (ast.Call, ast.Tuple))]
        elif isinstance(v, ast.Tuple):  # one row of several argnames
            items = list(v.elts)
        else:
            continue
        for i, item in enumerate(items):
            if _is_cuda_str(item):
                name = argnames[i] if len(argnames) > 1 and i < len(argnames) else \
                    (argnames[0] if argnames else "?")
                out.append((name, gpu, item.lineno))
    # one value can be reached as a list element and as a row: keep each line once
    seen, uniq = set(), []
    for x in out:
        if x[2:] + (x[0],) not in seen:
            seen.add(x[2:] + (x[0],))
            uniq.append(x)
    return uniq


def _module_consts(tree: ast.Module) -> Set[str]:
    consts = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and _is_cuda_str(node.value):
            consts.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return consts


def _module_gpu_marked(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            return _is_gpu_mark(node.value)
    return False


def _fixture_table(trees: List[ast.Module]) -> Dict[str, _FnFacts]:
    """Fixture name -> facts, for conftest trees (later ones override earlier ones)."""
    table: Dict[str, _FnFacts] = {}
    for tree in trees:
        consts = _module_consts(tree)
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_fixture(node):
                table[node.name] = _fn_facts(node, consts, {})
    return table


@functools.lru_cache(maxsize=16)
def _fixture_table_cached(srcs: Tuple[str, ...]) -> Dict[str, _FnFacts]:
    return _fixture_table([ast.parse(s) for s in srcs])


def _module_facts(tree: ast.Module, consts: Set[str]) -> Dict[str, _FnFacts]:
    """Facts of the module's functions, helpers before their callers where they come first
    in the file; a second pass picks up helpers defined below their callers."""
    top = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    facts: Dict[str, _FnFacts] = {n.name: _FnFacts(args=_args(n)) for n in top}
    for _ in range(2):
        for n in top:
            facts[n.name] = _fn_facts(n, consts, facts)
    return facts


def cuda_test_findings(src: str, path: str = "<test>",
                       conftest_srcs: Iterable[str] = ()) -> List[Finding]:
    """Rule (a) on one test module's source, the allowlist not applied. `conftest_srcs`: the
    conftest.py files in effect (outermost first), for the fixtures they define."""
    if "cuda" not in src:  # every form of rule (a) spells it
        return []
    tree = ast.parse(src)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == STAND_IN for t in node.targets):
            if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str) \
                    and node.value.value.strip():
                return []
            raise ValueError(f"{path}: {STAND_IN} must be a non-empty string (the reason)")
    consts = _module_consts(tree)
    module_gpu = _module_gpu_marked(tree)
    facts = _module_facts(tree, consts)
    fixtures = dict(_fixture_table_cached(tuple(conftest_srcs)))
    local_fixtures = {n.name for n in tree.body
                      if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                      and _is_fixture(n)}
    fixtures.update({n: facts[n] for n in local_fixtures})

    def fixture_kind(name: str, seen: Tuple[str, ...] = ()) -> Tuple[bool, bool]:
        """(a cuda fixture, a toolchain fixture), following the fixtures it asks for."""
        cuda, tool = name in CUDA_FIXTURES, name in TOOLCHAIN_FIXTURES
        f = fixtures.get(name)
        if f is not None:
            cuda, tool = cuda or f.toolchain, tool or f.toolchain
            for a in f.args:
                if a not in seen and a != name:
                    c, t = fixture_kind(a, seen + (name,))
                    cuda, tool = cuda or c, tool or t
        return cuda, tool

    tests: List[Tuple[str, ast.AST, bool]] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                and node.name.startswith("test"):
            tests.append((node.name, node, False))
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            cls_gpu = any(_is_gpu_mark(d) for d in node.decorator_list)
            for m in node.body:
                if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                        and m.name.startswith("test"):
                    tests.append((f"{node.name}.{m.name}", m, cls_gpu))

    out: List[Finding] = []
    for where, fn, cls_gpu in tests:
        f = facts.get(where) or _fn_facts(fn, consts, facts)
        marked = module_gpu or cls_gpu or any(_is_gpu_mark(d) for d in fn.decorator_list)
        # what the test reaches: its body, the module's helpers and fixtures it names or asks
        # for, and theirs
        reach, todo = set(), [where] + list(f.refs) + list(f.args)
        while todo:
            n = todo.pop()
            if n in reach:
                continue
            reach.add(n)
            g = f if n == where else facts.get(n)
            if g is not None:
                todo.extend(g.refs)
                if n in local_fixtures:
                    todo.extend(g.args)
        reached = [f if n == where else facts[n] for n in reach if n == where or (
            n in facts and (n not in fixtures or n in local_fixtures))]
        device_lines = sorted({ln for g in reached for ln in g.device})
        backend_lines = sorted({ln for g in reached for ln in g.backend})
        kinds = [fixture_kind(a) for a in f.args]
        has_cuda_fixture = any(c for c, _ in kinds)
        has_toolchain = any(t for _, t in kinds) or f.toolchain

        params = []  # (argname, gpu-marked, line, routed through a fixture)
        for call, argnames, indirect in _parametrizes(fn):
            for argname, gpu, line in _cuda_param_values(call, argnames):
                ind = indirect is True or (isinstance(indirect, set) and argname in indirect)
                fx = fixtures.get(argname)
                routed = ind and (argname in CUDA_FIXTURES
                                  or (fx is not None and (fx.routes or fx.toolchain)))
                params.append((argname, gpu, line, routed))
                if not routed:
                    out.append(Finding(path, line, where, (
                        f"'cuda' is a direct value of parametrized {argname!r}: it bypasses "
                        "the toolchain skip; parametrize a fixture that calls require_backend "
                        "(cuda_backend, backend) with indirect=True")))
                    if "backend" in argname:
                        backend_lines.append(line)
        if not (device_lines or backend_lines or params):
            continue
        params_gpu = bool(params) and all(p[1] for p in params)
        routed_all = bool(params) and all(p[3] for p in params)
        first = (device_lines or [p[2] for p in params] or backend_lines)[0]
        if not (marked or params_gpu):
            out.append(Finding(path, first, where, (
                "uses CUDA (a device or the cuda backend) but is not marked gpu: on a GPU "
                "machine it would run in the process with the Triton interpreter on; mark it "
                "gpu (or its CUDA parametrize values)")))
        if device_lines and not (has_cuda_fixture or routed_all):
            out.append(Finding(path, device_lines[0], where, (
                "uses a CUDA device without a cuda fixture: take cuda_backend, cuda_op or "
                "cuda_device (tests/conftest.py), or a fixture that calls "
                "require_backend('cuda')")))
        if backend_lines and not (has_toolchain or routed_all):
            out.append(Finding(path, sorted(backend_lines)[0], where, (
                "runs the cuda backend without the toolchain skip: take cuda_backend or "
                "cuda_op (a GPU box without a matching nvcc must skip, not fail)")))
    return out


def tree_test_findings() -> Tuple[List[Finding], Set[Tuple[str, str]]]:
    """Findings not allowlisted, and the allowlist entries that matched something."""
    bad, used = [], set()
    for test in sorted((REPO / "tests").rglob("test_*.py")):
        path = _rel(test)
        for x in cuda_test_findings(test.read_text(), path, _conftests_for(test)):
            for key in ((path, x.where.split(".")[-1]), (path, "*")):
                if key in TEST_CUDA_ALLOWED:
                    used.add(key)
                    break
            else:
                bad.append(x)
    return bad, used


def _conftests_for(test: Path) -> List[str]:
    out = []
    d = test.parent
    while True:
        c = d / "conftest.py"
        if c.exists():
            out.append(c.read_text())
        if d == REPO or d == d.parent:
            break
        d = d.parent
    return list(reversed(out))


# ===================================================================== (b) step modules ======

STEP_MODULES = ["zerokern/core/**/*.py", "zerokern/optimizers/**/*.py", "zerokern/grads/**/*.py", "zerokern/stage3/**/*.py",
                "zerokern/comm/**/*.py", "zerokern/rules/**/*.py", "zerokern/kernels/**/*.py",
                "zerokern/state/**/*.py"]
# Build-time modules among the kernels: they never run in a step.
NOT_STEP_MODULES = {"zerokern/kernels/build.py", "zerokern/kernels/cuda_toolchain.py"}
CONSTRUCTORS = {"__init__", "__post_init__", "__new__"}

# (module, function) -> reason. "being fixed: ..." entries are known violations other changes
# remove; every other entry must still match a call (a stale entry fails the test).
STEP_COPY_ALLOWED: Dict[Tuple[str, str], str] = {
    ("zerokern/stage3/activation_policy.py", "ActivationPolicy._unpack"):
        "activation_checkpointing='offload': a saved tensor comes back from the pinned host "
        "copy _pack made, non_blocking (pageable only where pin_memory=False was asked for)",
    ("zerokern/rules/adafactor.py", "AdafactorRule.group_step_"):
        "ZeroAdafactor with offload='cpu' only (the state on the host, g.steps.device is the "
        "CPU): the whole-param exchange runs on the device, so the shard's grads and masters "
        "cross host<->device once per step, blocking (not staged through pinned buffers as "
        "ZeroMuon's offload is: left to do, said in the issue 35 note); with the state on the "
        "device every .to() here is a no-op",
    # -- not on the step path: the model moved, the user wrote params, checkpoint IO
    ("zerokern/core/optimizer.py", "ZeroOptimizer._move_to"):
        "follows model.to(device) (model_sync.py): once when the model moves, not per step",
    ("zerokern/grads/full_grads.py", "FullGrads.to_"): "follows model.to(device)",
    ("zerokern/grads/sharded_grads.py", "ShardedGrads.to_"): "follows model.to(device)",
    ("zerokern/grads/sharded_grads.py", "BucketedGrads.to_"): "follows model.to(device)",
    ("zerokern/state/placement.py", "DeviceState.to_"): "follows model.to(device)",
    ("zerokern/state/compact_master.py", "CompactState.to_"): "follows model.to(device)",
    ("zerokern/rules/matrix_states.py", "MatrixStates.to_"): "follows model.to(device)",
    ("zerokern/core/loss_scale.py", "LossScaler.to_"): "follows model.to(device)",
    ("zerokern/core/model_sync.py", "ModelWatch._sync_master"):
        "the user wrote params since the last step (load_state_dict, p.data = ...): the master "
        "follows them at the next backward or step, once per such write, not per step; with "
        "offload the master is on the host and `new` comes from the device",
    ("zerokern/core/model_sync.py", "_bitwise_equal"):
        "device tensors compared once per model move (model_sync.py), not per step",
    ("zerokern/comm/fingerprint.py", "differ_across_ranks"):
        "construction (broadcast_params=False, model_sync.py) and the end of a "
        "gathered_params() block (stage3/runtime.py): a few fingerprints, one all-reduce; "
        "not per step",
    ("zerokern/stage3/sharded_flat.py", "ShardedFlat.write_back_"):
        "between steps: keeps what the user wrote into whole params (whole_params.py: "
        "release_all / frozen_whole with write_back), not per step",
    ("zerokern/stage3/param_offload.py", "OffloadedShardedFlat.write_back_"):
        "between steps, as ShardedFlat.write_back_",
    ("zerokern/stage3/sharded_flat.py", "ShardedFlat.load_piece_"):
        "checkpoint IO: model.load_state_dict into a stage-3 model (stage3/guards.py)",
    ("zerokern/comm/debug.py", "CollectiveLog.check"):
        "ZEROKERN_DEBUG_COLLECTIVES=1 only: the debug check compares the ranks' logs and "
        "waits by design",
    # -- NVMe: the step waits for the host by design
    ("zerokern/state/offload_nvme.py", "NvmeOffloader.finish"):
        "offload='nvme': the step ends with one host read of the all-or-nothing flag "
        "([Note: all or nothing]); the flag's copy is inside that wait",
    # -- copies of device tensors (the receiver is on the device already)
    ("zerokern/kernels/reference.py", "_f64"):
        "a device tensor's dtype cast (CPU tensors are filled with torch.full just above)",
    ("zerokern/kernels/triton_kernels.py", "adam_scalars"):
        "device tensors only: _hyper turned CPU tensors into floats first",
    ("zerokern/kernels/triton_lion.py", "lion_step_"):
        "device tensors only: _hyper turned CPU tensors into floats first",
    ("zerokern/comm/quantized.py", "DeviceIndex.on"):
        "built at construction on the group's device; another device gets its copy once, "
        "at its first use, never per call",
    # -- open: found by this check, in modules owned elsewhere (reported, not fixed here)
    ("zerokern/kernels/native.py", "_hyper_args"):
        "open: a CPU-tensor hyperparameter next to a CUDA-tensor one is copied with "
        ".to(device) from pageable memory at every call (kernels/triton_kernels._hyper reads "
        "it on the host instead)",
    ("zerokern/kernels/compact_bits.py", "_bits"):
        "open: the 8-entry bit table is copied to the device at its first use, inside the "
        "first step (the checklist: lookup tables at construction)",
    # -- issue 34's fixes: what of them still reads as a copy to this check
    ("zerokern/rules/muon.py", "MuonRule.group_step_"):
        "same-device .to(): without host staging the state is on the params' device; with it, "
        "upd, found and the steps are host tensors and every host<->device copy goes through "
        "the pinned staging buffer (finding 11b, [Note: Muon's host copies])",
    ("zerokern/rules/muon.py", "MuonRule.group_step_.upd_"):
        "same-device .to() of found_inf (see MuonRule.group_step_)",
    ("zerokern/kernels/quant8.py", "code_map"):
        "a per-device cache: an optimizer fills it at construction (quant8.prepare_maps from "
        "the 8-bit rule's group set-up, issue 34, in progress: 'code maps copied inside the "
        "first step'); a kernel called directly on a new device fills it at that first call",
}

_DEVICE_NAME = re.compile(r"(^|_)(dev|device)$")


def _device_like(node: ast.AST) -> bool:
    """An expression that is a device: x.device, dev, self.device, torch.device(...), "cuda"."""
    if isinstance(node, ast.Attribute):
        return bool(_DEVICE_NAME.search(node.attr))
    if isinstance(node, ast.Name):
        return bool(_DEVICE_NAME.search(node.id))
    if isinstance(node, ast.Call):
        return _dotted(node.func) == "torch.device"
    return isinstance(node, ast.Constant) and isinstance(node.value, str) \
        and node.value.startswith("cuda")


def _is_cpu(node: Optional[ast.AST]) -> bool:
    if isinstance(node, ast.Constant):
        return node.value is None or node.value == "cpu"
    return isinstance(node, ast.Call) and _dotted(node.func) == "torch.device" \
        and bool(node.args) and isinstance(node.args[0], ast.Constant) \
        and node.args[0].value == "cpu"


def _host_copy(call: ast.Call) -> Optional[str]:
    """What kind of host-to-device copy `call` may be, or None."""
    if _is_true(_kw(call, "non_blocking")):
        return None
    fname = _dotted(call.func)
    if fname in ("torch.tensor", "torch.as_tensor"):
        dev = _kw(call, "device")
        if dev is None and fname == "torch.as_tensor" and len(call.args) >= 3:
            dev = call.args[2]
        if dev is not None and not _is_cpu(dev):
            return f"{fname}(..., device=...)"
        return None
    if not isinstance(call.func, ast.Attribute):
        return None
    if call.func.attr == "cuda" and fname != "torch.cuda":
        return ".cuda()"
    if call.func.attr == "to":
        dev = _kw(call, "device")
        if dev is None and call.args and _device_like(call.args[0]):
            dev = call.args[0]
        if dev is not None and not _is_cpu(dev):
            return ".to(<device>)"
    return None


def step_copy_findings(src: str, path: str = "<module>") -> List[Finding]:
    """Rule (b) on one step module's source: every possible host-to-device copy inside a
    function other than a constructor (allowlist not applied)."""
    out = []
    for qual, fn in _functions(ast.parse(src)):
        if fn.name in CONSTRUCTORS:
            continue
        for node in _own_nodes(fn):
            if isinstance(node, ast.Call):
                kind = _host_copy(node)
                if kind:
                    out.append(Finding(path, node.lineno, qual, (
                        f"{kind}: a pageable host-to-device copy synchronizes the stream on "
                        "the step/backward/gather path; build it once at construction (on "
                        "the device) or copy from a pinned buffer with non_blocking=True")))
    return sorted(out, key=lambda f: f.line)


def _step_files() -> List[Path]:
    files = set()
    for pat in STEP_MODULES:
        files.update(REPO.glob(pat))
    return sorted(f for f in files if _rel(f) not in NOT_STEP_MODULES)


def tree_step_copy_findings() -> Tuple[List[Finding], Set[Tuple[str, str]]]:
    """Findings not allowlisted, and the allowlist entries that matched something."""
    bad, used = [], set()
    for f in _step_files():
        for x in step_copy_findings(f.read_text(), _rel(f)):
            key = (x.path, x.where)
            if key in STEP_COPY_ALLOWED:
                used.add(key)
            else:
                bad.append(x)
    return bad, used


# ======================================================================= (c) device loops =====

DEVICE_LOOP_ALLOWED: Dict[Tuple[str, str], str] = {
    ("zerokern/kernels/build.py", "_cuda_arch_key"):
        "set-up: the build key names every visible GPU's architecture, as cpp_extension "
        "compiles for them; device properties only (no context), once per process",
    ("zerokern/cli.py", "cmd_info"):
        "`zerokern info`, a diagnostic command: one GPU name per line; device properties only",
}


def _counts_devices(node: ast.AST, counts: Set[str]) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Call) and _dotted(n.func).split(".")[-1] == "device_count":
            return True
        if isinstance(n, ast.Name) and n.id in counts:
            return True
    return False


def _module_level(tree: ast.Module) -> Iterable[ast.AST]:
    """Nodes outside every function (import-time code)."""
    skip = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
    stack = [n for n in tree.body if not isinstance(n, skip)]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(c for c in ast.iter_child_nodes(node) if not isinstance(c, skip))


def device_loop_findings(src: str, path: str = "<module>") -> List[Finding]:
    """Rule (c): a for loop or comprehension over range(... device_count() ...), directly or
    through a local name assigned from device_count()."""
    out = []
    tree = ast.parse(src)
    if "device_count" not in src:
        return out
    scopes = [("<module>", list(_module_level(tree)))]
    scopes += [(qual, list(_own_nodes(fn))) for qual, fn in _functions(tree)]
    for qual, nodes in scopes:
        counts = {t.id for n in nodes if isinstance(n, ast.Assign)
                  and _counts_devices(n.value, set())
                  for t in n.targets if isinstance(t, ast.Name)}
        for n in nodes:
            it = n.iter if isinstance(n, (ast.For, ast.AsyncFor, ast.comprehension)) else None
            if isinstance(it, ast.Call) and _dotted(it.func) == "range" \
                    and _counts_devices(it, counts):
                out.append(Finding(path, it.lineno, qual, (
                    "loops over every visible GPU: each one touched gets a CUDA context "
                    "(several hundred MB) on every rank; use the current device")))
    return sorted(out, key=lambda f: f.line)


def tree_device_loop_findings() -> Tuple[List[Finding], Set[Tuple[str, str]]]:
    bad, used = [], set()
    for f in sorted((REPO / "zerokern").rglob("*.py")):
        for x in device_loop_findings(f.read_text(), _rel(f)):
            key = (x.path, x.where)
            if key in DEVICE_LOOP_ALLOWED:
                used.add(key)
            else:
                bad.append(x)
    return bad, used


# ================================================================================ tests ======

def _report(findings: List[Finding]) -> str:
    return "\n".join(str(f) for f in findings)


CONFTEST = (REPO / "tests" / "conftest.py").read_text()


def _a(src: str) -> List[str]:
    """Rule (a)'s messages for a planted test module, under this repo's conftest."""
    return [f"{f.where}:{f.message.split(':')[0]}" for f in
            cuda_test_findings(src, "tests/planted.py", [CONFTEST])]


def test_a_catches_cuda_listed_in_a_parametrize_list():
    """The defect of tests/kernels/test_gpu.py:204,307 and test_lion_step.py:208 before this
    change: 'cuda' as a direct parameter value, past the toolchain skip."""
    old_gpu = '''
import pytest, torch
pytestmark = pytest.mark.gpu
DEV = "cuda"
@pytest.mark.parametrize(
    "backend", ["reference"] + (["triton", "cuda"] if torch.cuda.is_available() else []))
def test_sync(backend):
    x = torch.zeros(3, device=DEV)
'''
    got = _a(old_gpu)
    assert any("direct value of parametrized 'backend'" in g for g in got), got
    assert any("without the toolchain skip" in g for g in got), got
    old_lion = '''
import pytest, torch
@pytest.mark.parametrize("backend", ["cpu", "triton",
                                     pytest.param("cuda", marks=pytest.mark.gpu)])
def test_sign(backend):
    dev = "cpu"
    if backend == "cuda":
        dev = "cuda"
    master = torch.ones(3).to(dev)
'''
    got = _a(old_lion)
    assert any("direct value" in g for g in got) and \
        any("without a cuda fixture" in g for g in got), got
    fixed = old_lion.replace("marks=pytest.mark.gpu)])", "marks=pytest.mark.gpu)],\n"
                             "    indirect=True)")
    assert _a(fixed) == []
    fixed_gpu = old_gpu.replace('"backend", ["reference"] + (["triton", "cuda"] if '
                                'torch.cuda.is_available() else []))',
                                '"cuda_backend", ["reference", "triton", "cuda"], '
                                'indirect=True)').replace("(backend)", "(cuda_backend)")
    assert _a(fixed_gpu) == []


@pytest.mark.parametrize("body,want", [
    ("x = torch.ones(2).cuda()", "not marked gpu"),
    ("x = torch.ones(2, device='cuda:1')", "not marked gpu"),
    ("x = torch.ones(2).to(torch.device('cuda', 0))", "not marked gpu"),
    ("x = torch.ones(2).to(DEV)", "not marked gpu"),
    ("d = torch.device('cuda', 1); x = torch.ones(2, device=d)", "not marked gpu"),
    ("x = _place(torch.ones(2), 'cuda')", "not marked gpu"),
    ("zk.adam_step_(*args, backend='cuda')", "not marked gpu"),
    ("_run('cuda')", "without the toolchain skip"),
], ids=["dot-cuda", "device-kw", "torch-device", "module-const", "local-var", "helper-param",
        "backend-kw", "helper-backend"])
def test_a_catches_each_way_of_naming_cuda(body, want):
    src = f'''
import pytest, torch
DEV = "cuda"
def _place(t, where):
    return t.to(where)
def _run(backend):
    zk.adam_step_(backend=backend)
def test_planted():
    {body}
'''
    got = _a(src)
    assert any(want in g for g in got), got
    marked = src.replace("def test_planted():", "@pytest.mark.gpu\ndef test_planted(cuda_op):")
    assert _a(marked) == [], _a(marked)  # the gpu mark and the extension fixture: fine


def test_a_needs_the_toolchain_fixture_for_the_cuda_backend():
    src = '''
import pytest, torch
pytestmark = pytest.mark.gpu
def test_planted(cuda_device):
    zk.adam_step_(torch.ones(2, device="cuda"), backend="cuda")
'''
    assert [g for g in _a(src) if "toolchain" in g], _a(src)
    assert _a(src.replace("cuda_device", "cuda_backend")) == []
    # a module fixture that calls require_backend("cuda") is a toolchain fixture too
    own = src.replace("def test_planted(cuda_device)", '''@pytest.fixture
def ext():
    conftest.require_backend("cuda")
def test_planted(ext)''')
    assert _a(own) == []


def test_a_module_may_declare_its_cuda_a_stand_in():
    src = """
import torch
def test_fake():
    x = torch.empty(2, device="cuda")
"""
    assert _a(src)
    assert _a('CUDA_STAND_IN = "FakeTensors on the fake CUDA device"\n' + src) == []
    with pytest.raises(ValueError, match="reason"):
        _a('CUDA_STAND_IN = ""\n' + src)


def test_a_ignores_strings_that_are_not_a_device_here():
    src = '''
import pytest, torch
def test_planted(tmp_path):
    subprocess.run(["zerokern", "train", "--device", "cuda"])
    t = GPUTarget("cuda", 90, 32)
    p = CSRC / "cuda" / "binding.cpp"
    assert dispatch.resolve("cuda", meta) == "cuda"
    check_params_backend(torch.device("cuda", 0), None, None)
    assert step._device(a, 3) == torch.device("cuda", 3)
'''
    assert _a(src) == []


def test_a_passes_on_the_tree():
    bad, used = tree_test_findings()
    assert not bad, "tests that use CUDA past the toolchain skip:\n" + _report(bad)
    stale = set(TEST_CUDA_ALLOWED) - used
    assert not stale, f"TEST_CUDA_ALLOWED entries that match nothing now: {sorted(stale)}"


def test_b_catches_each_kind_of_host_copy():
    src = '''
import torch
class Gather:
    def __init__(self, perm, device):
        self.perm = torch.tensor(perm, device=device)  # construction: fine
    def wait(self, full):
        idx = torch.as_tensor(self.order, device=full.device)
        j = self.order_cpu.to(full.device)
        k = torch.tensor([1, 2], dtype=torch.int64, device=full.device)
        m = self.code.to(device=full.device, dtype=torch.float32)
        n = self.host.cuda()
        ok = self.pinned.to(full.device, non_blocking=True)
        ok2 = full.to(torch.float32)
        ok3 = torch.tensor([1.0])
        ok4 = full.to("cpu")
        return idx, j, k, m, n
'''
    got = step_copy_findings(src, "zerokern/comm/planted.py")
    assert [(f.where, f.line) for f in got] == [("Gather.wait", n) for n in range(7, 12)], \
        _report(got)
    assert "Gather.__init__" not in {f.where for f in got}


def test_b_catches_the_known_violations_of_the_old_tree():
    """The four kinds issue 34 names, as they stood (the old comm/quantized.py index copies,
    kernels/quant8.py's map copied in the first step, rules/muon.py's pageable copies)."""
    old = '''
def _reduce_levels(rows, lv):
    rows = rows.index_select(0, torch.as_tensor(lv.perm, device=rows.device))
class _DequantizeOnWait:
    def wait(self, full, vals):
        full.index_copy_(0, self._order.to(full.device), vals)
def code_map(signed, device):
    _MAPS[key] = dynamic_map(signed).to(device)
class MuonRule:
    def group_step_(self, g, upd, views, found):
        work = upd.to(g.device)
        def upd_():
            f(found_inf=found.to(views[0].device))
'''
    got = {f.where for f in step_copy_findings(old, "zerokern/planted.py")}
    assert got == {"_reduce_levels", "_DequantizeOnWait.wait", "code_map",
                   "MuonRule.group_step_", "MuonRule.group_step_.upd_"}, got


def test_b_passes_on_the_tree():
    bad, used = tree_step_copy_findings()
    assert not bad, ("host-to-device copies of host data in the step modules (build them at "
                     "construction, or allowlist with a reason):\n" + _report(bad))
    stale = {k for k in set(STEP_COPY_ALLOWED) - used
             if not STEP_COPY_ALLOWED[k].startswith("being fixed")}
    assert not stale, f"STEP_COPY_ALLOWED entries that match nothing now: {sorted(stale)}"


def test_c_catches_loops_over_every_gpu():
    src = '''
import torch
def prebuilt_problem(probe):
    for dev in range(torch.cuda.device_count()):
        probe(dev)
def caps():
    n = torch.cuda.device_count()
    return [torch.cuda.get_device_capability(i) for i in range(n)]
def fine():
    return torch.cuda.device_count() > 1, range(torch.cuda.current_device())
for i in range(torch.cuda.device_count()):
    pass
'''
    got = [(f.where, f.line) for f in device_loop_findings(src, "zerokern/planted.py")]
    assert sorted(got) == [("<module>", 11), ("caps", 8), ("prebuilt_problem", 4)], got


def test_c_catches_the_old_kernel_image_check():
    """kernels/cuda_toolchain.py before this change probed every visible GPU."""
    old = subprocess.run(["git", "show", "fcb28c3:zerokern/kernels/cuda_toolchain.py"],
                         cwd=REPO, capture_output=True, text=True)
    if old.returncode:
        pytest.skip("the old revision is not in this checkout")
    got = device_loop_findings(old.stdout, "zerokern/kernels/cuda_toolchain.py")
    assert [f.where for f in got] == ["prebuilt_problem"], _report(got)


def test_c_passes_on_the_tree():
    bad, used = tree_device_loop_findings()
    assert not bad, "loops over every visible GPU:\n" + _report(bad)
    stale = set(DEVICE_LOOP_ALLOWED) - used
    assert not stale, f"DEVICE_LOOP_ALLOWED entries that match nothing now: {sorted(stale)}"


# ======================================================================== the device run ======

def test_the_documented_device_run_exists_as_a_script():
    """docs/gpu.md's one command runs tests/gpu/run_gpu.sh: the gpu tests, then the GPU
    benchmarks the docs list."""
    script = REPO / "tests" / "gpu" / "run_gpu.sh"
    doc = (REPO / "docs" / "gpu.md").read_text()
    assert "bash tests/gpu/run_gpu.sh" in doc
    assert script.stat().st_mode & 0o111, "run_gpu.sh is not executable"
    text = script.read_text()
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert 'python -m pytest -m "${ZK_GPU_MARK:-gpu}"' in text and "python -m pytest -m gpu" in doc
    for bench in ("bench --kernels --device cuda", "bench --step --device cuda"):
        assert f"python -m zerokern {bench}" in text and f"zerokern {bench}" in doc, bench
