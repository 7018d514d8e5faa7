"""Per-rank memory of zerokern's buffers, exactly, for a model or a parameter count.

`estimate_memory` (memory.py) is the DESIGN §4 formula: 2Ψ + 2Ψ + 12Ψ and its shards. This module
predicts what `opt.memory_report()["measured"]` will say, byte for byte, by building zerokern's
own layout: `FlatGroup` (so `make_layout`, `bucket_numel_for` and `ALIGN` padding) over `meta`
tensors, which allocate nothing. A model contributes its real param shapes: frozen params are
skipped and a tied param (one Parameter reached twice) is stored once, as ZeroAdamW does, in one
flat buffer (a model gives one param group). `--params N` is one buffer of N elements.

[Note: categories that depend on the run]
Two categories are not a function of the shapes alone; here is how each is modelled.
- Stage-2 staging buckets (`buckets`): how many bucket-sized staging buffers stage 2 allocates
  depends on the order grads arrive in backward (a bucket is launched only when all its params'
  grads are in, and in a fixed order). We replay that order through zerokern's own
  `BucketedGrads` (the runtime class, on meta tensors, with a communicator that completes at
  once, which is how its pool is drained anyway: only when a buffer is needed or backward ends).
  The order comes from one backward of the model on the `meta` device (token ids in, sum of
  the output as the loss): that is the order autograd fires the post-accumulate-grad hooks
  in, the same on CPU as on meta (checked on zerokern.gpt). When the model cannot run on meta
  (an unknown input signature), the order is reverse registration order and the result says so;
  `--params` is one param, so its order is trivial.
- The gloo ring's scratch buffer (`buckets`, stage 1 over gloo, N > 1): zerokern runs gloo's
  reduce-scatter as a ring that needs a work copy of the bucket when the bucket itself must
  survive (stage 1 reduces the `p.grad` buffer); it keeps one such buffer, sized to the largest
  bucket. NCCL (GPUs), `ZEROKERN_GLOO_RING=0` and world size 1 have none. `comm="gloo"` counts
  it; the default `comm="nccl"` does not.
The measurement is taken after at least one training step: before the first backward stage 2
holds no staging buffers yet.

Stage 3 and offload are not implemented yet (ZeroAdamW raises for them). Their figures model
DESIGN §2's proposal: stage 3 gives each unit (each child of every nn.ModuleList, plus the root
for the rest) its own flat buffer of which a rank holds a shard, plus one gathered unit live at
a time (`live_units`, the largest unit) and one staging bucket; offload moves master, m and v
(and their padding) to host memory. They are marked `exact: False`.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple
from urllib.parse import urlparse

import torch
from torch import nn

from .memory import _pad_in_range, estimate_memory
from .partition import bucket_numel_for, make_layout

CATEGORIES = ("params", "live_units", "grads", "buckets", "master", "exp_avg", "exp_avg_sq",
              "padding")
MEASURED = ("params", "grads", "buckets", "master", "exp_avg", "exp_avg_sq", "padding")
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
COMMS = ("nccl", "gloo")
# ZeRO paper / DeepSpeed estimator: fp32 master + m + v per param (mixed-precision Adam).
K_DEEPSPEED = 12
# Token ids fed to the meta backward that finds the grad order. 4 positions: short enough for
# any positional table (tests/zero/models.py has 7), and attention still mixes positions.
_PROBE_SEQ = 4


@dataclass(frozen=True)
class ModelSpec:
    """What the estimate needs from a model: trainable param shapes, grad order, stage-3 units.

    shapes: unique trainable params in `model.parameters()` order (the flat-buffer order).
    grad_order: indices into `shapes` in the order backward delivers their grads; indices
        missing here get no grad (unused params), as in a real backward.
    units: stage-3 units as (name, indices into shapes); None when there is no model.
    """

    name: str
    shapes: Tuple[Tuple[int, ...], ...]
    grad_order: Tuple[int, ...]
    order_source: str
    units: Optional[Tuple[Tuple[str, Tuple[int, ...]], ...]] = None

    @property
    def num_params(self) -> int:
        return sum(_numel(s) for s in self.shapes)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---------------------------------------------------------------------------- model specs


def spec_from_numel(num_params: int) -> ModelSpec:
    """A bare parameter count: one flat buffer of `num_params` elements."""
    if isinstance(num_params, bool) or not isinstance(num_params, int) or num_params < 1:
        raise ValueError(f"num_params must be a positive int, got {num_params!r}")
    return ModelSpec("--params", ((num_params,),), (0,), "one param")


def _trainable(model: nn.Module) -> List[nn.Parameter]:
    # parameters() already yields a tied Parameter once; frozen ones stay out of the buffers.
    return [p for p in model.parameters() if p.requires_grad]


def stage3_units(model: nn.Module, params: Sequence[nn.Parameter]
                 ) -> Tuple[Tuple[str, Tuple[int, ...]], ...]:
    """DESIGN §2 default units: each child of every nn.ModuleList, plus the root for the rest.

    A param reached from several units (tied) belongs to the first unit that reaches it.
    """
    index = {id(p): i for i, p in enumerate(params)}
    taken: set = set()
    units = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList):
            for cname, child in mod.named_children():
                ids = []
                for p in child.parameters():
                    if id(p) in index and id(p) not in taken:
                        taken.add(id(p))
                        ids.append(index[id(p)])
                if ids:
                    units.append((f"{name}.{cname}" if name else cname, tuple(sorted(ids))))
    rest = tuple(i for i, p in enumerate(params) if id(p) not in taken)
    if rest:
        units.insert(0, ("<root>", rest))
    return tuple(units)


def grad_order(model: nn.Module, params: Sequence[nn.Parameter]) -> Tuple[Tuple[int, ...], str]:
    """Order in which backward delivers the params' grads, from one backward on `meta`.

    Returns (indices into params, how it was found). Falls back to reverse registration order
    (the order the flat layout assumes) when the model does not run on meta with token ids.
    """
    index = {id(p): i for i, p in enumerate(params)}
    seen: List[int] = []
    hooks = [p.register_post_accumulate_grad_hook(lambda p: seen.append(index[id(p)]))
             for p in params]
    try:
        dev = params[0].device if params else torch.device("meta")
        if dev.type != "meta":
            raise ValueError("the model is not on the meta device")
        x = torch.zeros(1, _PROBE_SEQ, dtype=torch.long, device="meta")
        out = model(x)
        out = getattr(out, "logits", out)
        if isinstance(out, (tuple, list)):
            out = out[0]
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"the model returned {type(out).__name__}, not a tensor")
        out.float().sum().backward()
        order, source = tuple(seen), "one backward on the meta device"
    except Exception as e:  # noqa: BLE001 - any failure means: use the fallback order
        msg = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        order = tuple(reversed(range(len(params))))
        source = f"reverse registration order (the model did not run on meta: {msg})"
    finally:
        for h in hooks:
            h.remove()
        for p in params:
            p.grad = None
    return order, source


def spec_from_model(model: nn.Module, name: str = "model") -> ModelSpec:
    """Shapes, grad order and stage-3 units of `model` (ideally built on the meta device)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    params = _trainable(model)
    if not params:
        raise ValueError(f"{name} has no trainable parameters (requires_grad=True)")
    order, source = grad_order(model, params)
    return ModelSpec(name, tuple(tuple(p.shape) for p in params), order, source,
                     stage3_units(model, params))


