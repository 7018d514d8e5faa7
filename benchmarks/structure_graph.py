"""The module graph of `zerokern/` in one or more commits (issue 35's Check: modules, packages,
floors, imports running back up, cycles, flat modules), read from the source alone.

    python benchmarks/structure_graph.py d14dba9 HEAD [--json out.json]

Each argument is a commit (read through `git show`, no checkout needed) or a directory holding
a checkout. What is counted:

- modules: every `.py` file under `zerokern/`, `__init__.py` files included.
- largest module: its path and lines (newlines in the file).
- rooms: the top-level packages of `zerokern/` (a folder with its sub-folders) and the modules
  flat in `zerokern/` other than `__init__.py` (the package's face, which re-exports the public
  names and so imports nearly every room: left out of the room graph, as a face).
- flat modules: the `.py` files directly in `zerokern/`, `__init__.py` not counted.
- imports: every `import` / `from ... import` statement anywhere in a module (top level, inside
  functions, under `if TYPE_CHECKING`), resolved to the zerokern module it names (`from pkg
  import name` is the module `pkg.name` when that file exists, else `pkg`'s `__init__`).
- cycles: the strongly connected components of more than one module in the module graph (a
  lazy import inside a function closes a cycle as well as a top-level one).
- imports running back up: the room graph (A -> B when a module of room A imports one of room
  B) cannot stand in floors while it has a cycle. The fewest module imports whose room edges,
  removed, leave the room graph acyclic (a minimum feedback arc set, weighted by the number of
  module imports each room edge carries, found exhaustively per cyclic component) are the
  imports that run back up; each is listed.
- room cycles: the strongly connected components of more than one room.
- device-type modules (outside zerokern/platform/, the device handle): strict, the modules
  comparing something with the literal "cuda" or reading `.is_cuda`; broad, also those that
  compare with or choose the literal "cuda" or "nccl" or read `torch.cuda.*`: the modules a
  new device type (one that does not answer as "cuda") may have to touch.
- floors: the longest chain of rooms in what is left: a room that imports no other room is on
  floor 1, any other one floor above the highest room it imports.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import json
import os
import subprocess
import sys
from collections import defaultdict
from typing import Dict, List, Set, Tuple

PKG = "zerokern"


def read_sources(where: str) -> Dict[str, str]:
    """{'zerokern/x/y.py': text} for a directory, else for a commit of the current repo."""
    if os.path.isdir(where):
        out = {}
        for dirpath, _dirs, files in os.walk(os.path.join(where, PKG)):
            for f in files:
                if f.endswith(".py"):
                    p = os.path.join(dirpath, f)
                    out[os.path.relpath(p, where)] = open(p, encoding="utf-8").read()
        return out
    names = subprocess.check_output(["git", "ls-tree", "-r", "--name-only", where, PKG],
                                    text=True).split()
    return {n: subprocess.check_output(["git", "show", f"{where}:{n}"], text=True)
            for n in names if n.endswith(".py")}


def module_name(path: str) -> str:
    parts = path[:-3].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: str, text: str, modules: Set[str]) -> Set[str]:
    """The zerokern modules that `path` imports (anywhere in it), itself left out."""
    me = module_name(path)
    package = me if path.endswith("__init__.py") else me.rpartition(".")[0]
    found = set()

    def resolve(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == PKG or a.name.startswith(PKG + "."):
                    found.add(resolve(a.name))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not (mod == PKG or mod.startswith(PKG + ".")):
                continue
            for a in node.names:
                sub = f"{mod}.{a.name}"
                found.add(sub if sub in modules else resolve(mod))
    found.discard(me)
    found.discard("")
    return found


def _names(node: ast.AST, values) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in values
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(isinstance(e, ast.Constant) and e.value in values for e in node.elts)
    return False


def device_type_sites(text: str) -> Tuple[bool, bool]:
    """(strict, broad) for one module's code (comments and docstrings are not code):
    strict: it compares something with the literal "cuda" or reads `.is_cuda` (what
    tests/test_device_type_compares.py counts); broad: that, or it compares with or chooses
    (`a if c else b`) the literal "cuda" or "nccl", or reads an attribute of `torch.cuda`."""
    strict = broad = False
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Attribute) and node.attr == "is_cuda":
            strict = True
        elif isinstance(node, ast.Compare):
            ops = [node.left, *node.comparators]
            strict |= any(_names(o, {"cuda"}) for o in ops)
            broad |= any(_names(o, {"cuda", "nccl"}) for o in ops)
        elif isinstance(node, ast.IfExp):
            broad |= _names(node.body, {"cuda", "nccl"}) or _names(node.orelse, {"cuda", "nccl"})
        elif isinstance(node, ast.Attribute) and ast.unparse(node).startswith("torch.cuda."):
            broad = True
    return strict, strict or broad


def room_of(module: str) -> str:
    parts = module.split(".")
    return PKG if len(parts) == 1 else parts[1]


def sccs(nodes, edges: Dict[str, Set[str]]) -> List[List[str]]:
    """Tarjan's strongly connected components (iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        work = [(v, iter(sorted(edges.get(v, ()))))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        while work:
            node, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    out.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def acyclic(nodes, edges: Dict[str, Set[str]]) -> bool:
    return all(len(c) == 1 for c in sccs(nodes, edges))


