"""Model-parallel RNG states: Megatron's / DeepSpeed's `get_cuda_rng_tracker()` and
`model_parallel_cuda_manual_seed()`.

[Note: the two RNG streams]
A tensor-parallel model draws random numbers from two streams:
- the default generator, seeded with the same `seed` on every TP rank: dropout on activations
  that every TP rank holds whole (after the row-parallel all-reduce) is the same on every TP
  rank, as Megatron expects (the ranks compute the same thing redundantly);
- the tracker's named state "model-parallel-rng", seeded with `seed + 2718 + tp_rank`: dropout
  on activations that are split over the TP ranks (attention probabilities of a rank's heads)
  differs between TP ranks, and is the same on every data-parallel replica of a TP rank.
Code draws from the second stream inside `with get_cuda_rng_tracker().fork(): ...`. The
offset 2718 is Megatron's and DeepSpeed's, so a model seeded here draws the same numbers as
under `deepspeed.checkpointing`.

[Note: the tracker's device]
The tracker keeps states of the accelerator's generator, as DeepSpeed's does with
`get_accelerator()`: the current CUDA device's generator when CUDA is available, else the CPU
generator (a CPU-only machine, a gloo run). On CPU, `fork()` therefore swaps the state of
torch's default CPU generator, the one `torch.manual_seed` seeds and CPU dropout draws from.

[Note: replaying the tracker]
`zerokern.checkpointing.checkpoint` snapshots the tracker's states when a checkpointed forward
starts and puts that snapshot back for the recompute (and the states of the moment back after
it), next to torch's own replay of the default CPU and CUDA generators. Dropout drawn through
`fork()` inside a checkpointed function is therefore replayed identically in the backward.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Dict, Iterator, Optional

import torch

from zerokern.platform.device import accelerator

MODEL_PARALLEL_RNG = "model-parallel-rng"
SEED_OFFSET = 2718  # Megatron's / DeepSpeed's: the tracker's seed is seed + 2718 + tp_rank


def _device_type() -> str:
    """[Note: the tracker's device]."""
    return accelerator().type


def _get_state() -> torch.Tensor:
    return accelerator().get_rng_state()


def _set_state(state: torch.Tensor) -> None:
    accelerator().set_rng_state(state)


def _manual_seed(seed: int) -> None:
    accelerator().manual_seed(seed)


class RNGStatesTracker:
    """Named states of the accelerator's RNG ([Note: the tracker's device]), as Megatron's and
    DeepSpeed's `CudaRNGStatesTracker`: `add(name, seed)` makes a state, `fork(name)` runs a
    block with it and keeps what the block advanced it to."""

    def __init__(self) -> None:
        self._states: Dict[str, torch.Tensor] = {}
        self._seeds: set = set()

    def reset(self) -> None:
        """Forget every state and seed."""
        self._states = {}
        self._seeds = set()

    def get_states(self) -> Dict[str, torch.Tensor]:
        """A copy of the name -> state dict (the states themselves are not copied: `fork`
        replaces a state, it never writes into one).

        Returns:
            The name -> RNG state (a uint8 tensor) dict.
        """
        return copy.copy(self._states)

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        """Replace every state (no check that they fit the generator, as DeepSpeed's).

        Args:
            states: a name -> RNG state dict, as `get_states` returns.
        """
        self._states = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Add a state named `name`, seeded with `seed`; the generator's state is left as it
        was.

        Args:
            name: the state's name (e.g. "model-parallel-rng").
            seed: its seed.

        Raises:
            ValueError: the name or the seed is taken already (before anything changes).
        """
        if seed in self._seeds:
            raise ValueError(f"rng tracker: seed {seed} is used already")
        if name in self._states:
            raise ValueError(f"rng tracker: a state named {name!r} exists already")
        saved = _get_state()
        try:
            _manual_seed(seed)
            self._states[name] = _get_state()
        finally:
            _set_state(saved)
        self._seeds.add(seed)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block with the generator set to state `name`; afterwards the state keeps
        what the block drew and the generator is back where it was.

        Args:
            name: the state's name (default "model-parallel-rng").

        Raises:
            KeyError: no state of that name (add it, or call model_parallel_cuda_manual_seed).
        """
        if name not in self._states:
            raise KeyError(f"rng tracker: no state named {name!r} (add it first, e.g. with "
                           "zerokern.checkpointing.model_parallel_cuda_manual_seed)")
        saved = _get_state()
        _set_state(self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_state()
            _set_state(saved)


_TRACKER = RNGStatesTracker()


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """The process's RNG tracker ([Note: the two RNG streams]; on a machine without CUDA it
    tracks the CPU generator: [Note: the tracker's device]).

    Returns:
        The RNGStatesTracker.
    """
    return _TRACKER


def seed_model_parallel(seed: int, tp_rank: int) -> None:
    """[Note: the two RNG streams] for a given tensor-parallel rank."""
    _TRACKER.reset()
    _manual_seed(seed)
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + SEED_OFFSET + tp_rank)


@contextlib.contextmanager
def replay(snapshot: Optional[Dict[str, torch.Tensor]]) -> Iterator[None]:
    """The recompute side of [Note: replaying the tracker]: the tracker as it was at the
    forward, and as it is now afterwards."""
    if snapshot is None:
        yield
        return
    now = _TRACKER.get_states()
    _TRACKER.set_states(snapshot)
    try:
        yield
    finally:
        _TRACKER.set_states(now)
