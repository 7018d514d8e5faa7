"""DeepSpeed's `deepspeed.checkpointing` API: configure, is_configured, checkpoint, reset, and
the model-parallel seed.

[Note: configure is all or nothing]
`configure` checks everything (the values, the mpu, the config section) before it changes
anything: a bad value raises and the previous configuration stays, checkpoints already taken
included. Like DeepSpeed's, each call starts from the defaults, then the config section, then
the keywords given (not None) override it.

[Note: bad input]
- partition_activations with no model-parallel group (mpu_=None): a no-op with a
  UserWarning naming partition_activations, not an error: a DeepSpeed config written for a
  tensor-parallel run still runs unchanged on one rank or under plain data parallelism, where
  there is nothing to split over (checkpoints are kept whole). With a group of one rank it is
  a no-op without a warning.
- cpu_checkpointing on a machine without CUDA (host memory is the device): it runs (the
  checkpoints are copied into the host pool, which is how the CPU tests exercise it) and a
  UserWarning naming cpu_checkpointing says that it saves no memory there.
- number_checkpoints smaller than the checkpointed calls of a forward: ValueError
  (TooManyCheckpoints) before the extra call runs (contiguous.py).
- an unknown key of the config section, or a value of the wrong type: ValueError naming it.
In every case the warning or error comes before anything has changed.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import torch
import torch.utils.checkpoint as torch_checkpoint

from zerokern.platform.device import accelerator, has_accelerator

from . import groups, rng
from .settings import Settings, check_value, parse_section, section_of
from .store import Store

log = logging.getLogger("zerokern.checkpointing")


@dataclass
class Plan:
    """A checked configuration, not yet in effect ([Note: configure is all or nothing])."""

    settings: Settings
    tp: groups.TPGroup
    mpu: Any
    warnings: tuple = ()


@dataclass
class _State:
    settings: Settings
    tp: groups.TPGroup
    mpu: Any
    store: Store
    configured: bool


def _store(s: Settings, tp: groups.TPGroup) -> Store:
    return Store(tp, s.partition_activations, s.checkpoint_in_cpu, s.contiguous_checkpointing,
                 s.num_checkpoints)


_STATE = _State(Settings(), groups.NONE, None, _store(Settings(), groups.NONE), False)
_DEPTH = [0]  # checkpointed calls running now (nested ones use torch's checkpoint alone)


def prepare(mpu_: Any = None, deepspeed_config: Any = None, section: Optional[Dict] = None,
            error: type = ValueError, **kw: Any) -> Plan:
    """Check a configuration without applying it ([Note: configure is all or nothing]);
    `section` is an already parsed activation_checkpointing section ({field: value})."""
    s = Settings()
    if deepspeed_config is not None:
        sec = section_of(deepspeed_config)
        if sec is not None:
            s = s.replace(**parse_section(sec, error))
    if section is not None:
        s = s.replace(**section)
    given = {k: check_value(k, v, error) for k, v in kw.items() if v is not None}
    s = s.replace(**given)
    tp = groups.resolve(mpu_)
    notes = []
    if s.partition_activations and mpu_ is None:
        notes.append("partition_activations is on but there is no model-parallel group "
                     "(mpu_ is None): a no-op, checkpoints are kept whole; pass an mpu, a "
                     "DeviceMesh or a ProcessGroup to split them over its ranks")
    if s.checkpoint_in_cpu and not has_accelerator():
        notes.append("cpu_checkpointing is on but host memory is the device here (no CUDA): "
                     "checkpoints are copied into host buffers, which saves no memory")
    return Plan(s, tp, mpu_, tuple(notes))


def apply(plan: Plan) -> None:
    """Put a checked configuration in effect (`prepare` has raised if it is bad)."""
    global _STATE
    for note in plan.warnings:
        warnings.warn(f"zerokern.checkpointing: {note}", UserWarning, stacklevel=3)
    _STATE = _State(plan.settings, plan.tp, plan.mpu, _store(plan.settings, plan.tp), True)
    s = plan.settings
    log.info("activation checkpointing: partition_activations %s (tp %d), cpu_checkpointing "
             "%s, contiguous %s (num_checkpoints %s), synchronize %s, profile %s",
             s.partition_activations, plan.tp.size, s.checkpoint_in_cpu,
             s.contiguous_checkpointing, s.num_checkpoints, s.synchronize, s.profile)


def configure(mpu_: Any, deepspeed_config: Any = None, partition_activations: Optional[bool] = None,
              contiguous_checkpointing: Optional[bool] = None,
              num_checkpoints: Optional[int] = None, checkpoint_in_cpu: Optional[bool] = None,
              synchronize: Optional[bool] = None, profile: Optional[bool] = None) -> None:
    """Configure activation checkpointing, as `deepspeed.checkpointing.configure`.

    Each call starts from the defaults (all off), applies the config's
    `activation_checkpointing` section, then the keywords that are not None. Everything is
    checked before anything changes ([Note: configure is all or nothing]); the bad-input
    rules are in [Note: bad input] (zerokern/checkpointing/api.py).

    Args:
        mpu_: the model-parallel group checkpoints are partitioned over: None, Megatron's
            `mpu`, a DTensor DeviceMesh (its "tp" dim, or its only / last dim) or a
            ProcessGroup.
        deepspeed_config: a DeepSpeed config (a dict or a JSON file's path) whose
            `activation_checkpointing` section is read.
        partition_activations: split each checkpointed input over the model-parallel ranks
            and all-gather it before the recompute (config key partition_activations).
        contiguous_checkpointing: write the checkpoints into one preallocated buffer per
            input slot (config key contiguous_memory_optimization); needs no
            partition_activations, unlike DeepSpeed's.
        num_checkpoints: the checkpointed calls per forward, the buffers' rows (config key
            number_checkpoints); derived from the first forward when None.
        checkpoint_in_cpu: keep the checkpoints in pinned host memory from a bounded pool
            (config key cpu_checkpointing); works without partition_activations, unlike
            DeepSpeed's.
        synchronize: synchronize the device before and after each checkpointed forward and
            recompute (config key synchronize_checkpoint_boundary).
        profile: log the time of each checkpointed forward and recompute (config key profile).

    Raises:
        ValueError: an unknown config key or a bad value (named), or an mpu_ whose group
            does not contain this rank.
        TypeError: an mpu_ of no known kind.
    """
    apply(prepare(mpu_, deepspeed_config, partition_activations=partition_activations,
                  contiguous_checkpointing=contiguous_checkpointing,
                  num_checkpoints=num_checkpoints, checkpoint_in_cpu=checkpoint_in_cpu,
                  synchronize=synchronize, profile=profile))


def is_configured() -> bool:
    """Whether `configure` has been called (by the user, or by `zerokern.initialize` for a
    config with an `activation_checkpointing` section).

    Returns:
        True once configured.
    """
    return _STATE.configured


def reset() -> None:
    """Drop the contiguous buffers and the host pool's free buffers, and start the next
    forward at the first contiguous row: for evaluation forwards run with grad on and no
    backward, as DeepSpeed's `reset`. Checkpoints still alive keep their own memory."""
    _STATE.store.reset()


