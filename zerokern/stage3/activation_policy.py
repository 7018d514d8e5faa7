"""Activation checkpointing policies on the model's units (issue 37, ZeRO-R's activations).

`ZeroOptimizer(..., activation_checkpointing=...)` applies one policy to every unit: the
stage-3 units (each child of every `nn.ModuleList` by default, or the `units=` policy's
modules; never the root), and at stages 0-2 each child of every `nn.ModuleList`:

    "full"       non-reentrant `torch.utils.checkpoint` around the unit's forward: only the
                 unit's inputs are held for backward; the whole unit is recomputed there.
    "selective"  the same, with torch's selective-checkpoint contexts
                 (`create_selective_checkpoint_contexts`): the outputs of the matmuls
                 (aten.mm / addmm / bmm / linear) and of attention
                 (scaled_dot_product_attention's kernels) are kept, the elementwise ops
                 (norms, activations, residual adds, softmax, dropout) are recomputed.
    "offload"    nothing is recomputed: every tensor the unit saves for backward (params
                 excepted) goes to host memory (`torch.autograd.graph.save_on_cpu`'s
                 semantics; pinned on a GPU, so the copies are asynchronous) and comes back
                 in the unit's backward, prefetched one unit ahead ([Note: offload's backward
                 prefetch]). On a CPU-only machine host memory is the device, so the tensors
                 stay where they are (nothing to move).
    None         nothing (the default).

[Note: policies and stage-3 gathers]
The policy replaces the unit module's `forward` (an instance attribute), so stage 3's module
hooks run around it as before: the pre-hook gathers the unit, the checkpointed forward runs,
the post-hook frees it and hooks its outputs. In backward the pre-hook on the output's grad_fn
re-gathers the unit before any node of the unit runs; the recompute starts at the first
unpack of a saved tensor of that node, so it runs on the gathered params. The recompute calls
the original `forward` directly (not the module), so no stage-3 hook runs twice; a unit nested
inside a unit is not wrapped (its outer unit's checkpoint covers it) and its own hooks see
`in_backward` ([Note: stage-3 collective order] in runtime.py). Dropout and other random ops
are replayed with the RNG state of the first forward (`preserve_rng_state=True`), so every
policy trains bit for bit as no checkpointing does on a deterministic backend.

[Note: offload's backward prefetch]
With "offload", each call of a unit (one forward of it) records the host copies its pack hook
made, and the call that ran before it. When the grad of the call's output is ready (a pre-hook
on its outputs' grad_fn, the moment stage 3's output hook re-gathers the unit: runtime.py), the
host copies of the call itself (when nothing prefetched them yet) and of the call before it,
the unit whose backward comes next, are copied back to the device on a copy stream of their own
(`CopyStream`: the stream waits for the compute stream, the copy is non-blocking from pinned
memory, an event marks its end). The unpack hook hands out the prefetched tensor once (the
compute stream waits for its event, and the tensor is marked as used by the compute stream);
a second unpack of the same saved tensor (retain_graph) copies again. Bounded to one unit
ahead: at each call's pre-hook, prefetched copies of any call other than this one and the one
before it (a call whose backward did not run, or not in reverse order) are dropped, so at most
the running unit's and the next unit's saved tensors are on the device (the running unit's
would be there anyway). The copy is issued before the next unit's first unpack (the order
tests/stage3/test_offload_prefetch.py checks through `trace`), and the tensors unpacked are
the same values either way (bitwise the same training). On a CPU-only machine there is no copy
stream (`CopyStream.for_device` is None) and host memory is the device: the prefetch hands out
the host copy itself (a no-op copy), so only its control flow runs there. The stream part goes
through the device handle (platform/device.py) as stage 3's gather stream does; it has run on
fake CUDA tensors only (tests/support/fake_cuda, scenario "stage3-offload-activations": no host
sync, no pageable or blocking host-to-device copy in forward or backward), never on a GPU.

[Note: what the activation rows count]
`report()` (memory_report()'s `activations` rows) counts what the units hold for backward:
"full" their inputs; "selective" their inputs and the outputs the policy kept; "offload" the
host copies. Each is tracked by a weak reference to its storage (unique storages, dropped
when autograd frees them), sampled after each unit's forward, where the peak is (the end of
forward). The root's own saved tensors (embeddings, head, loss) are not the units'; the
estimate (`zerokern.accounting.activations`) counts them too.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from zerokern.platform.device import handle

from .units import tensors_in

MODES = ("full", "selective", "offload")


def check_mode(mode: Any) -> Optional[str]:
    """`activation_checkpointing`'s value: None or one of MODES ("none" reads as None)."""
    if mode is None or mode == "none":
        return None
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"activation_checkpointing must be None, 'full', 'selective' or "
                         f"'offload', got {mode!r}")
    return mode


