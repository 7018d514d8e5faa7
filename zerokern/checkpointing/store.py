"""Where a checkpointed input is kept between the forward and the recompute: the saved-tensor
hooks around torch's non-reentrant checkpoint.

[Note: hooks around torch's checkpoint]
`torch.utils.checkpoint(use_reentrant=False)` keeps a checkpointed call's tensor inputs as
saved tensors, made while the caller's saved-tensor hooks are active (the call's own ops save
through torch's inner hooks, which hold nothing), and its recompute reads them back through
those hooks. `checkpoint` wraps torch's call in this store's `saved_tensors_hooks`, so the pack
hook sees exactly the checkpointed inputs and the unpack hook runs right before the recompute;
autograd, the recompute and its RNG replay stay torch's. Pack keeps each input one of four ways:
- as it is (no option applies): the reference torch would keep;
- its 1/tp piece (partition_activations: partition.py [Note: partitioned checkpoints]);
- in a row of a contiguous buffer (contiguous.py [Note: contiguous checkpoint buffers]);
- in a host buffer from the pool (cpu_checkpointing: host_pool.py [Note: the host pool]);
(the last three combine: the piece goes into the row or the host buffer). Unpack brings it back
to its device and all-gathers the pieces. A kept input is freed, and its host buffer returned
to the pool, when autograd frees the saved tensor (after the backward, or when the graph is
dropped). As DeepSpeed, only floating tensors are split, offloaded or made contiguous; other
inputs (masks, indices) are kept as they are.

[Note: Pa+cpu's backward prefetch]
With checkpoints in host memory (cpu_checkpointing), each checkpointed call records its host-
kept inputs and the call before it. When the recompute of a call starts (the first unpack of
one of its inputs), its own inputs come back on the compute stream as before, and then the host
copies of the call before it, whose recompute comes next, are copied to the device on the
pool's side stream (after the event of their device-to-host copy; an event marks the end);
their unpack hands the copy out once (the compute stream waits for its event; the tensor is
marked as used by the compute stream). One call ahead: at each recompute's start, prefetched
copies of any call other than this one and the one before it are dropped, so at most the running
checkpoint's inputs and the next one's are on the device. On the CPU the copy back is the host
buffer itself, so the prefetch is a no-op and only its control flow runs
(tests/checkpointing/test_prefetch.py); the stream part goes through the device handle and has
run on fake CUDA tensors only (tests/support/fake_cuda, scenario "stage3-cpu-checkpointing": no
host sync, host wait or pageable copy in forward or backward), never on a GPU. `prefetch =
False` on the store turns it off.

[Note: what stats() counts]
checkpoints (inputs kept now), device_bytes / host_bytes (the bytes they hold where they are
kept: on their device, or in host memory), peak_bytes (the largest device_bytes + host_bytes
since the last reset), pool_allocations / pool_bytes (host buffers ever allocated / owned by
the pool), copies_to_host / copies_from_host (checkpoints copied into the pool / restored from
it), gathers (all-gathers of pieces), prefetches (calls whose host inputs were prefetched:
[Note: Pa+cpu's backward prefetch]), contiguous_bytes (bytes of the contiguous buffers),
forward_s / recompute_s (with profile=True: the time in checkpointed forwards / recomputes).
An input kept as it is counts its own bytes, though its storage may be shared with a tensor the
model holds anyway.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, Optional

import torch

from zerokern.platform.device import handle

from . import partition
from .contiguous import ContiguousBuffers
from .groups import TPGroup
from .host_pool import HostPool


class _Kept:
    """One checkpointed input, as kept ([Note: hooks around torch's checkpoint]); returns its
    bytes (and its host buffer) when autograd frees it."""

    __slots__ = ("store", "data", "shape", "numel", "device", "split", "where", "nbytes",
                 "pooled", "event", "done", "call", "ready", "ready_done", "__weakref__")

    def __del__(self) -> None:
        store = self.store
        if store is not None:
            store._forget(self)


class _Call:
    """One checkpointed call's host-kept inputs (weakly: autograd owns them) and the call before
    it ([Note: Pa+cpu's backward prefetch])."""

    __slots__ = ("index", "kept", "prev", "started", "prefetched", "__weakref__")

    def __init__(self, index: int, prev) -> None:
        self.index, self.prev = index, prev
        self.kept: list = []
        self.started = self.prefetched = False


class Store:
    """The pack/unpack hooks of one configuration, and its counters ([Note: what stats()
    counts])."""

    def __init__(self, tp: TPGroup, partition_activations: bool, checkpoint_in_cpu: bool,
                 contiguous: bool, num_checkpoints: Optional[int]) -> None:
        self.tp = tp
        self.split = partition_activations and tp.size > 1
        self.cpu = checkpoint_in_cpu
        self.pool = HostPool()
        self.contiguous = ContiguousBuffers(num_checkpoints, host=checkpoint_in_cpu,
                                            pin=self.pool.pin) if contiguous else None
        self._lock = threading.Lock()
        self.live = 0
        self.device_bytes = 0
        self.host_bytes = 0
        self.peak_bytes = 0
        self.gathers = 0
        self.forward_s = 0.0
        self.recompute_s = 0.0
        self._row: Optional[int] = None
        self._index = 0
        self.prefetch = True   # [Note: Pa+cpu's backward prefetch]
        self.prefetches = 0
        self.prefetch_hits = 0  # inputs handed out from a prefetch
        self.trace: Optional[list] = None  # a list: ("unpack" | "prefetch", call index)
        self._calls = 0
        self._call: Optional[_Call] = None
        self._last = None                   # weakref to the last call
        self._ahead: list = []              # weakrefs to calls holding prefetched copies

    # ---- one checkpointed call ----------------------------------------------------------
    def check_room(self) -> None:
        """Raise before a call that would pass num_checkpoints (nothing changes)."""
        if self.contiguous is not None:
            self.contiguous.check_room(self.live == 0)

    def begin_call(self) -> None:
        self._row = None if self.contiguous is None else \
            self.contiguous.begin_call(self.live == 0)
        self._index = 0
        self._call = _Call(self._calls, self._last)
        self._calls += 1
        self._last = weakref.ref(self._call)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    # ---- the hooks ----------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> _Kept:
        x = t.detach()
        k = _Kept()
        k.store, k.shape, k.numel, k.device = None, x.shape, x.numel(), x.device
        k.split, k.pooled, k.event, k.done = False, False, None, None
        k.call = k.ready = k.ready_done = None
        index = self._index
        self._index += 1
        managed = x.is_floating_point() and (self.split or self.cpu or self.contiguous)
        if not managed:
            k.data, k.where = x, "device"
        else:
            k.split = self.split and partition.splittable(x, self.tp)
            src = partition.my_piece(x, self.tp) if k.split else x.reshape(-1)
            row = None
            if self.contiguous is not None and self._row is not None:
                row = self.contiguous.row(self._row, index, src)
            if row is not None:
                if row.device.type == "cpu" and handle(src).has_streams:
                    k.data, k.event = self._copy_into_host(src, row)
                else:
                    row.copy_(src)
                    k.data = row
                    if self.cpu:
                        self.pool.copies_out += 1
                k.where = "host" if self.cpu else "device"
            elif self.cpu:
                k.data, k.event = self.pool.to_host(src)
                k.where, k.pooled = "host", True
            else:  # split only: a copy of the piece, so that the whole input can be freed
                k.data = src.clone() if src._base is not None or src is x else src
                k.where = "device"
        k.nbytes = k.data.numel() * k.data.element_size()
        if k.where == "host" and self._call is not None:
            k.call = self._call
            self._call.kept.append(weakref.ref(k))
        with self._lock:
            self.live += 1
            if k.where == "host":
                self.host_bytes += k.nbytes
            else:
                self.device_bytes += k.nbytes
            self.peak_bytes = max(self.peak_bytes, self.device_bytes + self.host_bytes)
        k.store = self
        return k

    def _copy_into_host(self, src: torch.Tensor, row: torch.Tensor):
        """A device piece into a host row of a contiguous buffer, on the side stream."""
        dev = handle(src)
        stream = self.pool.side_stream(src.device)
        stream.wait_stream(dev.current_stream(src.device))
        with dev.use_stream(stream):
            row.copy_(src, non_blocking=True)
            event = dev.recorded_event(stream)
        src.record_stream(stream)
        self.pool.copies_out += 1
        return row, event

    def unpack(self, k: _Kept) -> torch.Tensor:
        data = k.data
        if k.where == "host":
            call = k.call
            if self.trace is not None and call is not None:
                self.trace.append(("unpack", call.index))
            if k.ready is not None:  # prefetched: handed out once
                data, k.done = k.ready, k.ready_done
                k.ready = k.ready_done = None
                self.prefetch_hits += 1
                self.pool.hand_over(data, k.done)
            else:
                data, k.done = self.pool.from_host(data, k.event, k.device)
            if call is not None and not call.started:  # this call's recompute starts
                call.started = True
                if self.prefetch:
                    self._prefetch_before(call)
        if k.split:
            with self._lock:
                self.gathers += 1
            return partition.gather(data, k.numel, k.shape, self.tp)
        return data.view(k.shape)

    def _prefetch_before(self, call: _Call) -> None:
        """[Note: Pa+cpu's backward prefetch]: the call before this one, one call ahead."""
        prev = call.prev() if call.prev is not None else None
        keep = {id(call), id(prev)}
        for r in self._ahead:
            c = r()
            if c is not None and id(c) not in keep:
                for kr in c.kept:
                    k = kr()
                    if k is not None:
                        k.ready = k.ready_done = None
                c.prefetched = False
        self._ahead = [r for r in self._ahead if r() is not None and id(r()) in keep]
        if prev is None or prev.prefetched:
            return
        prev.prefetched = True
        self.prefetches += 1
        if self.trace is not None:
            self.trace.append(("prefetch", prev.index))
        for kr in prev.kept:
            k = kr()
            if k is not None and k.ready is None:
                k.ready, k.ready_done = self.pool.prefetch(k.data, k.event, k.device)
                k.done = k.ready_done  # the buffer's last copy, for the pool's reuse
        self._ahead.append(weakref.ref(prev))

    def _forget(self, k: _Kept) -> None:
        with self._lock:
            self.live -= 1
            if k.where == "host":
                self.host_bytes -= k.nbytes
            else:
                self.device_bytes -= k.nbytes
        if k.pooled:
            self.pool.release(k.data, k.done)
        k.store = None

    # ---- bookkeeping --------------------------------------------------------------------
    def reset(self) -> None:
        if self.contiguous is not None:
            self.contiguous.reset()
        self.pool.reset()
        self.peak_bytes = self.device_bytes + self.host_bytes

    def stats(self) -> Dict[str, Any]:
        return {"checkpoints": self.live, "device_bytes": self.device_bytes,
                "host_bytes": self.host_bytes, "peak_bytes": self.peak_bytes,
                "pool_allocations": self.pool.allocations, "pool_bytes": self.pool.pool_bytes,
                "copies_to_host": self.pool.copies_out,
                "copies_from_host": self.pool.copies_in, "gathers": self.gathers,
                "prefetches": self.prefetches,
                "contiguous_bytes": 0 if self.contiguous is None else
                self.contiguous.allocated_bytes,
                "forward_s": self.forward_s, "recompute_s": self.recompute_s}
