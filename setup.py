"""Build script: ships csrc/ inside the package for JIT builds; ZEROKERN_BUILD_OPS=1 prebuilds.

Metadata lives in pyproject.toml. torch is imported only for the opt-in AOT build, which needs
`--no-build-isolation` so that the installed torch is the one built against (DESIGN §6).
"""

import os
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithSources(build_py):
    """Copy csrc/ to zerokern/_csrc in the built package, where the JIT builder finds it."""

    def run(self):
        super().run()
        dst = Path(self.build_lib) / "zerokern" / "_csrc"
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(ROOT / "csrc", dst)


def ext_modules():
    if os.environ.get("ZEROKERN_BUILD_OPS", "0") != "1":
        return [], {}
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    # The JIT build's flags (kernels/build.py OPS["cpu"]; -ffp-contract=off is load-bearing).
    cpu_src = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "cpu").glob("*.cpp"))
    exts = [CppExtension("zerokern._ops_cpu", cpu_src,
                         extra_compile_args=["-O3", "-std=c++17", "-ffp-contract=off", "-fopenmp"],
                         extra_link_args=["-fopenmp"])]
    if CUDA_HOME is not None and (torch.cuda.is_available()
                                  or os.environ.get("TORCH_CUDA_ARCH_LIST")):
        # Every .cpp/.cu of csrc/cuda: the JIT build's list (kernels/build.py OPS["cuda"]);
        # binding.cpp registers functions defined in the others (lion, adamw8bit).
        cuda_src = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "cuda").iterdir()
                          if p.suffix in (".cpp", ".cu"))
        exts.append(CUDAExtension(
            "zerokern._ops_cuda", cuda_src,
            extra_compile_args={"cxx": ["-O3", "-std=c++17"], "nvcc": ["-O3", "-lineinfo"]}))
    return exts, {"build_ext": BuildExtension}


exts, cmds = ext_modules()
setup(ext_modules=exts, cmdclass={"build_py": BuildPyWithSources, **cmds})
