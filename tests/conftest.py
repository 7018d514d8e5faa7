"""Shared test setup: the Triton interpreter or the compiled kernels, the backends runnable
here, the `gpu` and `large` marks, per-test seeds.

[Note: one kind of Triton kernel per process] (issue 14, defect 1)
TRITON_INTERPRET is read when @triton.jit decorates the kernels, so one process runs either
interpreted kernels (CPU tensors, numpy) or compiled ones (CUDA), never both. This conftest
decides in `pytest_configure`, before any test module (and so triton) is imported:
* `python -m pytest -m gpu` on a CUDA machine: the interpreter stays OFF, and the tests marked
  `gpu` run the compiled Triton kernels and the CUDA extension on the GPU;
* any other run: the interpreter is ON (the Triton kernels are checked on CPU tensors) and the
  `gpu` tests are skipped, with the command that runs them; on a CUDA machine
  tests/kernels/test_gpu.py::test_gpu_suite_in_child runs that command in a child process.
ZK_TEST_COMPILED_TRITON=1 forces the compiled kernels too (the child sets it).
"""

import os
import sys
import zlib
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO))

from zerokern import kernels as zk  # noqa: E402
from zerokern.kernels.build import ToolchainError  # noqa: E402

# Backends that run on CPU tensors in this process ("triton" = the Triton interpreter).
HOST_BACKENDS = ["reference", "cpu", "triton"]
# Backends that run on CUDA tensors (compiled Triton and the CUDA extension); empty without a GPU.
CUDA_BACKENDS = ["triton", "cuda"] if torch.cuda.is_available() else []
# Set by pytest_configure: True when this process runs the compiled kernels (no interpreter).
COMPILED = {"on": False}
GPU_COMMAND = "python -m pytest -m gpu"


def _selects_only_gpu(markexpr: str) -> bool:
    """Does `-m markexpr` select tests marked gpu and deselect unmarked ones?"""
    if not markexpr:
        return False
    try:
        from _pytest.mark.expression import Expression

        expr = Expression.compile(markexpr)
        return bool(expr.evaluate(lambda m: m == "gpu")) and not expr.evaluate(lambda m: False)
    except Exception:  # noqa: BLE001 - a private API; fall back to reading the words
        words = markexpr.split()
        return "gpu" in words and "not" not in words


def pytest_configure(config):
    config.addinivalue_line("markers", f"gpu: runs the compiled kernels on a CUDA device; "
                                       f"`{GPU_COMMAND}` (skipped in any other run)")
    config.addinivalue_line("markers", "large: needs tens of GiB of GPU memory (n >= 2^31); "
                                       "deselect with -m 'gpu and not large'")
    compiled = torch.cuda.is_available() and (
        _selects_only_gpu(config.getoption("markexpr", "") or "")
        or os.environ.get("ZK_TEST_COMPILED_TRITON") == "1")
    COMPILED["on"] = compiled
    if compiled:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = "1"
    if "zerokern.kernels.triton_kernels" in sys.modules:  # decorated already: too late
        tk = sys.modules["zerokern.kernels.triton_kernels"]
        assert tk.INTERPRET == (not compiled), "triton kernels imported before conftest chose"


def pytest_collection_modifyitems(config, items):
    if COMPILED["on"]:
        return
    why = ("needs a CUDA device" if not torch.cuda.is_available() else
           f"runs the compiled kernels, in their own process: `{GPU_COMMAND}`")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.skip(reason=why))
# The instruction sets the CPU extension can be forced to (op.force_isa), vector paths first.
CPU_ISAS = ["avx512", "avx2", "scalar"]

_BUILD_ERRORS: dict = {}


def cuda_toolchain_skip() -> None:
    """Skip (with the reason) when the cuda backend cannot be built on this machine: no nvcc,
    or nvcc's CUDA major differs from torch's (issue 24, item 6: a pip-only GPU box). A
    usable prebuilt or cached op needs no toolchain. Any other build failure still fails."""
    from zerokern.kernels import cuda_toolchain
    from zerokern.kernels.dispatch import _prebuilt_or_cached

    if not _prebuilt_or_cached("cuda"):
        why = cuda_toolchain.toolchain_problem()
        if why is not None:
            pytest.skip(f"cuda backend not buildable here: {why}")


def _skip_if_toolchain(err: str) -> None:
    """A prebuilt op unusable here (another GPU) whose JIT rebuild has no toolchain: skip."""
    if err and err.startswith(_TOOLCHAIN_MARK):
        pytest.skip(f"cuda backend not buildable here: {err}")


_TOOLCHAIN_MARK = "[toolchain] "


