"""Bytes per step by group, and step time, of stage 3 on 4 gloo ranks as 2 "nodes" x 2:
plain (a 1-D mesh of 4), HSDP (2x2 mesh) and hpZ (2x2, hpz=True). Not a timed test.

Cross-node bytes are derived from the per-group counts (comm_stats()["dims"]), with ranks 0-1
on node A and 2-3 on node B:
- a ring over all 4 ranks (0-1-2-3-0) crosses nodes on 2 of its 4 links, so half the bytes of
  the world-wide collectives cross (plain: everything; hpZ: the forward gathers and the
  reduce-scatters);
- HSDP's replicate all-reduce pairs rank r with r+2: all its bytes cross; its shard group and
  hpZ's node group never cross.

    PYTHONPATH=. python benchmarks/bench_mesh.py [--size small] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import zerokern as zk
from zerokern.gpt import PRESETS, build_gpt
from zerokern.spawn import spawn_ranks

CONFIGS = ("plain", "hsdp", "hpz")


def _opt(model, name, meshes):
    mesh = meshes["4"] if name == "plain" else meshes["2x2"]
    return zk.ZeroAdamW(model, stage=3, precision="fp32", mesh=mesh, hpz=name == "hpz",
                        backend="cpu")


def _worker(rank, ws, size, steps, batch):
    meshes = {"4": init_device_mesh("cpu", (4,)),
              "2x2": init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))}
    cfg = PRESETS[size]
    runs = {}
    for name in CONFIGS:
        model = build_gpt(size, seed=0)
        runs[name] = (model, _opt(model, name, meshes))
    times = {n: [] for n in CONFIGS}
    stats = {}
    g = torch.Generator().manual_seed(rank)
    for s in range(steps + 1):  # step 0 warms up; configs interleaved per step
        tok = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=g)
        for i in range(len(CONFIGS)):  # rotated each step: no config always goes first
            name = CONFIGS[(i + s) % len(CONFIGS)]
            model, opt = runs[name]
            opt.reset_comm_stats()
            t0 = time.perf_counter()
            logits = model(tok[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), tok[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            dt = time.perf_counter() - t0
            if s > 0:
                times[name].append(dt)
            stats[name] = opt.comm_stats()
    return {"times": times, "stats": stats,
            "params": sum(g.layout.numel for g in runs["plain"][1].flat_groups)}


def _cross(name, st) -> int:
    d = st["dims"]
    if name == "hsdp":
        return d["replicate"]["total"]
    return d["shard"]["total"] // 2  # plain and hpZ: the world ring, 2 of 4 links cross


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="small")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    res = spawn_ranks(_worker, 4, a.size, a.steps, a.batch, threads=1, timeout=1200)
    r0 = res[0]
    base = statistics.median(r0["times"]["plain"])
    rows = []
    for name in CONFIGS:
        st = r0["stats"][name]
        med = statistics.median(r0["times"][name])
        rows.append({"config": name, "bytes_per_step": st["total"],
                     "dims": {k: v["total"] for k, v in st["dims"].items()},
                     "cross_node": _cross(name, st), "step_s": med, "ratio": med / base,
                     "spread_s": [min(r0["times"][name]), max(r0["times"][name])]})
    plain_cross = rows[0]["cross_node"]
    print(f"GPT {a.size} ({r0['params'] / 1e6:.2f}M params), stage 3 fp32, 4 gloo ranks "
          f"(2 x 2), rank 0, {a.steps} steps, torch {torch.__version__}")
    print("| config | bytes/step (rank 0) | per group | cross-node | x plain | step s | x plain |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['bytes_per_step']:,} | {r['dims']} | "
              f"{r['cross_node']:,} | {r['cross_node'] / plain_cross:.2f} | "
              f"{r['step_s']:.3f} | {r['ratio']:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"size": a.size, "steps": a.steps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
