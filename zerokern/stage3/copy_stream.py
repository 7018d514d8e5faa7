"""The param-offload copy stream: host -> device shard copies off the compute stream.

[Note: param offload copy stream] (issue 24, item 5)
With offload_params on a GPU, a unit's shard is copied from its pinned home to the device right
before its all-gather (param_offload.py [Note: param offload choices] 1). On the compute stream
that copy queues behind the running unit's kernels, so a prefetch cannot start moving bytes
before the compute queued ahead of it ends, and the compute after it waits for the copy. Here:
1. the copy stream waits for the compute stream once, at issue (the full buffer was just
   allocated there, and the previous unit's frees are ordered there);
2. on the copy stream: the device shard is allocated, the H2D copy is queued and the all-gather
   is issued (NCCL's stream waits for the copy stream, so the gather waits for the copy in
   stream order; the host never waits);
3. an event recorded on the copy stream after the gather call; finish_gather() makes the
   compute stream wait for it (covers a world-size-1 local copy and gloo's staging, which run
   on the stream current at the call) and then waits on the gather's handle as before.
The compute stream thus overlaps the next unit's copy and all-gather with this unit's kernels.
One copy stream per device, shared by every buffer of the optimizer: copies are serialised in
issue order, which is the gather schedule's order.
"""

from __future__ import annotations

from typing import Dict

import torch


class CopyStream:
    """One device's copy stream and the three stream operations of the Note."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)  # overlaps the compute stream

    def wait_compute(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def context(self):
        return torch.cuda.stream(self.stream)

    def record(self):
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def compute_waits(self, event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def used_by_compute(self, t: torch.Tensor) -> None:
        """t (the device shard, allocated on the copy stream) is freed from the compute stream
        after that waited for the gather: the allocator must not hand its block to the copy
        stream's next shard before then (with TORCH_NCCL_AVOID_RECORD_STREAMS NCCL does not
        record its read of it)."""
        t.record_stream(torch.cuda.current_stream(self.device))


_STREAMS: Dict[torch.device, CopyStream] = {}


def for_device(device: torch.device):
    """The copy stream of a CUDA device (made once), or None on the CPU."""
    if device.type != "cuda":
        return None
    if device not in _STREAMS:
        _STREAMS[device] = CopyStream(device)
    return _STREAMS[device]
