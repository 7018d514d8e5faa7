"""JIT build of the native ops (csrc/cpu, csrc/cuda) with ninja, cached across processes.

[Note: build cache and locking]
- Each op builds into `<cache>/<op>-<key>/`, where key hashes the sources, flags, torch, CUDA and
  Python versions, and for the CUDA op the GPU architectures it is compiled for (issue 14,
  defect 5: `_cuda_arch_key`); a change to any of them builds afresh, and an existing `.so`
  is imported straight away without calling ninja (a second process pays ~0.1 s, not a
  rebuild).
- The cache is $ZEROKERN_CACHE_DIR, else $TORCH_EXTENSIONS_DIR/zerokern, else ~/.cache/zerokern.
- Builds are serialised by `fcntl.flock` on `<cache>/<op>.lock`. The kernel drops a flock when
  its holder dies, so a build killed mid-way leaves no lock that can hang a later import.
  torch's own `lock` file (an O_EXCL baton, which does go stale) is removed while we hold the
  flock: nobody else can be building then. Waiting is bounded by $ZEROKERN_BUILD_TIMEOUT
  (default 900 s), after which a BuildError names the lock file.
- Prebuilt (AOT) ops from `ZEROKERN_BUILD_OPS=1 pip install` are tried first.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import importlib.util
import logging
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List

from zerokern.platform.device import handle

from . import cuda_toolchain

log = logging.getLogger("zerokern")

_PKG_DIR = Path(__file__).resolve().parent.parent


class BuildError(RuntimeError):
    """A native op could not be built or loaded."""


class ToolchainError(BuildError):
    """The op needs a JIT build and this machine has no matching compiler (no nvcc, or nvcc's
    CUDA major differs from torch's): [Note: CUDA toolchain checks] in cuda_toolchain.py."""


@dataclass(frozen=True)
class OpSpec:
    """How to build one native op module."""

    name: str                      # cache/module stem, e.g. "cpu"
    sources: List[str]             # glob patterns relative to the csrc root
    cflags: List[str] = field(default_factory=list)
    cuda_cflags: List[str] = field(default_factory=list)
    ldflags: List[str] = field(default_factory=list)
    cuda: bool = False
    root: str = ""                 # csrc root override (tests); default: csrc_root()


OPS: Dict[str, OpSpec] = {
    # No -march: the CPU kernel picks AVX-512 / AVX2 / scalar at run time, so a cached build
    # stays valid on another x86 machine sharing the cache (e.g. an NFS home directory).
    # -ffp-contract=off: GCC contracts a*b + c into an FMA even in ISO C++ mode wherever the
    # target has one (an avx512f body does), and the 8-bit AdamW kernels must round each product
    # (adamw8bit.py [Note: the 8-bit step, bit for bit]): measured 1-ulp master differences
    # without it. The other CPU kernels compile to the same code with or without it (their FMAs
    # are explicit intrinsics; objdump-compared).
    "cpu": OpSpec("cpu", ["cpu/*.cpp"],
                  cflags=["-O3", "-std=c++17", "-ffp-contract=off", "-fopenmp"],
                  ldflags=["-fopenmp"]),
    # No --use_fast_math: the contract needs IEEE sqrt and division (DESIGN §3).
    # Every source of the one CUDA module; setup.py's AOT build takes this same list.
    "cuda": OpSpec("cuda", ["cuda/binding.cpp", "cuda/zk_kernels.cu", "cuda/lion_binding.cpp",
                            "cuda/lion.cu", "cuda/adamw8bit_binding.cpp", "cuda/adamw8bit.cu"],
                   cflags=["-O3", "-std=c++17"], cuda_cflags=["-O3", "-lineinfo"], cuda=True),
}


def csrc_root() -> Path:
    """Sources ship inside the package (zerokern/_csrc) or, in a checkout, at the repo's csrc/."""
    for cand in (_PKG_DIR / "_csrc", _PKG_DIR.parent / "csrc"):
        if cand.is_dir():
            return cand
    raise BuildError(f"zerokern native sources not found (looked in {_PKG_DIR / '_csrc'} and "
                     f"{_PKG_DIR.parent / 'csrc'}); reinstall zerokern or use backend='reference'")


def cache_root() -> Path:
    if os.environ.get("ZEROKERN_CACHE_DIR"):
        return Path(os.environ["ZEROKERN_CACHE_DIR"])
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "zerokern"
    return Path.home() / ".cache" / "zerokern"


def _root(spec: OpSpec) -> Path:
    return Path(spec.root) if spec.root else csrc_root()


def _sources(spec: OpSpec) -> List[Path]:
    root = _root(spec)
    files = sorted({f for pat in spec.sources for f in root.glob(pat)})
    if not files:
        raise BuildError(f"no sources match {spec.sources} under {root}")
    return files


def _all_source_files(spec: OpSpec) -> List[Path]:
    """The sources plus every header beside them (a header edit must rebuild too)."""
    files = set(_sources(spec))
    for d in {f.parent for f in files}:
        files.update(p for p in d.iterdir() if p.suffix in (".h", ".cuh", ".hpp"))
    return sorted(files)


def _cuda_arch_key() -> str:
    """(5) The architectures cpp_extension will compile for, as it chooses them.

    TORCH_CUDA_ARCH_LIST when set; else the compute capability of every visible GPU (what
    cpp_extension detects). Without this, a cache shared by two GPU models (an NFS home, a
    container image) hands one model a .so built for the other: "no kernel image is available".
    """

    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if env:
        return "list:" + " ".join(env.replace(";", " ").split())
    cuda = handle("cuda")
    if cuda.is_available():
        caps = sorted({cuda.capability(i) for i in range(cuda.device_count())})
        return "detected:" + ",".join(f"{a}.{b}" for a, b in caps)
    return "detected:none"


def build_key(spec: OpSpec) -> str:
    import torch

    h = hashlib.sha256()
    for f in _all_source_files(spec):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    h.update(repr((spec.cflags, spec.cuda_cflags, spec.ldflags, torch.__version__,
                   torch.version.cuda, sys.version_info[:2], platform.machine())).encode())
    if spec.cuda:
        h.update(_cuda_arch_key().encode())
    return h.hexdigest()[:16]


def module_name(spec: OpSpec) -> str:
    return f"zerokern_{spec.name}_ops"


def build_dir(spec: OpSpec) -> Path:
    return cache_root() / f"{spec.name}-{build_key(spec)}"


def _import_so(name: str, path: Path):
    s = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(s)
    s.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def _build_lock(path: Path):
    timeout = float(os.environ.get("ZEROKERN_BUILD_TIMEOUT", "900"))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        deadline = time.monotonic() + timeout
        announced = False
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise BuildError(
                        f"timed out after {timeout:.0f} s waiting for the build lock {path}, held "
                        "by another live process building the same op; wait for it, raise "
                        "ZEROKERN_BUILD_TIMEOUT, or use backend='reference'") from None
                if not announced:
                    log.warning("zerokern: waiting for another process building ops (%s)", path)
                    announced = True
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


_LOADED: Dict[str, object] = {}


def load_op(spec_or_name) -> object:
    """Import a native op module, building it on first use (cached; one log line).

    Args:
        spec_or_name: "cpu" or "cuda", or an OpSpec.

    Returns:
        The extension module.

    Raises:
        BuildError: the build failed; the message names the command and the build directory
            (`ninja -v` there shows the compiler's output) and suggests backend="reference".
    """
    spec = OPS[spec_or_name] if isinstance(spec_or_name, str) else spec_or_name
    if spec.name in _LOADED:
        return _LOADED[spec.name]
    if not spec.root:  # AOT build from `ZEROKERN_BUILD_OPS=1 pip install`
        with contextlib.suppress(ImportError):
            mod = importlib.import_module(f"zerokern._ops_{spec.name}")
            why = cuda_toolchain.prebuilt_problem(mod) if spec.cuda else None
            if why is None:
                _LOADED[spec.name] = mod
                return mod
            # [Note: CUDA toolchain checks]: build for the GPUs present instead
            log.warning("zerokern: not using the prebuilt zerokern._ops_%s: %s; JIT-building",
                        spec.name, why)
    name, bdir = module_name(spec), build_dir(spec)
    so = bdir / f"{name}.so"
    if not so.exists() and spec.cuda:
        why = cuda_toolchain.toolchain_problem()
        if why is not None:
            raise ToolchainError(f"cannot build zerokern {spec.name} ops: {why}")
    if not so.exists():
        with _build_lock(cache_root() / f"{spec.name}.lock"):
            if not so.exists():
                _build(spec, name, bdir)
    try:
        mod = _import_so(name, so)
    except ImportError as e:
        raise BuildError(f"built {so} but could not import it ({e}); delete {bdir} to rebuild, "
                         "or use backend='reference'") from e
    _LOADED[spec.name] = mod
    return mod


def _build(spec: OpSpec, name: str, bdir: Path) -> None:
    from torch.utils import cpp_extension

    bdir.mkdir(parents=True, exist_ok=True)
    # We hold the flock, so a torch baton here was left by a killed build: remove it or
    # cpp_extension.load would wait on it forever.
    with contextlib.suppress(FileNotFoundError):
        (bdir / "lock").unlink()
    root = _root(spec)
    log.warning("zerokern: building %s ops (first use; ~1 min) in %s", spec.name, bdir)
    t0 = time.time()
    try:
        cpp_extension.load(
            name=name, sources=[str(f) for f in _sources(spec)],
            extra_cflags=spec.cflags, extra_cuda_cflags=spec.cuda_cflags,
            extra_ldflags=spec.ldflags, extra_include_paths=[str(root)],
            build_directory=str(bdir), with_cuda=spec.cuda, verbose=False)
    except Exception as e:  # ninja/compiler failure, missing nvcc, ...
        detail = str(e).strip().splitlines()
        tail = "\n".join(detail[-25:])
        raise BuildError(
            f"building zerokern {spec.name} ops failed.\n  command: ninja -v  (in {bdir}; "
            f"build.ninja there lists each compiler call)\n{tail}\n"
            "Fix the toolchain (a C++17 compiler with OpenMP; nvcc matching torch's CUDA for "
            "the cuda ops) or pass backend='reference' to run the plain-torch kernels.") from e
    log.warning("zerokern: built %s ops in %.0f s", spec.name, time.time() - t0)