def _aten_ops(names: Sequence[str]) -> frozenset:
    ops = set()
    for n in names:
        packet = getattr(torch.ops.aten, n, None)
        if packet is not None:
            ops.update(getattr(packet, o) for o in packet.overloads())
    return frozenset(ops)


# The ops whose outputs "selective" keeps: matmuls, and attention's fused kernels (the
# composite scaled_dot_product_attention itself never reaches the dispatcher; its math
# fallback is bmm + softmax, whose bmm outputs are kept and softmax recomputed).
SAVED_OPS = _aten_ops([
    "mm", "addmm", "bmm", "baddbmm", "linear", "_scaled_mm",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
    "_efficient_attention_forward",
])


def selective_policy(ctx, func, *args, **kwargs):
    """The "selective" policy: keep matmul and attention outputs, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if func in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _storages(obj, out: list) -> list:
    out.extend(t.untyped_storage() for t in tensors_in(obj, []))
    return out


class _Held:
    """Unique storages by weak reference: the bytes of those still alive."""

    def __init__(self) -> None:
        self.refs: Dict[int, tuple] = {}

    def add(self, storage) -> None:
        if storage.nbytes() == 0:
            return
        key = storage._cdata
        old = self.refs.get(key)
        if old is None or old[0].expired():
            self.refs[key] = (StorageWeakRef(storage), storage.nbytes())

    def bytes(self) -> int:
        dead = [k for k, (w, _) in self.refs.items() if w.expired()]
        for k in dead:
            del self.refs[k]
        return sum(n for _, n in self.refs.values())


class CopyStream:
    """The host-to-device copy stream of offload's prefetch on one accelerator device ([Note:
    offload's backward prefetch]), through the device handle (platform/device.py);
    `for_device` answers None on the CPU."""

    _STREAMS: Dict[Any, CopyStream] = {}

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.dev = handle(device)
        self.stream = self.dev.stream(device)

    @classmethod
    def for_device(cls, device: torch.device) -> Optional[CopyStream]:
        if not handle(device).is_accelerator:
            return None
        device = handle(device).indexed(device)
        if device not in cls._STREAMS:
            cls._STREAMS[device] = cls(device)
        return cls._STREAMS[device]

    def to_device(self, host: torch.Tensor):
        """host copied to the device on this stream: (tensor, event at the copy's end)."""
        self.stream.wait_stream(self.dev.current_stream(self.device))
        with self.dev.use_stream(self.stream):
            out = torch.empty(host.size(), dtype=host.dtype, layout=host.layout,
                              device=self.device)
            out.copy_(host, non_blocking=host.is_pinned())
        return out, self.dev.recorded_event(self.stream)

    def hand_over(self, t: torch.Tensor, event) -> torch.Tensor:
        """The compute stream waits for the copy, and t's block is reused only after it."""
        cur = self.dev.current_stream(self.device)
        cur.wait_event(event)
        t.record_stream(cur)
        return t


class _Packed:
    """One saved tensor of an offloaded call: its device (None: kept as is) and host copy, and
    the prefetched device tensor until unpacked ([Note: offload's backward prefetch])."""

    __slots__ = ("device", "host", "ready", "event", "call", "__weakref__")

    def __init__(self, device, host, call) -> None:
        self.device, self.host, self.call = device, host, call
        self.ready = self.event = None


class _Call:
    """One call of an offloaded unit: its packed tensors (weakly: autograd owns them) and the
    call before it (the unit whose backward comes next)."""

    __slots__ = ("index", "packed", "prev", "prefetched", "__weakref__")

    def __init__(self, index: int, prev) -> None:
        self.index = index
        self.packed: List[weakref.ref] = []
        self.prev = prev               # weakref.ref to the previous _Call, or None
        self.prefetched = False


class ActivationPolicy:
    """One activation policy applied to modules (see the module's docstring)."""

    def __init__(self, modules: Sequence[nn.Module], mode: str,
                 pin_memory: Optional[bool] = None, preserve_rng_state: bool = True,
                 prefetch: bool = True, copy_on_cpu: bool = False) -> None:
        """prefetch: offload's backward prefetch, one unit ahead ([Note: offload's backward
        prefetch]). copy_on_cpu: offload copies CPU tensors too (into fresh host tensors;
        for the tests of the copy path on a CPU-only machine)."""
        self.mode = check_mode(mode)
        if self.mode is None:
            raise ValueError("ActivationPolicy needs a mode; None applies nothing")
        self.modules: List[nn.Module] = list(modules)
        self.pin_memory = pin_memory
        self.preserve_rng_state = preserve_rng_state
        self._held = _Held()   # inputs and kept outputs (full / selective)
        self._host = _Held()   # host copies (offload)
        self._records: List[list] = []  # per checkpoint taken: [input refs, recomputed]
        self.checkpoints_taken = 0
        self.recomputes = 0
        self.peak_saved_bytes = 0
        self.peak_host_bytes = 0
        self.peak_checkpoints_held = 0
        self.prefetch = prefetch
        self.copy_on_cpu = copy_on_cpu
        self.prefetches = 0    # calls whose host copies were prefetched
        self.prefetch_hits = 0  # unpacks served by a prefetched tensor
        self.trace: Optional[list] = None  # a list: ("backward" | "prefetch" | "unpack", call)
        self._call: Optional[_Call] = None      # the offloaded call running now
        self._last: Optional[weakref.ref] = None  # the call that ran last
        self._calls_made = 0
        self._ahead: List[weakref.ref] = []     # calls holding prefetched tensors
        self._own: List[tuple] = []
        for m in self.modules:
            had = "forward" in m.__dict__
            orig = m.__dict__["forward"] if had else m.forward
            old = getattr(orig, "_zerokern_policy", None)
            if old is not None:  # a newer optimizer on the same model: its policy replaces
                had, orig = old          # the older one (no checkpoint inside a checkpoint)
            wrapper = functools.wraps(orig)(functools.partial(self._run, orig))
            wrapper._zerokern_policy = (had, orig)
            m.forward = wrapper
            self._own.append((m, had, orig))

    # ---- the wrapped forward --------------------------------------------------------------
    def _run(self, orig, *args, **kwargs):
        if not torch.is_grad_enabled():
            return orig(*args, **kwargs)
        if self.mode == "offload":
            call = _Call(self._calls_made, self._last)
            self._calls_made += 1
            outer, self._call = self._call, call
            try:
                with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                    out = orig(*args, **kwargs)
            finally:
                self._call = outer
            self._last = weakref.ref(call)
            if self.prefetch and call.packed:
                self._hook_backward(call, out)
            self._sample()
            return out
        record = [[StorageWeakRef(s) for s in _storages((args, kwargs), [])], False]

        def fn(*a, **k):
            if record[1] is None:  # the first call is the forward
                record[1] = False
            else:
                record[1] = True
                self.recomputes += 1
            return orig(*a, **k)

        record[1] = None
        ctx = noop_context_fn
        cache = None
        if self.mode == "selective":
            fwd, rec = create_selective_checkpoint_contexts(selective_policy)
            cache = getattr(fwd, "storage", None)
            ctx = lambda: (fwd, rec)  # noqa: E731
        out = checkpoint(fn, *args, use_reentrant=False, context_fn=ctx,
                         preserve_rng_state=self.preserve_rng_state, **kwargs)
        self.checkpoints_taken += 1
        for s in _storages((args, kwargs), []):
            self._held.add(s)
        if cache is not None:  # the outputs the selective policy kept
            for outs in list(cache.values()):
                for s in _storages(outs, []):
                    self._held.add(s)
        self._records.append(record)
        self._sample()
        return out

    def _pack(self, t: torch.Tensor):
        param = isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)
        if param or (t.device.type == "cpu" and not self.copy_on_cpu):
            if not param:  # host memory is the device: kept as is (params and their views,
                self._host.add(t.untyped_storage())  # weight.t(), always stay)
            return self._record(_Packed(None, t, self._call))
        pin = handle(t).pins_host_memory if self.pin_memory is None else self.pin_memory
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=pin)
        host.copy_(t, non_blocking=pin)
        self._host.add(host.untyped_storage())
        return self._record(_Packed(t.device, host, self._call))

    def _record(self, p: _Packed) -> _Packed:
        if p.call is not None:
            p.call.packed.append(weakref.ref(p))
        return p

    def _unpack(self, p: _Packed):
        if self.trace is not None and p.call is not None:
            self.trace.append(("unpack", p.call.index))
        if p.ready is not None:  # prefetched: handed out once
            t, ev = p.ready, p.event
            p.ready = p.event = None
            self.prefetch_hits += 1
            stream = None if ev is None else CopyStream.for_device(t.device)
            return t if stream is None else stream.hand_over(t, ev)
        if p.device is None:
            return p.host
        return p.host.to(p.device, non_blocking=p.host.is_pinned())

    # ---- offload's backward prefetch ([Note: offload's backward prefetch]) -----------------
    def _hook_backward(self, call: _Call, out) -> None:
        ref = weakref.ref(self)
        cref = weakref.ref(call)

        def hook(*_):
            pol, c = ref(), cref()
            if pol is not None and c is not None:
                pol._backward_starts(c)

        seen = set()
        for t in tensors_in(out, []):
            if not t.requires_grad:
                continue
            fn = t.grad_fn
            if fn is None:
                t.register_hook(hook)
            elif id(fn) not in seen:
                seen.add(id(fn))
                fn.register_prehook(hook)

    def _backward_starts(self, call: _Call) -> None:
        """The grad of call's output is ready: its backward runs next, then the call's before
        (a call with several outputs comes here once per grad_fn: the rest is a no-op)."""
        if self.trace is not None:
            self.trace.append(("backward", call.index))
        prev = call.prev() if call.prev is not None else None
        keep = {id(call), id(prev)}
        for r in self._ahead:  # one unit ahead: drop prefetches nobody used in time
            c = r()
            if c is not None and id(c) not in keep:
                self._drop(c)
        self._ahead = [r for r in self._ahead if r() is not None and id(r()) in keep]
        for c in (call, prev):
            if c is not None and not c.prefetched:
                self._prefetch(c)

    def _prefetch(self, call: _Call) -> None:
        call.prefetched = True
        self.prefetches += 1
        if self.trace is not None:
            self.trace.append(("prefetch", call.index))
        for r in call.packed:
            p = r()
            if p is None or p.ready is not None:
                continue
            if p.device is None or p.device.type == "cpu":  # host memory is the device:
                p.ready = p.host                               # the host tensor (a no-op)
                continue
            stream = CopyStream.for_device(p.device)
            if stream is not None:  # (another device, no copy stream: the unpack copies)
                p.ready, p.event = stream.to_device(p.host)
        self._ahead.append(weakref.ref(call))

    def _drop(self, call: _Call) -> None:
        for r in call.packed:
            p = r()
            if p is not None:
                p.ready = p.event = None
        call.prefetched = False

    # ---- the report -------------------------------------------------------------------------
    def checkpoints_held(self) -> int:
        """Checkpoints taken whose recompute has not run, and whose inputs are still alive."""
        self._records = [r for r in self._records if r[1] is not True and
                         any(not w.expired() for w in r[0])]
        return len(self._records)

    def _sample(self) -> None:
        self.peak_saved_bytes = max(self.peak_saved_bytes, self._held.bytes()
                                    + self._host.bytes())
        self.peak_host_bytes = max(self.peak_host_bytes, self._host.bytes())
        self.peak_checkpoints_held = max(self.peak_checkpoints_held, self.checkpoints_held())

    def reset_peak(self) -> None:
        self.peak_saved_bytes = self.peak_host_bytes = self.peak_checkpoints_held = 0

    def report(self) -> Dict[str, Any]:
        """memory_report()'s activation rows ([Note: offload's backward prefetch]
With "offload", each call of a unit (one forward of it) records the host copies its pack hook
made, and the call that ran before it. When the grad of the call's output is ready (a pre-hook
on its outputs' grad_fn, the moment stage 3's output hook re-gathers the unit: runtime.py), the
host copies of the call itself (when nothing prefetched them yet) and of the call before it,
the unit whose backward comes next, are copied back to the device on a copy stream of their own
(`CopyStream`: the stream waits for the compute stream, the copy is non-blocking from pinned
memory, an event marks its end). The unpack hook hands out the prefetched tensor once (the
compute stream waits for its event, and the tensor is marked as used by the compute stream);
a second unpack of the same saved tensor (retain_graph) copies again. Bounded to one unit
ahead: at each call's pre-hook, prefetched copies of any call other than this one and the one
before it (a call whose backward did not run, or not in reverse order) are dropped, so at most
the running unit's and the next unit's saved tensors are on the device (the running unit's
would be there anyway). The copy is issued before the next unit's first unpack (the order
tests/stage3/test_offload_prefetch.py checks through `trace`), and the tensors unpacked are
the same values either way (bitwise the same training). On a CPU-only machine there is no copy
stream (`CopyStream.for_device` is None) and host memory is the device: the prefetch hands out
the host copy itself (a no-op copy), so only its control flow runs there. The stream part goes
through the device handle (platform/device.py) as stage 3's gather stream does; it has run on
fake CUDA tensors only (tests/support/fake_cuda, scenario "stage3-offload-activations": no host
sync, no pageable or blocking host-to-device copy in forward or backward), never on a GPU.

[Note: what the activation rows count])."""
        return {"policy": self.mode, "units": len(self.modules),
                "checkpoints_held": self.checkpoints_held(),
                "checkpoints_peak": self.peak_checkpoints_held,
                "checkpoints_taken": self.checkpoints_taken, "recomputes": self.recomputes,
                "saved_bytes": self._held.bytes() + self._host.bytes(),
                "saved_peak": self.peak_saved_bytes,
                "host_bytes": self._host.bytes(), "host_peak": self.peak_host_bytes}

    def remove(self) -> None:
        """Restore the modules' own forward."""
        for m, had, orig in self._own:
            if had:
                m.forward = orig
            else:
                m.__dict__.pop("forward", None)
        self._own = []


