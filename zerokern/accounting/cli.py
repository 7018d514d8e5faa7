"""`zerokern estimate`: the command line and the table over `zerokern.accounting.estimate.estimate`.

The estimator itself (zerokern's buffers built on `meta`, byte for byte what
`opt.memory_report()` will measure) is `estimate.py`; this module parses the arguments,
loads the model spec and renders one column per stage, or JSON.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

from zerokern.accounting.estimate import COMMS, estimate, estimate_pipeline
from zerokern.accounting.model_spec import (
    load_model,
    load_stage_models,
    spec_from_model,
    spec_from_numel,
)
from zerokern.memory.mesh import mesh_lines
from zerokern.options.args import PRECISIONS


def _count(text: str) -> int:
    """--params: an integer count, also written as 7e9 or 1.3e9 (must be whole)."""
    import argparse

    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of parameters, got {text!r}") \
            from None
    if not (v >= 1 and v == int(v)) or v > 2**62:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text}")
    return int(v)


def add_arguments(p) -> None:
    from zerokern.tools.argtypes import int_at_least, mesh_shape, mib_or_inf, positive_float

    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=_count, metavar="N",
                      help="parameter count (e.g. 7e9): one flat buffer of N elements")
    what.add_argument("--model", metavar="SPEC",
                      help="a zerokern.tools.gpt preset (tiny, small, 20m, 100m), a factory "
                           "module:function, or a Hugging Face config (JSON, config.json path, "
                           "directory, or hub name); built on the meta device")
    p.add_argument("--world-size", type=int_at_least(1), default=1, metavar="N",
                   help="ranks (default 1)")
    p.add_argument("--stage", type=int, choices=[0, 1, 2, 3], action="append",
                   help="stage(s) to show (repeatable; default all of 0-3)")
    p.add_argument("--precision", choices=list(PRECISIONS), default="bf16")
    p.add_argument("--offload", choices=["none", "cpu", "nvme"], default="none")
    p.add_argument("--offload-params", choices=["none", "cpu", "nvme"], default="none",
                   help="stage 3: where the param shards live between uses (nvme needs "
                        "--offload nvme)")
    p.add_argument("--master", choices=["fp32", "compact"], default="fp32",
                   help="ZeroAdamW's master=: 'compact' holds the bf16 run's fp32 master in "
                        "2.125 bytes per element (bf16, no offload, stages 0-2)")
    p.add_argument("--optimizer", choices=["adamw", "adamw8bit", "lion", "muon", "adafactor"],
                   default="adamw",
                   help="the optimizer rule: adamw (ZeroAdamW: master, m, v; K = 12), "
                        "adamw8bit (ZeroAdamW(state_bits=8): master, 8-bit m and v, per-128 "
                        "scales; K = 6.0625), lion (ZeroLion: master, one momentum; K = 8), "
                        "muon (ZeroMuon: Muon's momentum for the matrices, K = 8, AdamW for "
                        "the rest; needs --model) or adafactor (ZeroAdafactor: master, K = 4, "
                        "plus rows + cols + 1 fp32 per matrix on its owner rank, n + 1 per "
                        "1-D param of n)")
    p.add_argument("--bucket-mb", type=positive_float, default=25.0,
                   help="ZeroAdamW bucket_mb (default 25)")
    p.add_argument("--rank", type=int, default=0,
                   help="rank to report (totals are equal on all ranks; default 0)")
    p.add_argument("--comm", choices=list(COMMS), default="nccl",
                   help="collective backend: offload's host buffers are pinned for nccl "
                        "only (default nccl)")
    p.add_argument("--mesh", type=mesh_shape, default=None, metavar="RxS",
                   help="a 2-D (replicate, shard) data-parallel mesh of R*S ranks (HSDP: "
                        "sharded over S, replicated over R); sets --world-size")
    p.add_argument("--pp", type=int_at_least(1), default=1, metavar="P",
                   help="pipeline stages: --model (a gpt preset) split into P stages by layers "
                        "(embeddings on the first, head on the last); bytes per stage, each "
                        "stage a dp group of --world-size / P ranks (--mesh RxS: each "
                        "stage's dp mesh, world P*R*S)")
    p.add_argument("--hpz", action="store_true",
                   help="with --mesh at stage 3: ZeRO++'s hpZ (sharded over all ranks plus a "
                        "secondary copy over S)")
    p.add_argument("--keep-for-backward-mb", type=mib_or_inf, default=0.0, metavar="MIB",
                   help="stage 3: ZeroAdamW keep_for_backward_mb, MiB of units a forward "
                        "leaves gathered for the backward (inf: every unit; default 0)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    act = p.add_argument_group("activations (ZeRO-R; need --model, --batch and --seq)")
    act.add_argument("--batch", type=int_at_least(1), default=None, metavar="B",
                     help="micro-batch per rank: adds the activations of one B x S forward")
    act.add_argument("--seq", type=int_at_least(1), default=None, metavar="S",
                     help="sequence length of the micro-batch")
    act.add_argument("--activation-checkpointing",
                     choices=["none", "full", "selective", "offload"], default="none",
                     help="ZeroAdamW activation_checkpointing= on the model's units (default "
                          "none)")
    act.add_argument("--tp", type=int_at_least(1), default=1, metavar="T",
                     help="tensor-parallel degree: activations inside the units / T "
                          "(Megatron with sequence parallelism; not measured here)")
    act.add_argument("--partition-activations", action="store_true",
                     help="DeepSpeed's partition_activations: the checkpointed inputs split "
                          "over the --tp ranks")
    act.add_argument("--cpu-checkpointing", action="store_true",
                     help="DeepSpeed's cpu_checkpointing: the checkpointed inputs in host "
                          "memory")


def human_bytes(n: Optional[float]) -> str:
    if n is None:
        return "n/a"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _state_rows(r0, prefix: str, suffix: str = "", matrix: bool = True):
    """One row per optimizer state of the estimate's rule (zerokern.rules), master first, then
    (matrix) its per-matrix states, held on each param's owner rank."""
    from zerokern.rules.registry import rule_by_name

    # a rule per param group (ZeroMuon) is named "muon+adamw": the union of their states
    kinds = {"master": "fp32"}
    for part in r0.get("optimizer", "adamw").split("+"):
        for s in rule_by_name(part).states:
            kinds.setdefault(s.name, ("uint8" if s.dtype.itemsize == 1 else "fp32")
                             + (f", 1 per {s.block}" if s.block > 1 else ""))
        for s in rule_by_name(part).matrix_states if matrix else ():
            kinds.setdefault(s.name, "fp32, per matrix, on its owner")
    return [(n, f"{prefix}{n} ({kinds[n]}{suffix})") for n in kinds]


