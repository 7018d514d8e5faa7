"""zerokern: ZeRO sharded data parallelism for PyTorch with fused optimizer kernels."""

from zerokern.core.optimizer import ZeroOptimizer
from zerokern.memory.formula import estimate_memory
from zerokern.optimizers.adafactor import ZeroAdafactor
from zerokern.optimizers.adamw import ZeroAdamW
from zerokern.optimizers.lion import ZeroLion
from zerokern.optimizers.muon import ZeroMuon

from . import checkpoint, checkpointing, kernels
from .engine import init_distributed, initialize
from .version import __version__

__all__ = ["ZeroAdafactor", "ZeroAdamW", "ZeroLion", "ZeroMuon", "ZeroOptimizer", "checkpoint",
           "checkpointing", "estimate_memory", "init_distributed", "initialize", "kernels",
           "__version__"]
