"""The negative control of test_gpu.py's host-wait count (issue 24): torch's sync-debug mode
does not see Event.synchronize, so test_step_does_not_sync also counts it. Here, on the CPU,
a call of torch.cuda.Event.synchronize / Stream.synchronize inside `_counting_host_waits` is
recorded with its caller (the real method is then called on a stand-in and fails, which is
fine: only the record matters), so the GPU check can fail; outside the block nothing is
recorded and the methods are restored."""

from __future__ import annotations

import torch

from ..gpu.test_gpu import ALLOWED_WAITS, _counting_host_waits


def _caller_waits(cls):
    try:
        cls.synchronize(object())
    except Exception:  # noqa: BLE001 - no CUDA here; the record happened before the call
        pass


def test_counter_sees_event_and_stream_synchronize():
    before = (torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize)
    with _counting_host_waits() as waits:
        _caller_waits(torch.cuda.Event)
        _caller_waits(torch.cuda.Stream)
    assert waits == [("Event", "test_host_wait_counter.py", "_caller_waits"),
                     ("Stream", "test_host_wait_counter.py", "_caller_waits")]
    assert not [w for w in waits if w in ALLOWED_WAITS]  # these would fail the GPU test
    assert (torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize) == before
