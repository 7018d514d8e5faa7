"""Static checks on the source of every Triton kernel in zerokern/kernels (GPU_CHECKLIST.md,
"Kernels"), read with `ast`: no import, no GPU, no compile. A new kernel or launcher in any
module of the package is checked without editing this file.

* int64 offsets: a program's offset built from `tl.program_id(...)` must be cast with
  `.to(tl.int64)` before it is multiplied by a block size. `tl.program_id` is int32, so
  `pid * BLOCK` wraps once an offset passes 2^31 (a unit, a quantized bucket).
* device guard: every launch `kernel[grid](...)` of a @triton.jit function runs inside a
  `with _on_device(...)` (or `torch.cuda.device(...)`) block. Triton launches on the *current*
  device, so tensors on cuda:1 while cuda:0 is current would launch on the wrong device
  (triton_kernels [Note: launch plan] (2)).

Each rule has a planted violation (a source string) that it must report and a fixed twin that
it must pass.
"""

from __future__ import annotations

import ast
import functools
import textwrap
from pathlib import Path
from typing import Iterable, Iterator, List, Set, Tuple

import pytest

KERNELS_DIR = Path(__file__).resolve().parents[2] / "zerokern" / "kernels"
# Context managers that make the tensors' device current for a launch.
GUARDS = {"_on_device", "device"}  # triton_kernels._on_device, torch.cuda.device


def _is_jit(dec: ast.expr) -> bool:
    """@triton.jit, @triton.jit(...), @jit."""
    if isinstance(dec, ast.Call):
        dec = dec.func
    name = dec.attr if isinstance(dec, ast.Attribute) else getattr(dec, "id", "")
    return name == "jit"


def jit_functions(tree: ast.AST) -> List[ast.FunctionDef]:
    return [n for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef) and any(_is_jit(d) for d in n.decorator_list)]


def is_kernel(fn: ast.FunctionDef) -> bool:
    """A launchable kernel, not a helper: it returns no value (a bare `return` exits early)."""
    return not any(isinstance(n, ast.Return) and n.value is not None for n in ast.walk(fn))


def kernel_sources() -> Iterator[Tuple[str, str]]:
    for path in sorted(KERNELS_DIR.glob("*.py")):
        yield path.name, path.read_text()


# ---- rule 1: int64 offsets --------------------------------------------------------------------

def _is_program_id(node: ast.expr) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "program_id")


def _is_int64_cast(node: ast.expr) -> bool:
    """x.to(tl.int64) / x.to(tl.uint64) (or the dtype as a keyword)."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "to"):
        return False
    args = list(node.args) + [k.value for k in node.keywords if k.arg == "dtype"]
    return any(isinstance(a, ast.Attribute) and a.attr in ("int64", "uint64") for a in args[:1])


class _Int32Offsets:
    """Follows int32 values derived from tl.program_id through one function, statement by
    statement, and records each multiplication of one (`*`, `<<`, `*=`, `<<=`)."""

    MULS = (ast.Mult, ast.LShift)

    def __init__(self) -> None:
        self.tainted: Set[str] = set()
        self.found: List[Tuple[int, str]] = []

    def tainted_expr(self, node: ast.expr) -> bool:
        if _is_program_id(node):
            return True
        if _is_int64_cast(node):
            self.visit_expr(node.func.value)
            return False
        if isinstance(node, ast.Name):
            return node.id in self.tainted
        if isinstance(node, ast.Subscript):  # rows[:, None]
            return self.tainted_expr(node.value)
        if isinstance(node, ast.UnaryOp):
            return self.tainted_expr(node.operand)
        if isinstance(node, ast.BinOp):
            left, right = self.tainted_expr(node.left), self.tainted_expr(node.right)
            if isinstance(node.op, self.MULS) and (left or right):
                self.found.append((node.lineno, ast.unparse(node)))
            return left or right
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "to":  # another cast keeps the width problem
            return self.tainted_expr(node.func.value)
        self.visit_expr(node)  # anything else (a call, a compare): look inside, not tainted
        return False

    def visit_expr(self, node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.expr):
                self.tainted_expr(child)

    def assign(self, target: ast.expr, tainted: bool) -> None:
        if isinstance(target, ast.Name):
            (self.tainted.add if tainted else self.tainted.discard)(target.id)
        elif isinstance(target, (ast.Tuple, ast.List)):
            for t in target.elts:
                self.assign(t, tainted)

    def run(self, body: List[ast.stmt]) -> None:
        for st in body:
            if isinstance(st, ast.Assign):
                t = self.tainted_expr(st.value)
                for target in st.targets:
                    self.assign(target, t)
            elif isinstance(st, ast.AnnAssign) and st.value is not None:
                self.assign(st.target, self.tainted_expr(st.value))
            elif isinstance(st, ast.AugAssign):
                value = self.tainted_expr(st.value)
                target = self.tainted_expr(st.target)
                if isinstance(st.op, self.MULS) and (target or value):
                    self.found.append((st.lineno, ast.unparse(st)))
                self.assign(st.target, target or value)
            elif isinstance(st, (ast.If, ast.For, ast.While, ast.With)):
                for field in ("test", "iter"):
                    if hasattr(st, field):
                        self.tainted_expr(getattr(st, field))
                self.run(st.body)  # branches in order: taint from either survives
                self.run(getattr(st, "orelse", []))
            else:
                for node in ast.iter_child_nodes(st):
                    if isinstance(node, ast.expr):
                        self.tainted_expr(node)


def int32_offset_products(source: str) -> List[Tuple[str, int, str]]:
    """[(function, line, expression)]: a tl.program_id-derived int32 value multiplied."""
    out = []
    for fn in jit_functions(ast.parse(source)):
        walker = _Int32Offsets()
        walker.run(fn.body)
        out += [(fn.name, line, expr) for line, expr in walker.found]
    return out


# ---- rule 2: launches under the device guard ------------------------------------------------

def _guard_call(item: ast.withitem) -> bool:
    call = item.context_expr
    if not isinstance(call, ast.Call):
        return False
    f = call.func
    return (f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")) in GUARDS


def _launch_name(node: ast.AST) -> str:
    """'kernel' for a call `kernel[grid](...)` / `mod.kernel[grid](...)`, else ''."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
        v = node.func.value
        return v.attr if isinstance(v, ast.Attribute) else getattr(v, "id", "")
    return ""


