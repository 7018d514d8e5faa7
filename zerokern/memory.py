"""Model-state memory per rank: measured from the buffers held, and the DESIGN §4 formula.

`memory_report` sums the storages the optimizer really holds (so it is a measurement, not the
formula restated); `estimate_memory` is the formula. They agree within the bucket and padding
terms, which the report lists separately.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from .optimizer_args import OFFLOADS, check_stage, elem_size

# frozen: stage 3's shards of the requires_grad=False params (sharded with their unit, no
# optimizer state); 0 at stages 0-2, where frozen params are the model's own tensors.
_CATS = ("params", "frozen", "grads", "buckets", "master", "exp_avg", "exp_avg_sq",
         "live_units", "padding")


def estimate_memory(num_params: int, world_size: int, stage: int, precision: str = "bf16",
                    offload: Optional[str] = None, reduce_bytes: Optional[int] = None
                    ) -> Dict[str, int]:
    """DESIGN §4 bytes per rank for `num_params` (Ψ) params over `world_size` (N) ranks.

    Returns params, grads, master, exp_avg, exp_avg_sq, optimizer (their sum), total; with
    offload="cpu" the optimizer column is reported as host bytes and left out of `total`; with
    offload="nvme" it is reported as `disk` bytes, twice (offload_nvme's two halves: a step
    writes the half it does not read), and `host` is 0 (the bounded I/O pool is not a term).
    """
    if not isinstance(num_params, int) or num_params < 1:
        raise ValueError(f"num_params must be a positive int, got {num_params!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    check_stage(stage)
    e = elem_size(precision)
    if offload not in OFFLOADS:  # (the formula also answers "what would stage 0 offload")
        raise ValueError(f"offload must be None, 'cpu' or 'nvme', got {offload!r}")
    psi, n = num_params, world_size
    g = reduce_bytes or e
    state = psi if stage == 0 else psi / n
    out = {
        "params": e * (psi / n if stage == 3 else psi),
        "grads": g * psi if stage <= 1 else g * psi / n,
        # offload keeps an fp32 master on the host at every precision (the device params
        # are only the working copy); without offload fp32 params are the master
        "master": 0 if precision == "fp32" and not offload else 4 * state,
        "exp_avg": 4 * state,
        "exp_avg_sq": 4 * state,
    }
    out["optimizer"] = out["master"] + out["exp_avg"] + out["exp_avg_sq"]
    out = {k: int(round(v)) for k, v in out.items()}
    out["total"] = out["params"] + out["grads"] + (0 if offload else out["optimizer"])
    out["host"] = out["optimizer"] if offload == "cpu" else 0
    out["disk"] = 2 * out["optimizer"] if offload == "nvme" else 0
    return out


def _pad_in_range(lo: int, hi: int, numel: int) -> int:
    """Padding elements (index >= numel) inside flat range [lo, hi)."""
    return max(0, hi - max(lo, numel))


def _buffers(opt):
    """(category, tensor, padding elements in it) for every buffer the optimizer holds."""
    held = opt.grad_sync.held()
    for gi, g in enumerate(opt.flat_groups):
        L = g.layout
        state_ranges = [L.bucket_range(k) if opt.stage == 0 else L.piece_range(k, opt.comm.rank)
                        for k in range(L.n_buckets)]
        state_pad = sum(_pad_in_range(lo, hi, L.numel) for lo, hi in state_ranges)
        if opt.stage == 3:  # the resident shard, and the full unit while it is gathered
            yield "params", g.flat, state_pad
            yield "live_units", g.full, L.padding
        else:
            yield "params", g.flat, L.padding
        for cat, t in (("master", g.master), ("exp_avg", g.exp_avg),
                       ("exp_avg_sq", g.exp_avg_sq)):
            if t is not None and opt.offloader is None:  # offloaded: host bytes, apart
                yield cat, t, state_pad
        grads = held["grads"][gi]
        yield "grads", grads, (L.padding if grads.numel() == L.padded_numel else state_pad)
    for f in getattr(opt.grad_sync, "frozen", ()):  # stage 3: frozen shards, gathered units
        L = f.layout
        yield "frozen", f.flat, _pad_in_range(*L.piece_range(0, opt.comm.rank), L.numel)
        yield "live_units", f.full, L.padding
    for t in held.get("buckets", []):
        yield "buckets", t, 0
    ring = getattr(opt.comm, "ring", None)
    if ring is not None and ring._scratch is not None:  # gloo ring work buffer (a bucket)
        yield "buckets", ring._scratch, 0


def memory_report(opt) -> Dict[str, Any]:
    """Measured bytes per category for a ZeroAdamW, the formula, and the allowed slack.

    Each category counts the storage bytes of the buffers really held, less their padding,
    which is reported on its own line; measured_total is the sum of all of them.
    Stage 3 adds peak_live_units (the most full-unit bytes gathered at once so far) and
    live_units_bound (root + its dependencies + the two largest other units: the running one
    and the prefetched one), and peak_live_units <= live_units_bound.

    allowed_slack = staging buckets + gathered stage-3 units (live_units, 0 between steps)
    + each buffer's whole padding (< N*128 elements, DESIGN §4).
    The whole padding, not this rank's share: padding sits in the last bucket, so the ranks that
    hold less of it hold more real elements than Ψ/N, by up to the buffer's padding / N.
    """
    meas = dict.fromkeys(_CATS, 0)
    seen = set()
    pad_bound = 0
    for g in opt.flat_groups:
        n_bufs = 4 + (g.master is not None)  # params, grads, exp_avg, exp_avg_sq (+ master)
        if opt.offloader is not None:
            n_bufs = 2  # master, exp_avg, exp_avg_sq are host bytes, not in this total
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
    psi = sum(g.layout.numel for g in opt.flat_groups)
    reduce_bytes = torch.empty((), dtype=opt.reduce_dtype).element_size()
    formula = estimate_memory(psi, opt.comm.world_size, opt.stage, opt.precision,
                              offload=opt.offload, reduce_bytes=reduce_bytes)
    # Frozen params at stage 3 (not in the DESIGN §4 table, which counts trainable Ψ): their
    # 16-bit shard, Φ·e/N for Φ frozen elements.
    frozen_numel = sum(f.layout.numel for f in frozen)
    formula["frozen"] = int(round(frozen_numel * torch.empty((), dtype=opt.dtype)
                                  .element_size() / opt.comm.world_size))
    formula["total"] += formula["frozen"]
    out = {}
    if opt.offloader is not None:  # host memory, apart from the device's
        host = opt.offloader.host_bytes()
        out["host_measured"] = host
        out["host_measured_total"] = sum(host.values())
        out["host_formula_total"] = formula["host"]
        disk = getattr(opt.offloader, "disk_bytes", None)
        if disk is not None:  # offload="nvme": host pinned / pageable, and disk, apart
            pinned = opt.offloader.pin
            out["host_pinned_total"] = out["host_measured_total"] if pinned else 0
            out["host_pageable_total"] = 0 if pinned else out["host_measured_total"]
            out["disk_measured"] = disk()
            out["disk_measured_total"] = sum(out["disk_measured"].values())
            out["disk_formula_total"] = formula["disk"]
    if opt.stage == 3:
        sync = opt.grad_sync
        out.update(peak_live_units=sync.peak_live_bytes, live_units_bound=sync.live_bound())
    return {"measured": meas, "measured_total": sum(meas.values()), "formula": formula,
            "formula_total": formula["total"],
            "allowed_slack": meas["buckets"] + meas["live_units"] + pad_bound, **out,
            "num_params": psi, "num_frozen": frozen_numel,
            "world_size": opt.comm.world_size, "stage": opt.stage,
            "precision": opt.precision}