def feedback_edges(comp: List[str], weight: Dict[Tuple[str, str], int]):
    """Every set of room edges inside one cyclic component of least total weight whose removal
    leaves it acyclic (exhaustive over subsets of up to 4 edges; components here are small).
    Ties are all returned: which of them "runs back up" is a choice the graph alone does not
    make."""
    inner = sorted(e for e in weight if e[0] in comp and e[1] in comp)
    best, cuts = None, []
    for k in range(1, min(len(inner), 4) + 1):
        for cut in itertools.combinations(inner, k):
            w = sum(weight[e] for e in cut)
            if best is not None and w > best:
                continue
            rest = defaultdict(set)
            for a, b in inner:
                if (a, b) not in cut:
                    rest[a].add(b)
            if acyclic(comp, rest):
                if best is None or w < best:
                    best, cuts = w, []
                cuts.append(list(cut))
    return cuts


def measure(where: str) -> dict:
    src = read_sources(where)
    modules = {module_name(p): p for p in src}
    graph = {m: imports(p, src[p], set(modules)) for m, p in modules.items()}
    flat = sorted(p for p in src if p.count("/") == 1 and not p.endswith("__init__.py"))
    rooms = sorted({room_of(m) for m in modules} - {PKG})
    packages = sorted({room_of(m) for m in modules if modules[m].count("/") > 1})
    # the module graph's cycles (a lazy import closes one as well)
    cycles = [c for c in sccs(modules, graph) if len(c) > 1]
    # the room graph, the face (zerokern/__init__.py) left out
    weight: Dict[Tuple[str, str], int] = defaultdict(int)
    via: Dict[Tuple[str, str], List[str]] = defaultdict(list)
    face_imports = []
    for m, targets in graph.items():
        for t in targets:
            a, b = room_of(m), room_of(t)
            if b == PKG:
                face_imports.append(f"{modules[m]} -> {modules[t]}")
            if a == PKG or b == PKG or a == b:
                continue
            weight[(a, b)] += 1
            via[(a, b)].append(f"{modules[m]} -> {modules[t]}")
    room_edges = defaultdict(set)
    for a, b in weight:
        room_edges[a].add(b)
    back, ties, room_cycles = [], [], []
    for comp in sccs(rooms, room_edges):
        if len(comp) > 1:
            room_cycles.append(comp)
            cuts = feedback_edges(comp, weight)
            back += cuts[0]  # the floors below are counted with the first of equal cuts
            ties.append([{f"{a} -> {b}": via[(a, b)] for a, b in c} for c in cuts])
    for a, b in back:
        room_edges[a].discard(b)
    sites = {p: device_type_sites(t) for p, t in src.items()
             if not p.startswith(f"{PKG}/platform/")}
    floor: Dict[str, int] = {}

    def floor_of(r):
        if r not in floor:
            floor[r] = 1 + max((floor_of(b) for b in room_edges.get(r, ())), default=0)
        return floor[r]

    for r in rooms:
        floor_of(r)
    return {
        "tree": where,
        "commit": subprocess.check_output(["git", "rev-parse", "--short", where], text=True,
                                          cwd=where if os.path.isdir(where) else None,
                                          ).strip() if not os.path.isdir(where) else
        subprocess.check_output(["git", "-C", where, "rev-parse", "--short", "HEAD"],
                                text=True).strip(),
        "modules": len(src),
        "largest_module": max(((p, t.count("\n")) for p, t in src.items()), key=lambda x: x[1]),
        "rooms": len(rooms),
        "packages": len(packages),
        "flat_modules": len(flat),
        "flat": [p.split("/")[1] for p in flat],
        "floors": max(floor.values()),
        "room_edges": len(weight),
        "module_imports": sum(len(v) for v in graph.values()),
        "imports_running_back_up": sum(weight[e] for e in back),
        "back_up": {f"{a} -> {b}": via[(a, b)] for a, b in back},
        "back_up_equal_cuts": ties,
        "room_cycles": len(room_cycles),
        "rooms_in_cycles": room_cycles,
        "module_cycles": len(cycles),
        "cycles": cycles,
        "imports_of_the_face": sorted(face_imports),
        "device_type_modules_strict": sum(v[0] for v in sites.values()),
        "device_type_modules_broad": sum(v[1] for v in sites.values()),
        "device_type_broad": sorted(p for p, v in sites.items() if v[1]),
        "floor_of": dict(sorted(floor.items(), key=lambda kv: (-kv[1], kv[0]))),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trees", nargs="+", help="commits or checkout directories")
    p.add_argument("--json", help="write the measurements here")
    args = p.parse_args(argv)
    res = [measure(t) for t in args.trees]
    keys = ["modules", "rooms", "packages", "flat_modules", "floors", "imports_running_back_up",
            "room_cycles", "module_cycles", "device_type_modules_strict",
            "device_type_modules_broad", "room_edges", "module_imports"]
    print("| | " + " | ".join(f"{r['tree']} ({r['commit']})" for r in res) + " |")
    print("|---|" + "---|" * len(res))
    for k in keys:
        print(f"| {k} | " + " | ".join(str(r[k]) for r in res) + " |")
    big = [f"{r['largest_module'][0]} ({r['largest_module'][1]} lines)" for r in res]
    print("| largest module | " + " | ".join(big) + " |")
    for r in res:
        print(f"\n{r['tree']}: flat {r['flat']}")
        for comp in r["rooms_in_cycles"]:
            print(f"  rooms in a cycle: {comp}")
        for comp in r["back_up_equal_cuts"]:
            for i, cut in enumerate(comp):
                print(f"  back up, cut {i + 1} of {len(comp)} of equal weight: {cut}")
        for c in r["cycles"]:
            print(f"  cycle: {c}")
        if r["imports_of_the_face"]:
            print(f"  imports of zerokern/__init__.py: {r['imports_of_the_face']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