def require_backend(name: str, on_cpu: bool = False) -> None:
    """Fail (not skip) when a backend that should run here cannot: a broken build is a bug
    (a missing or mismatched nvcc skips the cuda backend instead: cuda_toolchain_skip)."""
    if name == "cuda":
        cuda_toolchain_skip()
    if name in ("cpu", "cuda"):
        if name not in _BUILD_ERRORS:
            try:
                zk.load_op(name)
                _BUILD_ERRORS[name] = None
            except ToolchainError as e:
                _BUILD_ERRORS[name] = _TOOLCHAIN_MARK + str(e)
            except zk.BuildError as e:
                _BUILD_ERRORS[name] = str(e)
        _skip_if_toolchain(_BUILD_ERRORS[name])
        if _BUILD_ERRORS[name]:
            pytest.fail(f"the {name} backend failed to build:\n{_BUILD_ERRORS[name]}")
    if name == "triton" and on_cpu and COMPILED["on"]:
        pytest.skip("the Triton interpreter is off in this process (compiled kernels, -m gpu)")
    ok, why = zk.backend_status()[name]
    if not ok:
        pytest.fail(f"backend {name!r} should run here but is unavailable: {why}")


@pytest.fixture(params=HOST_BACKENDS)
def backend(request) -> str:
    """A backend on CPU tensors. Narrow it with parametrize("backend", [...], indirect=True);
    a "cuda" value marked gpu goes through it too, and so gets the cuda toolchain skip."""
    require_backend(request.param, on_cpu=True)
    return request.param


@pytest.fixture(params=CUDA_BACKENDS or [pytest.param("none", marks=pytest.mark.skip("no CUDA"))])
def cuda_backend(request) -> str:
    """A backend on CUDA tensors (compiled triton, cuda); skipped without a GPU, and the cuda
    backend skipped where it cannot be built (cuda_toolchain_skip). Only for tests marked `gpu`
    (elsewhere the interpreter would run the Triton kernels on CUDA tensors). Other values go
    through it too: parametrize("cuda_backend", ["reference", "triton", "cuda"],
    indirect=True); a "cuda" listed directly would bypass the skip
    (tests/test_gpu_static_checks.py checks)."""
    assert request.node.get_closest_marker("gpu") is not None, "mark this test gpu"
    require_backend(request.param)
    return request.param


@pytest.fixture
def cuda_op(request):
    """The CUDA extension module, for a test marked `gpu` that calls backend="cuda" itself;
    skipped where it cannot be built (no nvcc, or a CUDA major other than torch's)."""
    assert request.node.get_closest_marker("gpu") is not None, "mark this test gpu"
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    require_backend("cuda")
    return zk.load_op("cuda")


@pytest.fixture
def cuda_device(request) -> torch.device:
    """The current CUDA device, for a test marked `gpu` that runs no cuda-backend kernel
    (compiled Triton, torch's own ops, NCCL): it needs no nvcc. Skipped without a GPU."""
    assert request.node.get_closest_marker("gpu") is not None, "mark this test gpu"
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture
def cpu_op():
    """The CPU extension module (built on first use)."""
    require_backend("cpu")
    return zk.load_op("cpu")


@pytest.fixture(params=CPU_ISAS)
def cpu_isa(request, cpu_op) -> str:
    """Force the CPU extension onto one instruction set for the test, then back to 'auto'."""
    if not hasattr(cpu_op, "force_isa"):
        pytest.skip("this CPU extension build cannot force an ISA")
    try:
        cpu_op.force_isa(request.param)
    except ValueError as e:  # the CPU lacks it
        pytest.skip(str(e))
    assert cpu_op.selected_isa() == request.param
    yield request.param
    cpu_op.force_isa("auto")


@pytest.fixture(autouse=True)
def zk_seed(request) -> int:
    """Fresh random data in every test, reproducible: the seed hashes the test id.

    Set ZK_TEST_SEED to another integer to draw different data for the whole suite.
    """
    s = zlib.crc32(request.node.nodeid.encode()) + int(os.environ.get("ZK_TEST_SEED", "0"))
    s %= 2**31
    torch.manual_seed(s)
    request.node.user_properties.append(("seed", s))
    return s


def pytest_report_header(config):
    st = zk.backend_status()
    lines = [
        "zerokern backends: "
        + ", ".join(f"{k}={'yes' if ok else 'no'}" for k, (ok, _) in st.items())
    ]
    lines.append(
        f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')} "
        f"ZK_TEST_SEED={os.environ.get('ZK_TEST_SEED', '0')}"
    )
    return lines
