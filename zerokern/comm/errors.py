"""The errors every rank raises when another rank failed: `RankAborted` (a peer raised and
posted its error: abort.py) and `PeerLost` (a peer's process died or its host was lost, posting
nothing: liveness.py). Apart from both so that neither imports the other."""

from __future__ import annotations


class RankAborted(RuntimeError):
    """Another rank failed (its error is in the message); this rank's collectives cannot
    complete."""


class PeerLost(RankAborted):
    """A rank's process died or its host was lost, posting nothing ([Note: a rank that dies]
    in liveness.py): the message names the rank, its host and pid (`lost`, a liveness.Lost;
    `origin` the rank, -1 for the store's launcher). Every rank raises it; exit and restart."""

    def __init__(self, lost, me: int, what: str = "a collective") -> None:
        self.lost = lost
        self.origin = lost.rank if lost.rank is not None else -1
        self.root = f"{lost.who()} was lost: {lost.how}"
        super().__init__(
            f"zerokern: {self.root}. Rank {me} saw it while waiting in {what}. Every rank "
            "raises this; the process group is now out of step and cannot be used again: "
            "exit, and restart from the last checkpoint (torchrun --max-restarts restarts "
            "the job)")


class CollectiveMismatch(RankAborted):
    """Two ranks wait in different collectives at the same place in their order ([Note: ranks
    stuck in different collectives] in abort.py): a branch ran collectives on some ranks only.
    Every rank raises it; exit and restart."""
