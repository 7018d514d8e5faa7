"""Shared test setup: the Triton interpreter, the backends runnable here, per-test seeds.

TRITON_INTERPRET=1 must be in the environment before triton or zerokern is imported: @triton.jit
reads it when the kernels are decorated. The Triton backend then runs on CPU tensors (numpy),
which is how the Triton kernels are checked on machines without a GPU.

The one exception is the child process that tests/kernels/test_gpu.py starts on a CUDA machine
to exercise the *compiled* Triton kernels: it sets ZK_TEST_COMPILED_TRITON=1, and the
interpreter stays off there (one process cannot hold both kinds of kernel).
"""

import os

if os.environ.get("ZK_TEST_COMPILED_TRITON") != "1":
    os.environ["TRITON_INTERPRET"] = "1"

import sys  # noqa: E402
import zlib  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO))

from zerokern import kernels as zk  # noqa: E402

# Backends that run on CPU tensors in this process ("triton" = the Triton interpreter).
HOST_BACKENDS = ["reference", "cpu", "triton"]
# Backends that run on CUDA tensors (compiled Triton and the CUDA extension); empty without a GPU.
CUDA_BACKENDS = ["triton", "cuda"] if torch.cuda.is_available() else []
# The instruction sets the CPU extension can be forced to (op.force_isa), vector paths first.
CPU_ISAS = ["avx512", "avx2", "scalar"]

_BUILD_ERRORS: dict = {}


def require_backend(name: str) -> None:
    """Fail (not skip) when a backend that should run here cannot: a broken build is a bug."""
    if name in ("cpu", "cuda"):
        if name not in _BUILD_ERRORS:
            try:
                zk.load_op(name)
                _BUILD_ERRORS[name] = None
            except zk.BuildError as e:
                _BUILD_ERRORS[name] = str(e)
        if _BUILD_ERRORS[name]:
            pytest.fail(f"the {name} backend failed to build:\n{_BUILD_ERRORS[name]}")
    ok, why = zk.backend_status()[name]
    if not ok:
        pytest.fail(f"backend {name!r} should run here but is unavailable: {why}")


@pytest.fixture(params=HOST_BACKENDS)
def backend(request) -> str:
    """A backend on CPU tensors. Narrow it with parametrize("backend", [...], indirect=True)."""
    require_backend(request.param)
    return request.param


@pytest.fixture(params=CUDA_BACKENDS or [pytest.param("none", marks=pytest.mark.skip("no CUDA"))])
def cuda_backend(request) -> str:
    """A backend on CUDA tensors (compiled triton, cuda); skipped without a GPU."""
    require_backend(request.param)
    return request.param


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
