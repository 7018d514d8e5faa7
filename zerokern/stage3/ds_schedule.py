"""DeepSpeed's four stage-3 schedule keys on zerokern's units: which units a forward keeps
gathered for the backward, and how far ahead it prefetches (zerokern.initialize; runtime.py
`Stage3Runtime.use_schedule`).

[Note: DeepSpeed's stage-3 keys]
DeepSpeed 0.19 decides per param, at run time, from a trace of the modules it recorded in the
first steps (runtime/zero/partitioned_param_coordinator.py, parameter_offload.py):
- stage3_param_persistence_threshold (default 1e5 elements): a param of at most that many
  elements is "persistent": never released; after every step it is all-gathered again (stage3.py
  _post_step), so it costs one gather per step and none in forward or backward.
- stage3_max_reuse_distance (1e9): after a module's forward (or backward) a param is not released
  if the trace uses it again before that many elements of params have been used in between
  (counting each module's params in trace order from the next module on; 0 releases all).
- stage3_prefetch_bucket_size (5e7): at each fetch, the trace is scanned ahead and params that
  are not gathered are all-gathered until that many elements are in flight; a param the scan
  passes while it is still gathered is marked and not released before that later use (so a model
  smaller than the bucket is gathered whole by its first module and kept to its backward, whatever
  the reuse distance). 0 turns prefetching off.
- stage3_max_live_parameters (1e9): the prefetch scan stops where gathered params would exceed it
  (it caps prefetching only; the module running is always fetched).

zerokern decides per unit (units.py), once, at initialize, by running that same algorithm over a
trace of units (`deepspeed_keep`): forward = the schedule, then the root (whose own modules, the
head, run after the blocks and are the first the backward needs), backward = the root, then the
schedule reversed; a unit holds the numel of its params (and its deps'); the root is gathered from
the forward's start (the outermost module). A unit is persistent when every param it owns is at or
under the threshold. The units the algorithm does not release after their forward are the kept
units ([Note: kept units] in units.py: kept gathered from their forward to their backward, the
root among them or not); the prefetch budget (the bucket, capped by max_live_parameters) sets how
many units of the schedule a forward launches ahead (at least one while it is > 0, none at 0;
`prefetch_units`). Each kept unit saves its backward re-gather, as in DeepSpeed.

Where it differs from DeepSpeed, and why:
- Granularity: a unit is kept or released whole. A unit mixing small and large params (a block:
  LayerNorms and biases under the threshold, matrices above) follows its large params, so its small
  params are gathered with it where DeepSpeed keeps them resident: at most the unit's small
  params' elements more per re-gather. Reuse distances count units, not modules, so a distance
  near a unit boundary can fall on the other side of it.
- Persistent units are gathered at their forward and freed at the end of backward, not kept whole
  between steps and re-gathered after step() as DeepSpeed does: the same one gather per step,
  without holding the full params between steps.
- The backward prefetches one unit ahead whatever the bucket (the reduce-scatter windows of
  runtime.py are placed between the backward's gather steps, rule 4 there); the bucket sets the
  forward's depth only. max_live_parameters caps the prefetch depth statically (not by what is
  live at that moment), so the gather order is the same on every rank (rule 1).
- Under gradient accumulation a persistent unit is gathered at each micro-batch's forward;
  DeepSpeed gathers its persistent params once per optimizer step.
- DeepSpeed releases everything in its first two steps (it records the trace); zerokern keeps
  from its first step what DeepSpeed keeps from its third.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence

# DeepSpeed 0.19's defaults (runtime/zero/config.py), in elements.
DEFAULTS = {"stage3_max_reuse_distance": 10**9, "stage3_max_live_parameters": 10**9,
            "stage3_prefetch_bucket_size": 5 * 10**7,
            "stage3_param_persistence_threshold": 10**5}


@dataclass(frozen=True)
class Stage3Keys:
    """DeepSpeed's four stage-3 schedule keys, in elements (DeepSpeed's units and defaults)."""

    max_reuse_distance: int = DEFAULTS["stage3_max_reuse_distance"]
    max_live_parameters: int = DEFAULTS["stage3_max_live_parameters"]
    prefetch_bucket_size: int = DEFAULTS["stage3_prefetch_bucket_size"]
    param_persistence_threshold: int = DEFAULTS["stage3_param_persistence_threshold"]

    @property
    def prefetch_numel(self) -> int:
        """Elements a forward may prefetch ahead: the bucket, capped by max_live_parameters."""
        return min(self.prefetch_bucket_size, self.max_live_parameters)


def deepspeed_keep(schedule: Sequence[int], root: int, numel: Callable[[int], int],
                   persistent: Callable[[int], bool], keys: Stage3Keys) -> List[int]:
    """The units DeepSpeed's coordinator would leave gathered between their forward and their
    backward, run over a trace of units ([Note: DeepSpeed's stage-3 keys]).

    Args:
        schedule: the units in forward order (the root excluded).
        root: the root unit.
        numel: elements a unit gathers (its params and its deps').
        persistent: whether a unit is persistent (every param at or under the threshold).
        keys: the four keys.

    Returns:
        The kept units (the root among them when kept), in schedule order, the root first.
    """
    trace = list(schedule) + [root, root] + list(reversed(schedule))
    end_of_forward = len(schedule)  # the root's forward release
    queue = deque(enumerate(trace))
    # persistent units are whole from the last step (DeepSpeed's post-step gather); the root
    # from the forward's start (it encloses every unit)
    available = {u for u in set(trace) if persistent(u)} | {root}
    most_recent: Dict[int, int] = defaultdict(lambda: -1)
    live = numel(root) if not persistent(root) else 0
    kept = []

    def fetch(step: int, u: int) -> None:
        nonlocal live
        if most_recent[u] < step:  # pop this use off the queue (the prefetch may have)
            most_recent[u] = queue.popleft()[0]  # (the queue's head: uses are popped in order)
        if u not in available:
            available.add(u)
            live += numel(u)
        if keys.prefetch_bucket_size <= 0:
            return
        budget = min(keys.max_live_parameters - live, keys.prefetch_bucket_size)
        fetching = 0
        prefetch = []
        while queue and fetching < budget:
            s, v = queue.popleft()
            if v not in available and v not in prefetch:
                prefetch.append(v)
                fetching += numel(v)
            most_recent[v] = max(most_recent[v], s)
        for v in prefetch:
            available.add(v)
        live += fetching

    def released(step: int, u: int) -> bool:
        nonlocal live
        if persistent(u) or most_recent[u] > step + 1:
            return False
        traversed = 0
        for v in trace[step + 1:]:
            if traversed >= keys.max_reuse_distance:
                break
            if v == u:
                return False
            traversed += numel(v)
        available.discard(u)
        live -= numel(u)
        return True

    for step, u in enumerate(trace[:end_of_forward + 1]):
        fetch(step, u)
        if not released(step, u):
            kept.append(u)
    return [root] * (root in kept) + [u for u in schedule if u in kept]


def prefetch_units(schedule: Sequence[int], start: int, numel: Callable[[int], int],
                   gathered: Callable[[int], bool], budget: float) -> List[int]:
    """The units a forward launches ahead from schedule[start]: in order, those not gathered
    yet, while fewer than `budget` elements are launched (DeepSpeed's prefetch bucket); at least
    one while budget > 0, none at 0.

    Args:
        schedule: the units in forward order.
        start: the first position to look at.
        numel: elements a unit gathers.
        gathered: whether a unit is gathered (or in flight) already.
        budget: the prefetch budget in elements.
    """
    out, fetching = [], 0
    for u in schedule[start:]:
        if budget <= 0 or fetching >= budget:
            break
        out.append(u)
        if not gathered(u):
            fetching += numel(u)
    return out
