"""Per-rank memory of zerokern's buffers, exactly, for a model or a parameter count.

`estimate_memory` (formula.py) is the DESIGN §4 formula: 2Ψ + 2Ψ + KΨ and its shards. This
module predicts what `opt.memory_report()` will say, byte for byte, by building zerokern's own
buffers over `meta` tensors, which allocate nothing: `FlatGroup` at stages 0-2 (so `make_layout`,
`bucket_numel_for` and `ALIGN` padding), and at stage 3 one `ShardedFlat` per unit that owns
params, units from `zerokern.stage3.find_units` (the default policy, or the one given to
`spec_from_model(units=...)`, as ZeroAdamW's `units=`). A model contributes its real param
shapes: frozen params are skipped and a tied param (one Parameter reached twice) is stored once,
by the first unit that reaches it, as ZeroAdamW does (a model gives one param group).
`--params N` is one buffer of N elements (at stage 3: one param, so the root is the only unit).
The model side (param shapes, the recorded grad and unit orders, loading presets, factories
and Hugging Face configs) is in `model_spec.py`.

What is predicted, after a training step:
- `bytes`: `memory_report()["measured"]`, the device categories. `live_units` (stage-3 units
  gathered) is 0 between steps; `live_units_bound` is `memory_report()["live_units_bound"]`
  (`Stage3Runtime.live_bound()`: the root and its ties plus the two largest other units).
- The optimizer state (the master and the rule's states, `optimizer=`: "adamw", "lion" or a
  zerokern.rules.Rule) is what the placement class says it holds for each layout
  (placement.py [Note: each placement reports its own bytes]: `layout_bytes` per buffer,
  `fixed_bytes` once): on the device without offload; with offload="cpu" in `host`
  (`memory_report()["host_measured"]`: an fp32 master at every precision, the rule's states
  and staging); with offload="nvme" `host` is the I/O pool (pinned with nccl, pageable with
  gloo) and `disk` the state files (`memory_report()["disk_measured"]`).

[Note: categories that depend on the run]
Three buffers are not a function of the shapes alone; here is how each is modelled.
- Stage-2 staging buckets (`buckets`): how many bucket-sized staging buffers stage 2 allocates
  depends on the order grads arrive in backward (a bucket is launched only when all its params'
  grads are in, and in a fixed order). We replay that order through zerokern's own
  `BucketedGrads` (the runtime class, on meta tensors, with a communicator that completes at
  once, which is how its pool is drained anyway: only when a buffer is needed or backward ends).
  The order comes from one backward of the model on the `meta` device (token ids in, sum of
  the output as the loss): that is the order autograd fires the post-accumulate-grad hooks
  in, the same on CPU as on meta (checked on zerokern.tools.gpt). When the model cannot run on meta
  (an unknown input signature), the order is reverse registration order and the result says so
  (`exact: False`); `--params` is one param, so its order is trivial.
- Stage-3 staging pool (`buckets`): Stage3Runtime keeps, per padded unit size, as many full-unit
  staging buffers as were ever in use at once: a unit takes one at its first grad and gives it
  back when its reduce-scatter is waited for, which happens only when MAX_IN_FLIGHT (2) are in
  flight or backward ends; reduce-scatters go in the reverse of the forward's unit order, the
  root last. So it depends on the grad order and on the forward's unit order. The same meta
  forward records the units' calls (their forward pre-hooks, as Stage3Runtime records them), and
  the replay drives the real Stage3Runtime over meta ShardedFlats: one forward through stand-in
  unit modules carrying its hooks (so it derives its reduce-scatter order itself), then
  `on_grad` in the recorded grad order and `end_backward`.
- No communication buffer at stage 1, over any backend: it reduce-scatters the grad buffer in
  place (full_grads.py, [Note: stage 1 reduces in place]), with no grad shard and no gloo ring
  scratch. (Stages 2-3 hand the ring their staging buffer as its work buffer.)
The measurement is taken after at least one training step: before the first backward stages 2
and 3 hold no staging buffers yet.

[Note: per-stage bytes of a pipeline]
With pipeline parallelism every stage's ranks hold that stage's params only, sharded over the
stage's data-parallel group (ZeroAdamW(mesh=world) with a "pp" dim: comm/mesh.py [Note: a
world mesh]). So a rank of stage s holds exactly what a rank of a dp-sized job training stage
s's module holds: `estimate_pipeline` is `estimate` of each stage's own ModelSpec over the dp
group of the plan's RoleSizes (`role_sizes(..., pp=P)`: world = pp x dp), stage by stage.
Stages differ (the demo GPT's embeddings on the first, its head on the last:
tools/gpt_stages.py), so the job's peak is the largest stage's, not the whole model / P.
The pp agreement's own buffers (the step's stats all-reduced over pp) are the ones a flat job
has: nothing more is held.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

from zerokern.accounting.model_spec import (  # noqa: F401 (the estimate's model side, its API)
    _ONE_PARAM,
    ModelSpec,
    UnitSpec,
    _numel,
    grad_order,
    load_model,
    record_order,
    spec_from_model,
    spec_from_numel,
    stage3_units,
)
from zerokern.layout.stages import pattern
from zerokern.memory.formula import deepspeed_formula, estimate_memory
from zerokern.options.args import (
    check_keep_for_backward,
    check_master,
    check_offload,
    check_precision,
    check_stage,
)
from zerokern.rules import combine, slot_align
from zerokern.rules.matrix_states import names_of, owned_bytes
from zerokern.rules.registry import adamw_rule, rule_by_name
from zerokern.state.offload_nvme import CHUNK_NUMEL, QUEUE_DEPTH, pool_chunk, rules_granule
from zerokern.state.placement import placement_class


def categories(rule) -> tuple:
    """Device categories, as memory_report()["measured"] (live_units: gathered stage-3 units,
    0 between steps), for an optimizer with `rule`."""
    return ("params", "frozen", "live_units", "grads", "buckets", "master", *rule.state_names,
            *names_of(rule),
            "padding")


def host_categories(rule) -> tuple:
    """Host categories, as memory_report()["host_measured"] (offload)."""
    return ("master", *rule.state_names, *names_of(rule), "host_staging")


# ZeroAdamW's (the default optimizer's) categories.
CATEGORIES = categories(adamw_rule())
MEASURED = CATEGORIES
HOST_CATEGORIES = host_categories(adamw_rule())
COMMS = ("nccl", "gloo")
# ---------------------------------------------------------------------------- the estimate


class _InstantComm:
    """Stands in for zerokern.comm.Comm: collectives complete at once (no data moves)."""

    class _Done:
        def wait(self) -> bool:
            return True

    def __init__(self, world_size: int, rank: int, node=None, reads_pieces=False) -> None:
        self.world_size, self.rank = world_size, rank
        # gloo on one host: the shared-memory exchange reads stages 2-3's grads in place
        # (comm/pieces.py [Note: grads read where they lie]): no staging buffer is held
        self.reads_pieces = reads_pieces and world_size > 1
        self.shard = self.world = self  # the roles of zerokern.comm.Comm, one group
        self.replicate = None
        # hpZ: the node group (size, rank) the secondary copies are sharded over
        self.hpz = None if node is None else _InstantComm(*node)
        self.qwz = False  # quantized gathers hold the same buffers (their payloads are transient)
        self.backend = "gloo"  # a host agreement (comm/host_agree.py) takes agree_ below

    def agree_(self, t, op, label, host_group=None) -> None:
        pass

    def reduce_scatter_(self, out, inp, async_op=False, label=None):
        return self._Done()

    def reduce_grads_(self, out, inp, async_op=False, label=None):
        return self._Done()

    def all_gather_(self, out, inp, async_op=False, label=None):
        return self._Done()

    def split(self) -> _InstantComm:
        return self

    def enable_debug_log(self) -> None:
        pass

    def check_collectives(self, where: str = "") -> None:
        pass

    def signal_failure(self, error: BaseException) -> None:
        pass


def _meta_group(spec: ModelSpec, idx: Sequence[int], dtype, world_size, rank, pat,
                bucket_bytes, slot_align: int = 1):
    from zerokern.layout.flat_group import FlatGroup

    params = [nn.Parameter(torch.empty(spec.shapes[i], device="meta")) for i in idx]
    return FlatGroup(params, dtype, world_size, rank, pat, bucket_bytes,
                     slot_align=slot_align)


def _staging_bytes(spec: ModelSpec, groups, idx, reduce_dtype, reads_pieces: bool) -> int:
    """Stage-2 staging buffers after one backward in spec.grad_order, via BucketedGrads over
    the buffers `groups` (buffer gi holds the params idx[gi]); `reads_pieces`: the grads are
    read in place (gloo on one host), so none is held."""
    from zerokern.grads.sharded_grads import BucketedGrads

    where = {j: (gi, slot) for gi, ix in enumerate(idx) for slot, j in enumerate(ix)}
    comm = _InstantComm(groups[0].layout.world_size, groups[0].rank,
                        reads_pieces=reads_pieces)
    gs = BucketedGrads(list(groups), comm, reduce_dtype)
    try:
        for i in spec.grad_order:
            gi, slot = where[i]
            p = groups[gi].params[slot]
            p.grad = torch.empty(p.shape, dtype=groups[gi].dtype, device="meta")
            gs.on_grad(gi, slot, p)
        gs.end_backward()
        return sum(t.numel() * t.element_size() for t in gs.held()["buckets"])
    finally:
        gs.detach()


class _Stub(nn.Module):
    """A unit's module in the stage-3 replay: calling it runs Stage3Runtime's forward hooks. The
    root's stub calls the other units' stubs in the recorded forward order."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: List[nn.Module] = []  # a plain list: not submodules

    def forward(self) -> None:
        for m in self.calls:
            m()


