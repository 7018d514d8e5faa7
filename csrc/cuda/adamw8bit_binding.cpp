// zerokern CUDA backend: the torch side of the 8-bit AdamW step (adamw8bit.cu), registered by
// binding.cpp's module. Python validates first (kernels/adamw8bit.py); cheap invariants are
// re-checked here. Everything runs on the current CUDA stream: no host sync.
#include <torch/extension.h>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <optional>

#include "adamw8bit.cuh"
#include "torch_dtype.h"

namespace {

// On `dev`; with n >= 0 also contiguous with n elements of dtype `dt`.
void q8_check(const at::Tensor& t, const char* name, const at::Device& dev, int64_t n,
              at::ScalarType dt) {
  TORCH_CHECK(t.is_cuda() && t.device() == dev, "zerokern cuda: ", name, " must be on ", dev,
              ", got ", t.device());
  TORCH_CHECK(n < 0 || (t.is_contiguous() && t.numel() == n && t.scalar_type() == dt),
              "zerokern cuda: ", name, " must be contiguous ", dt, " with ", n,
              " elements, got ", t.scalar_type(), " with ", t.numel());
}

}  // namespace

void zk_adamw8bit_step(const at::Tensor& master, const at::Tensor& m_q,
                       const at::Tensor& m_absmax, const at::Tensor& v_q,
                       const at::Tensor& v_absmax, const at::Tensor& grad,
                       const std::optional<at::Tensor>& param_out, double lr, double beta1,
                       double beta2, double eps, double weight_decay, const at::Tensor& step,
                       const at::Tensor& grad_scale, const at::Tensor& found_inf,
                       const at::Tensor& code_s, const at::Tensor& code_u,
                       const at::Tensor& mid_s, const at::Tensor& mid_u,
                       const std::optional<at::Tensor>& hp) {
  const at::Device dev = master.device();
  const int64_t n = master.numel();
  TORCH_CHECK(n % 128 == 0, "zerokern cuda: master must have a multiple of 128 elements, got ",
              n);
  q8_check(master, "master", dev, n, at::kFloat);
  q8_check(m_q, "m_q", dev, n, at::kByte);
  q8_check(v_q, "v_q", dev, n, at::kByte);
  q8_check(m_absmax, "m_absmax", dev, n / 128, at::kFloat);
  q8_check(v_absmax, "v_absmax", dev, n / 128, at::kFloat);
  const auto gt = grad.scalar_type();
  TORCH_CHECK(gt == at::kFloat || gt == at::kHalf || gt == at::kBFloat16,
              "zerokern cuda: grad must be float32, float16 or bfloat16, got ", gt);
  q8_check(grad, "grad", dev, n, gt);
  q8_check(code_s, "code_s", dev, 256, at::kFloat);
  q8_check(code_u, "code_u", dev, 256, at::kFloat);
  q8_check(mid_s, "mid_s", dev, 255, at::kFloat);
  q8_check(mid_u, "mid_u", dev, 255, at::kFloat);
  void* out_ptr = nullptr;
  zk_dtype_t out_dtype = ZK_DTYPE_NONE;
  if (param_out.has_value()) {
    const auto ot = param_out->scalar_type();
    TORCH_CHECK(ot == at::kHalf || ot == at::kBFloat16,
                "zerokern cuda: param_out must be float16 or bfloat16, got ", ot);
    q8_check(*param_out, "param_out", dev, n, ot);
    out_ptr = param_out->data_ptr();
    out_dtype = zk_dtype_of(*param_out);
  }
  q8_check(step, "step", dev, -1, at::kLong);  // scalars: the device only (n < 0)
  q8_check(grad_scale, "grad_scale", dev, -1, at::kFloat);
  q8_check(found_inf, "found_inf", dev, -1, at::kBool);
  TORCH_CHECK(step.numel() == 1 && grad_scale.numel() == 1 && found_inf.numel() == 1,
              "zerokern cuda: step, grad_scale and found_inf must have one element each");
  const auto st = step.scalar_type(), ft = found_inf.scalar_type();
  TORCH_CHECK(st == at::kLong || st == at::kInt || st == at::kFloat || st == at::kDouble,
              "zerokern cuda: step must be int64, int32, float32 or float64, got ", st);
  TORCH_CHECK(grad_scale.scalar_type() == at::kFloat, "zerokern cuda: grad_scale must be float32");
  TORCH_CHECK(ft == at::kBool || ft == at::kFloat,
              "zerokern cuda: found_inf must be bool or float32, got ", ft);
  const double* hp_ptr = nullptr;
  if (hp.has_value()) {
    q8_check(*hp, "hp", dev, 5, at::kDouble);
    hp_ptr = hp->data_ptr<double>();
  }
  const c10::cuda::CUDAGuard guard(dev);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  const cudaError_t err = zk_adamw8bit_step_launch(
      master.data_ptr<float>(), m_q.data_ptr<uint8_t>(), m_absmax.data_ptr<float>(),
      v_q.data_ptr<uint8_t>(), v_absmax.data_ptr<float>(), grad.data_ptr(), zk_dtype_of(grad),
      out_ptr, out_dtype, n, lr, beta1, beta2, eps, weight_decay, step.data_ptr(),
      zk_dtype_of(step), grad_scale.data_ptr<float>(), found_inf.data_ptr(),
      zk_dtype_of(found_inf), hp_ptr, code_s.data_ptr<float>(), code_u.data_ptr<float>(),
      mid_s.data_ptr<float>(), mid_u.data_ptr<float>(), stream);
  C10_CUDA_CHECK(err);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
