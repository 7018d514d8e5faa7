"""Per-matrix states (StateSpec kind MATRIX): numel, bytes, views and resharding in one place
(zerokern.rules [Note: state kinds and the owner protocol]).

[Note: per-matrix states on the owner]
A phased rule's per-matrix state (Adafactor's row_var (..., R, 1), col_var (..., 1, C), a 1-D
param's variance, the per-param step) lives whole on the param's owner rank (rules/owners.py),
in one flat fp32 tensor per buffer and rank (`MatrixStates.flat`, on the device where the
placement keeps the buffer's state: the params' device, or the host with offload="cpu"), each
state of each owned param a contiguous, shaped view of it (`views`). Its size is what the
rule's `shape_of` says per param shape (`matrix_state_numel`), never per element: Adafactor's
matrix of R x C costs R + C + 1 fp32 on one rank (its owner), a 1-D param of n, n + 1.
Resharding: the state is saved per param and state name, whole (`items`), so a load at any
world size or stage gives each param's state to whichever rank owns it there (`load_`);
nothing depends on the owners of the saving job.
"""

from __future__ import annotations

import math
from typing import Dict, Iterator, Sequence, Tuple

import torch


def state_shape(spec, shape: Sequence[int]):
    """The shape of `spec`'s state for a param of `shape` (None: that param has none)."""
    out = spec.shape_of(tuple(shape))
    return None if out is None else tuple(out)


def matrix_state_numel(specs, shape: Sequence[int]) -> int:
    """fp32 elements of the per-matrix states `specs` for one param of `shape`."""
    return sum(math.prod(s) for s in (state_shape(sp, shape) for sp in specs) if s is not None)


class MatrixStates:
    """The per-matrix states of the params one rank owns in one buffer ([Note: per-matrix
    states on the owner]).

    Args:
        specs: the rule's `matrix_states`.
        shapes: slot -> param shape, for the slots this rank owns.
        device: where the buffer's state lives.
    """

    def __init__(self, specs, shapes: Dict[int, Tuple[int, ...]], device) -> None:
        self.specs = tuple(specs)
        self.index: Dict[Tuple[int, str], Tuple[int, Tuple[int, ...]]] = {}
        at = 0
        for i in sorted(shapes):
            for sp in self.specs:
                s = state_shape(sp, shapes[i])
                if s is not None:
                    self.index[(i, sp.name)] = (at, s)
                    at += math.prod(s)
        self.flat = torch.zeros(at, dtype=torch.float32, device=device)  # (numel,) fp32

    @property
    def numel(self) -> int:
        return self.flat.numel()

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def views(self, i: int) -> Dict[str, torch.Tensor]:
        """Slot i's states by name, shaped (those it has)."""
        return {name: self._view(at, s) for (j, name), (at, s) in self.index.items() if j == i}

    def _view(self, at: int, shape) -> torch.Tensor:
        return self.flat[at:at + math.prod(shape)].view(shape)

    def items(self) -> Iterator[Tuple[int, str, torch.Tensor]]:
        """(slot, state name, shaped view) of every state held here, in slot order."""
        for (i, name), (at, s) in self.index.items():
            yield i, name, self._view(at, s)

    def load_(self, i: int, name: str, value: torch.Tensor) -> None:
        """Write slot i's state `name` (its whole value, saved at any world size).

        Raises:
            ValueError: this rank holds no such state, or the shape differs.
        """
        if (i, name) not in self.index:
            raise ValueError(f"no per-matrix state {name!r} for slot {i} on this rank")
        at, s = self.index[(i, name)]
        if tuple(value.shape) != s:
            raise ValueError(f"per-matrix state {name!r} of slot {i}: shape "
                             f"{tuple(value.shape)} != {s}")
        self._view(at, s).copy_(value)

    def to_(self, device) -> None:
        self.flat = self.flat.to(device)

    def bytes_by_name(self) -> Dict[str, int]:
        """Bytes held per state name (memory_report's categories)."""
        out = {sp.name: 0 for sp in self.specs}
        for (_, name), (_, s) in self.index.items():
            out[name] += 4 * math.prod(s)
        return out


def owned_bytes(specs, layout, rank: int) -> Dict[str, int]:
    """Bytes of each per-matrix state `rank` holds for buffer `layout` (its owners balanced as
    OwnerPlan does: by elements over layout.world_size ranks): what MatrixStates allocates
    there (memory_report) and what `estimate` reports."""
    from zerokern.rules.owners import balance

    owners = balance([s.numel for s in layout.slots], layout.world_size)
    out = {sp.name: 0 for sp in specs}
    for s, owner in zip(layout.slots, owners):
        if owner == rank:
            for sp in specs:
                shape = state_shape(sp, s.shape)
                if shape is not None:
                    out[sp.name] += 4 * math.prod(shape)
    return out


def names_of(rule) -> tuple:
    """The names of `rule`'s per-matrix states (report categories)."""
    return tuple(s.name for s in getattr(rule, "matrix_states", ()))