class _GradOf:
    """All Stage3Runtime.on_grad reads of a param: its `.grad` (which it sets to None)."""

    def __init__(self, grad: torch.Tensor) -> None:
        self.grad = grad


def _stage3_replay(spec: ModelSpec, dtype, world_size: int, rank: int, reduce_dtype,
                   idx=None, node=None, keep_bytes: float = 0, aligns=None,
                   reads_pieces: bool = False):
    """Stage 3 through zerokern's own ShardedFlat and Stage3Runtime on meta tensors.

    One forward (the recorded unit calls, so Stage3Runtime derives its reduce-scatter order as in
    a run) and one backward (on_grad in the recorded grad order, then end_backward). Returns
    (the flats, bytes of the staging pool it holds after, Stage3Runtime.live_bound(), bytes of
    hpZ's secondary copies: node = (node size, rank in it), None without hpZ). aligns: each
    param group's slot alignment (rules.slot_align; None: 1).
    """
    from zerokern.stage3 import ShardedFlat, Stage3Runtime, Unit

    params = [nn.Parameter(torch.empty(s, device="meta")) for s in spec.shapes]
    stubs = [_Stub() for _ in spec.units]
    units = [Unit(i, u.name, stubs[i], [params[j] for j in u.params], set(u.deps))
             for i, u in enumerate(spec.units)]
    # one flat per (unit, param group) with params, in build_stage3's order; idx: the param
    # groups' indices into spec.shapes (None: one group)
    group_of = {j: gi for gi, ix in enumerate(idx or [range(len(spec.shapes))]) for j in ix}
    n_groups = len(idx) if idx else 1
    members = [(u, gi, [j for j in us.params if group_of[j] == gi])
               for u, us in zip(units, spec.units) for gi in range(n_groups)]
    members = [(u, gi, js) for u, gi, js in members if js]
    flats = [ShardedFlat([params[j] for j in js], dtype, world_size, rank, gi, u.index,
                         slot_align=aligns[gi] if aligns else 1)
             for u, gi, js in members]
    frozen = [ShardedFlat([nn.Parameter(torch.empty(s, device="meta"), requires_grad=False)
                           for s in us.frozen], dtype, world_size, rank, -1, i, trainable=False)
              for i, us in enumerate(spec.units) if us.frozen]
    where = {j: (fi, slot) for fi, (_, _, js) in enumerate(members)
             for slot, j in enumerate(js)}
    sync = Stage3Runtime(flats, units, _InstantComm(world_size, rank, node, reads_pieces),
                         reduce_dtype,
                         stubs[0], frozen, keep_bytes)
    try:
        stubs[0].calls = [stubs[i] for i in spec.fwd_units]
        stubs[0]()
        # hpZ: the secondaries the forward kept (a run's backward frees the root while in
        # backward, which keeps none; this replay has no autograd to do that)
        secondary = sum(t.numel() * t.element_size() for t in sync.held().get("hpz", []))
        # The backward cursor moves as in a run (a unit's output hook fires before its params'
        # grads): it opens the reduce-scatter windows ([Note: stage-3 collective order], 4).
        sync.replay_output_grad(units[0])
        reached = {0}
        for j in spec.grad_order:
            fi, slot = where[j]
            ui = flats[fi].unit_index
            if ui not in reached:
                reached.add(ui)
                sync.replay_output_grad(units[ui])
            sync.on_grad(fi, slot, _GradOf(torch.empty(spec.shapes[j], dtype=dtype,
                                                       device="meta")))
        sync.end_backward()
        staging = sum(t.untyped_storage().nbytes() for t in sync.held()["buckets"])
        return flats, frozen, staging, sync.live_bound(), secondary
    finally:
        sync.detach()