def _rows(r0):
    return [("params", "params"), ("frozen", "frozen params (stage 3 shard)"),
            ("live_units", "live units (bound, in a step)"), ("grads", "grads"),
            ("buckets", "buckets"), *_state_rows(r0, "optimizer: "), ("padding", "padding")]


def _host_rows(r0):
    return _state_rows(r0, "host: ") + [("host_staging", "host: staging")]


# ZeroAdamW's rows (the default --optimizer)
_ROWS = _rows({})
_HOST_ROWS = _host_rows({})
_PARAM_HOST_ROWS = [("params", "host: param shards"), ("frozen", "host: frozen shards"),
                    ("param_staging", "host: param I/O buffers")]
_PARAM_DISK_ROWS = [("params", "disk: param shards (2 halves)"),
                    ("frozen", "disk: frozen shards")]


def _world_text(r0) -> str:
    d = r0.get("mesh")
    if d is None or (d["replicate"] == 1 and "hpz" not in d):
        return f"world size {r0['world_size']}"
    if "hpz" in d:
        return f"mesh {d['world'] // d['hpz']}x{d['hpz']} with hpZ ({d['world']} ranks)"
    return f"mesh {d['replicate']}x{d['shard']} ({d['world']} ranks)"


def format_table(results: List[Dict[str, Any]], pipeline: bool = False) -> str:
    """The human-readable table: one column per ZeRO stage, or with `pipeline` (the results
    of one ZeRO stage, `estimate_pipeline`) one column per pipeline stage."""
    r0 = results[0]
    what = f"{r0['num_params']:,} params" if r0["model"] == "--params" else \
        f"{r0['model']} ({r0['num_params']:,} params)"
    if pipeline:
        n = sum(r["num_params"] for r in results)
        what = (f"{r0['model'].rsplit(', pipeline stage', 1)[0]} in {len(results)} pipeline "
                f"stages ({n:,} params), ZeRO stage {r0['stage']} over each stage's dp group")
    where = _world_text(r0)
    if pipeline:
        ro = r0["roles"]
        where = (f"{ro['pp']} stages x {where.replace('world size', 'dp')} per stage "
                 f"({ro['world']} ranks)")
    head = (f"zerokern estimate: {what}, "
            + where + f", {r0['precision']}, bucket {r0['bucket_mb']:g} MiB, "
            f"offload {r0['offload'] or 'none'}"
            + (f", offload_params {r0['offload_params']}" if r0.get("offload_params") else "")
            + f", optimizer {r0.get('optimizer', 'adamw')}"
            + f", comm {r0['comm']}; bytes on rank {r0['rank']}")
    cols = [(f"pp {r['pp']['stage']}" if pipeline else f"stage {r['stage']}")
            + ("" if r["exact"] else " *") for r in results]
    table = []
    if pipeline:
        table.append(("params (count)", [f"{r['num_params']:,}" for r in results]))
    for key, label in _rows(r0):
        if key == "master" and r0.get("master") == "compact":
            label = "optimizer: master (compact)"
        if key == "live_units":  # the bound; the measured category is 0 between steps
            cells = [human_bytes(r["live_units_bound"]) if r["stage"] == 3 else "-"
                     for r in results]
        else:
            cells = [human_bytes(r["bytes"][key]) for r in results]
        table.append((label, cells))
    if any("hpz_secondary" in r["bytes"] for r in results):
        table.append(("hpZ secondary (16-bit, over S)",
                      [human_bytes(r["bytes"].get("hpz_secondary", 0)) for r in results]))
    table.append(("total on the device", [human_bytes(r["device_total"]) for r in results]))
    table += _activation_rows(results)
    poff = any(r.get("offload_params") for r in results)
    if any(r["offload"] for r in results) or poff:
        for key, label in _host_rows(r0) + (_PARAM_HOST_ROWS if poff else []):
            table.append((label, [human_bytes(r["host"].get(key, 0)) for r in results]))
        table.append(("total on the host", [human_bytes(r["host_total"]) for r in results]))
        table.append(("DESIGN §4 formula (host)",
                      [human_bytes(r["formula"]["host"]) for r in results]))
    if any(r["offload"] == "nvme" for r in results):
        for key, label in _state_rows(r0, "disk: ", ", 2 halves", matrix=False) + \
                (_PARAM_DISK_ROWS if poff else []):
            table.append((label, [human_bytes(r["disk"].get(key, 0)) for r in results]))
        table.append(("total on disk", [human_bytes(r["disk_total"]) for r in results]))
        table.append(("DESIGN §4 formula (disk, x2)",
                      [human_bytes(r["formula"]["disk"]) for r in results]))
    table.append(("DESIGN §4 formula (device total)" if any(r["offload"] for r in results)
                  else "DESIGN §4 formula (total)",
                  [human_bytes(r["formula"]["total"]) for r in results]))
    table.append(("DeepSpeed / ZeRO paper, K = 12",
                  [human_bytes(r["deepspeed"]["total"]) for r in results]))
    w0 = max(len(label) for label, _ in table)
    ws = [max(len(c), *(len(cells[i]) for _, cells in table)) for i, c in enumerate(cols)]
    lines = [head, "", "  ".join([" " * w0] + [c.rjust(w) for c, w in zip(cols, ws)])]
    for label, cells in table:
        lines.append("  ".join([label.ljust(w0)] + [c.rjust(w) for c, w in zip(cells, ws)]))
    lines.append("")
    lines.append("Exact for zerokern's layout" + (" (stages without *)" if not
                                                  all(r["exact"] for r in results) else "")
                 + ": each device row equals opt.memory_report()['measured'] after a training "
                 "step" + (", each host row its ['host_measured']" if r0["offload"] or poff else "")
                 + (", live units its ['live_units_bound']" if any(r["stage"] == 3
                                                                  for r in results) else "")
                 + ".")
    notes = []
    for r in results:
        for n in r["notes"]:
            if n not in notes:
                notes.append(n)
    lines += [f"- {n}" for n in notes]
    return "\n".join(lines)


