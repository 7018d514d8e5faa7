"""zerokern: ZeRO sharded data parallelism for PyTorch with fused optimizer kernels."""

from zerokern.accounting.formula import estimate_memory

from . import checkpoint, checkpointing, kernels
from .engine import init_distributed, initialize
from .optimizer import ZeroOptimizer
from .optimizer_adafactor import ZeroAdafactor
from .optimizer_adamw import ZeroAdamW
from .optimizer_lion import ZeroLion
from .optimizer_muon import ZeroMuon
from .version import __version__

__all__ = ["ZeroAdafactor", "ZeroAdamW", "ZeroLion", "ZeroMuon", "ZeroOptimizer", "checkpoint", "checkpointing",
           "estimate_memory", "init_distributed", "initialize",
           "kernels", "__version__"]
