"""Backend selection and availability (DESIGN §6).

`auto` picks triton for CUDA tensors (cuda where Triton is not installed) and cpu for CPU tensors.
A backend that cannot run raises with the reason; nothing falls back silently to another one.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from typing import Dict, Tuple

import torch

from zerokern.platform.device import handle

from .build import OPS, BuildError, build_dir, module_name


def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _prebuilt_or_cached(name: str) -> bool:
    if importlib.util.find_spec(f"zerokern._ops_{name}") is not None:
        return True
    try:
        return (build_dir(OPS[name]) / f"{module_name(OPS[name])}.so").exists()
    except BuildError:
        return False


def backend_status() -> Dict[str, Tuple[bool, str]]:
    """Each backend -> (available, reason or note). Never builds anything."""
    cuda = handle("cuda").is_available()
    st: Dict[str, Tuple[bool, str]] = {"reference": (True, "plain torch ops, any device")}
    if not _triton_importable():
        st["triton"] = (False, "triton is not installed (pip install triton; Linux only)")
    elif cuda:
        st["triton"] = (True, "CUDA tensors")
    elif _interpreting():
        st["triton"] = (True, "CPU tensors under TRITON_INTERPRET=1 (slow; for tests)")
    else:
        st["triton"] = (False, "no CUDA device (set TRITON_INTERPRET=1 to run on CPU tensors)")
    if not cuda:
        st["cuda"] = (False, "no CUDA device visible to torch")
    elif _prebuilt_or_cached("cuda"):
        st["cuda"] = (True, "built")
    else:
        from torch.utils.cpp_extension import CUDA_HOME

        from .cuda_toolchain import toolchain_problem

        why = toolchain_problem()
        if why is not None:
            st["cuda"] = (False, why)
        else:
            st["cuda"] = (True, f"JIT-builds on first use with {CUDA_HOME}/bin/nvcc")
    if _prebuilt_or_cached("cpu"):
        st["cpu"] = (True, "built")
    else:
        cxx = os.environ.get("CXX", "c++")
        if shutil.which(cxx) is None:
            st["cpu"] = (False, f"no C++ compiler ({cxx}) to JIT-build csrc/cpu")
        else:
            st["cpu"] = (True, "JIT-builds on first use")
    return st


def available_backends() -> list:
    """Names of the backends that can run in this process, e.g. ['reference', 'cpu']."""
    return [name for name, (ok, _) in backend_status().items() if ok]


def resolve(backend: str, device: torch.device) -> str:
    """Map `backend` (validated) to a concrete backend for tensors on `device`."""
    if backend == "auto":
        if device.type == "cuda":
            return "triton" if _triton_importable() else "cuda"
        if device.type == "cpu":
            return "cpu"
        return "reference"
    if backend == "cpu" and device.type != "cpu":
        raise ValueError(f"backend='cpu' needs CPU tensors, got {device}")
    if backend == "cuda" and device.type != "cuda":
        raise ValueError(f"backend='cuda' needs CUDA tensors, got {device}")
    if backend == "triton":
        if not _triton_importable():
            raise ValueError("backend='triton' needs triton installed (pip install triton)")
        if device.type == "cpu" and not _interpreting():
            raise ValueError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before "
                             "zerokern is imported; use backend='cpu' for the CPU kernel")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"backend='triton' needs CUDA tensors, got {device}")
    return backend
