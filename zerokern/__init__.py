"""zerokern: ZeRO sharded data parallelism for PyTorch with fused optimizer kernels."""

from . import kernels

__version__ = "0.1.0"
__all__ = ["kernels", "__version__"]