def _activations(args, model):
    """The activation estimate (zerokern.accounting.activations), or None without --batch."""
    given = (args.batch, args.seq)
    flags = (args.activation_checkpointing != "none" or args.tp != 1
             or args.partition_activations or args.cpu_checkpointing)
    if given == (None, None) and not flags:
        return None
    if None in given:
        raise ValueError("the activation estimate needs both --batch and --seq")
    if model is None:
        raise ValueError("the activation estimate needs --model (a model to trace), not "
                         "--params")
    from zerokern.accounting.activations import activation_estimate
    from zerokern.options.args import PRECISIONS as dtypes

    return activation_estimate(model, args.batch, args.seq, args.activation_checkpointing,
                               dtype=dtypes[args.precision], tp=args.tp,
                               partition_activations=args.partition_activations,
                               cpu_checkpointing=args.cpu_checkpointing)


def whole_peak(r) -> int:
    """Per-rank device peak: the model states (`device_total`), stage 3's gathered units
    (`live_units_bound`), the activations held at the end of forward and the recompute's
    working set in backward."""
    a = r.get("activations") or {"device": 0, "recompute": 0}
    return (r["device_total"] + (r["live_units_bound"] or 0 if r["stage"] == 3 else 0)
            + a["device"] + a["recompute"])


