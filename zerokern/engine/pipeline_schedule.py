"""The order in which one pipeline stage runs its micro-batches: 1F1B for training, forwards
only for evaluation (the pipeline engine, engine/pipeline_engine.py, executes it).

[Note: the 1F1B order]
Stage `s` of `P` warms up with min(P - 1 - s, M) forwards, then alternates one forward and one
backward, then runs the backwards left. At most min(P - s, M) micro-batches are in flight on
stage s (forwarded, not yet backwarded), the bound of DeepSpeed's TrainSchedule
(`num_pipe_buffers`), and the backwards run in micro-batch order on every stage, as DeepSpeed's.
DeepSpeed interleaves the same computations on an even/odd step clock so that its blocking
sends pair up; zerokern posts its sends asynchronously (engine/pipeline_p2p.py) and needs only
a per-stage order in which every receive is eventually matched, which this one is (the
schedule Megatron-LM's non-interleaved 1F1B uses). The losses and gradients do not depend on
the order: gradients sum over the micro-batches.
"""

from __future__ import annotations

from typing import List, Tuple

FORWARD, BACKWARD = "F", "B"


def train_order(stages: int, stage_id: int, micro_batches: int) -> List[Tuple[str, int]]:
    """[Note: the 1F1B order] for one stage.

    Args:
        stages: the number of pipeline stages P (>= 1).
        stage_id: this stage, 0 <= stage_id < P.
        micro_batches: micro-batches per step M (>= 1).

    Returns:
        [(FORWARD or BACKWARD, micro-batch index)], 2 * M entries.
    """
    if not 0 <= stage_id < stages or micro_batches < 1:
        raise ValueError(f"train_order: stage_id {stage_id} of {stages} stages, "
                         f"{micro_batches} micro-batches")
    warmup = min(stages - 1 - stage_id, micro_batches)
    order = [(FORWARD, i) for i in range(warmup)]
    for i in range(warmup, micro_batches):
        order.append((FORWARD, i))
        order.append((BACKWARD, i - warmup))
    order.extend((BACKWARD, i) for i in range(micro_batches - warmup, micro_batches))
    return order


def in_flight(order: List[Tuple[str, int]]) -> int:
    """The most micro-batches forwarded and not yet backwarded at any point of `order`."""
    live = peak = 0
    for kind, _ in order:
        live += 1 if kind == FORWARD else -1
        peak = max(peak, live)
    return peak