# ---------------------------------------------------------------------------- model loading


def _hub_reachable(timeout: float = 3.0) -> bool:
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _hf_config(spec: str):
    try:
        from transformers import AutoConfig
    except ImportError as e:
        raise ValueError(f"--model {spec!r} looks like a Hugging Face config, which needs "
                         "transformers (pip install transformers)") from e
    if spec.lstrip().startswith("{"):
        try:
            d = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"--model: not valid JSON ({e})") from e
        if not isinstance(d, dict) or "model_type" not in d:
            raise ValueError("--model as a JSON config needs a 'model_type' key, "
                             "e.g. '{\"model_type\": \"llama\", \"num_hidden_layers\": 2}'")
        return AutoConfig.for_model(**d)
    if os.path.isfile(spec):
        with open(spec) as fh:
            d = json.load(fh)
        if "model_type" not in d:
            raise ValueError(f"--model {spec!r}: the config has no 'model_type' key")
        return AutoConfig.for_model(**d)
    if os.path.isdir(spec):
        return AutoConfig.from_pretrained(spec)
    try:  # a hub name already in the local cache needs no network
        return AutoConfig.from_pretrained(spec, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached: try the hub below
        pass
    if os.environ.get("HF_HUB_OFFLINE") == "1" or not _hub_reachable():
        raise ValueError(f"--model {spec!r} is not a zerokern preset, a module:function, a "
                         "local config path or JSON, and the Hugging Face hub is not reachable "
                         "(offline?) to fetch its config; pass a path to a config.json or its "
                         "directory instead")
    try:
        return AutoConfig.from_pretrained(spec)
    except Exception as e:  # noqa: BLE001 - turn hub errors into one clear message
        raise ValueError(f"--model {spec!r}: could not load its config from the Hugging Face "
                         f"hub: {str(e).splitlines()[0]}") from e


def load_model(spec: str) -> Tuple[nn.Module, str]:
    """Build the model named by `spec` on the meta device (no memory, no download of weights).

    spec: a zerokern.gpt preset name ("tiny", "small", "20m", "100m"); a factory
    "module:function" called with no arguments; or a Hugging Face config: a JSON object, a
    config.json path, a directory holding one, or a hub name (needs the network or the cache).
    Returns (model, description).
    """
    from .gpt import PRESETS, build_gpt

    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"--model must be a non-empty string, got {spec!r}")
    with torch.device("meta"):
        if spec in PRESETS:
            return build_gpt(spec), f"zerokern.gpt preset {spec!r}"
        if ":" in spec and not spec.lstrip().startswith("{") and not os.path.exists(spec):
            mod_name, _, fn_name = spec.partition(":")
            try:
                fn = getattr(importlib.import_module(mod_name), fn_name)
            except (ImportError, AttributeError) as e:
                raise ValueError(f"--model {spec!r}: cannot import {fn_name!r} from "
                                 f"{mod_name!r} ({e})") from e
            model = fn()
            if not isinstance(model, nn.Module):
                raise TypeError(f"--model {spec!r} returned {type(model).__name__}, "
                                "not an nn.Module")
            return model, f"factory {spec}"
        cfg = _hf_config(spec)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(cfg)
        return model, f"transformers {type(model).__name__} ({cfg.model_type})"


