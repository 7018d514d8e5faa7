"""What `zerokern estimate` needs from a model, and how it gets the model (DESIGN §4).

A `ModelSpec` holds the unique trainable param shapes (the flat-buffer order), the order one
backward delivers their grads and the order the forward calls the stage-3 units, both recorded
from one forward and backward on the `meta` device (nothing is allocated). `load_model` builds a
model from a gpt preset, a `module:function` factory or a Hugging Face config.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
from dataclasses import dataclass
from typing import List, NamedTuple, Sequence, Tuple
from urllib.parse import urlparse

import torch
from torch import nn

# Token ids fed to the meta backward that finds the grad order. 4 positions: short enough for
# any positional table (tests/support/models.py has 7), and attention still mixes positions.
_PROBE_SEQ = 4
_ONE_PARAM = "one param"  # the order_source of `--params` (its order is trivial)


class UnitSpec(NamedTuple):
    """One stage-3 unit, as `zerokern.stage3.find_units` makes it.

    name: module path ("" is the root); params: indices into ModelSpec.shapes of the params it
    owns, in the unit's own order (its flat buffer's); deps: units whose params it uses (ties).
    """

    name: str
    params: Tuple[int, ...]
    deps: Tuple[int, ...] = ()
    frozen: Tuple[Tuple[int, ...], ...] = ()  # shapes of its frozen float params (sharded)


@dataclass(frozen=True)
class ModelSpec:
    """What the estimate needs from a model: trainable param shapes, grad order, stage-3 units.

    shapes: unique trainable params in `model.parameters()` order (the flat-buffer order).
    grad_order: indices into `shapes` in the order backward delivers their grads; indices
        missing here get no grad (unused params), as in a real backward.
    order_source: how grad_order and fwd_units were found; order_known: False when they are
        a fallback guess (the model did not run on meta), which stage 2-3 staging depends on.
    units: stage-3 units (`find_units` with `unit_policy`); unit 0 is the root.
    fwd_units: indices into `units` (not the root) in the order the forward called them, as
        Stage3Runtime records it (repeats included); its reduce-scatter order follows from it.
    """

    name: str
    shapes: Tuple[Tuple[int, ...], ...]
    grad_order: Tuple[int, ...]
    order_source: str
    units: Tuple[UnitSpec, ...]
    fwd_units: Tuple[int, ...] = ()
    order_known: bool = True
    unit_policy: str = "default"
    # per shape: ZeroMuon's default gives it Muon (>= 2-D, not an embedding weight); () for
    # --params (one 1-D buffer)
    matrices: Tuple[bool, ...] = ()

    @property
    def num_params(self) -> int:
        return sum(_numel(s) for s in self.shapes)

    @property
    def num_frozen(self) -> int:
        """Elements of the frozen float params (stage 3 shards them with their unit)."""
        return sum(_numel(s) for u in self.units for s in u.frozen)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---------------------------------------------------------------------------- model specs


def spec_from_numel(num_params: int) -> ModelSpec:
    """A bare parameter count: one flat buffer of `num_params` elements (at stage 3 one param
    in the root unit, the only unit)."""
    if isinstance(num_params, bool) or not isinstance(num_params, int) or num_params < 1:
        raise ValueError(f"num_params must be a positive int, got {num_params!r}")
    return ModelSpec("--params", ((num_params,),), (0,), _ONE_PARAM, (UnitSpec("", (0,)),),
                     unit_policy="root only")


def _trainable(model: nn.Module) -> List[nn.Parameter]:
    # parameters() already yields a tied Parameter once; frozen ones stay out of the buffers.
    return [p for p in model.parameters() if p.requires_grad]


def stage3_units(model: nn.Module, params: Sequence[nn.Parameter], policy=None
                 ) -> Tuple[Tuple[UnitSpec, ...], list]:
    """Stage-3 units of `model` by zerokern's own `find_units(model, policy)` (None: each child
    of every nn.ModuleList, plus the root), as UnitSpecs over `params`; also the Units."""
    from zerokern.stage3 import find_units

    index = {id(p): i for i, p in enumerate(params)}
    units = find_units(model, policy)
    return tuple(UnitSpec(u.name, tuple(index[id(p)] for p in u.params), tuple(sorted(u.deps)),
                          tuple(tuple(p.shape) for p in u.frozen))
                 for u in units), units


def record_order(model: nn.Module, params: Sequence[nn.Parameter], units: Sequence = ()
                 ) -> Tuple[Tuple[int, ...], Tuple[int, ...], str, bool]:
    """The order backward delivers the params' grads and the order forward calls the stage-3
    units, from one forward and backward on `meta`.

    Returns (grad order: indices into params, forward unit order: indices into units without
    the root, how it was found, whether it was found). Falls back to reverse registration order
    for grads (the order the flat layout assumes) and unit order for the forward when the model
    does not run on meta with token ids.
    """
    index = {id(p): i for i, p in enumerate(params)}
    seen: List[int] = []
    calls: List[int] = []
    recording = [True]  # unit calls inside backward (checkpoint recompute) are not recorded

    def on_call(ui: int) -> None:
        if recording[0]:
            calls.append(ui)

    hooks = [p.register_post_accumulate_grad_hook(lambda p: seen.append(index[id(p)]))
             for p in params]
    hooks += [u.module.register_forward_pre_hook(lambda m, args, ui=u.index: on_call(ui))
              for u in units if u.index != 0]
    try:
        dev = params[0].device if params else torch.device("meta")
        if dev.type != "meta":
            raise ValueError("the model is not on the meta device")
        probe = getattr(model, "probe_input", None)  # a pipeline stage's input kind
        x = probe(1, _PROBE_SEQ, device="meta") if callable(probe) else \
            torch.zeros(1, _PROBE_SEQ, dtype=torch.long, device="meta")
        out = model(x)
        recording[0] = False
        out = getattr(out, "logits", out)
        if isinstance(out, (tuple, list)):
            out = out[0]
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"the model returned {type(out).__name__}, not a tensor")
        out.float().sum().backward()
        order, fwd, source, known = (tuple(seen), tuple(calls),
                                     "one forward and backward on the meta device", True)
    except Exception as e:  # noqa: BLE001 - any failure means: use the fallback order
        msg = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        order = tuple(reversed(range(len(params))))
        fwd = tuple(u.index for u in units if u.index != 0)
        source = f"reverse registration order (the model did not run on meta: {msg})"
        known = False
    finally:
        for h in hooks:
            h.remove()
        for p in params:
            p.grad = None
    return order, fwd, source, known


def grad_order(model: nn.Module, params: Sequence[nn.Parameter]) -> Tuple[Tuple[int, ...], str]:
    """Order in which backward delivers the params' grads (see `record_order`)."""
    order, _, source, _ = record_order(model, params)
    return order, source


