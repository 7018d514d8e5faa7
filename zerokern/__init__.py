"""zerokern: ZeRO sharded data parallelism for PyTorch with fused optimizer kernels."""

from zerokern.accounting.formula import estimate_memory

from . import checkpoint, kernels
from .engine import init_distributed, initialize
from .optimizer import ZeroAdamW
from .version import __version__

__all__ = ["ZeroAdamW", "checkpoint", "estimate_memory", "init_distributed", "initialize",
           "kernels", "__version__"]
