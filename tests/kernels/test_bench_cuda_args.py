"""`zerokern bench --kernels|--step --device cuda` are one call away (issue 14): the argument
handling of the CUDA runs, checked on the CPU with torch's device queries patched."""

import pytest
import torch

from zerokern.bench import kernels, step


@pytest.fixture
def gpus(monkeypatch):
    def set_count(k):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: k > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: k)
    return set_count


def test_step_cuda_takes_one_nccl_rank_per_gpu(gpus):
    gpus(4)
    a = step.parse_args(["--device", "cuda"])
    assert a.device == "cuda" and a.nproc == 4
    assert step._device(a, 3) == torch.device("cuda", 3)
    with pytest.raises(SystemExit):  # NCCL refuses two ranks on one GPU
        step.parse_args(["--device", "cuda", "--nproc", "5"])


def test_step_cuda_without_gpu_is_a_usage_error(gpus):
    gpus(0)
    with pytest.raises(SystemExit):
        step.parse_args(["--device", "cuda"])
    a = step.parse_args([])
    assert a.device == "cpu" and a.nproc == 2


def test_kernels_cuda_defaults(gpus):
    """The GPU run's defaults: sizes 2^20..2^30, 50 reps; the copy ceiling is a row of every
    size (build_timed), so every GPU number has its ceiling from the same run."""
    gpus(1)
    args = kernels.build_parser().parse_args(["--device", "cuda"])
    assert args.device == "cuda"
    need = kernels.bytes_needed_per_elem([kernels.make_case("bf16"), kernels.make_case("fp32")],
                                         ["triton", "cuda", *kernels.TORCH_PROVIDERS], False)
    assert need * 2**30 < 0.85 * 80e9, "2^30 would not fit an 80 GB GPU"