def outermost(modules: Sequence[nn.Module]) -> List[nn.Module]:
    """The modules not inside another of them (a nested unit is covered by its outer one)."""
    inner = set()
    for m in modules:
        for sub in m.modules():
            if sub is not m:
                inner.add(id(sub))
    return [m for m in modules if id(m) not in inner]


def policy_modules(model: nn.Module, units=None) -> List[nn.Module]:
    """The modules a policy wraps: the non-root units of `find_units(model, units)` (each
    child of every nn.ModuleList by default), outermost first."""
    from .units import find_units

    return outermost([u.module for u in find_units(model, units) if not u.is_root])


def apply_policy(model: nn.Module, mode: Optional[str], units=None, modules=None,
                 **kw) -> Optional[ActivationPolicy]:
    """Apply `mode` to the model's units (or to `modules`); None for mode None."""
    mode = check_mode(mode)
    if mode is None:
        return None
    mods = outermost(modules) if modules is not None else policy_modules(model, units)
    if not mods:
        raise ValueError(f"activation_checkpointing={mode!r}: the model has no units to "
                         "checkpoint (no nn.ModuleList children, and no units= policy that "
                         "names submodules)")
    return ActivationPolicy(mods, mode, **kw)


def check_policy_target(mode: Any, params_or_model, units=None) -> Optional[str]:
    """The optimizer's check, before anything changes: the mode, and a model to apply it to."""
    mode = check_mode(mode)
    if mode is not None and not isinstance(params_or_model, nn.Module):
        raise ValueError(f"activation_checkpointing={mode!r} needs the model (an nn.Module) as "
                         "the first argument, not its params: it wraps the model's units")
    if mode is not None and not policy_modules(params_or_model, units):
        raise ValueError(f"activation_checkpointing={mode!r}: the model has no units to "
                         "checkpoint (no nn.ModuleList children, and no units= policy that "
                         "names submodules)")
    return mode
