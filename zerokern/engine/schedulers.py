"""DeepSpeed's learning-rate schedules as torch LR schedulers (no deepspeed import).

WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle and LRRangeTest take DeepSpeed's parameter
names and follow its formulas (tests/engine compare them with DeepSpeed 0.19.8's, step by
step). They subclass `torch.optim.lr_scheduler.LRScheduler`, so `state_dict()`,
`get_last_lr()` and Trainer/Accelerate's handling work unchanged; DeepSpeed's own classes are
plain objects, so zerokern returns these instead of DeepSpeed's (same names, same values).

[Note: iteration index] DeepSpeed's schedules count `last_batch_iteration` from -1 (before the
first step) and are stepped once per optimizer step. torch's `last_epoch` is 0 after
construction, so the DeepSpeed index is `last_epoch - 1`: the lr of the first optimizer step is
the schedule at index -1 (the minimum for the warm-ups), of the second at index 0, and so on,
as in DeepSpeed. `step(batch_iteration)` and `last_batch_iteration` use DeepSpeed's index
(torch's `step(epoch)` would be one behind it), through `_DeepSpeedIndex`.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from torch.optim.lr_scheduler import LRScheduler

from .config_values import ConfigError

Floats = Union[float, Sequence[float]]


def _per_group(opt, value: Floats, name: str) -> List[float]:
    n = len(opt.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name}: {len(value)} values for {n} param groups")
        return [float(v) for v in value]
    return [float(value)] * n


class _DeepSpeedIndex:
    """DeepSpeed's iteration index on a torch LRScheduler ([Note: iteration index])."""

    @property
    def last_batch_iteration(self) -> int:
        return self.last_epoch - 1

    def step(self, batch_iteration: Optional[int] = None) -> None:
        """One step, or (DeepSpeed's `step(n)`) jump to DeepSpeed index n.

        Args:
            batch_iteration: None for the next step, or the DeepSpeed index to jump to.
        """
        if batch_iteration is not None:
            self.last_epoch = int(batch_iteration)  # LRScheduler.step adds the 1
        super().step()


def _warmup_gamma(i: int, warmup_num_steps: int, warmup_type: str) -> float:
    """Fraction of the warm-up done at DeepSpeed index i (>= 0): log or linear."""
    if i >= warmup_num_steps:
        return 1.0
    if warmup_type == "log":
        return math.log(i + 1) / math.log(warmup_num_steps)
    return i / warmup_num_steps


def _check_warmup_type(t: str) -> str:
    if t not in ("log", "linear"):
        raise ValueError(f"warmup_type must be 'log' or 'linear', got {t!r}")
    return t