def _add(b: dict, host: dict, disk: dict, part: dict) -> None:
    """Add a placement's layout_bytes / fixed_bytes (device, host, disk) into the totals."""
    for into, key in ((b, "device"), (host, "host"), (disk, "disk")):
        for cat, n in (part[key] or {}).items():
            into[cat] = into.get(cat, 0) + n


def _check(world_size, stage, precision, bucket_mb, offload, rank, comm) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    check_stage(stage)
    check_precision(precision)
    if not (isinstance(bucket_mb, (int, float)) and bucket_mb > 0):
        raise ValueError(f"bucket_mb must be a number > 0, got {bucket_mb!r}")
    check_offload(offload, stage)  # as ZeroAdamW
    if not (isinstance(rank, int) and 0 <= rank < world_size):
        raise ValueError(f"rank must be an int in [0, world_size), got {rank!r}")
    if comm not in COMMS:
        raise ValueError(f"comm must be one of {COMMS}, got {comm!r}")


def _param_groups(spec: ModelSpec, rule, offload, master):
    """The optimizer's param groups (indices into spec.shapes) and their rules: one group, or
    for "muon" ZeroMuon's default split (optimizer_muon.py [Note: which params Muon takes]):
    the matrices (Muon), then the rest (AdamW)."""
    from zerokern.rules.adamw import ADAMW
    from zerokern.rules.muon import MUON

    if rule is not MUON:
        return [list(range(len(spec.shapes)))], [rule]
    if not spec.matrices:
        raise ValueError("optimizer='muon' needs a model (--model): which params take Muon "
                         "depends on their shapes and modules, which --params does not give")
    mats = [j for j, m in enumerate(spec.matrices) if m]
    rest = [j for j, m in enumerate(spec.matrices) if not m]
    pairs = [(ix, r) for ix, r in ((mats, MUON), (rest, ADAMW)) if ix]
    return [ix for ix, _ in pairs], [r for _, r in pairs]


