"""Step time of plain ZeRO-3, HSDP, hpZ and hpZ + qwZ + qgZ on GPU clusters, projected on paper
from the bytes zerokern's own counters measured (issue 40). Not a measurement of GPUs.

[Note: the mesh projection]
1. The bytes. comm_stats() counts, per rank and per process group, what each collective sent
   (benchmarks/bench_mesh.py stores it per config, with the unit buffers' padded sizes E and
   E_kept: the root and the last unit, which stay gathered from forward to backward). `bytes_per
   _group` below gives the same counts from the sizes, for any R nodes x n GPUs; `check` first
   evaluates it at the benchmark's 2 x 2 and requires it to equal the measured counters (to the
   12-byte agreement all-reduce per step). So the bytes projected are the ones the code sends.
2. The links. A group inside a node (HSDP's shard group, hpZ's node group, qwZ's and qgZ's
   node hops) runs on NVLink; the cross-node group of one GPU per node (qwZ's first hop, qgZ's
   second, HSDP's replicate all-reduce) and the flat world group (plain, and hpZ's forward
   gathers and reduce-scatter) cross nodes. A node's n GPUs share its inter-node bandwidth B
   (25, 100 or 400 Gb/s per node). A flat ring over all N GPUs carries (N-1)/N of every
   collective through each node's NICs (NCCL's rings for all-gather and reduce-scatter); a
   collective over the cross group imports each other node's share once: n x the per-GPU bytes
   per node. NVLink: 450 GB/s per GPU per direction (H100/H200 SXM), at 80% efficiency.
3. Compute. 6 · params · tokens FLOPs per step per GPU (no attention term, no recompute) at
   40% MFU of 989 TFLOP/s (H100 SXM, dense bf16), tokens per GPU per step as in MODELS. The
   codec of qwZ/qgZ runs on the GPU's HBM (3.35 TB/s, H100): its bytes read and written are
   added to the compute time (it competes for the same SMs and memory).
4. Overlap. Collectives are prefetched (gathers) and bucketed (reduce-scatters) behind
   compute: the step is compute + max(0, comm - f · compute) with comm = max(the cross-node
   time, the NVLink time) (hops of successive buckets pipeline, the two kinds of links run at
   once); f = 0.9 (all but the first gather and the last reduce-scatter hide) and f = 0
   (nothing hidden: an upper bound).
5. Precision: bf16 params, gathers and reduce-scatters (2 bytes each), int8 qwZ, int8 or int4
   qgZ; the codec reads and writes fp32 grads.

    PYTHONPATH=. python benchmarks/project_mesh.py [--measured benchmarks/results/X.json]
        [--json out.json] [--md out.md]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from zerokern.tools.gpt import PRESETS, GPTConfig

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
MEASURED = RESULTS / "mesh-quant-2x2-issue40-20261129.json"
DOCS = REPO / "docs" / "guides" / "multi-node.md"
REGION = ("<!-- projection: mesh (benchmarks/project_mesh.py --write-docs) -->\n",
          "<!-- /projection -->")

CONFIGS = ("plain", "hsdp", "hpz", "hpz_q8", "hpz_q4")
NAMES = {"plain": "plain ZeRO-3", "hsdp": "HSDP", "hpz": "hpZ", "hpz_q8": "hpZ+qwZ+qgZ int8",
         "hpz_q4": "hpZ+qwZ+qgZ int4"}
BLOCK = 128

# the two models: zerokern's "100m" preset, and a 7B GPT of the same shape family (tied
# embeddings), with tokens per GPU per step
MODELS = {
    "100m": (PRESETS["100m"], 16 * 1024),
    "7b": (GPTConfig(vocab=32000, seq=4096, d_model=4096, n_layers=32, n_heads=32), 4 * 4096),
}
MESHES = ((2, 8), (16, 8))            # R nodes x n GPUs
BANDWIDTH_GBPS = (25, 100, 400)       # inter-node, per node
NVLINK_BPS = 450e9 * 0.8              # per GPU, per direction, at 80%
HBM_BPS = 3.35e12                     # H100 SXM
PEAK_FLOPS = 989e12                   # H100 SXM dense bf16
MFU = 0.40
OVERLAPS = (0.9, 0.0)


def wire(numel: float, bits: int) -> float:
    """Bytes of a quantized payload: codes plus an fp32 scale per 128 (comm/quantized.py)."""
    return numel * bits / 8 + numel / BLOCK * 4


def bytes_per_group(config: str, R: int, n: int, E: float, E_kept: float, e: float,
                    e_r: float) -> dict:
    """Bytes one rank sends per step, per process group (comm_stats()'s dims), from the unit
    buffers' sizes: E elements in all, E_kept of them kept from forward to backward; e bytes
    per param element (gathers), e_r per reduced grad element ([Note: the mesh projection])."""
    N = R * n
    if config == "plain":  # 1-D over N: gathers in forward and backward, one reduce-scatter
        return {"shard": (N - 1) / N * (e * (2 * E - E_kept) + e_r * E)}
    if config == "hsdp":  # shard inside the node, all-reduce of the shard across nodes
        return {"shard": (n - 1) / n * (e * (2 * E - E_kept) + e_r * E),
                "replicate": 2 * (R - 1) / R * e_r * E / n}
    if config == "hpz":  # primary over N (forward gather, reduce-scatter), backward in the node
        return {"shard": (N - 1) / N * (e * E + e_r * E),
                "hpz": (n - 1) / n * e * (E - E_kept)}
    bits = 8 if config == "hpz_q8" else 4
    # qwZ hop 1 (cross, R ranks) and hop 2 (node); qgZ hop 1 (node), hop 2 (cross)
    return {"cross": (R - 1) * wire(E / N, 8) + (R - 1) * wire(E / N, bits),
            "hpz": (n - 1) * R * wire(E / N, 8) + (n - 1) / n * e * (E - E_kept)
            + (n - 1) * wire(E / n, bits)}


def link_bytes(config: str, R: int, n: int, g: dict) -> dict:
    """{"node_nic": bytes through one node's inter-node links, "nvlink": bytes one GPU sends
    over NVLink} per step, from the per-group bytes ([Note: the mesh projection], 2)."""
    nic = nvl = 0.0
    for dim, b in g.items():
        if dim == "hpz" or (dim == "shard" and config == "hsdp"):  # inside the node
            nvl += b
        elif dim in ("cross", "replicate"):  # one GPU per node: the node's n GPUs send it
            nic += n * b
        else:  # the flat ring over N: a rank sends (N-1)/N of each collective, and so much
            # passes through every node's links; the other hops are inside the node
            nic += b if R > 1 else 0.0
            nvl += b * (n - 1) / n
    return {"node_nic": nic, "nvlink": nvl}


def codec_bytes(config: str, R: int, n: int, E: float, e: float) -> float:
    """HBM bytes the GPU's codec reads and writes per step (qwZ: quantize the own piece,
    dequantize the others'; qgZ: quantize the rows sent, decode-and-add the rows received, on
    each hop)."""
    if not config.startswith("hpz_q"):
        return 0.0
    N = R * n
    bits = 8 if config == "hpz_q8" else 4
    w8, wb = wire(1, 8), wire(1, bits)
    qwz = 2 * ((e + w8) * E / N + (w8 + e) * E * (N - 1) / N)  # forward and backward gathers
    hop1 = (4 + wb) * E * (n - 1) / n + (wb + 8) * E * (n - 1) / n  # fp32 grads: q, decode+add
    hop2 = (4 + wb) * E / n * (R - 1) / R + (wb + 8) * E / n * (R - 1) / R
    return qwz / 2 + hop1 + hop2  # (the backward gathers come from hpZ's secondary: exact)


def kept(cfg: GPTConfig) -> float:
    """The root's params (embeddings, tied head, final norm) and the last block's."""
    d = cfg.d_model
    return cfg.vocab * d + cfg.seq * d + 2 * d + 12 * d * d + 13 * d


def one_run(data: dict) -> dict:
    """A bench_mesh.py result: a single run, or the last tree's first run of a before/after
    file (--trees: every run sends the same bytes; bench_mesh's table shows them)."""
    if "runs" in data:
        return list(data["runs"].values())[-1][0]
    return data


def check(measured: dict) -> list:
    """Every config's per-group counters of the 2 x 2 run against bytes_per_group there."""
    measured = one_run(measured)
    m = measured["mesh"]
    out = []
    for row in measured["rows"]:
        c = row["config"]
        want = bytes_per_group(c, 2, 2, m["E"], m["E_kept"], m["e"], m["e_r"])
        got = {k: v for k, v in row["dims"].items() if k != "world"}
        for dim, b in want.items():
            diff = got.get(dim, 0) - b
            out.append({"config": c, "dim": dim, "measured": got.get(dim, 0), "formula": b,
                        "diff": diff})
            if abs(diff) > 400:  # the agreement all-reduce: 12 bytes x 27 per step at most
                raise SystemExit(f"{c} {dim}: measured {got.get(dim)} B, formula {b:.0f} B: the "
                                 "formula does not describe what the code sends")
    return out


def project() -> list:
    rows = []
    for model, (cfg, tokens) in MODELS.items():
        P = cfg.approx_params
        E, Ek = float(P), float(kept(cfg))
        t_compute = 6 * P * tokens / (MFU * PEAK_FLOPS)
        for R, n in MESHES:
            for gbps in BANDWIDTH_GBPS:
                B = gbps * 1e9 / 8
                row = {"model": model, "params": P, "R": R, "n": n, "node_Gbps": gbps,
                       "compute_s": t_compute, "configs": {}}
                for c in CONFIGS:
                    g = bytes_per_group(c, R, n, E, Ek, 2, 2)
                    lk = link_bytes(c, R, n, g)
                    t_nic, t_nvl = lk["node_nic"] / B, lk["nvlink"] / NVLINK_BPS
                    t_codec = codec_bytes(c, R, n, E, 2) / HBM_BPS
                    comm = max(t_nic, t_nvl)
                    tc = t_compute + t_codec
                    steps = {f: tc + max(0.0, comm - f * tc) for f in OVERLAPS}
                    mem = 16 * P / (R * n) if c != "hsdp" else 16 * P / n
                    if c.startswith("hpz"):
                        mem += 2 * P / n  # the secondary copy
                    row["configs"][c] = {"node_nic_GB": lk["node_nic"] / 1e9,
                                         "nvlink_GB": lk["nvlink"] / 1e9, "nic_s": t_nic,
                                         "nvlink_s": t_nvl, "codec_s": t_codec,
                                         "step_s": {str(f): s for f, s in steps.items()},
                                         "model_states_GB": mem / 1e9}
                rows.append(row)
    return rows


def markdown(rows, checks, measured_name) -> str:
    out = ["Checked against the measured counters (2 x 2, small GPT, "
           f"`{measured_name}`): per config and group, formula − measured in bytes: "
           + ", ".join(f"{c['config']}/{c['dim']} {c['formula'] - c['measured']:+.0f}"
                       for c in checks) + ".", ""]
    for f in OVERLAPS:
        out += [f"Step time in ms, overlap f = {f} "
                f"({'prefetch and bucketing hide all but 10%' if f else 'nothing hidden'}); "
                "**bold**: the fastest; in brackets: the inter-node time alone.", "",
                "| model | mesh | Gb/s per node | compute | " + " | ".join(NAMES[c] for c in
                                                                       CONFIGS) + " |",
                "|---|---|---:|---:|" + "---:|" * len(CONFIGS)]
        for r in rows:
            steps = {c: r["configs"][c]["step_s"][str(f)] for c in CONFIGS}
            best = min(steps.values())
            cells = []
            for c in CONFIGS:
                s = f"{1e3 * steps[c]:.0f} ({1e3 * r['configs'][c]['nic_s']:.0f})"
                cells.append(f"**{s}**" if steps[c] <= best * 1.005 else s)
            out.append(f"| {r['model']} | {r['R']}x{r['n']} | {r['node_Gbps']} | "
                       f"{1e3 * r['compute_s']:.0f} | " + " | ".join(cells) + " |")
        out.append("")
    out += ["Model states per GPU (GB; fp32 master and moments, bf16 params and grads: 16 bytes "
            "per param over the shard group, hpZ's secondary 2 bytes per param over the node):",
            "", "| model | mesh | " + " | ".join(NAMES[c] for c in CONFIGS) + " |",
            "|---|---|" + "---:|" * len(CONFIGS)]
    seen = set()
    for r in rows:
        k = (r["model"], r["R"], r["n"])
        if k in seen:
            continue
        seen.add(k)
        out.append(f"| {r['model']} | {r['R']}x{r['n']} | " + " | ".join(
            f"{r['configs'][c]['model_states_GB']:.2f}" for c in CONFIGS) + " |")
    return "\n".join(out)


def docs_region(md: str) -> str:
    return REGION[0] + md + "\n" + REGION[1]


def page_with(md: str, page: str) -> str:
    """The docs page with its projection region replaced by `md`."""
    i, j = page.index(REGION[0]), page.index(REGION[1])
    return page[:i] + docs_region(md) + page[j + len(REGION[1]):]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--measured", default=str(MEASURED))
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None)
    ap.add_argument("--write-docs", action="store_true",
                    help=f"write the tables into {DOCS.relative_to(REPO)}")
    ap.add_argument("--check-docs", action="store_true",
                    help="exit 1 if the docs page's tables differ from this output")
    a = ap.parse_args()
    measured = json.loads(Path(a.measured).read_text())
    checks = check(measured)
    rows = project()
    md = markdown(rows, checks, Path(a.measured).name)
    if a.check_docs or a.write_docs:
        page = DOCS.read_text()
        new = page_with(md, page)
        if a.write_docs:
            DOCS.write_text(new)
        elif new != page:
            raise SystemExit(f"{DOCS.relative_to(REPO)}: the projection differs from "
                             "benchmarks/project_mesh.py's output (run it with --write-docs)")
        return
    print(md)
    if a.json:
        Path(a.json).write_text(json.dumps({"measured": Path(a.measured).name,
                                            "checks": checks, "rows": rows,
                                            "assumptions": {
                                                "nvlink_Bps": NVLINK_BPS, "hbm_Bps": HBM_BPS,
                                                "peak_flops": PEAK_FLOPS, "mfu": MFU,
                                                "overlaps": OVERLAPS,
                                                "models": {k: {"params": v[0].approx_params,
                                                               "tokens_per_gpu": v[1]}
                                                           for k, v in MODELS.items()}}},
                                           indent=1))
    if a.md:
        Path(a.md).write_text(md + "\n")


if __name__ == "__main__":
    main()