# ---------------------------------------------------------------------------- the estimate


class _InstantComm:
    """Stands in for zerokern.comm.Comm: collectives complete at once (no data moves)."""

    class _Done:
        def wait(self) -> bool:
            return True

    def __init__(self, world_size: int, rank: int) -> None:
        self.world_size, self.rank = world_size, rank

    def reduce_scatter_(self, out, inp, async_op=False, inp_is_scratch=False):
        return self._Done()


def _meta_group(spec: ModelSpec, idx: Sequence[int], dtype, world_size, rank, stage,
                bucket_bytes):
    from .flat_group import FlatGroup

    params = [nn.Parameter(torch.empty(spec.shapes[i], device="meta")) for i in idx]
    return FlatGroup(params, dtype, world_size, rank, stage, bucket_bytes)


def _staging_bytes(spec: ModelSpec, group, reduce_dtype) -> int:
    """Stage-2 staging buffers after one backward in spec.grad_order, via BucketedGrads."""
    from .grad_sync import BucketedGrads

    comm = _InstantComm(group.layout.world_size, group.rank)
    gs = BucketedGrads([group], comm, reduce_dtype)
    try:
        for i in spec.grad_order:
            p = group.params[i]
            p.grad = torch.empty(p.shape, dtype=group.dtype, device="meta")
            gs.on_grad(0, i, p)
        gs.end_backward()
        return sum(t.numel() * t.element_size() for t in gs.held()["buckets"])
    finally:
        gs.detach()


