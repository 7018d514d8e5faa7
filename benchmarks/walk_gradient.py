"""A walk of one gradient, and of `mesh=`, through zerokern's modules, traced as it runs (issue
35's Check: "a walk of one gradient and of `mesh=`, with the transitions counted").

    python benchmarks/walk_gradient.py --trees before=/tmp/wt-before,after=. \
        [--json out.json]

Each tree is a checkout (a `git worktree` of the commit); every measurement runs in a fresh
process with that tree first on sys.path (the script checks that `zerokern` came from it).
One gloo rank (world size 1), one `nn.Linear(8, 8, bias=False)`, ZeroAdamW at fp32 with the
reference kernels (nothing to build), two warm-up steps, then:

- gradient, stage S: `sys.setprofile` records the module of every Python call made in
  zerokern's files (the main thread only: a ring or I/O thread's calls are not seen) from
  `loss.backward()` through `opt.step()`. Along that sequence of modules, a transition is a
  call in another module than the call before it; a re-entry is a transition into a module
  the walk had already been in. Also counted: the calls into the optimizer's own module
  (`optimizer.py` before issue 35's packages, `core/optimizer.py` after) made during the
  backward, i.e. the gradient hook calling back up into the optimizer.
- mesh: the same recording during `ZeroAdamW(model, mesh=mesh)` with a 1 x 1
  ("replicate", "shard") DeviceMesh, keeping only the calls that receive the mesh: a call
  whose arguments hold the DeviceMesh given, a DeviceMesh taken from it (`mesh["shard"]`), or
  one of its process groups. Transitions and re-entries as above, over those calls only.

A module's name is its path under zerokern/, so the counts of two trees with other file names
compare as walks, not file by file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def _trace(root: str, what: str) -> dict:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, root)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    import zerokern as zk

    pkg = os.path.join(os.path.realpath(root), "zerokern") + os.sep
    assert os.path.realpath(zk.__file__).startswith(pkg), (zk.__file__, pkg)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False))
    x = torch.randn(4, 8)
    seq = []
    kw = dict(lr=1e-3, precision="fp32", backend="reference")
    backward_calls_into_optimizer = None

    if what.startswith("gradient"):
        opt = zk.ZeroAdamW(model, stage=int(what.split("-")[1]), **kw)
        for _ in range(2):  # warm
            model(x).square().sum().backward()
            opt.step()
            opt.zero_grad()

        def prof(frame, event, arg):
            if event == "call":
                f = os.path.realpath(frame.f_code.co_filename)
                if f.startswith(pkg):
                    seq.append(f[len(pkg):])

        loss = model(x).square().sum()
        sys.setprofile(prof)
        loss.backward()
        n_backward = len(seq)
        opt.step()
        sys.setprofile(None)
        optimizer_module = {"optimizer.py", "core/optimizer.py"}
        backward_calls_into_optimizer = sum(m in optimizer_module for m in seq[:n_backward])
    else:
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
        groups = {id(g) for g in mesh.get_all_groups()}

        def carries_mesh(v) -> bool:
            return isinstance(v, DeviceMesh) or id(v) in groups

        def prof(frame, event, arg):
            if event == "call":
                f = os.path.realpath(frame.f_code.co_filename)
                if not f.startswith(pkg):
                    return
                code = frame.f_code
                names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount
                                         + bool(code.co_flags & 0x04) + bool(code.co_flags & 0x08)]
                for n in names:
                    v = frame.f_locals.get(n)
                    vals = v if isinstance(v, (list, tuple)) else \
                        (v.values() if isinstance(v, dict) else (v,))
                    if any(carries_mesh(u) for u in vals):
                        seq.append(f[len(pkg):])
                        return

        sys.setprofile(prof)
        zk.ZeroAdamW(model, stage=2, mesh=mesh, **kw)
        sys.setprofile(None)
        n_backward = 0
    dist.destroy_process_group()
    trans = reentries = 0
    seen, prev, path = set(), None, []
    for m in seq:
        if m != prev:
            if prev is not None:
                trans += 1
                if m in seen:
                    reentries += 1
            seen.add(m)
            path.append(m)
        prev = m
    return {"what": what, "calls": len(seq), "modules": len(seen), "transitions": trans,
            "re_entries": reentries, "backward_calls": n_backward,
            "backward_calls_into_optimizer": backward_calls_into_optimizer,
            "module_path": path}


WHAT = ["gradient-2", "gradient-3", "mesh"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trees", help="name=dir,name=dir (checkouts of the commits compared)")
    p.add_argument("--one", nargs=2, metavar=("DIR", "WHAT"), help=argparse.SUPPRESS)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(_trace(*args.one)))
        return 0
    out = {}
    for item in args.trees.split(","):
        name, root = item.split("=", 1)
        sha = subprocess.check_output(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                                      text=True).strip()
        out[name] = {"tree": root, "commit": sha}
        for what in WHAT:
            r = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", root, what],
                               capture_output=True, text=True, check=True)
            out[name][what] = json.loads(r.stdout.strip().splitlines()[-1])
    print("| tree | walk | calls | modules | transitions | re-entries | backward calls "
          "into the optimizer module |")
    print("|---|---|---|---|---|---|---|")
    for name, res in out.items():
        for what in WHAT:
            r = res[what]
            print(f"| {name} ({res['commit']}) | {what} | {r['calls']} | {r['modules']} | "
                  f"{r['transitions']} | {r['re_entries']} | "
                  f"{r['backward_calls_into_optimizer']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
