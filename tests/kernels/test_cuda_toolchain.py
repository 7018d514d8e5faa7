"""Issue 24, items 6 and 8 (prebuilt op): the cuda backend on machines that cannot build it.

* `toolchain_problem()` reads a (fake) nvcc's `--version`: none, another CUDA major than torch's,
  the same major (no problem; the positive control).
* conftest's `require_backend("cuda")` *skips* with that reason when nvcc is missing or
  mismatched: on the old conftest it called pytest.fail (a pip-only GPU box went red); any other
  build error still fails (negative control).
* `load_op("cuda")` does not use a prebuilt `zerokern._ops_cuda` whose kernels have no image for
  a visible GPU: it warns and JIT-builds (old code: imported it unchecked). One that passes the
  probe is used as is.
The GPU side: `python -m pytest -m gpu` on a box without nvcc shows the cuda-backend tests as
skipped with this reason (tests/kernels/test_gpu.py, tests/gpu/test_gpu.py).
"""

from __future__ import annotations

import logging
import types

import pytest

from tests import conftest
from zerokern import kernels as zk
from zerokern.kernels import build, cuda_toolchain, dispatch


def _fake_nvcc(tmp_path, release: str) -> str:
    home = tmp_path / f"cuda-{release}-{len(list(tmp_path.iterdir()))}"
    (home / "bin").mkdir(parents=True)
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
    nvcc.chmod(0o755)
    return str(home)


@pytest.fixture
def toolchain(monkeypatch, tmp_path):
    def set_(torch_cuda, nvcc_release):
        cuda_toolchain.nvcc_version.cache_clear()
        home = None if nvcc_release is None else _fake_nvcc(tmp_path, nvcc_release)
        monkeypatch.setattr(cuda_toolchain, "_torch_cuda", lambda: torch_cuda)
        monkeypatch.setattr(cuda_toolchain, "_cuda_home", lambda: home)
    yield set_
    cuda_toolchain.nvcc_version.cache_clear()


def test_toolchain_problem_names_the_cause(toolchain):
    toolchain("12.8", None)
    assert "nvcc not found" in cuda_toolchain.toolchain_problem()
    toolchain("12.8", "13.0")
    why = cuda_toolchain.toolchain_problem()
    assert "nvcc 13.0" in why and "12.8" in why and "major" in why
    toolchain("12.8", "12.4")  # minor differences are fine (cpp_extension only warns)
    assert cuda_toolchain.toolchain_problem() is None
    toolchain(None, "12.4")
    assert "no CUDA" in cuda_toolchain.toolchain_problem()


@pytest.mark.parametrize("nvcc", [None, "13.0"], ids=["missing", "other-major"])
def test_conftest_skips_cuda_backend_without_a_matching_nvcc(monkeypatch, toolchain, nvcc):
    toolchain("12.8", nvcc)
    monkeypatch.setattr(dispatch, "_prebuilt_or_cached", lambda name: False)
    monkeypatch.setattr(zk, "load_op", lambda name: (_ for _ in ()).throw(
        zk.BuildError("building zerokern cuda ops failed")))
    monkeypatch.setattr(conftest, "_BUILD_ERRORS", {})
    with pytest.raises(pytest.skip.Exception, match="not buildable here"):
        conftest.require_backend("cuda")


def test_conftest_still_fails_other_build_errors(monkeypatch, toolchain):
    toolchain("12.8", "12.8")  # the toolchain is fine: a failed build is a bug
    monkeypatch.setattr(dispatch, "_prebuilt_or_cached", lambda name: False)
    monkeypatch.setattr(zk, "load_op", lambda name: (_ for _ in ()).throw(
        zk.BuildError("ptxas error")))
    monkeypatch.setattr(conftest, "_BUILD_ERRORS", {})
    with pytest.raises(pytest.fail.Exception, match="ptxas error"):
        conftest.require_backend("cuda")


def test_jit_build_refuses_a_mismatched_nvcc_before_ninja(monkeypatch, toolchain, tmp_path):
    toolchain("12.8", "13.0")
    monkeypatch.setenv("ZEROKERN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_LOADED", {})
    monkeypatch.setattr(build.importlib, "import_module",
                        lambda name: (_ for _ in ()).throw(ImportError(name)))
    monkeypatch.setattr(build, "_cuda_arch_key", lambda: "detected:none")
    monkeypatch.setattr(build, "_build", lambda *a: pytest.fail("ninja ran"))
    with pytest.raises(build.BuildError, match="does not match torch's CUDA 12.8"):
        build.load_op("cuda")


@pytest.mark.parametrize("image_error", ["", "no kernel image is available for execution"],
                         ids=["runs-here", "other-gpu"])
def test_prebuilt_cuda_op_is_checked_for_this_gpu(monkeypatch, tmp_path, caplog, image_error):
    probed = []

    def kernel_image_error(dev):
        probed.append(dev)
        return image_error

    prebuilt = types.SimpleNamespace(kernel_image_error=kernel_image_error,
                                     **{f: None for f in cuda_toolchain.OP_FUNCTIONS[:-1]})
    jit = types.SimpleNamespace(name="jit")
    monkeypatch.setenv("ZEROKERN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_LOADED", {})
    monkeypatch.setattr(build.importlib, "import_module", lambda name: prebuilt)
    monkeypatch.setattr(build, "_cuda_arch_key", lambda: "detected:8.0")
    monkeypatch.setattr(cuda_toolchain, "toolchain_problem", lambda: None)
    monkeypatch.setattr(build, "_build", lambda *a: None)
    monkeypatch.setattr(build, "_import_so", lambda name, so: jit)
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: (8, 0))
    with caplog.at_level(logging.WARNING, logger="zerokern"):
        mod = build.load_op("cuda")
    assert probed == ([0, 1] if not image_error else [0])
    if image_error:
        assert mod is jit
        assert "not using the prebuilt" in caplog.text and "compute capability 8.0" in caplog.text
    else:
        assert mod is prebuilt and "prebuilt" not in caplog.text


def test_conftest_skips_when_a_prebuilt_op_needs_a_rebuild_without_nvcc(monkeypatch):
    """A prebuilt op for another GPU counts as 'prebuilt' for the up-front check; its JIT
    rebuild then meets no nvcc (ToolchainError): skip, not fail."""
    monkeypatch.setattr(dispatch, "_prebuilt_or_cached", lambda name: True)
    monkeypatch.setattr(zk, "load_op", lambda name: (_ for _ in ()).throw(
        build.ToolchainError("cannot build zerokern cuda ops: nvcc not found")))
    monkeypatch.setattr(conftest, "_BUILD_ERRORS", {})
    with pytest.raises(pytest.skip.Exception, match="nvcc not found"):
        conftest.require_backend("cuda")
