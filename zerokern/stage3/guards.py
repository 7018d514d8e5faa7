"""Stage 3: what the model's own API would get wrong with sharded params, caught or made right.

Between steps a stage-3 param is an empty tensor and its values live in the optimizer's shard
(sharded_flat.py). Anything that reads or replaces params behind the optimizer's back would
otherwise act on those empty tensors without a word. `ModelGuard` hooks the model so that:

- `model.state_dict()` outside `opt.gathered_params()` raises, naming gathered_params(): the
  values are not on this rank, and gathering them would be a collective that hangs when only
  rank 0 saves (the usual `if rank == 0: torch.save(model.state_dict())`). keep_vars=True is
  let through: it returns the Parameter objects themselves (what checkpoint code uses to
  name them), never copies of empty values. Inside gathered_params() the state dict holds
  copies of the gathered values, one per tied param ([Note: stage-3 state dicts own their
  values]), so savers see independent tensors and the dict outlives the block.
- `model.load_state_dict(full_sd)` loads anywhere, with no collective: each rank copies its
  own piece of every param from the full tensors into its shard (cast to the precision) and,
  for trainable params, the fp32 master (the full fp32 values, not the 16-bit rounding).
- A forward inside `DistributedDataParallel` raises: DDP would all-reduce grads that stage 3
  has already reduce-scattered and freed (it crashed deep in autograd on the [0]-shaped params).
- `model.to(device)` / `.half()` / `.float()` after the optimizer was built raises at the next
  forward or step (the params are the optimizer's views; a moved or cast empty tensor would be
  silently replaced by the next gather), and so does a changed set of parameters.
- `copy.deepcopy(model)` (torch.optim.swa_utils.AveragedModel, an EMA) or `torch.save(model)`
  outside `opt.gathered_params()` raises, naming gathered_params() ([Note: a copy of a
  stage-3 model]); inside the block the copy holds the full values and runs as a plain model.
Hooks hold the sync through a weak reference ([Note: weak, eager hooks] in weak_hook.py).
"""

from __future__ import annotations

import weakref
from typing import List

import torch

from zerokern.geometry.dtensor_params import is_dtensor, like_param, local
from zerokern.grads.weak_hook import weak_hook

from .sharded_flat import Residency


def _none():
    """What a pickled CopyGuard becomes when loaded: no `__deepcopy__` of its own, so
    copy.deepcopy copies the (then plain) param as torch does."""
    return None


class CopyGuard:
    """A stage-3 param's `__deepcopy__` (an instance attribute, which copy.deepcopy finds before
    Parameter's own).

    [Note: a copy of a stage-3 model]
    Between steps a stage-3 param is an empty tensor. `copy.deepcopy(model)` (what
    torch.optim.swa_utils.AveragedModel, timm's ModelEma and hand-written EMAs do) copied those
    empty tensors: the copy's forward then failed with a KeyError from our hooks, and an EMA
    updated from the model outside gathered_params() copied empty into empty, silently.
    `torch.save(model)` pickled the empty tensors, a checkpoint with no values. So copying or
    pickling a param while it is sharded raises, naming gathered_params(); inside the block
    the param holds its full values and is copied as torch copies it (the copy is a plain
    Parameter; the model's hooks, shared by the copy's modules, let modules that are not the
    model's run untouched, runtime.py). Pickling the guard while the param is whole gives
    `_none` (the loaded param copies as torch's)."""

    def __init__(self, guard: ModelGuard, p: torch.nn.Parameter) -> None:
        self._guard = weakref.ref(guard)
        self._p = weakref.ref(p)

    def _check(self, what: str):
        guard, p = self._guard(), self._p()
        if guard is not None and p is not None:
            guard.refuse_copy(p, what)
        return p

    def __call__(self, memo):
        p = self._check("copy.deepcopy")
        if p is None:
            raise RuntimeError("zerokern stage 3: a param's copy guard outlived its param")
        return type(p).__deepcopy__(p, memo)

    def __reduce__(self):
        self._check("pickling (torch.save(model))")
        return (_none, ())