def stats() -> Dict[str, Any]:
    """The counters of the current configuration (zerokern/checkpointing/store.py [Note:
    what stats() counts]): checkpoints kept now, their device and host bytes, the peak, the
    host pool's allocations and copies, the all-gathers.

    Returns:
        A dict of counters.
    """
    return _STATE.store.stats()


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the two RNG streams of a tensor-parallel model (zerokern/checkpointing/rng.py
    [Note: the two RNG streams]): the default generator with `seed` (the same on every TP
    rank), the tracker's "model-parallel-rng" with seed + 2718 + the TP rank of the
    configured group (0 without one). Call `configure` first, as in DeepSpeed.

    Args:
        seed: the run's seed.
    """
    rng.seed_model_parallel(seed, _STATE.tp.rank)


def _sync() -> None:
    accelerator().synchronize()


@contextlib.contextmanager
def _timed(s: Settings, store: Store, what: str):
    if s.synchronize:
        _sync()
    t0 = time.perf_counter() if s.profile else 0.0
    try:
        yield
    finally:
        if s.synchronize or s.profile:
            _sync()
        if s.profile:
            dt = time.perf_counter() - t0
            setattr(store, what, getattr(store, what) + dt)
            log.info("checkpointing: %s %.3f ms", what[:-2], dt * 1e3)


def checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """Run `function(*args, **kwargs)` without keeping its activations; recompute them in
    the backward. Non-reentrant, as `torch.utils.checkpoint(use_reentrant=False)` (on which it
    is built): inputs need not require grad, `torch.autograd.grad` works, outputs keep their
    structure. The recompute replays the default CPU / CUDA generators (torch) and the RNG
    tracker (zerokern/checkpointing/rng.py [Note: replaying the tracker]), so dropout
    is identical. The positional tensor inputs are kept as configured (partitioned,
    offloaded, contiguous: zerokern/checkpointing/store.py); keyword tensors are kept as
    they are.

    Args:
        function: the function to run (a module's forward, a layer).
        *args: its positional inputs (tensors and other values).
        **kwargs: its keyword inputs.

    Returns:
        What `function` returns.

    Raises:
        ValueError: with contiguous_checkpointing, this call is past num_checkpoints
            (before it runs).
    """
    st = _STATE
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    if _DEPTH[0]:
        return torch_checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)
    store, s = st.store, st.settings
    store.check_room()
    snapshot = rng.get_cuda_rng_tracker().get_states()

    def contexts():
        return contextlib.nullcontext(), _recompute_ctx(snapshot, s, store)

    store.begin_call()
    _DEPTH[0] += 1
    try:
        with _timed(s, store, "forward_s"), store.hooks():
            return torch_checkpoint.checkpoint(function, *args, use_reentrant=False,
                                               context_fn=contexts, **kwargs)
    finally:
        _DEPTH[0] -= 1


@contextlib.contextmanager
def _recompute_ctx(snapshot, s: Settings, store: Store):
    with _timed(s, store, "recompute_s"), rng.replay(snapshot):
        yield
