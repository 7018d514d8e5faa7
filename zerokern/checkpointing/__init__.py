"""Activation checkpointing with DeepSpeed's API (`deepspeed.checkpointing`): ZeRO-R's
partitioned activations (Pa), host-offloaded checkpoints (Pa+cpu, at tp = 1 too) and contiguous
checkpoint buffers (MD), over torch's non-reentrant checkpoint.

    import zerokern.checkpointing as ckpt
    ckpt.configure(mpu, partition_activations=True, checkpoint_in_cpu=True)
    ckpt.model_parallel_cuda_manual_seed(1234)
    h = ckpt.checkpoint(layer, h)          # in the model's forward

The guide: docs/guides/activation-checkpointing.md. One concept per module: api.py (configure,
checkpoint), rng.py (the RNG tracker), store.py (the saved-tensor hooks), partition.py (Pa),
host_pool.py (Pa+cpu), contiguous.py (MD), groups.py (the model-parallel group), settings.py
(the options and the config section).
"""

from .api import checkpoint, configure, is_configured, model_parallel_cuda_manual_seed, reset, stats
from .contiguous import TooManyCheckpoints
from .host_pool import PoolExhausted
from .rng import RNGStatesTracker, get_cuda_rng_tracker

__all__ = ["configure", "is_configured", "checkpoint", "reset", "stats",
           "get_cuda_rng_tracker", "model_parallel_cuda_manual_seed", "RNGStatesTracker",
           "TooManyCheckpoints", "PoolExhausted"]
