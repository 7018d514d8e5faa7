"""Stage 3's gather stream: all-gathers (and param offload's H2D fetch) off the compute stream.

[Note: stage-3 gather stream] (issue 24, items 3 and 5)
Stage 3 issues its all-gathers on one process group and its reduce-scatters on another
([Note: stage-3 collective order], rule 2), each in a static order, interleaved the same way on
every rank (rule 4). What must not happen is a wait that makes a gather
depend on a reduce-scatter: the compute stream waits for reduce-scatters (bounded staging,
MAX_IN_FLIGHT), and a gather issued from the compute stream makes NCCL's stream wait for the
compute stream, so rank A's gather G could wait for its reduce-scatter R while rank B's R waits
(through B's compute stream) for B's G: a cycle across ranks, a hang. So on a GPU:
1. every all-gather is issued with this stream current: NCCL's stream waits for the gather
   stream, never for the compute stream; its output (`full`) and, for param offload, the
   device shard are allocated on this stream, and the H2D fetch of the shard runs on it too
   (it overlaps the running unit's kernels: item 5);
2. the gather stream waits for the compute stream once per pass (a forward, a backward,
   gather_all, frozen_whole starts: `new_epoch`), before any reduce-scatter of that pass was
   issued: that orders the gathers after the step that wrote the shards, and after the last
   pass's reduce-scatters, which every rank issues in full by the end of its backward;
3. an event recorded on this stream after each gather call; the compute stream waits for it
   before the params are used (finish_gather) or the buffer is dropped (free), then the
   buffers are marked as used by the compute stream (record_stream) so the allocator hands
   their blocks back to this stream only after the compute stream is done with them.
Gathers then depend only on earlier gathers (the same static sequence on every rank) and on
the pass start; reduce-scatters depend on the compute stream and earlier reduce-scatters (one
static order). No cycle is left through streams or waits. The host issues the two groups'
collectives in one interleaving on every rank (rule 4), which is what NCCL asks of several
communicators: a device-synchronising CUDA call (cudaFree, and possibly cudaMalloc: the caching
allocator's cache misses, torch.cuda.empty_cache(), an allocation retry near OOM) blocks a
rank's host until its queued kernels finish. If rank A stops at position X of the common
sequence and rank B at Y >= X, every kernel A queued has its partner queued on B, and nothing
B queued before X depends on work queued after it (streams are FIFO, and every wait above
points to earlier work), so A's kernels finish, A's host goes on and reaches Y too. With
rank-dependent interleavings A could wait on a kernel whose partner B queues only after the
call that blocks B: a hang.
On the CPU (gloo) there are no streams: nothing here runs.
"""

from __future__ import annotations

from typing import Dict

import torch

from zerokern.platform.device import handle


class GatherStream:
    """One device's gather stream and the stream operations of the Note."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.dev = handle(device)
        self.stream = self.dev.stream(device)  # overlaps the compute stream

    def new_epoch(self) -> None:
        """2: the gather stream waits for everything queued on the compute stream so far."""
        self.stream.wait_stream(self.dev.current_stream(self.device))

    def context(self):
        return self.dev.use_stream(self.stream)

    def record(self):
        return self.dev.recorded_event(self.stream)

    def compute_waits(self, event) -> None:
        self.dev.current_stream(self.device).wait_event(event)

    def used_by_compute(self, t: torch.Tensor) -> None:
        """t, allocated on this stream, is about to be freed from the compute stream, which has
        used it (or waited for its gather): its block is reused here only after that."""
        t.record_stream(self.dev.current_stream(self.device))


_STREAMS: Dict[torch.device, GatherStream] = {}


def for_device(device: torch.device):
    """The gather stream of a CUDA device (made once), or None on the CPU."""
    if not handle(device).has_streams:
        return None
    if device.index is None:
        device = handle(device).current_device()
    if device not in _STREAMS:
        _STREAMS[device] = GatherStream(device)
    return _STREAMS[device]