def _activation_rows(results) -> list:
    a = results[0].get("activations")
    if a is None:
        return []
    n = len(results)
    rows = [(f"activations ({a['policy']}, {a['batch']}x{a['seq']}"
             + (f", tp {a['tp']}" if a["tp"] > 1 else "") + ")", [human_bytes(a["device"])] * n),
            ("activations: recompute working set", [human_bytes(a["recompute"])] * n)]
    if a["host"]:
        rows.append(("activations on the host", [human_bytes(a["host"])] * n))
    # model states + (stage 3) the units gathered in a step + activations + the recompute
    rows.append(("whole peak on the device",
                 [human_bytes(whole_peak(r)) for r in results]))
    return rows


def main(args) -> int:
    if getattr(args, "pp", 1) > 1:
        return _main_pipeline(args)
    model = None
    if args.params is not None:
        spec = spec_from_numel(args.params)
    else:
        model, desc = load_model(args.model)
        spec = spec_from_model(model, desc)
    act = _activations(args, model)
    if args.mesh is not None:  # the mesh's ranks are the world
        n = args.mesh[0] * args.mesh[1]
        if args.world_size not in (1, n):
            raise ValueError(f"--mesh {args.mesh[0]}x{args.mesh[1]} has {n} ranks but "
                             f"--world-size is {args.world_size}; give one of them")
        args.world_size = n
    if args.hpz and args.mesh is None:
        raise ValueError("--hpz needs --mesh RxS")
    if args.hpz and not args.stage:
        args.stage = [3]  # hpZ is stage 3's
    if args.hpz and args.stage != [3] and sorted(set(args.stage)) != [3]:
        raise ValueError("--hpz is for --stage 3")
    if not 0 <= args.rank < args.world_size:
        raise ValueError(f"--rank must be in [0, --world-size), got {args.rank}")
    offload = None if args.offload == "none" else args.offload
    offload_params = None if args.offload_params == "none" else args.offload_params
    if offload_params and not args.stage:
        args.stage = [3]  # param offload is stage 3's
    if args.stage:
        stages = sorted(set(args.stage))
        if offload and 0 in stages:
            raise ValueError(f"--offload {offload} needs --stage 1, 2 or 3 (stage 0 keeps the full "
                             "optimizer state on every rank)")
    else:  # every stage that takes this --offload
        stages = [1, 2, 3] if offload else [0, 1, 2, 3]
    results = [estimate(spec, args.world_size, s, args.precision, args.bucket_mb, offload,
                        args.rank, args.comm, offload_params, args.master,
                        optimizer=args.optimizer, mesh=args.mesh, hpz=args.hpz,
                        keep_for_backward_mb=args.keep_for_backward_mb if s == 3 else 0.0)
               for s in stages]
    if act is not None:
        for r in results:
            r["activations"] = act
            r["whole_peak"] = whole_peak(r)
    if args.json:
        print(json.dumps({"results": results}, indent=1))
    else:
        print(format_table(results))
        if args.mesh is not None:
            print("\n".join(mesh_lines(results)))
    return 0


