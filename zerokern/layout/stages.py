"""What each ZeRO stage keeps, as one object: the question every layer used to answer with its
own `if stage == 0` (DESIGN §2's buffer table).

| pattern              | stage 0 | stage 1 | stage 2 | stage 3 |
|----------------------|---------|---------|---------|---------|
| replicated_state     | yes     |         |         |         |
| shards_grads         |         |         | yes     | yes     |
| shards_params        |         |         |         | yes     |
| grads_averaged       | yes     |         |         |         |
| publishes (gathers   |         | yes     | yes     |         |
|   each updated piece)|         |         |         |         |

The optimizer (which buffer and gradient classes to build; whether the step's statistics are
combined across ranks and divided by N: `grads_averaged`), the gradient path (FullGrads
all-reduces or reduce-scatters by `grads_averaged`), the buffers (`ShardBuffer`: which flat
range a bucket's state is, whether `publish_piece` all-gathers), `memory_report`, the exact
estimate and the checkpoint views ask the pattern; no module outside this one tests the stage
number for a decision on the gradient path. The coordinates themselves (bucket, piece, state
offset, padding) are `partition.FlatLayout`'s; a pattern only says which of them apply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

from zerokern.geometry.partition import FlatLayout
from zerokern.options.args import check_stage


@dataclass(frozen=True)
class StagePattern:
    stage: int
    replicated_state: bool  # every rank holds master/m/v of every bucket (stage 0)
    shards_grads: bool      # a grad shard per rank, reduce-scattered (stages 2-3)
    shards_params: bool     # only the param shard is resident between uses (stage 3)

    @property
    def publishes(self) -> bool:
        """Each updated piece is all-gathered into every rank's full params (stages 1-2);
        stage 0 updated the whole bucket on every rank, stage 3 gathers at the next use."""
        return not (self.replicated_state or self.shards_params)

    @property
    def grads_averaged(self) -> bool:
        """Grads are all-reduced, so each rank's are already DDP's average (stage 0): the
        step's statistics need no all-reduce and no division by the world size. Otherwise
        they are reduce-scattered and each rank holds its shard of the sum (stages 1-3)."""
        return self.replicated_state

    # -- the state a rank holds, in a buffer's layout --------------------------------------------
    def state_range(self, layout: FlatLayout, rank: int, k: int) -> Tuple[int, int]:
        return layout.state_range(k, rank, self.replicated_state)

    def state_offset(self, layout: FlatLayout, k: int) -> int:
        return layout.state_offset(k, self.replicated_state)

    def state_numel(self, layout: FlatLayout) -> int:
        return layout.state_numel(self.replicated_state)

    def state_padding(self, layout: FlatLayout, rank: int) -> int:
        return layout.state_padding(rank, self.replicated_state)

    def resident_params(self, layout: FlatLayout) -> int:
        """Param elements resident between steps: the whole buffer, or the shard (stage 3)."""
        return layout.shard_numel if self.shards_params else layout.padded_numel

    def resident_grads(self, layout: FlatLayout) -> int:
        """Grad elements kept between backward and step: full, or the shard (stages 2-3)."""
        return layout.shard_numel if self.shards_grads else layout.padded_numel


_PATTERNS = {0: StagePattern(0, True, False, False), 1: StagePattern(1, False, False, False),
             2: StagePattern(2, False, True, False), 3: StagePattern(3, False, True, True)}


def pattern(stage: int) -> StagePattern:
    """The StagePattern of ZeRO stage 0-3 (ValueError naming `stage` otherwise)."""
    return _PATTERNS[check_stage(stage)]