def _state_padding(layout, rank: int, stage: int) -> int:
    ranges = [layout.bucket_range(k) if stage == 0 else layout.piece_range(k, rank)
              for k in range(layout.n_buckets)]
    return sum(_pad_in_range(lo, hi, layout.numel) for lo, hi in ranges)


def _check(world_size, stage, precision, bucket_mb, offload, rank, comm) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be one of 0, 1, 2, 3, got {stage!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {tuple(PRECISIONS)}, got {precision!r}")
    if not (isinstance(bucket_mb, (int, float)) and bucket_mb > 0):
        raise ValueError(f"bucket_mb must be a number > 0, got {bucket_mb!r}")
    if offload not in (None, "cpu"):
        raise ValueError(f"offload must be None or 'cpu', got {offload!r}")
    if not (isinstance(rank, int) and 0 <= rank < world_size):
        raise ValueError(f"rank must be an int in [0, world_size), got {rank!r}")
    if comm not in COMMS:
        raise ValueError(f"comm must be one of {COMMS}, got {comm!r}")


def deepspeed_formula(num_params: int, world_size: int, stage: int,
                      offload: Optional[str] = None) -> Dict[str, int]:
    """The ZeRO paper / DeepSpeed figures: 16-bit params and grads, K = 12 bytes of optimizer
    state per param, each term divided by N once its stage shards it."""
    psi, n = num_params, world_size
    out = {"params": 2 * psi / (n if stage >= 3 else 1),
           "grads": 2 * psi / (n if stage >= 2 else 1),
           "optimizer": K_DEEPSPEED * psi / (n if stage >= 1 else 1)}
    out = {k: int(round(v)) for k, v in out.items()}
    out["total"] = out["params"] + out["grads"] + (0 if offload else out["optimizer"])
    return out


def estimate(spec: ModelSpec, world_size: int, stage: int, precision: str = "bf16",
             bucket_mb: float = 25.0, offload: Optional[str] = None, rank: int = 0,
             comm: str = "nccl") -> Dict[str, Any]:
    """Bytes per rank per category for zerokern at `stage`, with both formulas beside them.

    Args:
        spec: from `spec_from_model` or `spec_from_numel`.
        world_size, stage, precision, bucket_mb, offload: as ZeroAdamW (N ranks).
        rank: the rank to report. Totals are the same on every rank; the split between real
            elements and `padding` is not (padding sits at the end of the last bucket, so rank
            0 holds the most real elements).
        comm: "nccl" or "gloo" (gloo's ring keeps a scratch bucket at stage 1, see the Note).

    Returns a dict: `bytes` (category -> bytes; the stage 0-2 categories equal
    `memory_report()["measured"]` after a training step), `device_total`, `host_total`,
    `formula` (DESIGN §4, `estimate_memory`), `deepspeed` (K = 12), `exact` (False for stage 3
    and offload, which model the design proposal), and notes.
    """
    _check(world_size, stage, precision, bucket_mb, offload, rank, comm)
    dtype = PRECISIONS[precision]
    e = dtype.itemsize
    r = e  # reduce dtype: the precision's (ZeroAdamW's default)
    has_master = dtype != torch.float32
    bucket_bytes = bucket_mb * 2**20
    b = dict.fromkeys(CATEGORIES, 0)
    opt_pad = 0  # padding inside master/m/v (moves to the host with offload)
    notes = []
    if stage < 3:
        g = _meta_group(spec, range(len(spec.shapes)), dtype, world_size, rank, stage,
                        bucket_bytes)
        L = g.layout
        state_numel = L.padded_numel if stage == 0 else L.shard_numel
        spad = _state_padding(L, rank, stage)
        b["params"], b["padding"] = (L.padded_numel - L.padding) * e, L.padding * e
        for cat in ("master", "exp_avg", "exp_avg_sq"):
            if cat != "master" or has_master:
                b[cat] = (state_numel - spad) * 4
                opt_pad += spad * 4
        if stage <= 1:  # FullGrads: a full grad buffer in the model dtype
            b["grads"] = (L.padded_numel - L.padding) * e
            b["padding"] += L.padding * e
        else:  # BucketedGrads: this rank's grad shard in the reduce dtype, plus staging
            b["grads"] = (L.shard_numel - spad) * r
            b["padding"] += spad * r
            b["buckets"] = _staging_bytes(spec, g, dtype)
            if spec.units is not None:  # a model: say where its grad order came from
                notes.append(f"stage-2 staging buckets replay the grad order of "
                             f"{spec.order_source}")
        if stage == 1 and comm == "gloo" and world_size > 1:
            b["buckets"] = L.bucket_numel * r  # the ring's one scratch bucket (see the Note)
    else:
        units = spec.units or (("<all>", tuple(range(len(spec.shapes)))),)
        bn = None
        for _, idx in units:
            L = make_layout([spec.shapes[i] for i in idx], world_size,
                            bucket_numel_for(bucket_bytes, e, world_size))
            bn = max(bn or 0, L.bucket_numel)
            spad = _state_padding(L, rank, 1)
            real = L.shard_numel - spad
            b["params"] += real * e
            b["grads"] += real * r
            b["padding"] += spad * (e + r)
            for cat in ("master", "exp_avg", "exp_avg_sq"):
                if cat != "master" or has_master:
                    b[cat] += real * 4
                    opt_pad += spad * 4
            if spec.units:
                b["live_units"] = max(b["live_units"], L.padded_numel * e)
        b["buckets"] = bn * r
        notes.append("stage 3 models DESIGN §2's proposal (not implemented yet): per-unit flat "
                     "shards, one gathered unit live (the largest), one staging bucket")
        if not spec.units:
            notes.append("live units: n/a without a model (give --model)")
    b["padding"] += 0 if offload else opt_pad
    host = dict.fromkeys(("master", "exp_avg", "exp_avg_sq", "padding"), 0)
    if offload:
        for cat in ("master", "exp_avg", "exp_avg_sq"):
            host[cat], b[cat] = b[cat], 0
        host["padding"] = opt_pad
        notes.append("offload='cpu' (not implemented yet): master, m, v on the host; pinned "
                     "16-bit staging copies are not counted")
    formula = estimate_memory(spec.num_params, world_size, stage, precision, offload=offload)
    return {
        "model": spec.name, "num_params": spec.num_params, "world_size": world_size,
        "stage": stage, "precision": precision, "bucket_mb": bucket_mb, "offload": offload,
        "rank": rank, "comm": comm, "exact": stage < 3 and not offload,
        "bytes": b, "device_total": sum(b.values()), "host": host,
        "host_total": sum(host.values()),
        "formula": formula, "deepspeed": deepspeed_formula(spec.num_params, world_size, stage,
                                                           offload),
        "grad_order": spec.order_source, "notes": notes,
    }


# ---------------------------------------------------------------------------- command line


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
    from .train.config import int_at_least, positive_float

    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=_count, metavar="N",
                      help="parameter count (e.g. 7e9): one flat buffer of N elements")
    what.add_argument("--model", metavar="SPEC",
                      help="a zerokern.gpt preset (tiny, small, 20m, 100m), a factory "
                           "module:function, or a Hugging Face config (JSON, config.json path, "
                           "directory, or hub name); built on the meta device")
    p.add_argument("--world-size", type=int_at_least(1), default=1, metavar="N",
                   help="ranks (default 1)")
    p.add_argument("--stage", type=int, choices=[0, 1, 2, 3], action="append",
                   help="stage(s) to show (repeatable; default all of 0-3)")
    p.add_argument("--precision", choices=list(PRECISIONS), default="bf16")
    p.add_argument("--offload", choices=["none", "cpu"], default="none")
    p.add_argument("--bucket-mb", type=positive_float, default=25.0,
                   help="ZeroAdamW bucket_mb (default 25)")
    p.add_argument("--rank", type=int, default=0,
                   help="rank to report (totals are equal on all ranks; default 0)")
    p.add_argument("--comm", choices=list(COMMS), default="nccl",
                   help="collective backend: gloo's ring keeps a scratch bucket at stage 1 "
                        "(default nccl)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def human_bytes(n: Optional[float]) -> str:
    if n is None:
        return "n/a"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


_ROWS = [("params", "params"), ("live_units", "live units (max gathered unit)"),
         ("grads", "grads"), ("buckets", "buckets"), ("master", "optimizer: master (fp32)"),
         ("exp_avg", "optimizer: m (fp32)"), ("exp_avg_sq", "optimizer: v (fp32)"),
         ("padding", "padding")]


def format_table(results: List[Dict[str, Any]]) -> str:
    """The human-readable table: one column per stage."""
    r0 = results[0]
    what = f"{r0['num_params']:,} params" if r0["model"] == "--params" else \
        f"{r0['model']} ({r0['num_params']:,} params)"
    head = (f"zerokern estimate: {what}, "
            f"world size {r0['world_size']}, {r0['precision']}, bucket {r0['bucket_mb']:g} MiB, "
            f"offload {r0['offload'] or 'none'}, comm {r0['comm']}; bytes on rank {r0['rank']}")
    cols = [f"stage {r['stage']}" + ("" if r["exact"] else " *") for r in results]
    table = []
    for key, label in _ROWS:
        cells = []
        for r in results:
            if key == "live_units":
                cells.append("n/a" if r["stage"] == 3 and r["bytes"][key] == 0 else
                             "-" if r["stage"] < 3 else human_bytes(r["bytes"][key]))
            else:
                cells.append(human_bytes(r["bytes"][key]))
        table.append((label, cells))
    table.append(("total on the device", [human_bytes(r["device_total"]) for r in results]))
    if any(r["offload"] for r in results):
        table.append(("host (offload)", [human_bytes(r["host_total"]) for r in results]))
    table.append(("DESIGN §4 formula (total)",
                  [human_bytes(r["formula"]["total"]) for r in results]))
    table.append(("DeepSpeed / ZeRO paper, K = 12",
                  [human_bytes(r["deepspeed"]["total"]) for r in results]))
    w0 = max(len(label) for label, _ in table)
    ws = [max(len(c), *(len(cells[i]) for _, cells in table)) for i, c in enumerate(cols)]
    lines = [head, "", "  ".join([" " * w0] + [c.rjust(w) for c, w in zip(cols, ws)])]
    for label, cells in table:
        lines.append("  ".join([label.ljust(w0)] + [c.rjust(w) for c, w in zip(cells, ws)]))
    lines.append("")
    if any(r["exact"] for r in results):
        lines.append("Stages without * are exact for zerokern's layout: they equal "
                     "opt.memory_report()['measured'] after a training step.")
    notes = []
    for r in results:
        for n in r["notes"]:
            if n not in notes:
                notes.append(n)
    lines += [f"* {n}" if n.startswith(("stage 3", "offload")) else f"- {n}" for n in notes]
    return "\n".join(lines)


def main(args) -> int:
    if args.params is not None:
        spec = spec_from_numel(args.params)
    else:
        model, desc = load_model(args.model)
        spec = spec_from_model(model, desc)
    if not 0 <= args.rank < args.world_size:
        raise ValueError(f"--rank must be in [0, --world-size), got {args.rank}")
    stages = sorted(set(args.stage)) if args.stage else [0, 1, 2, 3]
    offload = None if args.offload == "none" else args.offload
    results = [estimate(spec, args.world_size, s, args.precision, args.bucket_mb, offload,
                        args.rank, args.comm) for s in stages]
    if args.json:
        print(json.dumps({"results": results}, indent=1))
    else:
        print(format_table(results))
    return 0
