"""The param groups' hyperparameters agreed across the data-parallel ranks, inside the step's
own all-reduce.

[Note: the same hyperparameters on every rank]
torch reads a group's values at every step, and they live on each rank's host: a scheduler
stepped on one rank only (`if accelerator.is_main_process: scheduler.step()`), an lr set by
hand in a rank-0 branch, or a per-rank seed feeding a hyperparameter search gives the ranks
different values. DDP + torch AdamW then lets the replicas drift apart, silently; at stages
1-3 each rank updates its own shard with its own values, so every rank ends up with one model
made of pieces trained with different lrs, silently too (shown on the old code: with rank 1's
lr x 10 every stage stepped without a word).

So the step's agreement all-reduce (optimizer.py `_prepare`: found_inf, sumsq and the used
flags, one SUM over the data-parallel ranks) carries three more floats per rank: two 12-bit
fingerprints of every group's hyperparameter values (crc32 of their repr: the same on every
rank for the same values, unlike Python's salted str hash) and a 1. After the sum, a rank whose
fingerprints times the rank count differ from the sums knows some rank's values differ (every
rank does: the sums are one value for all). The floats are small integers, so the sums are
exact up to 4096 ranks (2^12 * 2^12 = 2^24, fp32's exact range); two fingerprints make a
missed difference about 2^-24 likely.

Reading the sums is free where the stats live on the host (gloo CPU runs: the check raises in
step() before anything is updated, on every rank alike). On an accelerator it would cost a
host-device synchronisation per step, which the step path has none of, so there the check
runs under ZEROKERN_DEBUG_COLLECTIVES=1 only (the switch for cross-rank consistency checks).
A failed agreement holds for the grads it was computed with: every rank raises at step()
until `zero_grad()` and a new backward, so ranks that retry stay in step (all or none).
"""

from __future__ import annotations

import zlib
from typing import List, Optional, Tuple

import torch

from zerokern.comm.debug import enabled as debug_enabled
from zerokern.comm.host_agree import read_host_flags

SLOTS = 3  # [fingerprint 1, fingerprint 2, 1] per rank, summed
_MASK = (1 << 12) - 1


def _value(v) -> object:
    """A hyperparameter as the fingerprint reads it: a CPU tensor's value, not an accelerator
    tensor's (reading it would synchronise; such a value is left out)."""
    if isinstance(v, torch.Tensor):
        return float(v) if v.device.type == "cpu" and v.numel() == 1 else "tensor"
    return v


def fingerprint(param_groups, rules) -> Tuple[int, int]:
    """Two 12-bit fingerprints of every group's hyperparameters (its rule's keys, in order)."""
    parts: List[str] = []
    for gi, group in enumerate(param_groups):
        rule = rules[gi]
        parts.append(repr([(k, _value(group.get(k))) for k in rule.defaults]))
    crc = zlib.crc32("|".join(parts).encode())
    return crc & _MASK, (crc >> 12) & _MASK


class HyperAgreement:
    """Fills the step's extra stats slots and reads the agreed sums (module Note)."""

    def __init__(self, device: torch.device) -> None:
        self.active = device.type == "cpu" or debug_enabled()
        self.local: Optional[Tuple[int, int]] = None
        self.differ = False

    def fill_(self, slots: torch.Tensor, param_groups, rules) -> None:
        """Before the all-reduce: this rank's fingerprints and its 1 (zeros when inactive)."""
        self.differ = False
        if not self.active:
            self.local = None
            return
        self.local = fingerprint(param_groups, rules)
        for i, v in enumerate(self.local + (1,)):
            slots[i].fill_(float(v))  # a scalar fill: no host-to-device copy to wait for

    def read(self, slots: torch.Tensor) -> None:
        """After the all-reduce: whether any rank's values differ."""
        if self.local is None:
            return
        # on the host: the step path's one allowed read (no sync; debug mode on a device reads
        # with a sync, as that mode's own check does)
        s1, s2, n = read_host_flags(slots) if slots.device.type == "cpu" else slots.tolist()
        self.differ = s1 != n * self.local[0] or s2 != n * self.local[1]

    def check(self, param_groups, where: str) -> None:
        if not self.differ:
            return
        values = {gi: {k: _value(v) for k, v in g.items() if k != "params"}
                  for gi, g in enumerate(param_groups)}
        raise ValueError(
            f"zerokern ({where}): the param groups' hyperparameters differ across the "
            "data-parallel ranks (lr, betas, eps, weight_decay, ...; this rank's: "
            f"{values}). Each rank would update its part of the model with its own values. "
            "Step schedulers and set hyperparameters on every rank alike (not only on the "
            "main process); this step was not taken: fix them, then opt.zero_grad() and run "
            "the backward again")
