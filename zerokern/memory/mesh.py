"""Memory and communication on a 2-D (replicate, shard) mesh: the dims and DESIGN §4/§5-style
formulas per dim, for `zerokern estimate --mesh RxS [--hpz]` and `estimate(mesh=, hpz=)`.

[Note: per-rank bytes on a mesh] On an R x S mesh (R nodes of S ranks, N = R*S):
- HSDP (ZeroAdamW(mesh=)): every buffer is laid out over the shard dim alone, so each rank
  holds exactly what a rank of an S-rank job holds (same layout, same padding, same staging
  buckets: the replicate all-reduce works in the reduced shard itself), and the R replicas of
  a shard hold the same bytes. The per-rank estimate is the S-rank one at rank r mod S, and
  DESIGN §4's table applies with N -> S: stage 3 is 16Ψ/S per rank.
- hpZ (stage 3, hpz=True): the buffers are laid out over all N ranks (16Ψ/N), plus the node
  copy of each unit the forward gathered, a (E/S,) piece per flat buffer (E its padded size):
  2Ψ/S more at 16-bit (`hpz_secondary`, as memory_report() counts it). The estimate replays
  zerokern's own Stage3Runtime with an hpZ node group of S ranks, so it is exact.
`memory_report()` measures the same: its `world_size` is the shard group's size and its
`mesh` the dims, so the two agree to the byte (tests/accounting/test_mesh_estimate.py).

Communication per rank per step (elements, ring algorithms, Ψ params; DESIGN §5 per dim):
- HSDP stages 1-2: shard dim RS + AG, 2Ψ(S-1)/S; replicate dim: all-reduce of the Ψ/S shard,
  2(Ψ/S)(R-1)/R (the only traffic between nodes). Stage 3: 3Ψ(S-1)/S inside, the same
  2(Ψ/S)(R-1)/R across. Stage 0: one all-reduce over all N ranks, 2Ψ(N-1)/N.
- hpZ stage 3: the forward all-gather and the reduce-scatter over all N ranks, 2Ψ(N-1)/N,
  the backward all-gather inside the node, Ψ(S-1)/S.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from zerokern.comm.plan import check_hpz_roles, role_sizes


def mesh_dims(mesh: Optional[Tuple[int, int]], hpz: bool, world_size: int, stage: int,
              offload_params: Optional[str] = None) -> Dict[str, int]:
    """The group sizes by role ({"shard", "replicate", "world"[, "hpz"]}, as
    `opt.comm.dims`) of ZeroAdamW(mesh=(R, S) as a DeviceMesh, hpz=hpz) over world_size ranks.

    Args:
        mesh: None (one flat group) or (R, S), R * S = world_size.
        hpz: hpZ (stage 3 with a mesh).
        world_size: the number of ranks.
        stage: the ZeRO stage.
        offload_params: ZeroAdamW's (hpZ does not take it).

    Raises:
        ValueError: a malformed mesh, one that does not cover world_size, or hpz without a
            mesh, below stage 3 or with offload_params.
    """
    if not isinstance(hpz, bool):
        raise ValueError(f"hpz must be True or False, got {hpz!r}")
    if mesh is not None and not (
            isinstance(mesh, (tuple, list)) and len(mesh) == 2 and
            all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in mesh)):
        raise ValueError(f"mesh must be (replicate, shard), two ints >= 1, got {mesh!r}")
    shape = None if mesh is None else tuple(mesh)
    if shape is not None and shape[0] * shape[1] != world_size:
        raise ValueError(f"mesh {shape[0]}x{shape[1]} has {shape[0] * shape[1]} ranks, "
                         f"world_size is {world_size}")
    # the optimizer's own rules and sizes ([Note: one parallel plan] in comm/plan.py)
    check_hpz_roles(hpz, shape, stage, offload_params)
    return role_sizes(shape, hpz, world_size).dims()


def _el(x: float) -> str:
    return f"{x:,.0f}"


def comm_formulas(psi: int, dims: Dict[str, int], stage: int) -> List[Dict[str, Any]]:
    """Per dim: elements each rank sends per step, with the formula, and whether the dim
    crosses nodes ([Note: per-rank bytes on a mesh]). One row per dim that carries traffic."""
    n, s = dims["world"], dims["shard"]
    if "hpz" in dims:
        h = dims["hpz"]
        return [{"dim": "world (shard)", "formula": "2Ψ(N-1)/N", "elements": 2 * psi * (n - 1) / n,
                 "crosses_nodes": n > h},
                {"dim": "hpz (node)", "formula": "Ψ(S-1)/S", "elements": psi * (h - 1) / h,
                 "crosses_nodes": False}]
    r = dims["replicate"]
    if stage == 0:
        return [{"dim": "world", "formula": "2Ψ(N-1)/N", "elements": 2 * psi * (n - 1) / n,
                 "crosses_nodes": r > 1}]
    k = 3 if stage == 3 else 2
    rows = [{"dim": "shard (node)", "formula": f"{k}Ψ(S-1)/S", "elements": k * psi * (s - 1) / s,
             "crosses_nodes": False}]
    if r > 1:
        rows.append({"dim": "replicate (across nodes)", "formula": "2(Ψ/S)(R-1)/R",
                     "elements": 2 * psi / s * (r - 1) / r, "crosses_nodes": True})
    return rows


def mesh_lines(results: List[Dict[str, Any]]) -> List[str]:
    """The estimate table's mesh section: the dims, the §4 formula per dim, the §5 traffic."""
    r0 = results[0]
    d = r0["mesh"]
    psi = r0["num_params"]
    if "hpz" in d:
        head = (f"mesh {d['world'] // d['hpz']}x{d['hpz']} with hpZ: params, grads and state "
                f"sharded over all N = {d['world']} ranks, a secondary 16-bit copy over each "
                f"node's S = {d['hpz']}: per rank 16Ψ/N + 2Ψ/S (stage 3)")
    else:
        head = (f"mesh {d['replicate']}x{d['shard']} (HSDP): sharded over S = {d['shard']} "
                f"ranks of a node, replicated over R = {d['replicate']} nodes: each rank holds "
                f"what a rank of an S-rank job holds (DESIGN §4 with N -> S)")
    lines = [head, "communication per rank per step (DESIGN §5 per dim, elements; x bytes per "
                   "element of the reduce dtype):"]
    for r in results:
        for row in comm_formulas(psi, d, r["stage"]):
            where = "between nodes" if row["crosses_nodes"] else "inside a node"
            lines.append(f"  stage {r['stage']}: {row['dim']}: {row['formula']} = "
                         f"{_el(row['elements'])} ({where})")
    return lines


def node_split(dims_bytes: Dict[str, Dict[str, int]], dims: Dict[str, int]
               ) -> Optional[Dict[str, int]]:
    """Bytes inside a node and between nodes, from comm_stats()["dims"], on a 2-D mesh whose
    dim 1 is a node (torchrun's consecutive ranks); None without one (a flat group's links
    are unknown). HSDP: the shard group is a node, the replicate and world groups cross nodes;
    hpZ: the hpz group is a node, the shard (all ranks) group crosses them.

    Args:
        dims_bytes: comm_stats()["dims"] ({dim: {kind: bytes, "total"}}).
        dims: the optimizer's group sizes (`opt.comm.dims`).
    """
    if "hpz" in dims:
        if dims["world"] == dims["hpz"]:
            return None
        inside = {"hpz"}
    elif dims["replicate"] > 1:
        inside = {"shard"}
    else:
        return None
    intra = sum(v["total"] for d, v in dims_bytes.items() if d in inside)
    inter = sum(v["total"] for d, v in dims_bytes.items() if d not in inside)
    return {"intra_node": intra, "inter_node": inter}
