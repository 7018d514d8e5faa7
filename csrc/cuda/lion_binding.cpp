// zerokern CUDA backend: the torch side of the Lion step (lion.cu), registered by binding.cpp's
// module. Python validates first (kernels/lion.py); cheap invariants are re-checked here.
// Everything runs on the current CUDA stream: no host sync.
#include <torch/extension.h>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <optional>

#include "lion.cuh"
#include "torch_dtype.h"

namespace {

void lion_check(const at::Tensor& t, const char* name, const at::Device& dev, int64_t n) {
  TORCH_CHECK(t.is_cuda() && t.device() == dev, "zerokern cuda: ", name, " must be on ", dev,
              ", got ", t.device());
  TORCH_CHECK(n < 0 || (t.is_contiguous() && t.numel() == n), "zerokern cuda: ", name,
              " must be contiguous with ", n, " elements");
}

}  // namespace

void zk_lion_step(const at::Tensor& master, const at::Tensor& exp_avg, const at::Tensor& grad,
                  const std::optional<at::Tensor>& param_out, double lr, double beta1,
                  double beta2, double weight_decay, const at::Tensor& step,
                  const at::Tensor& grad_scale, const at::Tensor& found_inf,
                  const std::optional<at::Tensor>& hp) {
  const at::Device dev = master.device();
  const int64_t n = master.numel();
  lion_check(master, "master", dev, n);
  lion_check(exp_avg, "exp_avg", dev, n);
  lion_check(grad, "grad", dev, n);
  TORCH_CHECK(master.scalar_type() == at::kFloat && exp_avg.scalar_type() == at::kFloat,
              "zerokern cuda: master and exp_avg must be float32");
  void* out_ptr = nullptr;
  zk_dtype_t out_dtype = ZK_DTYPE_NONE;
  if (param_out.has_value()) {
    lion_check(*param_out, "param_out", dev, n);
    out_ptr = param_out->data_ptr();
    out_dtype = zk_dtype_of(*param_out);
  }
  lion_check(step, "step", dev, -1);
  lion_check(grad_scale, "grad_scale", dev, -1);
  lion_check(found_inf, "found_inf", dev, -1);
  const double* hp_ptr = nullptr;
  if (hp.has_value()) {
    lion_check(*hp, "hp", dev, 5);
    TORCH_CHECK(hp->scalar_type() == at::kDouble, "zerokern cuda: hp must be float64");
    hp_ptr = hp->data_ptr<double>();
  }
  const c10::cuda::CUDAGuard guard(dev);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  const cudaError_t err = zk_lion_step_launch(
      master.data_ptr<float>(), exp_avg.data_ptr<float>(), grad.data_ptr(), zk_dtype_of(grad),
      out_ptr, out_dtype, n, lr, beta1, beta2, weight_decay, step.data_ptr(),
      zk_dtype_of(step), grad_scale.data_ptr<float>(), found_inf.data_ptr(),
      zk_dtype_of(found_inf), hp_ptr, stream);
  C10_CUDA_CHECK(err);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