def _sites(tree: ast.AST, match) -> List[Tuple[int, str, str, bool]]:
    """[(line, name, enclosing function, guarded)] for each node where match(node) gives a
    name; guarded: inside a `with <device guard>` of its own function."""
    out = []

    def visit(node: ast.AST, guarded: bool, fn: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            guarded, fn = False, node.name
        if isinstance(node, (ast.With, ast.AsyncWith)):
            guarded = guarded or any(_guard_call(i) for i in node.items)
        name = match(node)
        if name:
            out.append((node.lineno, name, fn, guarded))
        for child in ast.iter_child_nodes(node):
            visit(child, guarded, fn)

    visit(tree, False, "")
    return out


def _call_name(node: ast.AST) -> str:
    if isinstance(node, ast.Call):
        f = node.func
        return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
    return ""


@functools.lru_cache(maxsize=None)
def _call_sites(source: str) -> Tuple[Tuple[int, str, str, bool], ...]:
    return tuple(_sites(ast.parse(source), _call_name))


def unguarded_launches(source: str, kernels: Set[str],
                       callers: Iterable[str] = ()) -> List[Tuple[int, str]]:
    """[(line, kernel)]: launches of the named kernels not inside a `with <device guard>`.

    A launch in a helper function passes when every call of that helper (by name, in `source`
    and the `callers` sources: the package) is guarded, or sits in a helper that passes in
    turn (adam_scalars runs under adam_step_'s and compact_adam_step_'s guard). A function
    nobody calls is reported: a public launcher guards its own launches."""
    tree = ast.parse(source)
    launches = _sites(tree, lambda n: _launch_name(n) if _launch_name(n) in kernels else "")
    calls = [c for src in [source, *callers] for c in _call_sites(src)]

    def covered(fn: str, seen: frozenset) -> bool:
        sites = [(caller, guarded) for _, callee, caller, guarded in calls if callee == fn]
        return bool(sites) and all(
            guarded or (caller and caller not in seen and covered(caller, seen | {caller}))
            for caller, guarded in sites)

    return [(line, name) for line, name, fn, guarded in launches
            if not guarded and not (fn and covered(fn, frozenset({fn})))]


@functools.lru_cache(maxsize=None)
def package_sources() -> Tuple[str, ...]:
    return tuple(p.read_text() for p in sorted(KERNELS_DIR.parent.rglob("*.py")))


def all_kernel_names() -> Set[str]:
    return {fn.name for _, src in kernel_sources() for fn in jit_functions(ast.parse(src))
            if is_kernel(fn)}


# ---- the checks on the package ----------------------------------------------------------------

def test_the_scan_sees_the_kernels():
    """Discovery works: the kernels of every Triton module are found (a rename or a new
    decorator spelling would otherwise let both rules pass vacuously)."""
    names = all_kernel_names()
    for want in ("_adam_step_kernel", "_grad_stats_partial_kernel", "_lion_step_kernel",
                 "_q8_step_kernel", "_quantize_kernel", "_dequantize_kernel",
                 "_compact_adam_kernel"):
        assert want in names, sorted(names)
    helpers = {fn.name for _, src in kernel_sources() for fn in jit_functions(ast.parse(src))
               if not is_kernel(fn)}
    assert {"_cast_bits_rne", "_nearest", "_rne"} <= helpers, sorted(helpers)


@pytest.mark.parametrize("module", [name for name, src in kernel_sources()
                                    if jit_functions(ast.parse(src))])
def test_program_offsets_are_int64(module):
    bad = int32_offset_products((KERNELS_DIR / module).read_text())
    assert not bad, (f"{module}: tl.program_id-derived int32 multiplied (cast with "
                     f".to(tl.int64) first): {bad}")


@pytest.mark.parametrize("module", [name for name, _ in kernel_sources()])
def test_launches_run_under_the_device_guard(module):
    kernels = all_kernel_names()
    bad = unguarded_launches((KERNELS_DIR / module).read_text(), kernels, package_sources())
    assert not bad, f"{module}: launches outside `with _on_device(t.device)`: {bad}"


# ---- planted cases: each rule reports a violation and passes its fixed twin -------------------

PLANTED_OFFSET = '''
import triton
import triton.language as tl

@triton.jit
def _planted_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)              # int32: wraps past 2^31
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)   # the call itself, no name
    base = rows[:, None] * BLOCK                          # derived from the int32 rows
    q = pid + 1
    q *= BLOCK                                            # in place
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, x, mask=offs < n)
'''

FIXED_OFFSET = '''
import triton
import triton.language as tl

@triton.jit
def _planted_kernel(x_ptr, y_ptr, part_ptr, n, iters, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    rows = tl.program_id(1).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    base = rows[:, None] * BLOCK
    nprog = tl.num_programs(0)
    for i in range(0, iters):   # a block index, cast before the block size (grad_stats_)
        o = (i * nprog + pid).to(tl.int64) * BLOCK
    pid = pid.to(tl.int64)
    q = pid * BLOCK
    tl.store(part_ptr + pid, 1.0)   # an index, not multiplied: no overflow below 2^31 programs
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, x, mask=offs < n)
'''


def test_planted_int32_offsets_are_reported():
    bad = int32_offset_products(textwrap.dedent(PLANTED_OFFSET))
    exprs = [e for _, _, e in bad]
    assert any(e.startswith("pid * BLOCK") for e in exprs), bad
    assert any(e.startswith("tl.program_id(1) * ROWS") for e in exprs), bad
    assert any(e.startswith("rows[:, None] * BLOCK") for e in exprs), bad
    assert any(e.startswith("q *= BLOCK") for e in exprs), bad
    assert all(fn == "_planted_kernel" for fn, _, _ in bad)


def test_fixed_twin_passes_the_offset_rule():
    assert int32_offset_products(textwrap.dedent(FIXED_OFFSET)) == []


PLANTED_LAUNCH = '''
import torch
import triton
from .triton_kernels import _on_device

def launch(x, y):
    _copy_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)

def launch_guarded_elsewhere(x, y):
    with _on_device(x.device):
        pass
    _copy_kernel[(1,)](x, y, x.numel(), BLOCK=1024)
'''

FIXED_LAUNCH = '''
import torch
import triton
from . import triton_kernels as tk

def launch(x, y):
    with tk._on_device(x.device):
        _copy_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)

def launch_torch_guard(x, y):
    with torch.cuda.device(x.device):
        if x.numel():
            _copy_kernel[(1,)](x, y, x.numel(), BLOCK=1024)
    table = {"a": print}
    table["a"]("not a kernel launch")
'''


def test_planted_unguarded_launches_are_reported():
    bad = unguarded_launches(textwrap.dedent(PLANTED_LAUNCH), {"_copy_kernel"})
    assert [k for _, k in bad] == ["_copy_kernel", "_copy_kernel"], bad


def test_fixed_twin_passes_the_launch_rule():
    assert unguarded_launches(textwrap.dedent(FIXED_LAUNCH), {"_copy_kernel"}) == []
