"""Model-state memory per rank, measured: `memory_report` sums the storages the optimizer
really holds (so it is a measurement, not the formula restated), beside DESIGN §4's formula
(`formula.estimate_memory`). They agree within the bucket and
padding terms, which the report lists separately.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from zerokern.memory.formula import estimate_memory


def categories(rule) -> tuple:
    """memory_report()["measured"]'s keys for an optimizer with `rule` (zerokern.rules): the
    master and the rule's states by name between the buffers and the transient ones.
    frozen: stage 3's shards of the requires_grad=False params (sharded with their unit, no
    optimizer state); 0 at stages 0-2, where frozen params are the model's own tensors."""
    return ("params", "frozen", "grads", "buckets", "master", *rule.state_names,
            *(s.name for s in rule.matrix_states), "live_units", "padding")


def _buffers(opt):
    """(category, tensor, padding elements in it) for every buffer the optimizer holds on the
    device. Each buffer says what it holds (ShardBuffer.device_buffers: its params, and the
    master and rule states where its placement keeps them on the device); the grads are
    grad_sync's."""
    held = opt.grad_sync.held()
    for gi, g in enumerate(opt.flat_groups):
        yield from g.device_buffers()
        if held["grads"]:  # (none between steps with free_grads=True)
            grads = held["grads"][gi]
            L = g.layout
            yield "grads", grads, (L.padding if grads.numel() == L.padded_numel
                                   else g.state_padding)
    for f in getattr(opt.grad_sync, "frozen", ()):  # stage 3: frozen shards, gathered units
        yield from f.device_buffers()
    for t in held.get("buckets", []):
        yield "buckets", t, 0
    for t in held.get("hpz", []):  # stage3/hpz.py: padding included (E/n per buffer)
        yield "hpz_secondary", t, 0


def _matrix_bytes(opt) -> Dict[str, int]:
    """Bytes per per-matrix state name this rank holds (zerokern.rules [Note: state kinds and
    the owner protocol]; rules/matrix_states.py)."""
    out: Dict[str, int] = {}
    for plan in getattr(opt, "_plans", {}).values():
        st = getattr(plan, "states", None)
        if st is not None:
            for name, n in st.bytes_by_name().items():
                out[name] = out.get(name, 0) + n
    return out


def _rule_shares(opt):
    """The optimizer's rule, or {rule: its params} with a rule per param group."""
    rules = getattr(opt, "rules", None)
    if rules is None or all(r is opt.rule for r in rules):
        return opt.rule
    out: Dict[Any, int] = {}
    for g in opt.flat_groups:
        r = rules[g.group_index]
        out[r] = out.get(r, 0) + g.layout.numel
    return out


def _param_format(opt):
    """The optimizer's `param_format=` from its codec (kernels/param_codec.py)."""
    d = getattr(opt, "decision", None)
    codec = getattr(d, "param_codec", None)
    return "fp8" if codec is not None and codec.scaled else None


