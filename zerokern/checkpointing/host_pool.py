"""Pa+cpu: checkpoints kept in host memory, in buffers from a bounded pool.

[Note: the host pool]
`cpu_checkpointing` copies each checkpointed input (after partitioning, when that is on) into a
host buffer and copies it back before the recompute. The buffers come from a pool keyed by
(dtype, numel): a buffer goes back to the pool when its checkpoint is freed (after the
backward), so the second step finds every buffer it needs and the pool allocates nothing after
the first step of a fixed-shape model (`allocations` counts them; the tests check it). The
pool holds at most the largest number of checkpoints alive at once; `max_bytes` bounds it
(None: no bound), and `reset()` frees it. The buffers are pinned when CUDA is available;
without CUDA they are ordinary host memory.

[Note: copies on a side stream]
On a GPU the device-to-host copy runs on a side stream: the side stream waits for the compute
stream (the tensor is written), copies into the pinned buffer without blocking, and records an
event; the device tensor is marked as used by the side stream (`record_stream`), so the
caching allocator does not reuse its memory before the copy is done, and the checkpoint keeps no
reference to it. Before the recompute the compute stream waits for that event and copies the
buffer back (non-blocking, from pinned memory); a second event, recorded after that copy, is
waited on by the side stream before its next copy into the buffer (a stream wait: the host does
not wait). The buffers are pinned for a tensor on an accelerator's device (asked of the tensor,
as the side stream is). On CPU the copies are plain `copy_`s.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from zerokern.platform.device import accelerator, handle, has_accelerator


class PoolExhausted(RuntimeError):
    """The host pool would grow past its `max_bytes`."""


class HostPool:
    """Host buffers for checkpoints ([Note: the host pool])."""

    def __init__(self, pin: Optional[bool] = None, max_bytes: Optional[int] = None) -> None:
        self.pin = has_accelerator() if pin is None else pin
        self._pin_given = pin     # None: also pinned for a tensor on an accelerator device
        self.max_bytes = max_bytes
        self._free: Dict[Tuple[torch.dtype, int], List[Tuple[torch.Tensor, object]]] = {}
        self.allocations = 0      # buffers ever allocated
        self.pool_bytes = 0       # bytes of every buffer the pool owns
        self.in_use_bytes = 0     # bytes handed out and not yet returned
        self.copies_out = 0       # copies into the pool (device -> host)
        self.copies_in = 0        # copies out of it (host -> device)
        self._stream = None

    def side_stream(self, device=None):
        """The side stream of `device`'s type (the tensor being copied), made once; None on the
        CPU. (Asked of the tensor's device, not of whether torch says an accelerator is
        available: the fake-CUDA harness says none is.)"""
        if self._stream is None:
            h = handle(device) if device is not None else accelerator()
            if h.is_accelerator:
                self._stream = h.stream(device)
        return self._stream

    def acquire(self, dtype: torch.dtype, numel: int, device=None, stream=None) -> torch.Tensor:
        """A 1-D host buffer of `numel` elements of `dtype`, from the pool if one is free.
        `device`: the device of the tensor it will hold (its buffer is pinned for an
        accelerator's); `stream`: the stream that will write it, made to wait for the buffer's
        last copy back (no host wait) where there is one."""
        free = self._free.get((dtype, numel))
        nbytes = numel * dtype.itemsize
        if free:
            buf, done = free.pop()
            if done is not None:  # its last copy back must have finished
                if stream is not None:
                    stream.wait_event(done)
                else:
                    done.synchronize()
        else:
            if self.max_bytes is not None and self.pool_bytes + nbytes > self.max_bytes:
                raise PoolExhausted(
                    f"cpu_checkpointing: the host pool would grow to {self.pool_bytes + nbytes}"
                    f" bytes, over its bound of {self.max_bytes}")
            pin = self.pin or (self._pin_given is None and device is not None
                               and handle(device).is_accelerator)
            buf = torch.empty(numel, dtype=dtype, pin_memory=pin)
            self.allocations += 1
            self.pool_bytes += nbytes
        self.in_use_bytes += nbytes
        return buf

    def release(self, buf: torch.Tensor, done=None) -> None:
        """Give `buf` back; `done` (a CUDA event or None) marks its last copy's end."""
        self.in_use_bytes -= buf.numel() * buf.element_size()
        self._free.setdefault((buf.dtype, buf.numel()), []).append((buf, done))

    def to_host(self, t: torch.Tensor) -> Tuple[torch.Tensor, object]:
        """Copy `t` (any device) into a pool buffer: (buffer, event or None)
        ([Note: copies on a side stream])."""
        flat = t.detach().reshape(-1)
        stream = self.side_stream(flat.device) if flat.device.type != "cpu" else None
        buf = self.acquire(flat.dtype, flat.numel(), flat.device, stream)
        self.copies_out += 1
        if stream is not None:
            dev = handle(flat)
            stream.wait_stream(dev.current_stream(flat.device))
            with dev.use_stream(stream):
                buf.copy_(flat, non_blocking=True)
                event = dev.recorded_event(stream)
            flat.record_stream(stream)
            return buf, event
        buf.copy_(flat)
        return buf, None

    def from_host(self, buf: torch.Tensor, event, device: torch.device) -> Tuple[torch.Tensor,
                                                                                 object]:
        """`buf` copied to `device`: (tensor, event marking the copy's end or None)."""
        self.copies_in += 1
        if device.type not in ("cpu", "meta"):
            dev = handle(device)
            stream = dev.current_stream(device)
            if event is not None:
                stream.wait_event(event)
            out = torch.empty(buf.shape, dtype=buf.dtype, device=device)
            out.copy_(buf, non_blocking=True)
            return out, dev.recorded_event(stream)
        if device.type == "cpu":  # host memory is the device: the buffer itself (it goes
            return buf, None      # back to the pool only when its checkpoint is freed)
        return buf.to(device), None

    def prefetch(self, buf: torch.Tensor, event, device: torch.device) -> Tuple[torch.Tensor,
                                                                                object]:
        """`buf` copied to `device` on the side stream, ahead of its use (store.py [Note:
        Pa+cpu's backward prefetch]): (tensor, event at the copy's end or None). On the CPU
        the buffer itself, as from_host (a no-op)."""
        if device.type in ("cpu", "meta"):
            return self.from_host(buf, event, device)
        self.copies_in += 1
        dev = handle(device)
        stream = self.side_stream(device)
        if event is not None:
            stream.wait_event(event)  # its device-to-host copy has landed
        with dev.use_stream(stream):
            out = torch.empty(buf.shape, dtype=buf.dtype, device=device)
            out.copy_(buf, non_blocking=True)
            done = dev.recorded_event(stream)
        return out, done

    def hand_over(self, t: torch.Tensor, done) -> None:
        """A prefetched tensor goes to the compute stream: it waits for the copy, and t's
        block is reused only after the compute stream is done with it."""
        if done is None or t.device.type == "cpu":
            return
        dev = handle(t)
        cur = dev.current_stream(t.device)
        cur.wait_event(done)
        t.record_stream(cur)

    def reset(self) -> None:
        """Free every pooled buffer (those in use are freed when their checkpoints are)."""
        self._free.clear()
        self.pool_bytes = self.in_use_bytes
