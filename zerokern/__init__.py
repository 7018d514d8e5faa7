"""zerokern: ZeRO sharded data parallelism for PyTorch with fused optimizer kernels."""

from . import checkpoint, kernels
from .engine import init_distributed, initialize
from .formula import estimate_memory
from .optimizer import ZeroAdamW, ZeroOptimizer
from .optimizer_lion import ZeroLion

__version__ = "0.1.0"
__all__ = ["ZeroAdamW", "ZeroLion", "ZeroOptimizer", "checkpoint", "estimate_memory",
           "init_distributed", "initialize",
           "kernels", "__version__"]