def memory_report(opt) -> Dict[str, Any]:
    """Measured bytes per category for a zerokern optimizer, the formula, and the allowed slack.

    Each category counts the storage bytes of the buffers really held, less their padding,
    which is reported on its own line; measured_total is the sum of all of them.
    Stage 3 adds peak_live_units (the most full-unit bytes gathered at once so far) and
    live_units_bound (root + its dependencies + the two largest other units: the running one
    and the prefetched one), and peak_live_units <= live_units_bound. comm_buffers: this
    rank's shared-memory segments for CPU collectives between ranks on one host
    (comm/shm.py; 8 MiB per process group once used), not a model state.
    activations (with activation_checkpointing): the units' activation rows, apart from the
    model states: checkpoints_held / checkpoints_peak (checkpoints whose recompute is still
    to come), saved_bytes / saved_peak (bytes the units hold for backward: checkpointed
    inputs, kept outputs, host copies; unique storages), host_bytes / host_peak ("offload").

    allowed_slack = staging buckets + gathered stage-3 units (live_units, 0 between steps)
    + each buffer's whole padding (< N*128 elements, DESIGN §4).
    The whole padding, not this rank's share: padding sits in the last bucket, so the ranks that
    hold less of it hold more real elements than Ψ/N, by up to the buffer's padding / N.
    """
    meas = dict.fromkeys(categories(opt.rule), 0)
    if opt.comm.hpz is not None:  # hpZ's secondary param copies (stage3/hpz.py)
        meas["hpz_secondary"] = 0
    seen = set()
    pad_bound = 0
    for g in opt.flat_groups:
        # params, grads, and the master and states where the placement keeps them on the device
        n_bufs = 2 + len(g.state.device_tensors())
        pad_bound += g.layout.padding * 4 * n_bufs  # 4 B: the widest element
    frozen = getattr(opt.grad_sync, "frozen", ())
    pad_bound += sum(f.layout.padding * 4 for f in frozen)
    for cat, t, pad in _buffers(opt):
        st = t.untyped_storage()
        if st.nbytes() == 0 or st.data_ptr() in seen:  # (a freed stage-3 unit holds 0 B)
            continue
        seen.add(st.data_ptr())
        pad_bytes = pad * t.element_size()
        meas[cat] += st.nbytes() - pad_bytes
        meas["padding"] += pad_bytes
    matrix = _matrix_bytes(opt)  # per-matrix states, on their owners
    if opt.offload is None:  # where the placement keeps the state
        for name, n in matrix.items():
            meas[name] += n
    psi = sum(g.layout.numel for g in opt.flat_groups)
    reduce_bytes = torch.empty((), dtype=opt.reduce_dtype).element_size()
    formula = estimate_memory(psi, opt.comm.shard.world_size, opt.stage, opt.precision,
                              offload=opt.offload, reduce_bytes=reduce_bytes,
                              master=getattr(opt, "master", "fp32"),
                              optimizer=_rule_shares(opt),
                              param_format=_param_format(opt))
    # Frozen params at stage 3 (not in the DESIGN §4 table, which counts trainable Ψ): their
    # 16-bit shard, Φ·e/N for Φ frozen elements.
    frozen_numel = sum(f.layout.numel for f in frozen)
    formula["frozen"] = int(round(frozen_numel * torch.empty((), dtype=opt.dtype)
                                  .element_size() / opt.comm.shard.world_size))
    formula["total"] += formula["frozen"]
    if opt.comm.hpz is not None:  # hpZ's secondary: (Ψ + Φ)·e/n, n the node group's size
        formula["hpz_secondary"] = int(round((psi + frozen_numel) * torch.empty(
            (), dtype=opt.dtype).element_size() / opt.comm.hpz.world_size))
        formula["total"] += formula["hpz_secondary"]
    out = {}
    place = opt.placement  # where the state lives: it says what it holds off the device
    host = place.host_bytes()
    if host is not None:  # host memory, apart from the device's
        for name, n in matrix.items():
            host[name] = host.get(name, 0) + n
        out["host_measured"] = host
        out["host_measured_total"] = sum(host.values())
        out["host_formula_total"] = formula["host"]
    disk = place.disk_bytes()
    if disk is not None:  # offload="nvme": host pinned / pageable, and disk, apart
        pinned = place.pin
        out["host_pinned_total"] = out["host_measured_total"] if pinned else 0
        out["host_pageable_total"] = 0 if pinned else out["host_measured_total"]
        out["disk_measured"] = disk
        out["disk_measured_total"] = sum(disk.values())
        out["disk_formula_total"] = formula["disk"]
    if getattr(opt, "param_homes", None) is not None:  # host / disk homes of the shards
        out.setdefault("host_measured", dict.fromkeys(("master", *opt.rule.state_names,
                                                       "host_staging"), 0))
        opt.param_homes.report(out, formula)
    # Transport buffers, not model states (as NCCL's own are not): this rank's shared-memory
    # segments for same-host CPU collectives (comm/shm.py), set up at the first collective.
    # Stage 3's reduce-scatter Comm shares the world (and replicate) group with opt.comm:
    # each group once.
    comms = [opt.comm, getattr(opt.grad_sync, "rs_comm", opt.comm)]
    rings = {id(gc.ring): gc.ring for c in comms for gc in c.group_comms()
             if gc.ring is not None}  # one per process group ([Note: one ring per process group])
    out["comm_buffers"] = sum(ring.shm_bytes for ring in rings.values())
    acts = getattr(opt, "activations", None)
    if acts is not None:  # activation_checkpointing: what the units hold for backward
        out["activations"] = acts.report()  # ([Note: what the activation rows count])
    if opt.pattern.shards_params:  # stage 3: units gathered in a step
        sync = opt.grad_sync
        out.update(peak_live_units=sync.peak_live_bytes, live_units_bound=sync.live_bound())
    return {"measured": meas, "measured_total": sum(meas.values()), "formula": formula,
            "formula_total": formula["total"],
            "allowed_slack": meas["buckets"] + meas["live_units"] + pad_bound, **out,
            "num_params": psi, "num_frozen": frozen_numel,
            # the sharding factor is the shard group's size; replicas hold the same bytes
            "world_size": opt.comm.shard.world_size, "mesh": opt.comm.dims, "stage": opt.stage,
            "precision": opt.precision}