def spec_from_model(model: nn.Module, name: str = "model", units=None) -> ModelSpec:
    """Shapes, grad order and stage-3 units of `model` (ideally built on the meta device).

    units: the stage-3 unit policy, as ZeroAdamW's `units=` (None: the default).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    params = _trainable(model)
    if not params:
        raise ValueError(f"{name} has no trainable parameters (requires_grad=True)")
    unit_specs, unit_objs = stage3_units(model, params, units)
    order, fwd, source, known = record_order(model, params, unit_objs)
    policy = "default" if units is None else getattr(units, "__name__", repr(units))
    from zerokern.rules.muon import embedding_weight_ids, takes_muon

    embeds = embedding_weight_ids(model)
    return ModelSpec(name, tuple(tuple(p.shape) for p in params), order, source, unit_specs,
                     fwd, known, policy,
                     tuple(takes_muon(tuple(p.shape), id(p) in embeds) for p in params))


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


def load_stage_models(spec: str, pp: int) -> List[Tuple[nn.Module, str]]:
    """The pipeline stages of `spec` on the meta device, in stage order: a zerokern.tools.gpt
    preset split by layers (tools/gpt_stages.py [Note: a GPT pipeline stage]: the embeddings
    on the first stage, the head on the last). Returns [(stage module, description)].

    Raises:
        ValueError: spec is not a gpt preset, or pp is not in [1, its layers].
    """
    from zerokern.tools.gpt import PRESETS
    from zerokern.tools.gpt_stages import GPTStage

    if spec not in PRESETS:
        raise ValueError(f"--pp needs --model a zerokern.tools.gpt preset {tuple(PRESETS)}, "
                         f"split into stages by layers; got {spec!r} (another model's split "
                         "into stages is its own)")
    with torch.device("meta"):
        return [(GPTStage(PRESETS[spec], s, pp),
                 f"zerokern.tools.gpt preset {spec!r}, pipeline stage {s} of {pp}")
                for s in range(pp)]


def load_model(spec: str) -> Tuple[nn.Module, str]:
    """Build the model named by `spec` on the meta device (no memory, no download of weights).

    spec: a zerokern.tools.gpt preset name ("tiny", "small", "20m", "100m"); a factory
    "module:function" called with no arguments; or a Hugging Face config: a JSON object, a
    config.json path, a directory holding one, or a hub name (needs the network or the cache).
    Returns (model, description).
    """
    from zerokern.tools.gpt import PRESETS, build_gpt

    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"--model must be a non-empty string, got {spec!r}")
    with torch.device("meta"):
        if spec in PRESETS:
            return build_gpt(spec), f"zerokern.tools.gpt preset {spec!r}"
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