def _ddp_forward_active() -> bool:
    ddp = torch.nn.parallel.DistributedDataParallel
    return getattr(ddp, "_active_ddp_module", None) is not None


class ModelGuard:
    def __init__(self, sync, model: torch.nn.Module) -> None:
        self._sync = weakref.ref(sync)
        self.model_ref = weakref.ref(model)
        self._param_ids = [id(p) for p in model.parameters()]
        # param id -> (buffer, slot index), for every sharded param, trainable and frozen
        self.where = {id(p): (f, i) for f in list(sync.groups) + sync.frozen
                      for i, p in enumerate(f.params)}
        f0 = sync.groups[0]
        self.dtype, self.device = f0.dtype, f0.device
        self.hooks: List = []
        self._names = {}  # param id -> its (first) name, for the errors
        for name, p in model.named_parameters(remove_duplicate=False):
            self._names.setdefault(id(p), name)
        self._loaded = []  # (buffer, slot) that this load_state_dict wrote ([Note: a write to
        # a sharded param]: torch's copy_ moves their counters; the post-hook takes them)
        for f in list(sync.groups) + sync.frozen:  # [Note: a copy of a stage-3 model]
            for p in f.params:
                if isinstance(p, torch.nn.Parameter):
                    p.__deepcopy__ = CopyGuard(self, p)
        on_sd, on_load = weak_hook(self, "_on_state_dict"), weak_hook(self, "_on_load")
        loaded = weak_hook(self, "_after_load")
        own = weak_hook(self, "_own_values")
        for mod in model.modules():  # any module's state_dict() may be the top call
            self.hooks.append(mod.register_state_dict_post_hook(
                lambda m, sd, prefix, meta: own(m, sd, prefix)))
        for mod in model.modules():
            if not any(id(p) in self.where for p in mod._parameters.values() if p is not None):
                continue
            self.hooks.append(mod.register_state_dict_pre_hook(
                lambda m, prefix, keep_vars: on_sd(m, keep_vars)))
            self.hooks.append(mod.register_load_state_dict_pre_hook(
                lambda m, sd, prefix, *rest: on_load(m, sd, prefix, *rest)))
            self.hooks.append(mod.register_load_state_dict_post_hook(
                lambda m, incompatible: loaded()))

    # ---- checks -------------------------------------------------------------------------------
    def check_forward(self) -> None:
        if _ddp_forward_active():
            raise RuntimeError(
                "zerokern stage 3: the model runs inside torch.nn.parallel."
                "DistributedDataParallel. Do not wrap a ZeroAdamW-managed model in DDP: "
                "ZeroAdamW reduces the gradients itself (at stage 3 it reduce-scatters them "
                "and frees the full params, which DDP's all-reduce cannot work with). Call the "
                "model directly (with Hugging Face Trainer/accelerate, let them see no DDP: "
                "e.g. build the optimizer yourself and pass the unwrapped model)")
        self.check_params("forward")

    def check_step(self) -> None:
        self.check_params("step()")

    def check_params(self, where: str) -> None:
        model = self.model_ref()
        if model is None:
            return
        # The model's params now (a .to() may have replaced them) and the optimizer's.
        params = list(model.parameters())
        moved = [p for p in params + [f.params[i] for f, i in self.where.values()]
                 if p.is_floating_point() and (p.dtype, p.device) != (self.dtype, self.device)]
        if moved:
            p = moved[0]
            raise RuntimeError(
                f"zerokern stage 3 ({where}): a param is now {p.dtype} on {p.device}, but "
                f"ZeroAdamW holds the params as {self.dtype} on {self.device}: model.to()/.cuda()/"
                ".half()/.float() ran after the optimizer was built. At stage 3 the params "
                "live in the optimizer's shards: move the model to its device before "
                "creating ZeroAdamW, and choose the dtype with precision= (the optimizer "
                "casts the model)")
        if [id(p) for p in params] != self._param_ids:
            raise ValueError("zerokern stage 3: the model's parameters changed after ZeroAdamW "
                             "wrapped it (a module replaced or added, or a parameter created "
                             "after wrapping); build the model completely, then create the "
                             "optimizer")
        self.check_writes(where)

    def check_writes(self, where: str) -> None:
        """[Note: a write to a sharded param] (sharded_flat.py): raise where a param was written
        in place between steps (the write did nothing)."""
        sync = self._sync()
        if sync is None:
            return
        for f in list(sync.groups) + sync.frozen:
            if f.residency is Residency.SHARD:
                written = f.unseen_writes()
                if written:
                    self.raise_write(where, f.params[written[0]], inside_block=False)

    def refuse_copy(self, p, what: str) -> None:
        """Raise where p is sharded now ([Note: a copy of a stage-3 model])."""
        place = self.where.get(id(p))
        if place is None:
            return
        f, i = place
        if p.numel() == 0 and f.layout.slots[i].numel > 0:
            raise RuntimeError(
                f"zerokern stage 3: {what} of param '{self.param_name(p)}' outside "
                "opt.gathered_params(): between steps each rank holds only its piece of the "
                "params and the param tensors are empty, so a copy of the model (copy.deepcopy, "
                "torch.optim.swa_utils.AveragedModel, an EMA) or a pickled model would hold "
                "no values. Copy it inside `with opt.gathered_params():` on every rank "
                "(collective), and update an EMA inside the block too; to save, use "
                "zerokern.checkpoint.save(path, model, opt) or a state dict taken inside the "
                "block")

    def param_name(self, p) -> str:
        """p's name in the model (its first, for a tied param)."""
        return self._names.get(id(p), "?")

    def raise_write(self, where: str, p, inside_block: bool) -> None:
        """Raise, posted (a write on one rank only leaves the others waiting in the next
        gather: comm/abort.py), for an in-place write to p between steps, or inside
        gathered_params() without modify=True (`inside_block`: discarded at its end)."""
        name = self.param_name(p)
        if inside_block:
            why = (f"param '{name}' was changed in place inside opt.gathered_params() without "
                   "modify=True, and the change was discarded at the block's end: use `with "
                   "opt.gathered_params(modify=True):`")
        else:
            why = (f"param '{name}' was changed in place between steps (an in-place op under "
                   "no_grad such as weight clipping, nn.init, model.apply(init)), but at stage "
                   "3 a param holds no values between steps (they are sharded in the "
                   "optimizer), so the change did nothing. Change params inside `with "
                   "opt.gathered_params(modify=True):` (collective), or load them with "
                   "model.load_state_dict(full_state_dict)")
        error = RuntimeError(f"zerokern stage 3 ({where}): {why}")
        sync = self._sync()
        if sync is not None:
            sync.comm.signal_failure(error)
        raise error

    # ---- state dicts ----------------------------------------------------------------------------
    def _on_state_dict(self, module, keep_vars: bool) -> None:
        sync = self._sync()
        if sync is None or keep_vars or sync.all_gathered:
            return
        if not any(id(p) in self.where for p in module._parameters.values() if p is not None):
            return  # a copy's module ([Note: a copy of a stage-3 model]): its own params
        raise RuntimeError(
            "zerokern stage 3: model.state_dict() outside opt.gathered_params(): the params "
            "are sharded across ranks and this rank holds only its piece (the param tensors "
            "are empty between steps). On every rank, wrap it: `with opt.gathered_params(): "
            "sd = model.state_dict()` (collective; then save on rank 0), or save with "
            "zerokern.checkpoint.save(path, model, opt)")

    def _own_values(self, module, state_dict, prefix) -> None:
        """Inside gathered_params(): the state dict gets copies of the gathered values.

        [Note: stage-3 state dicts own their values] (issue 21, item 5)
        The gathered params are views of their unit's full buffer: one storage per unit, freed
        (resized to 0) when gathered_params() exits. A state dict of views would (a) look like
        aliased tensors to every saver that keys on the storage (accelerate keeps one name per
        storage and drops the rest; safetensors.save_model refuses) and (b) hold no values
        once the block exits, where the usual `with opt.gathered_params(): sd =
        model.state_dict()` then `torch.save(sd)` uses it. Stage 0-2's zero-copy alias
        (layout/param_alias.py) cannot follow the resize, so the values are cloned: the state dict
        costs one more copy of the params in the model dtype (2 bytes/param at bf16) for as
        long as the caller keeps it, as `ZeroAccelerator.get_state_dict` always did.
        keep_vars=True (the Parameters themselves) is left alone. Done once, by the module
        whose state_dict() was called (prefix ""), so that a tied param gets ONE copy under
        all its names (savers recognise the tie by the shared storage)."""
        sync = self._sync()
        if prefix or sync is None or not sync.all_gathered:
            return
        copies = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            v = state_dict.get(name)
            if id(p) not in self.where or v is None or v is p:
                continue
            if id(p) not in copies:
                copies[id(p)] = v.clone()
            state_dict[name] = copies[id(p)]

    @torch.no_grad()
    def _on_load(self, module, state_dict, prefix, local_metadata, strict, missing, unexpected,
                 error_msgs) -> None:
        """Load this module's own sharded params from full tensors into this rank's shard."""
        for name, p in module._parameters.items():
            key = prefix + name
            if p is None or id(p) not in self.where or key not in state_dict:
                continue
            f, i = self.where[id(p)]
            slot = f.layout.slots[i]
            value = state_dict[key]
            if is_dtensor(value) or is_dtensor(p):  # tensor parallel: this rank's local part
                if not (is_dtensor(value) and is_dtensor(p)
                        and tuple(value.placements) == tuple(p.placements)
                        and value.device_mesh == p.device_mesh):
                    error_msgs.append(f"{key}: a DTensor param loads a DTensor of the same "
                                      "mesh and placements (got "
                                      f"{getattr(value, 'placements', type(value).__name__)})")
                    state_dict[key] = like_param(p, torch.empty(0, dtype=p.dtype,
                                                                device=p.device))
                    self._loaded.append((f, i))
                    continue
                value = local(value)
            if f.gathered:  # inside gathered_params(): torch copies into the full view
                if isinstance(value, torch.Tensor) and tuple(value.shape) == slot.shape:
                    # the shard takes it when the unit is freed, unless the ranks disagree
                    # ([Note: a write on some ranks only] in runtime.py)
                    f.pending_loads.append((i, value))
                    f.loaded_while_gathered = True
                    self._loaded.append((f, i))
                continue
            if local_metadata.get("assign_to_params_buffers", False):
                error_msgs.append(f"{key}: load_state_dict(assign=True) would replace a "
                                  "stage-3 param that ZeroAdamW shards; use assign=False")
            elif not isinstance(value, torch.Tensor) or tuple(value.shape) != slot.shape:
                shape = getattr(value, "shape", type(value).__name__)
                error_msgs.append(f"size mismatch for {key}: copying a param with shape "
                                  f"{tuple(shape) if isinstance(value, torch.Tensor) else shape}"
                                  f" from checkpoint, the shape in current model is "
                                  f"{slot.shape}")
            elif getattr(f, "param_scales", None) is not None:  # FP8 codes: an agreed scale
                error_msgs.append(f"{key}: param_format='fp8' params are loaded with "
                                  "zerokern.checkpoint, or set inside "
                                  "opt.gathered_params(modify=True) (their FP8 scales are "
                                  "agreed across ranks)")
            else:
                f.load_piece_(i, value)
            self._loaded.append((f, i))  # (torch's copy of the empty value moves its counter)
            # The param is an empty tensor now: hand torch's own copy an empty value (of the
            # param's kind: a DTensor keeps its global shape over an empty local tensor).
            state_dict[key] = like_param(p, torch.empty(0, dtype=p.dtype, device=p.device))

    def _after_load(self) -> None:
        """After a module's load: its params' counters moved by torch's copies, which wrote
        the loaded values into the shards (_on_load; or will, when a gathered unit is freed),
        not a write to lose."""
        for f, i in self._loaded:
            f.see_writes(i)
        self._loaded = []
