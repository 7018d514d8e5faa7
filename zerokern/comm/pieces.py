"""A reduce-scatter's input held as the tensors it is made of, not copied into one buffer.

[Note: grads read where they lie]
Stage 2 copied every gradient into its bucket's staging buffer, and the shared-memory
reduce-scatter then read that buffer (comm/shm.py [Note: a shared-memory ring]). On the 20m GPT
(2 ranks, fp32) that copy is 186 MB of memory traffic per rank and iteration, 8-11 ms of the
engine's ~93 ms over the bare model (issue 40; benchmarks/results/engine-20m-n2-issue40-
20261129-r8.md). The shared-memory exchange reads its input one slot region at a time, so it can
read the gradients where autograd left them: `Pieces` names a bucket's elements as (start,
tensor) pieces, what no piece covers (padding, a param with no grad on this rank) reading as
zero. The exchange copies the peers' regions from the pieces into its slot and adds its own
region's pieces to the peers' sums, the same additions in the same order as from a staging
buffer, so the bits are the same (tests/comm/test_pieces.py).

Memory: the gradients of a bucket live until its reduce-scatter lands, instead of a staging
buffer of the bucket's size; the launch still waits for the oldest reduce-scatter past
MAX_IN_FLIGHT (grads/grad_sync.py), so at most that many buckets' gradients are held, and never
more than the bare model holds after its backward (all of them).

Other transports (gloo's TCP ring, NCCL, torch's gloo collectives, qgZ) take a contiguous tensor:
`materialize()` makes one, so `Pieces` is never wrong, only no faster there; stage 2 passes
`Pieces` only where the shared-memory exchange carries the group (sharded_grads.py).

A gradient changed in place after it was put: the staging copy was taken when the grad arrived,
so a later change never reached the reduction; a held piece is read whenever the exchange gets
to it, so the change would be in the sum or not by timing. zerokern's hook sets p.grad = None
when it takes a grad, so only code that kept its own reference can change it: a user's hook that
ran first and kept p.grad, then changed it in place later in the backward. `put` records each
piece's version counter (what autograd checks for "modified by an inplace operation");
`changed_in_place`, asked when the reduce-scatter has landed (grads/sharded_grads.py), says if
one moved, and the backward raises at its end, once every reduce-scatter of it has landed (so
the ranks leave no exchange half done), before any step can use such a sum. The local
accumulator after no_sync() is zerokern's own buffer (put with watch=False): it is added into
in place by design.
"""

from __future__ import annotations

import bisect
from typing import Iterator, List, Optional, Tuple

import torch

# Where a piece's dtype is one of these and the reduction's is float32, reading it converts
# exactly (every bf16 / fp16 value is a float32), so summing it as float32 gives the bits of
# summing its staged float32 copy; any other mismatch is converted when put.
_EXACT_INTO = {torch.float32: (torch.bfloat16, torch.float16)}