class WarmupLR(_DeepSpeedIndex, LRScheduler):
    """From warmup_min_lr to warmup_max_lr (default: the optimizer's lr) over warmup_num_steps
    (log or linear), then constant.

    Args:
        optimizer: the ZeroAdamW (or any torch optimizer).
        warmup_min_lr: the starting lr: a float or one per param group.
        warmup_max_lr: the lr after warm-up: a float, one per group, or None (each group's
            own lr).
        warmup_num_steps: steps of the warm-up (at least 2, as DeepSpeed).
        warmup_type: "log" (DeepSpeed's default) or "linear".
        last_batch_iteration: must be -1; resume through `load_state_dict()`.

    Raises:
        ValueError: last_batch_iteration other than -1, an unknown warmup_type, or a per-group
            list of the wrong length, naming the argument.
    """

    def __init__(self, optimizer, warmup_min_lr: Floats = 0.0,
                 warmup_max_lr: Optional[Floats] = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1):
        if last_batch_iteration != -1:
            raise ValueError("last_batch_iteration: resume through load_state_dict()")
        self.warmup_type = _check_warmup_type(warmup_type)
        self.warmup_num_steps = max(2, int(warmup_num_steps))  # DeepSpeed's floor: log(1) = 0
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        maxs = [g["lr"] for g in optimizer.param_groups] if warmup_max_lr is None else warmup_max_lr
        self.max_lrs = _per_group(optimizer, maxs, "warmup_max_lr")
        super().__init__(optimizer)

    def _gamma(self, i: int) -> float:
        return _warmup_gamma(i, self.warmup_num_steps, self.warmup_type)

    def get_lr(self) -> List[float]:
        """Each group's lr at the current step (torch's LRScheduler protocol)."""
        i = self.last_epoch - 1  # [Note: iteration index]
        if i < 0:
            return list(self.min_lrs)
        g = self._gamma(i)
        return [lo + (hi - lo) * g for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at total_num_steps. warmup_max_lr defaults to 0.001,
    not to the optimizer's lr (WarmupLR's default): DeepSpeed 0.19's defaults differ so.

    Args:
        optimizer: the ZeroAdamW (or any torch optimizer).
        total_num_steps: the step at which the lr reaches 0.
        warmup_min_lr: the starting lr: a float or one per param group.
        warmup_max_lr: the lr after warm-up: a float or one per group (default 0.001, as
            DeepSpeed 0.19).
        warmup_num_steps: steps of the warm-up (at least 2, as DeepSpeed).
        warmup_type: "log" (DeepSpeed's default) or "linear".
        last_batch_iteration: must be -1; resume through `load_state_dict()`.
    """

    def __init__(self, optimizer, total_num_steps: int, warmup_min_lr: Floats = 0.0,
                 warmup_max_lr: Optional[Floats] = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1):
        if int(total_num_steps) < 1:
            raise ValueError(f"total_num_steps must be >= 1, got {total_num_steps!r}")
        self.total_num_steps = int(total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _gamma(self, i: int) -> float:
        if i < self.warmup_num_steps:
            return _warmup_gamma(i, self.warmup_num_steps, self.warmup_type)
        return max(0.0, (self.total_num_steps - i) /
                   max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_DeepSpeedIndex, LRScheduler):
    """A ratio of each group's own lr: warmup_min_ratio -> 1 over warmup_num_steps, then a
    cosine down to cos_min_ratio at total_num_steps (and held there).

    Args:
        optimizer: the ZeroAdamW (or any torch optimizer).
        total_num_steps: the step at which the cosine reaches cos_min_ratio.
        warmup_min_ratio: the starting ratio of each group's lr.
        warmup_num_steps: steps of the warm-up (at least 2, as DeepSpeed).
        warmup_type: "log" (DeepSpeed's default) or "linear".
        last_batch_iteration: must be -1; resume through `load_state_dict()`.
        cos_min_ratio: the final ratio.

    Raises:
        ValueError: warmup_num_steps not positive, last_batch_iteration other than -1, or an
            unknown warmup_type, naming the argument.
    """

    def __init__(self, optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001,
                 warmup_type: str = "log", last_batch_iteration: int = -1):
        if last_batch_iteration != -1:
            raise ValueError("last_batch_iteration: resume through load_state_dict()")
        if isinstance(warmup_num_steps, bool) or int(warmup_num_steps) <= 0:
            raise ValueError(f"warmup_num_steps must be a positive integer, "
                             f"got {warmup_num_steps!r}")
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio, self.cos_min_ratio = float(warmup_min_ratio), float(cos_min_ratio)
        self.warmup_type = _check_warmup_type(warmup_type)
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        super().__init__(optimizer)

    def ratio(self, i: int) -> float:
        """The factor on each group's lr after `i + 1` steps (0 before the first).

        Args:
            i: the step index (0-based).
        """
        if i < 0:
            return 0.0
        if i < self.warmup_num_steps:
            g = _warmup_gamma(i, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + g * (1.0 - self.warmup_min_ratio)
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        done = (i - self.warmup_num_steps + 1) / span
        cos = (1 + math.cos(math.pi * min(1.0, done))) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cos)

    def get_lr(self) -> List[float]:
        """Each group's lr at the current step (torch's LRScheduler protocol)."""
        r = self.ratio(self.last_epoch - 1)
        return [base * r for base in self.base_lrs]


class OneCycle(_DeepSpeedIndex, LRScheduler):
    """1cycle: lr cycle_min_lr -> cycle_max_lr over cycle_first_step_size, back over
    cycle_second_step_size (optionally in stairs), then decay by decay_lr_rate every
    decay_step_size; momentum (betas[0]) cycles the other way between cycle_max_mom and
    cycle_min_mom when cycle_momentum (and beta2 becomes 0.99, as in DeepSpeed).

    Args:
        optimizer: the ZeroAdamW (or any torch optimizer).
        cycle_min_lr: the lr at the start and end of the cycle (float or one per group).
        cycle_max_lr: the lr at the top of the cycle (float or one per group).
        decay_lr_rate: after the cycle, lr = cycle_min_lr / (1 + rate * decay intervals).
        cycle_first_step_size: steps from cycle_min_lr up to cycle_max_lr.
        cycle_second_step_size: steps back down; default cycle_first_step_size.
        cycle_first_stair_count: stairs on the way up (0: continuous).
        cycle_second_stair_count: stairs on the way down; default cycle_first_stair_count.
        decay_step_size: steps per decay interval after the cycle (0: no decay).
        cycle_momentum: cycle betas[0] inversely to the lr (and set beta2 to 0.99).
        cycle_min_mom: the lowest beta1 (at the top of the lr cycle).
        cycle_max_mom: the highest beta1.
        decay_mom_rate: after the cycle, beta1 = cycle_max_mom * (1 + rate * intervals).
        last_batch_iteration: must be -1; resume through `load_state_dict()`.

    Raises:
        ValueError: a bad argument, naming it.
    """

    def __init__(self, optimizer, cycle_min_lr: Floats, cycle_max_lr: Floats,
                 decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000,
                 cycle_second_step_size: Optional[int] = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: Optional[int] = None, decay_step_size: int = 0,
                 cycle_momentum: bool = True, cycle_min_mom: float = 0.8,
                 cycle_max_mom: float = 0.9, decay_mom_rate: float = 0.0,
                 last_batch_iteration: int = -1):
        if last_batch_iteration != -1:
            raise ValueError("last_batch_iteration: resume through load_state_dict()")
        first = float(cycle_first_step_size)
        second = first if cycle_second_step_size is None else float(cycle_second_step_size)
        if first <= 0 or second < 0:
            raise ValueError("cycle_first_step_size must be > 0 and cycle_second_step_size >= 0")
        self.first, self.second, self.total = first, second, first + second
        self.step_ratio = first / self.total
        self.stairs = (int(cycle_first_stair_count),
                       int(cycle_first_stair_count if cycle_second_stair_count is None
                           else cycle_second_stair_count))
        self.decay_step_size = float(decay_step_size)
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate, self.decay_mom_rate = float(decay_lr_rate), float(decay_mom_rate)
        self.cycle_momentum = bool(cycle_momentum)
        self.min_moms = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
        self.max_moms = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
        if self.cycle_momentum:
            for g in optimizer.param_groups:
                if "betas" not in g:
                    raise ValueError("cycle_momentum needs an optimizer with betas")
        super().__init__(optimizer)

    def _scale(self, it: int) -> float:
        """0 at the cycle's ends, 1 at its peak; `it` is the 1-based batch count."""
        cycle = math.floor(1 + it / self.total)
        x = 1.0 + it / self.total - cycle
        s = x / self.step_ratio if x <= self.step_ratio else (x - 1) / (self.step_ratio - 1)
        up, down = self.stairs
        pos = it % self.total
        count = up if pos <= self.first else down
        if count > 0:
            stair = (pos * count / self.first if pos <= self.first
                     else (self.total - pos) * count / self.second)
            s = math.floor(stair) / count
        return s

    def _decay(self, i: int) -> float:
        """Divisor after the cycle (1 when decay is off)."""
        if self.decay_step_size == 0:
            return None
        return (i - self.total + 1) / self.decay_step_size

    def get_lr(self) -> List[float]:
        """Each group's lr at the current step (torch's LRScheduler protocol)."""
        i = self.last_epoch - 1
        if i < 0:
            return list(self.min_lrs)
        if i < self.total:
            s = self._scale(i + 1)
            return [lo + (hi - lo) * s for lo, hi in zip(self.min_lrs, self.max_lrs)]
        d = self._decay(i)
        if d is None or self.decay_lr_rate == 0:
            return list(self.min_lrs)
        return [lo / (1 + self.decay_lr_rate * d) for lo in self.min_lrs]

    def _moms(self, i: int, start: bool) -> List[float]:
        """beta1 per group at DeepSpeed index i. start: the value DeepSpeed's constructor
        writes into the groups (cycle_min_mom), where its get_mom() reports the cycle's
        start (cycle_max_mom) -- both kept, so that the betas and get_mom() match it."""
        if i < 0 and start:
            return list(self.min_moms)
        if i < self.total:
            s = self._scale(i + 1)
            return [hi - (hi - lo) * s for lo, hi in zip(self.min_moms, self.max_moms)]
        d = self._decay(i)
        if d is None or self.decay_mom_rate == 0:
            return list(self.max_moms)
        return [hi * (1 + self.decay_mom_rate * d) for hi in self.max_moms]

    def get_mom(self) -> Optional[List[Tuple[float, float]]]:
        """DeepSpeed's OneCycle.get_mom(): (beta1, beta2) per group at the current index, or
        None when cycle_momentum is off."""
        if not self.cycle_momentum:
            return None
        return [(m, 0.99) for m in self._moms(self.last_epoch - 1, start=False)]

    def step(self, batch_iteration: Optional[int] = None) -> None:
        """Advance one step: the lr, and with cycle_momentum each group's betas.

        Args:
            batch_iteration: as DeepSpeed's: the iteration to move to (None: the next).
        """
        super().step(batch_iteration)
        if self.cycle_momentum:
            moms = self._moms(self.last_epoch - 1, start=batch_iteration is None)
            for g, m in zip(self.optimizer.param_groups, moms):
                # DeepSpeed's OneCycle sets beta2 to 0.99 whenever it cycles momentum; kept
                # so that a DeepSpeed config trains the same.
                g["betas"] = (m, 0.99)


class LRRangeTest(_DeepSpeedIndex, LRScheduler):
    """The LR range test: lr = lr_range_test_min_lr x (1 + lr_range_test_step_rate x k),
    k = (index + 1) / lr_range_test_step_size (floored with lr_range_test_staircase), so
    the lr grows every step from the minimum (used to find a cycle's bounds).

    Args:
        optimizer: the ZeroAdamW (or any torch optimizer).
        lr_range_test_min_lr: the starting lr: a float or one per param group.
        lr_range_test_step_size: steps per unit of k (a positive int).
        lr_range_test_step_rate: the lr's growth per unit of k.
        lr_range_test_staircase: floor k (the lr grows in stairs).
        last_batch_iteration: must be -1; resume through `load_state_dict()`.

    Raises:
        ValueError: lr_range_test_step_size not a positive int, or last_batch_iteration
            other than -1.
    """

    def __init__(self, optimizer, lr_range_test_min_lr: Floats = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1):
        if last_batch_iteration != -1:
            raise ValueError("last_batch_iteration: resume through load_state_dict()")
        if isinstance(lr_range_test_step_size, bool) or \
                not isinstance(lr_range_test_step_size, int) or lr_range_test_step_size <= 0:
            raise ValueError(f"lr_range_test_step_size must be a positive integer, "
                             f"got {lr_range_test_step_size!r}")
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = float(lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        super().__init__(optimizer)

    def get_lr(self) -> List[float]:
        """Each group's lr at the current step (torch's LRScheduler protocol)."""
        k = self.last_epoch / self.step_size  # (DeepSpeed index + 1): [Note: iteration index]
        if self.staircase:
            k = math.floor(k)
        return [lo * (1 + self.step_rate * k) for lo in self.min_lrs]


SCHEDULERS = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR,
              "WarmupCosineLR": WarmupCosineLR, "OneCycle": OneCycle,
              "LRRangeTest": LRRangeTest}


def build_scheduler(sched_cfg: Dict[str, Any], optimizer) -> LRScheduler:
    """Config `scheduler` {"type", "params"} -> the scheduler (ValueError naming the key)."""
    import inspect

    t = sched_cfg["type"]
    if t not in SCHEDULERS:
        raise ConfigError(f"config key scheduler.type {t!r} is not supported; one of "
                         f"{sorted(SCHEDULERS)}")
    cls = SCHEDULERS[t]
    allowed = set(inspect.signature(cls.__init__).parameters) - {"self", "optimizer"}
    for k in sched_cfg.get("params", {}):
        if k not in allowed:
            raise ConfigError(f"config key scheduler.params.{k} is not a {t} parameter "
                             f"({sorted(allowed)})")
    try:
        return cls(optimizer, **sched_cfg.get("params", {}))
    except TypeError as e:
        raise ConfigError(f"config key scheduler.params: {e}") from None
