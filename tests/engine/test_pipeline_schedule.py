"""zerokern/engine/pipeline_schedule.py: the 1F1B order of each stage, in process. Each order is
run against its neighbours' in a simulation of the engine's messages (sends posted without
waiting, receives blocking: engine/pipeline_p2p.py) to show that every stage finishes (no
deadlock), and that at most min(P - s, M) micro-batches are in flight on stage s (DeepSpeed's
TrainSchedule bound)."""

from __future__ import annotations

import itertools

import pytest

from zerokern.engine.pipeline_schedule import BACKWARD, FORWARD, in_flight, train_order


def _simulate(stages: int, micro: int, orders=None) -> bool:
    """True when every stage runs its order to the end; activations of micro-batch i reach
    stage s + 1 after stage s's forward i, gradients reach stage s - 1 after stage s's
    backward i; a forward on s > 0 waits for its activation, a backward for its own forward
    and, on s < P - 1, for its gradient."""
    orders = orders or [train_order(stages, s, micro) for s in range(stages)]
    pos = [0] * stages
    acts = [set() for _ in range(stages)]   # micro-batches whose activation reached stage s
    grads = [set() for _ in range(stages)]  # micro-batches whose gradient reached stage s
    progress = True
    while progress:
        progress = False
        for s in range(stages):
            while pos[s] < len(orders[s]):
                kind, i = orders[s][pos[s]]
                if kind == FORWARD and s > 0 and i not in acts[s]:
                    break
                if kind == BACKWARD and (s < stages - 1 and i not in grads[s]
                                         or (FORWARD, i) not in orders[s][:pos[s]]):
                    break
                if kind == FORWARD and s < stages - 1:
                    acts[s + 1].add(i)
                if kind == BACKWARD and s > 0:
                    grads[s - 1].add(i)
                pos[s] += 1
                progress = True
    return all(pos[s] == len(orders[s]) for s in range(stages))


@pytest.mark.parametrize("stages, micro", list(itertools.product([1, 2, 3, 4, 5], [1, 2, 3, 4, 7])))
def test_order_runs_and_bounds_in_flight(stages, micro):
    assert _simulate(stages, micro)
    for s in range(stages):
        order = train_order(stages, s, micro)
        assert sorted(order) == sorted([(FORWARD, i) for i in range(micro)]
                                       + [(BACKWARD, i) for i in range(micro)])
        assert [i for k, i in order if k == BACKWARD] == list(range(micro))  # DeepSpeed's order
        for i in range(micro):
            assert order.index((FORWARD, i)) < order.index((BACKWARD, i))
        assert in_flight(order) == min(stages - s, micro)


def test_simulation_catches_a_deadlock():
    """Negative control: stages that take the micro-batches in different orders wait on each
    other (stage 0 waits for micro-batch 0's gradient, stage 1 for micro-batch 1's input)."""
    orders = [[(FORWARD, 0), (BACKWARD, 0), (FORWARD, 1), (BACKWARD, 1)],
              [(FORWARD, 1), (BACKWARD, 1), (FORWARD, 0), (BACKWARD, 0)]]
    assert not _simulate(2, 2, orders)


@pytest.mark.parametrize("args", [(2, 2, 4), (2, -1, 4), (2, 0, 0)])
def test_bad_arguments(args):
    with pytest.raises(ValueError, match="train_order"):
        train_order(*args)