class Pieces:
    """`numel` elements of `dtype`: (start, 1-D tensor) pieces, in any order, not overlapping;
    every element no piece covers is +0.0 (a staging buffer's padding and its unarrived
    params). Duck-types what the collectives read of an input: `numel()`, `element_size()`,
    `dtype`, `shape`, `device`."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self._numel, self.dtype, self.device = int(numel), dtype, torch.device(device)
        self._starts: List[int] = []
        self._tensors: List[torch.Tensor] = []
        self._watched: List[Tuple[torch.Tensor, int]] = []  # (piece as put, its _version)
        self._sealed = True  # sorted and checked since the last put

    @property
    def shape(self) -> Tuple[int]:
        return (self._numel,)

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return self.dtype.itemsize

    def put(self, start: int, t: torch.Tensor, watch: bool = True) -> None:
        """Elements [start, start + t.numel()) are `t` (1-D, held by reference until this
        object is dropped). Raises ValueError outside the range. watch: `changed_in_place`
        reports `t` changed in place after this (False: zerokern's own buffer)."""
        t = t.reshape(-1)
        if start < 0 or start + t.numel() > self._numel:
            raise ValueError(f"a piece at {start} of {t.numel()} elements is outside "
                             f"[0, {self._numel})")
        if t.dtype != self.dtype and t.dtype not in _EXACT_INTO.get(self.dtype, ()):
            t = t.to(self.dtype)  # a rounding conversion: once, as the staging copy did
        elif watch:  # (a converted piece is a copy: a later change cannot reach it)
            self._watched.append((t, t._version))
        self._sealed = False
        self._starts.append(int(start))
        self._tensors.append(t)

    def _seal(self) -> None:
        """Sort the pieces and check they do not overlap, once after the last put (spans runs
        per slot round and peer on the ring thread)."""
        if self._sealed:
            return
        order = sorted(range(len(self._starts)), key=self._starts.__getitem__)
        self._starts = [self._starts[i] for i in order]
        self._tensors = [self._tensors[i] for i in order]
        for i in range(1, len(self._starts)):
            if self._starts[i - 1] + self._tensors[i - 1].numel() > self._starts[i]:
                raise ValueError(f"pieces at {self._starts[i - 1]} and {self._starts[i]} "
                                 "overlap")
        self._sealed = True

    def spans(self, a: int, b: int) -> Iterator[Tuple[int, int, Optional[torch.Tensor]]]:
        """(lo, hi, piece elements [lo, hi) or None for zeros) covering [a, b) in order."""
        self._seal()
        i = max(bisect.bisect_right(self._starts, a) - 1, 0)
        pos = a
        while pos < b:
            if i < len(self._starts) and self._starts[i] + self._tensors[i].numel() <= pos:
                i += 1
                continue
            if i >= len(self._starts) or self._starts[i] >= b:
                yield pos, b, None
                return
            s0 = self._starts[i]
            if s0 > pos:
                yield pos, s0, None
                pos = s0
            hi = min(b, s0 + self._tensors[i].numel())
            yield pos, hi, self._tensors[i][pos - s0:hi - s0]
            pos = hi
            i += 1

    def copy_to(self, dst: torch.Tensor, a: int) -> None:
        """dst (1-D, L elements) := elements [a, a + L)."""
        for lo, hi, t in self.spans(a, a + dst.numel()):
            if t is None:
                dst[lo - a:hi - a].zero_()
            else:
                dst[lo - a:hi - a].copy_(t)

    def add_to(self, theirs: torch.Tensor, out: torch.Tensor, a: int) -> None:
        """out := elements [a, a + L) + theirs (both 1-D, L elements): ours first, as
        `torch.add(staging[a:a + L], theirs, out=out)` (a zero span adds +0.0, as the staging
        buffer's zeros did: -0.0 becomes +0.0 alike)."""
        for lo, hi, t in self.spans(a, a + out.numel()):
            o, th = out[lo - a:hi - a], theirs[lo - a:hi - a]
            if t is None:
                torch.add(th, 0.0, out=o)
            else:
                torch.add(t, th, out=o)

    def changed_in_place(self, what: str) -> Optional[str]:
        """The error message if a watched piece was changed in place since it was put (the
        Note above: the reduction read it at some moment in between, so the sum is unusable),
        else None."""
        for t, version in self._watched:
            if t._version != version:
                return (
                    f"zerokern: a gradient ({t.numel()} elements, {what}) was changed in place "
                    "after zerokern took it for the reduce-scatter. Some code kept a reference "
                    "to p.grad (a gradient hook registered before the optimizer was built?) and "
                    "changed it during the backward; zerokern reads gradients where autograd "
                    "left them, so the change may or may not be in the reduced gradient, and "
                    "this backward's gradients must not be stepped on. Change the gradient "
                    "before zerokern's hook takes it, or change a clone. (Grads that are views "
                    "of one tensor, as from a forward that concatenated params, share one "
                    "counter: changing one counts for all.) ZEROKERN_SHM=0 copies every "
                    "gradient when it arrives (a later change is then never reduced)")
        return None

    def materialize(self) -> torch.Tensor:
        """One contiguous tensor of the elements (for a transport that needs one)."""
        out = torch.empty(self._numel, dtype=self.dtype, device=self.device)
        self.copy_to(out, 0)
        return out


def held_tensors(t) -> List[torch.Tensor]:
    """The tensors a staging buffer or a Pieces keeps alive (memory reports)."""
    return list(t._tensors) if isinstance(t, Pieces) else [t]


def contiguous(t) -> torch.Tensor:
    """t itself, or a Pieces' elements in one tensor."""
    return t.materialize() if isinstance(t, Pieces) else t