def estimate(spec: ModelSpec, world_size: int, stage: int, precision: str = "bf16",
             bucket_mb: float = 25.0, offload: Optional[str] = None, rank: int = 0,
             comm: str = "nccl", offload_params: Optional[str] = None,
             master: str = "fp32", optimizer="adamw", mesh=None,
             hpz: bool = False, keep_for_backward_mb: float = 0.0) -> Dict[str, Any]:
    """Bytes per rank per category for zerokern at `stage`, with both formulas beside them.

    Args:
        spec: from `spec_from_model` or `spec_from_numel`.
        world_size, stage, precision, bucket_mb, offload: as ZeroAdamW (N ranks); offload
            "cpu" needs stage 1-3, as ZeroAdamW.
        rank: the rank to report. Totals are the same on every rank; the split between real
            elements and `padding` is not (padding sits at the end of the last bucket, so rank
            0 holds the most real elements).
        comm: "nccl" or "gloo" (offload's host buffers are pinned for NCCL only).
        offload_params: stage 3: None, "cpu" or "nvme", as ZeroAdamW (the param and frozen
            shards leave the device for the host or the disk; zerokern.stage3.param_offload).
        master: "fp32" or "compact", as ZeroAdamW (bf16, no offload, stages 0-2): the master
            held is 2 bytes per state element (padding 2 bytes too) and a tie bitmap of
            state/8 bytes (zerokern.compact_master).
        optimizer: "adamw" (ZeroAdamW), "lion" (ZeroLion), "muon" (ZeroMuon built from the
            model: its default split, Muon for the matrices and AdamW for the rest, two param
            groups; needs a model spec) or a zerokern.rules.Rule: its state list gives the
            optimizer categories (K = 12, 8, 8 / 12 bytes/param with the master).
        mesh: None, or (R, S): ZeroAdamW(mesh=) a 2-D (replicate, shard) mesh with
            R * S = world_size; [Note: per-rank bytes on a mesh] in memory/mesh.py.
        hpz: stage 3 with a mesh: ZeroAdamW(hpz=True); adds `hpz_secondary`.
        keep_for_backward_mb: stage 3: as ZeroAdamW; the kept units raise
            `live_units_bound`.

    Returns a dict: `bytes` (category -> bytes on the device; equal to
    `memory_report()["measured"]` after a training step), `device_total`, `host` (with offload:
    equal to `memory_report()["host_measured"]`, else zeros), `host_total`,
    `live_units_bound` (stage 3: `memory_report()["live_units_bound"]`, the most full-unit
    bytes a step gathers at once; else None), `formula` (DESIGN §4, `estimate_memory`),
    `deepspeed` (K = 12), `exact` (False only where a staging pool depends on a grad order that
    had to be guessed), and notes.
    """
    _check(world_size, stage, precision, bucket_mb, offload, rank, comm)
    check_keep_for_backward(keep_for_backward_mb, stage)  # as ZeroAdamW
    from zerokern.memory.mesh import mesh_dims

    dims = mesh_dims(mesh, hpz, world_size, stage, offload_params)  # ValueError naming mesh
    # the layout's sharding: over S (HSDP) or every rank (hpZ); rank = its rank there
    world_size, rank, global_rank = dims["shard"], rank % dims["shard"], rank
    node = (dims["hpz"], rank % dims["hpz"]) if hpz else None
    from zerokern.stage3 import param_offload as PO

    PO.check_args(offload_params, stage, offload)
    check_master(master, precision, offload, stage)
    rule = rule_by_name(optimizer)
    idx, rules = _param_groups(spec, rule, offload, master)
    from zerokern.options.args import check_rule_support

    check_rule_support(rules, offload, master)  # as the optimizer (zerokern.rules [Note:
    # what a rule supports])
    rule = combine(rules)  # the categories: the union of the groups' states
    dtype = check_precision(precision)
    P = pattern(stage)  # what the stage keeps (stages.py)
    e = dtype.itemsize
    r = e  # reduce dtype: the precision's (ZeroAdamW's default)
    b = dict.fromkeys(categories(rule), 0)
    host = dict.fromkeys(host_categories(rule), 0)
    disk = dict.fromkeys(("master", *rule.state_names), 0)
    place = placement_class(offload)
    rdt = dtype  # the reduce dtype: the precision's (ZeroAdamW's default)
    live_bound = None
    notes = []
    # gloo: the ranks on one host, the shared-memory exchange reads stages 2-3's grads where
    # autograd left them (comm/pieces.py [Note: grads read where they lie]): no staging buffer
    in_place = comm == "gloo" and world_size > 1 and P.shards_grads
    if in_place:
        notes.append("gloo on one host: stages 2-3 read their grads in place through shared "
                     "memory, no staging buckets (gloo over TCP, ZEROKERN_SHM=0 or a full "
                     "/dev/shm: the staging buckets of an nccl estimate)")
    if not P.shards_params:
        groups = [_meta_group(spec, ix, dtype, world_size, rank, P, bucket_mb * 2**20,
                              slot_align(r)) for ix, r in zip(idx, rules)]
        layouts = [g.layout for g in groups]
        layout_rules = rules
        for L in layouts:
            b["params"] += (L.padded_numel - L.padding) * e
            b["padding"] += L.padding * e
            if not P.shards_grads:  # FullGrads: a full grad buffer in the model dtype
                b["grads"] += (L.padded_numel - L.padding) * e
                b["padding"] += L.padding * e
        if P.shards_grads:  # BucketedGrads: staging buffers (the grad shard is counted below)
            b["buckets"] = _staging_bytes(spec, groups, idx, dtype, in_place)
            if spec.order_source != _ONE_PARAM:  # a model: say where its grad order came from
                notes.append(f"stage-2 staging buckets replay the grad order of "
                             f"{spec.order_source}")
    else:
        flats, frozen, b["buckets"], live_bound, secondary = _stage3_replay(
            spec, dtype, world_size, rank, dtype, idx, node, keep_for_backward_mb * 2**20,
            [slot_align(r) for r in rules], in_place)
        if hpz:
            b["hpz_secondary"] = secondary
        layouts = [f.layout for f in flats]
        layout_rules = [rules[f.group_index] for f in flats]
        for f in frozen:  # frozen shards: this rank's piece, cast to the precision
            spad = P.state_padding(f.layout, rank)
            b["frozen"] += (f.layout.shard_numel - spad) * e
            b["padding"] += spad * e
        if spec.order_source == _ONE_PARAM:
            notes.append("stage 3 with --params: one param in the root unit, gathered whole, "
                         "with a staging buffer of its full size; give --model for per-block "
                         "units")
        else:
            notes.append(f"stage 3: {len(flats)} units with params ({spec.unit_policy} unit "
                         f"policy), one buffer each, padded to N*128 elements; the staging "
                         f"pool replays Stage3Runtime over the forward and grad order of "
                         f"{spec.order_source}")
        notes.append("live units (bound): full units gathered at once in a step (root and "
                     "its ties + the two largest other units"
                     + (", or + the units kept for the backward and one more"
                        if keep_for_backward_mb else "")
                     + "); 0 between steps, so not in the device total")
    for L, lrule in zip(layouts, layout_rules):
        # Sharded per-rank state (stages 1-3; the whole buffer at stage 0): this rank's pieces.
        state = P.state_numel(L)
        spad = P.state_padding(L, rank)
        if P.shards_params:  # the resident param shard
            b["params"] += (state - spad) * e
            b["padding"] += spad * e
        if P.shards_grads:  # the grad shard, in the reduce dtype
            b["grads"] += (state - spad) * r
            b["padding"] += spad * r
        # the optimizer state: what the placement says it holds for this layout
        _add(b, host, disk, place.layout_bytes(lrule, state, spad, dtype, rdt, master))
        # per-matrix states: on their owner, where the placement keeps the state (the host
        # with offload; zerokern.rules [Note: state kinds and the owner protocol])
        for name, n in owned_bytes(lrule.matrix_states, L, rank).items():
            (host if offload else b)[name] += n
    if offload_params:  # after a step the device holds no param shard (param_offload.py)
        PO.estimate_(b, host, disk, flats, frozen, rank, offload_params)
        notes.append(PO.NOTES[offload_params])
    _add(b, host, disk, place.fixed_bytes(rule, [P.state_numel(L) for L in layouts], dtype,
                                          rdt))
    if offload == "nvme":
        chunk = pool_chunk([P.state_numel(L) for L in layouts], CHUNK_NUMEL,
                           rules_granule(rules))
        notes.append(f"offload='nvme': master (fp32) and the {rule.name} states on disk (each "
                     "in its dtype, padded to 4096 bytes), two halves each; the "
                     f"host holds an I/O pool of {QUEUE_DEPTH} sets of {chunk} elements and 2 "
                     f"scalars, {'pinned' if comm == 'nccl' else 'pageable'} ({comm})")
    elif offload:
        notes.append("offload='cpu': master (fp32 at every precision), m and v in host memory, "
                     "with pinned staging (grad piece, 16-bit param piece) per buffer and 2 "
                     "scalars; host figures include their padding")
    exact = not P.shards_grads or spec.order_known
    if not exact:
        notes.append("stage 2-3 staging buffers: the grad order was guessed (the model did "
                     "not run on meta), so `buckets` may differ from a run")
    shares: Dict[Any, int] = {}
    for ix, r in zip(idx, rules):
        shares[r] = shares.get(r, 0) + sum(_numel(spec.shapes[j]) for j in ix)
    formula = estimate_memory(spec.num_params, world_size, stage, precision, offload=offload,
                              master=master, optimizer=shares)
    if master == "compact":
        notes.append("master='compact': the fp32 master held as its low 16 bits under the bf16 "
                     "params plus a tie bit per element (2.125 bytes, "
                     "zerokern.state.compact_master); "
                     "reading it between steps expands it (4 bytes more) until the next step")
    if P.shards_params:  # as memory_report(): frozen params' 16-bit shard, Φ·e/N
        formula["frozen"] = int(round(spec.num_frozen * e / world_size))
        formula["total"] += formula["frozen"]
    if offload_params:
        PO.formula_(formula, offload_params)
    if hpz:  # as memory_report(): (Ψ + Φ)·e/n, n the node group's size
        formula["hpz_secondary"] = int(round((spec.num_params + spec.num_frozen) * e /
                                             dims["hpz"]))
        formula["total"] += formula["hpz_secondary"]
    pinned = (offload == "nvme" or offload_params) and comm == "nccl"
    return {
        "model": spec.name, "num_params": spec.num_params, "world_size": world_size,
        "stage": stage, "precision": precision, "bucket_mb": bucket_mb, "offload": offload,
        "offload_params": offload_params, "master": master, "optimizer": rule.name,
        "rank": global_rank, "comm": comm, "exact": exact, "mesh": dims,
        "bytes": b, "device_total": sum(b.values()), "host": host,
        "host_total": sum(host.values()), "live_units_bound": live_bound,
        "host_pinned": sum(host.values()) if pinned else 0,
        "host_pageable": sum(host.values()) if (offload == "nvme" or offload_params)
        and not pinned else 0,
        "disk": disk, "disk_total": sum(disk.values()),
        "formula": formula, "deepspeed": deepspeed_formula(spec.num_params, world_size, stage,
                                                           offload),
        "grad_order": spec.order_source, "notes": notes,
    }


