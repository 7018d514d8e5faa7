"""Stage 3: `model.generate()` keeps every rank in step (synced_gpus on by default).

[Note: stage-3 generate is synced] (issue 21, item 7)
Each forward of a stage-3 model all-gathers its units: a collective, so every rank must run
the same number of forwards. `generate()` stops a rank once all its sequences hit EOS; with
different prompts the ranks stop at different lengths, and the rank still generating waited in
its next all-gather for the process-group timeout (60 s in the tests), then failed with an
opaque gloo error. transformers' answer is `synced_gpus=True` (a finished rank keeps running
dummy forwards until an all-reduce says every rank is done), which it turns on by itself only
when it detects DeepSpeed ZeRO-3 (`is_deepspeed_zero3_enabled()`, a process-wide switch that
also changes `from_pretrained`) or FSDP (`is_fsdp_managed_module`: the FSDP2 attribute
`_is_fsdp_managed_module`, which torch.compile also reads and then rejects the module as
"FSDP with use_orig_params=False"). Neither can be borrowed safely, so each module of the model
that has transformers' `generate` gets an instance attribute that calls the class's generate
with `synced_gpus=True` when world_size > 1. The outputs are the same tokens (a finished rank's
extra forwards are discarded); the cost is those extra forwards and one all-reduce of a scalar
per token. An explicit `synced_gpus=False` cannot work at stage 3 (it would hang): it is turned
on too, with a warning. The attribute is removed with the optimizer's other hooks.

A generate below the optimizer's root module (PEFT: `PeftModel.generate` calls the base
model's) never enters the root module's forward, whose hook gathers the root unit (embeddings,
final norm): it failed on every rank with "'weight' must be 2-D". There the wrapper runs
generate with every unit gathered (what `opt.gathered_params()` does): correct, at the memory
of the full params (2 bytes/param at bf16) for the length of the generate call.
"""

from __future__ import annotations

import functools
import sys
import warnings
import weakref
from typing import List

import torch


class _Handle:
    def __init__(self, module: torch.nn.Module) -> None:
        self._module = weakref.ref(module)

    def remove(self) -> None:
        m = self._module()
        if m is not None and getattr(m.__dict__.get("generate"), "_zerokern_synced", False):
            del m.__dict__["generate"]


def _generation_mixin():
    mod = sys.modules.get("transformers.generation.utils")
    return None if mod is None else getattr(mod, "GenerationMixin", None)


def sync_generate(model: torch.nn.Module, world_size: int, sync) -> List[_Handle]:
    """Make `generate()` of every transformers model inside `model` synced across ranks
    (and gathered, below the root; `sync` is the stage-3 runtime)."""
    mixin = _generation_mixin()
    if mixin is None or (world_size <= 1 and all(m is model for m in model.modules()
                                                 if isinstance(m, mixin))):
        return []
    sync_ref = weakref.ref(sync)
    handles = []
    for m in model.modules():
        if not isinstance(m, mixin) or "generate" in m.__dict__:
            continue
        ref = weakref.ref(m)
        cls_generate = type(m).generate

        @functools.wraps(cls_generate)
        def generate(*args, ref=ref, cls_generate=cls_generate, below=m is not model,
                     **kwargs):
            if world_size > 1:
                if kwargs.get("synced_gpus", None) is False:
                    warnings.warn(
                        "zerokern stage 3: generate(synced_gpus=False) would hang when ranks "
                        "stop at different lengths (every forward all-gathers the sharded "
                        "params); running with synced_gpus=True (the same outputs)",
                        stacklevel=2)
                kwargs["synced_gpus"] = True
            s = sync_ref()
            if not below or s is None:
                return cls_generate(ref(), *args, **kwargs)
            s.gather_all()  # collective; every rank calls generate
            try:
                return cls_generate(ref(), *args, **kwargs)
            finally:
                s.release_all(write_back=False)

        generate._zerokern_synced = True
        m.__dict__["generate"] = generate
        handles.append(_Handle(m))
    return handles


__all__ = ["sync_generate"]
