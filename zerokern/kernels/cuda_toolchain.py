"""Can this machine build or run the CUDA op? nvcc against torch's CUDA, a prebuilt op's GPUs.

[Note: CUDA toolchain checks] (issue 24, items 6 and 8)
* A JIT build of csrc/cuda needs nvcc whose CUDA *major* version equals torch's
  (torch.utils.cpp_extension refuses a major mismatch; a minor one only warns). A pip-only GPU
  box often has no nvcc at all. `toolchain_problem()` says which, before ninja runs, so the
  error names the cause, and the test suite skips the cuda-backend tests with that reason
  instead of failing them (the triton backend still runs there).
* A prebuilt `zerokern._ops_cuda` (ZEROKERN_BUILD_OPS=1 pip install) was compiled for the GPUs
  of the build machine or TORCH_CUDA_ARCH_LIST. Imported on another GPU model it loads fine
  and fails at the first launch ("no kernel image is available"). `prebuilt_problem(mod)` asks
  the module itself (cudaFuncGetAttributes on one of its kernels, on the current device) and
  the loader then JIT-builds for the GPUs present instead. Only the current device: probing
  each visible GPU created a CUDA context (several hundred MB) on every one of them, ~7 extra
  contexts per rank on an 8-GPU node (issue 34). A rank runs the op on its own device, which is
  current once it has called torch.cuda.set_device.
* A prebuilt op from an older zerokern may lack a newer op's function (the 8-bit AdamW step,
  issue 23): it would load and then fail with AttributeError mid-training. `OP_FUNCTIONS` names
  what the current sources define; a module missing one is rebuilt the same way.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
from typing import Optional, Tuple

from zerokern.platform.device import handle


def _nvcc_timeout_s() -> float:
    """Seconds `nvcc --version` may take ($ZEROKERN_NVCC_TIMEOUT_S, default 60)."""
    try:
        return float(os.environ.get("ZEROKERN_NVCC_TIMEOUT_S", "") or 60)
    except ValueError:
        raise ValueError("ZEROKERN_NVCC_TIMEOUT_S: expected a number of seconds") from None


@functools.cache
def nvcc_version(nvcc: str) -> Optional[Tuple[int, int]]:
    """(major, minor) from `nvcc --version`, or None if it does not run."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                             timeout=_nvcc_timeout_s())
    except (OSError, subprocess.SubprocessError):  # (a timeout too: toolchain_problem says so)
        return None
    m = re.search(r"release (\d+)\.(\d+)", out.stdout)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _torch_cuda() -> Optional[str]:
    import torch

    return torch.version.cuda


def _cuda_home() -> Optional[str]:
    from torch.utils.cpp_extension import CUDA_HOME

    return CUDA_HOME


def toolchain_problem() -> Optional[str]:
    """None if csrc/cuda can be JIT-built here, else why not (one line)."""
    torch_cuda = _torch_cuda()
    if torch_cuda is None:
        return "this torch build has no CUDA (torch.version.cuda is None)"
    home = _cuda_home()
    if home is None:
        return ("nvcc not found (no CUDA_HOME / CUDA_PATH and no nvcc on PATH): the cuda "
                "backend is JIT-built with nvcc; install the CUDA toolkit matching torch's "
                f"CUDA {torch_cuda}, or use backend='triton'")
    nvcc = os.path.join(home, "bin", "nvcc")
    ver = nvcc_version(nvcc)
    if ver is None:
        return (f"{nvcc} --version did not run, printed no release, or timed out after "
                f"{_nvcc_timeout_s():g} s (a busy machine: raise ZEROKERN_NVCC_TIMEOUT_S)")
    want = int(torch_cuda.split(".")[0])
    if ver[0] != want:
        return (f"nvcc {ver[0]}.{ver[1]} ({nvcc}) does not match torch's CUDA {torch_cuda}: "
                "torch.utils.cpp_extension refuses a different CUDA major version; install "
                f"CUDA {want}.x or a torch built for CUDA {ver[0]}, or use backend='triton'")
    return None


# The functions csrc/cuda/binding.cpp registers (tests/kernels/test_adamw8bit_cuda_dispatch.py
# checks this against the source).
OP_FUNCTIONS = ("adam_step", "grad_stats", "lion_step", "adamw8bit_step", "kernel_image_error")


def prebuilt_problem(mod) -> Optional[str]:
    """None if the prebuilt CUDA op has every function and runs on the current CUDA device, else
    why not. Touches no other device ([Note: CUDA toolchain checks])."""

    missing = [f for f in OP_FUNCTIONS if f != "kernel_image_error" and not hasattr(mod, f)]
    if missing and hasattr(mod, "kernel_image_error"):
        return (f"it lacks {', '.join(missing)} (built by an older zerokern); rebuild it with "
                "`zerokern build` or ZEROKERN_BUILD_OPS=1 pip install")

    probe = getattr(mod, "kernel_image_error", None)
    if probe is None:
        return ("it has no kernel-image check (built by an older zerokern); rebuild it with "
                "`zerokern build` or ZEROKERN_BUILD_OPS=1 pip install")
    cuda = handle("cuda")
    if not cuda.is_available():
        return None  # nothing to probe; the op cannot run here either way
    dev = cuda.current_device().index
    err = probe(dev)  # the binding refuses any other device (csrc/cuda/binding.cpp)
    if err:
        cap = cuda.capability(dev)
        return (f"it has no kernel image for cuda:{dev} (compute capability "
                f"{cap[0]}.{cap[1]}): {err}")
    return None