def estimate_pipeline(specs: Sequence[ModelSpec], world_size: int, stage: int,
                      precision: str = "bf16", bucket_mb: float = 25.0,
                      offload: Optional[str] = None, rank: int = 0, comm: str = "nccl",
                      offload_params: Optional[str] = None, master: str = "fp32",
                      optimizer="adamw", mesh=None, hpz: bool = False,
                      keep_for_backward_mb: float = 0.0) -> List[Dict[str, Any]]:
    """Bytes per rank of each pipeline stage: `estimate` of each stage's model over its
    data-parallel group ([Note: per-stage bytes of a pipeline]).

    Args:
        specs: one ModelSpec per pipeline stage, in stage order (`spec_from_model` of each
            stage module; model_spec.load_stage_models for a gpt preset).
        world_size: every rank of the job: pp x dp (x the mesh's R*S for dp).
        rank: the rank to report within each stage's dp group.
        mesh: None, or (R, S): each stage's 2-D data-parallel mesh (R * S = dp).
        stage, precision, bucket_mb, offload, comm, offload_params, master, optimizer, hpz,
            keep_for_backward_mb: as `estimate`.

    Returns:
        One `estimate` result per pipeline stage, each with "pp" ({"stage", "size"}) and
        "roles" (the plan's RoleSizes as a dict: shard, replicate, hpz, tp, pp, dp, world).

    Raises:
        ValueError: no specs, world_size not a multiple of the number of stages, or what
            `estimate` raises.
    """
    from zerokern.comm.plan import role_sizes

    if not specs:
        raise ValueError("specs: one ModelSpec per pipeline stage, got none")
    pp = len(specs)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < pp \
            or world_size % pp:
        raise ValueError(f"world_size must be a multiple of the {pp} pipeline stages (every "
                         f"stage a dp group of the same size), got {world_size!r}")
    dp = world_size // pp
    shape = None if mesh is None else tuple(mesh)
    sizes = role_sizes(shape, hpz, dp, pp=pp)  # the plan's roles (comm/plan.py)
    if sizes.world != world_size:
        raise ValueError(f"mesh {shape} has {sizes.dp} ranks; each of the {pp} stages has "
                         f"{dp} (world_size {world_size})")
    roles = {"shard": sizes.shard, "replicate": sizes.replicate, "hpz": sizes.hpz,
             "tp": sizes.tp, "pp": sizes.pp, "dp": sizes.dp, "world": sizes.world}
    out = []
    for s, spec in enumerate(specs):
        r = estimate(spec, sizes.dp, stage, precision, bucket_mb, offload, rank, comm,
                     offload_params, master, optimizer, mesh, hpz, keep_for_backward_mb)
        r["pp"] = {"stage": s, "size": pp}
        r["roles"] = roles
        out.append(r)
    return out