def _main_pipeline(args) -> int:
    """--pp P: per pipeline stage, per ZeRO stage (estimate.py [Note: per-stage bytes of a
    pipeline])."""
    if args.params is not None:
        raise ValueError("--pp needs --model (a gpt preset, split into stages by layers), not "
                         "--params")
    if args.batch is not None or args.seq is not None:
        raise ValueError("--pp with --batch/--seq: the activations of a pipeline stage are "
                         "not estimated; leave them out")
    if args.hpz and args.mesh is None:
        raise ValueError("--hpz needs --mesh RxS")
    specs = [spec_from_model(m, desc) for m, desc in load_stage_models(args.model, args.pp)]
    world = args.world_size
    if args.mesh is not None:
        n = args.pp * args.mesh[0] * args.mesh[1]
        if world not in (1, n):
            raise ValueError(f"--pp {args.pp} with --mesh {args.mesh[0]}x{args.mesh[1]} is "
                             f"{n} ranks but --world-size is {world}; give one of them")
        world = n
    elif world == 1:
        world = args.pp  # one rank per stage
    if not 0 <= args.rank < world // args.pp if world % args.pp == 0 else False:
        raise ValueError(f"--rank must be a rank of a stage's dp group, in [0, "
                         f"{max(world // args.pp, 1)}), got {args.rank}")
    offload = None if args.offload == "none" else args.offload
    offload_params = None if args.offload_params == "none" else args.offload_params
    stages = sorted(set(args.stage)) if args.stage else \
        ([3] if args.hpz or offload_params else [1, 2, 3] if offload else [0, 1, 2, 3])
    blocks = [estimate_pipeline(specs, world, k, args.precision, args.bucket_mb, offload,
                                args.rank, args.comm, offload_params, args.master,
                                optimizer=args.optimizer, mesh=args.mesh, hpz=args.hpz,
                                keep_for_backward_mb=args.keep_for_backward_mb if k == 3
                                else 0.0)
              for k in stages]
    if args.json:
        print(json.dumps({"pipeline": [{"zero_stage": k, "stages": b}
                                       for k, b in zip(stages, blocks)]}, indent=1))
    else:
        print("\n\n".join(format_table(b, pipeline=True) for b in blocks))
    return 0
