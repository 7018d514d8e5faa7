"""CB/MD: checkpoints written into one preallocated buffer per input slot.

[Note: contiguous checkpoint buffers]
With contiguous_checkpointing, the k-th checkpointed call of a forward writes its i-th tensor
input (its piece, with partition_activations) into row k of buffer i: one buffer of
num_checkpoints rows per input position, allocated once, where checkpoints in separate
allocations would fragment the device's memory between the forward and the backward. Rows are
taken in call order; a new forward starts at row 0 again once every checkpoint of the last one
has been freed (its backward ran), or after `reset()` (an evaluation that runs forwards with
grad on and no backward: DeepSpeed's reason for `reset`).

num_checkpoints, when given, is the number of rows: a forward that checkpoints more calls
raises before the extra call runs (its inputs are written nowhere; the model has not changed).
When absent it is derived: the first forward keeps its checkpoints in separate tensors and
counts its calls; the buffers, with that many rows, serve the forwards after it (DeepSpeed
raises IndexError when it is absent). A later forward that checkpoints more calls than the
derived count keeps the extra ones in separate tensors (with a warning, once), and so does an
input whose size or dtype differs from its buffer's rows (the buffers take a homogeneous model,
as DeepSpeed's: transformer layers).

The buffers live where the checkpoints would have: on the tensor's device, or in host memory
with cpu_checkpointing (pinned on a CUDA machine).
"""

from __future__ import annotations

import logging
from typing import Dict, Optional

import torch

log = logging.getLogger("zerokern.checkpointing")


class TooManyCheckpoints(ValueError):
    """A forward checkpoints more calls than num_checkpoints."""


class ContiguousBuffers:
    """[Note: contiguous checkpoint buffers]."""

    def __init__(self, num_checkpoints: Optional[int], host: bool, pin: bool) -> None:
        self.given = num_checkpoints
        self.rows = num_checkpoints          # None until derived
        self.host = host
        self.pin = pin
        self._buffers: Dict[int, torch.Tensor] = {}
        self.calls = 0                       # checkpointed calls in this forward
        self.allocated_bytes = 0
        self._warned = False

    def check_room(self, fresh: bool) -> None:
        """Raise TooManyCheckpoints if the next call would pass a given num_checkpoints."""
        calls = 0 if fresh else self.calls
        if self.given is not None and calls >= self.given:
            raise TooManyCheckpoints(
                f"contiguous_checkpointing: this forward checkpoints more than "
                f"num_checkpoints (config key activation_checkpointing.number_checkpoints) = "
                f"{self.given} calls; raise it to the number of checkpointed calls per "
                "forward, or leave it out to have it derived (this call has not run)")

    def begin_call(self, fresh: bool) -> int:
        """The row of the next checkpointed call; `fresh`: no checkpoint is alive, a new
        forward starts."""
        self.check_room(fresh)
        if fresh:
            if self.rows is None and self.calls:
                self.rows = self.calls       # derived from the first forward
            self.calls = 0
        row = self.calls
        self.calls += 1
        return row

    def row(self, row: int, index: int, piece: torch.Tensor) -> Optional[torch.Tensor]:
        """Row `row` of buffer `index` for `piece` (1-D), or None: keep it separately."""
        if self.rows is None:
            return None
        if row >= self.rows:
            self._warn(f"a forward checkpoints more calls ({row + 1}) than the {self.rows} "
                       "derived from the first one")
            return None
        device = torch.device("cpu") if self.host else piece.device
        buf = self._buffers.get(index)
        if buf is None:
            buf = torch.empty(self.rows, piece.numel(), dtype=piece.dtype, device=device,
                              pin_memory=self.pin and self.host)
            self._buffers[index] = buf
            self.allocated_bytes += buf.numel() * buf.element_size()
        if buf.shape[1] != piece.numel() or buf.dtype != piece.dtype or buf.device != device:
            self._warn(f"input {index} of a checkpointed call has {piece.numel()} elements of "
                       f"{piece.dtype}, its buffer's rows {buf.shape[1]} of {buf.dtype}")
            return None
        return buf[row]

    def _warn(self, what: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("contiguous_checkpointing: %s; those checkpoints are kept in separate "
                        "tensors", what)

    def reset(self) -> None:
        """Start the next forward at row 0 and drop the buffers (a checkpoint still alive
        keeps its own buffer alive)."""
        self._buffers.clear()
        self.allocated_bytes = 0
        self.calls = 0
