"""Whole params on one owner rank each, over ZeRO's flat pieces: the phased rules' protocol
(zerokern.rules [Note: state kinds and the owner protocol]), shared by Muon (Newton-Schulz on
the whole matrix, rules/muon_orthogonalize.py) and Adafactor (row/column statistics and the
whole-param norms, rules/adafactor.py).

[Note: one owner per matrix]
Each param of a buffer ("matrix": any shape, 1-D included) gets one owner rank, chosen by
balancing a per-param cost (`balance`: the largest first to the least-loaded rank, ties by
index, so every rank computes the same plan without talking; Muon: Newton-Schulz FLOPs,
Adafactor: elements). A phased step then
1. `gather_`: sends every piece of matrix i that this rank holds to its owner (one
   all_to_all_single over the shard group; a piece the owner holds itself is not sent), and
   returns the whole matrices this rank owns;
2. the rule computes on them (the owner only);
3. `scatter_`: sends each piece of the result back to every rank that holds it (a second
   all_to_all_single); the owner writes its own pieces directly.
No matrix is computed twice and no rank holds more than its own matrices whole: the peak extra
memory on a rank is its owned matrices plus its pieces in flight. Bytes per rank per step: what
it holds of other ranks' matrices, out and back (about 2Ψ(N-1)/N² elements when sharded; at
stage 0 (`replicated`), where every rank holds everything, only step 3 sends, about Ψ(N-1)/N).
A gathered tensor may carry trailing columns (Adafactor sends the grad and the master of a
piece as one (n, 2) block: one collective, not two).
The result is the same bits at every world size and stage: the owner computes on the whole
param exactly as a single process would, so a checkpoint resharded to another world size
continues bitwise (a reduction protocol, partial sums all-reduced, would not: its summation
order follows the pieces).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence

import torch
import torch.distributed as dist

from zerokern.geometry.partition import FlatLayout


def balance(costs: Sequence[int], world_size: int) -> List[int]:
    """Owner rank of each item: largest cost first onto the least-loaded rank (ties: the lower
    index, then the lower rank), so every rank derives the same plan without talking."""
    load = [0] * world_size
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world_size), key=lambda q: (load[q], q))
        owners[i] = r
        load[r] += costs[i]
    return owners


@dataclass(frozen=True)
class _Piece:
    slot: int          # index into layout.slots
    lo: int            # flat coordinates [lo, hi)
    hi: int
    state_at: int      # where [lo, hi) starts in the holder's state buffer


def held_pieces(layout: FlatLayout, rank: int, replicated: bool,
                slots: Sequence[int]) -> List[_Piece]:
    """The pieces of the given slots whose state `rank` holds, in flat order."""
    out = []
    for k in range(layout.n_buckets):
        lo, hi = layout.state_range(k, rank, replicated)
        base = layout.state_offset(k, replicated)
        for i, a, b in layout.overlaps(lo, hi):
            if i in slots:
                out.append(_Piece(i, a, b, base + (a - lo)))
    return out


def _view(state: torch.Tensor, p: _Piece) -> torch.Tensor:
    """Piece p's elements (rows) in the holder's state buffer."""
    return state[p.state_at:p.state_at + p.hi - p.lo]


class OwnerPlan:
    """[Note: one owner per matrix] for the given slots of one flat buffer.

    Args:
        layout: the buffer's FlatLayout.
        rank, world_size: this rank in `group` (world_size == layout.world_size).
        replicated: True at stage 0 (every rank holds every element's state).
        slots: indices of the layout's slots the plan moves whole.
        group: the process group the buffer is sharded over (None: world size 1).
        cost: slot index -> its cost for `balance` (default: its element count).
    """

    def __init__(self, layout: FlatLayout, rank: int, world_size: int, replicated: bool,
                 slots: Sequence[int], group=None,
                 cost: Callable[[int], int] = None) -> None:
        if world_size != layout.world_size:
            raise ValueError(f"world_size {world_size} != layout.world_size {layout.world_size}")
        self.layout, self.rank, self.world_size = layout, rank, world_size
        self.replicated, self.group = replicated, group
        self.slots = list(slots)
        cost = cost or (lambda i: layout.slots[i].numel)
        self.owner: Dict[int, int] = dict(zip(self.slots, balance(
            [cost(i) for i in self.slots], world_size)))
        slot_set = set(self.slots)
        # Every rank's pieces: the plan is a pure function of the layout, the same everywhere.
        self.pieces = [held_pieces(layout, r, replicated, slot_set) for r in range(world_size)]
        self.bytes_sent = 0

    @property
    def owned(self) -> List[int]:
        """The slots this rank owns, in slot order."""
        return [i for i in self.slots if self.owner[i] == self.rank]

    def _in_matrix(self, p: _Piece) -> slice:
        """Where piece p sits inside its matrix, flattened."""
        off = self.layout.slots[p.slot].offset
        return slice(p.lo - off, p.hi - off)

    def gather_(self, state: torch.Tensor) -> Dict[int, torch.Tensor]:
        """Step 1: every slot this rank owns, whole, from `state` (this rank's (S, ...) state
        buffer, laid out as the layout's state_range pieces) and the other holders' pieces.

        Returns:
            slot -> (numel, *state.shape[1:]) tensor, flattened in the param's order.
        """
        r, n = self.rank, self.world_size
        sources = ([[] for _ in range(n)] if self.replicated else
                   [[p for p in ps if self.owner[p.slot] != q]
                    for q, ps in enumerate(self.pieces)])
        send = [[p for p in sources[r] if self.owner[p.slot] == q] for q in range(n)]
        recv = [[p for p in sources[q] if self.owner[p.slot] == r] for q in range(n)]
        got = self._exchange(state, send, recv, any(sources))
        out: Dict[int, torch.Tensor] = {}
        for i in self.owned:
            full = state.new_empty((self.layout.slots[i].numel, *state.shape[1:]))
            for p in self.pieces[r]:
                if p.slot == i:
                    full[self._in_matrix(p)] = _view(state, p)
            for q in range(n):
                for p, vals in zip(recv[q], got[q]):
                    if p.slot == i:
                        full[self._in_matrix(p)] = vals
            out[i] = full
        return out

    def scatter_(self, state: torch.Tensor, results: Dict[int, torch.Tensor]) -> None:
        """Step 3: each owned slot's result (flattened, `results[i]`) into every holder's
        pieces of `state` (this rank's own pieces directly, the others' by one exchange)."""
        r, n = self.rank, self.world_size
        for p in self.pieces[r]:
            if self.owner[p.slot] == r:
                _view(state, p).copy_(results[p.slot][self._in_matrix(p)])
        back_send = [[p for p in self.pieces[q] if self.owner[p.slot] == r] if q != r else []
                     for q in range(n)]
        back_recv = [[p for p in self.pieces[r] if self.owner[p.slot] == q] if q != r else []
                     for q in range(n)]
        payload = [[results[p.slot][self._in_matrix(p)] for p in ps] for ps in back_send]
        anyone = any(self.owner[p.slot] != q for q, ps in enumerate(self.pieces) for p in ps)
        got = self._exchange(state, back_send, back_recv, anyone, payload)
        for q in range(n):
            for p, vals in zip(back_recv[q], got[q]):
                _view(state, p).copy_(vals)

    def _exchange(self, state: torch.Tensor, send, recv, anyone: bool,
                  payload=None) -> List[List[torch.Tensor]]:
        """One all_to_all_single: send[q] pieces to rank q (values from `state`, or from
        `payload[q][j]`), receive recv[q] pieces from rank q; returns the received values.
        `anyone` (does any rank send anything) comes from the plan, the same on every rank, so
        the collective is skipped by all ranks together or by none."""
        n = self.world_size
        if n == 1 or not anyone:
            return [[] for _ in range(n)]
        in_sizes = [sum(p.hi - p.lo for p in send[q]) for q in range(n)]
        out_sizes = [sum(p.hi - p.lo for p in recv[q]) for q in range(n)]
        parts = [_view(state, p) if payload is None else payload[q][j]
                 for q in range(n) for j, p in enumerate(send[q])]
        inp = (torch.cat(parts) if parts else
               state.new_empty((0, *state.shape[1:])))
        out = state.new_empty((sum(out_sizes), *state.shape[1:]))
        dist.all_to_all_single(out, inp, out_sizes, in_sizes, group=self.group)
        self.bytes_sent += inp.numel() * inp.element_size()
        got, at = [], 0
        for q in range(n):
            vals = []
            for p in recv[q]:
                vals.append(out[at:at + p.hi - p.lo])
                at += p.hi - p.lo
            got.append(vals)
        return got
