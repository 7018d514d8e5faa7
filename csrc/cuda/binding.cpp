// zerokern CUDA backend: thin torch binding over the pure-CUDA launchers in zk_kernels.cu.
// Python validates arguments first; here only cheap invariants are re-checked (device, dtype,
// contiguity, numel). Everything is enqueued on the current CUDA stream: no host sync, no .item().
#include <torch/extension.h>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <optional>
#include <string>

#include "zk_kernels.cuh"
#include "torch_dtype.h"

namespace {

void check_device(const at::Tensor& t, const char* name, const at::Device& dev) {
  TORCH_CHECK(t.is_cuda(), "zerokern cuda: ", name, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.device() == dev, "zerokern cuda: ", name, " must be on ", dev, ", got ",
              t.device());
}

// A flat array of n elements.
void check_flat(const at::Tensor& t, const char* name, const at::Device& dev, int64_t n) {
  check_device(t, name, dev);
  TORCH_CHECK(t.is_contiguous(), "zerokern cuda: ", name, " must be contiguous");
  TORCH_CHECK(t.numel() == n, "zerokern cuda: ", name, " must have ", n, " elements, got ",
              t.numel());
}

// A device scalar (0-d or one element).
void check_scalar(const at::Tensor& t, const char* name, const at::Device& dev) {
  check_device(t, name, dev);
  TORCH_CHECK(t.numel() == 1, "zerokern cuda: ", name, " must be a 0-d tensor, got shape ",
              t.sizes());
}

bool is_16bit_float(const at::Tensor& t) {
  return t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16;
}

bool is_grad_dtype(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || is_16bit_float(t);
}

bool is_flag_dtype(const at::Tensor& t) {
  return t.scalar_type() == at::kBool || t.scalar_type() == at::kFloat;
}

// One fused Adam/AdamW step on a flat fp32 shard (DESIGN.md §3), then step += 1 unless found_inf.
void adam_step(const at::Tensor& master, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
               const at::Tensor& grad, const std::optional<at::Tensor>& param_out, double lr,
               double beta1, double beta2, double eps, double weight_decay, bool adamw,
               const at::Tensor& step, const at::Tensor& grad_scale,
               const at::Tensor& found_inf, const std::optional<at::Tensor>& hp) {
  TORCH_CHECK(master.is_cuda(), "zerokern cuda: master must be a CUDA tensor, got ",
              master.device());
  const at::Device dev = master.device();
  const int64_t n = master.numel();
  check_flat(master, "master", dev, n);
  check_flat(exp_avg, "exp_avg", dev, n);
  check_flat(exp_avg_sq, "exp_avg_sq", dev, n);
  check_flat(grad, "grad", dev, n);
  TORCH_CHECK(master.scalar_type() == at::kFloat && exp_avg.scalar_type() == at::kFloat &&
                  exp_avg_sq.scalar_type() == at::kFloat,
              "zerokern cuda: master, exp_avg and exp_avg_sq must be float32");
  TORCH_CHECK(is_grad_dtype(grad), "zerokern cuda: grad must be float32, float16 or bfloat16, got ",
              grad.scalar_type());

  void* out_ptr = nullptr;
  zk_dtype_t out_dtype = ZK_DTYPE_NONE;
  if (param_out.has_value()) {
    const at::Tensor& po = *param_out;
    check_flat(po, "param_out", dev, n);
    TORCH_CHECK(is_16bit_float(po), "zerokern cuda: param_out must be float16 or bfloat16, got ",
                po.scalar_type());
    out_ptr = po.data_ptr();
    out_dtype = zk_dtype_of(po);
  }

  check_scalar(step, "step", dev);
  const at::ScalarType st = step.scalar_type();
  TORCH_CHECK(st == at::kLong || st == at::kInt || st == at::kFloat || st == at::kDouble,
              "zerokern cuda: step must be int64, int32, float32 or float64, got ", st);
  check_scalar(grad_scale, "grad_scale", dev);
  TORCH_CHECK(grad_scale.scalar_type() == at::kFloat,
              "zerokern cuda: grad_scale must be float32, got ", grad_scale.scalar_type());
  check_scalar(found_inf, "found_inf", dev);
  TORCH_CHECK(is_flag_dtype(found_inf), "zerokern cuda: found_inf must be bool or float32, got ",
              found_inf.scalar_type());

  const double* hp_ptr = nullptr;
  if (hp.has_value()) {
    const at::Tensor& h = *hp;
    check_flat(h, "hp", dev, 5);
    TORCH_CHECK(h.scalar_type() == at::kDouble, "zerokern cuda: hp must be float64, got ",
                h.scalar_type());
    hp_ptr = h.data_ptr<double>();
  }

  const c10::cuda::CUDAGuard guard(dev);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  const cudaError_t err = zk_adam_step_launch(
      master.data_ptr<float>(), exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(),
      grad.data_ptr(), zk_dtype_of(grad), out_ptr, out_dtype, n, lr, beta1, beta2, eps,
      weight_decay, adamw ? 1 : 0, step.data_ptr(), zk_dtype_of(step),
      grad_scale.data_ptr<float>(), found_inf.data_ptr(), zk_dtype_of(found_inf), hp_ptr, stream);
  C10_CUDA_CHECK(err);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// found_inf |= any(!isfinite(grad)); sumsq += sum(float(grad)^2). Deterministic, no atomics.
void grad_stats(const at::Tensor& grad, const at::Tensor& found_inf, const at::Tensor& sumsq) {
  TORCH_CHECK(grad.is_cuda(), "zerokern cuda: grad must be a CUDA tensor, got ", grad.device());
  const at::Device dev = grad.device();
  const int64_t n = grad.numel();
  check_flat(grad, "grad", dev, n);
  TORCH_CHECK(is_grad_dtype(grad), "zerokern cuda: grad must be float32, float16 or bfloat16, got ",
              grad.scalar_type());
  check_scalar(found_inf, "found_inf", dev);
  TORCH_CHECK(is_flag_dtype(found_inf), "zerokern cuda: found_inf must be bool or float32, got ",
              found_inf.scalar_type());
  check_scalar(sumsq, "sumsq", dev);
  TORCH_CHECK(sumsq.scalar_type() == at::kFloat || sumsq.scalar_type() == at::kDouble,
              "zerokern cuda: sumsq must be float32 or float64, got ", sumsq.scalar_type());
  if (n == 0) return;

  const c10::cuda::CUDAGuard guard(dev);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  // Small (<= 8 KiB) per-call workspace from the caching allocator on the current stream: stream
  // order makes reuse after this function returns safe, and nothing synchronizes.
  const int64_t ws_bytes = static_cast<int64_t>(zk_grad_stats_workspace_bytes(n));
  at::Tensor workspace = at::empty({ws_bytes}, grad.options().dtype(at::kByte));
  const cudaError_t err =
      zk_grad_stats_launch(grad.data_ptr(), zk_dtype_of(grad), n, found_inf.data_ptr(),
                           zk_dtype_of(found_inf), sumsq.data_ptr(), zk_dtype_of(sumsq),
                           workspace.data_ptr(), stream);
  C10_CUDA_CHECK(err);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// "" if this build has a kernel image the current device can run, else CUDA's error text (a
// prebuilt op compiled for other GPUs: zerokern.kernels.build checks before first use).
// The current device only: switching to another one would create a CUDA context there
// (several hundred MB, on every rank of a node). `device`, when given, must be the current one
// (callers from older zerokern versions pass it).
std::string kernel_image_error(const std::optional<int64_t>& device) {
  const int64_t current = c10::cuda::current_device();
  TORCH_CHECK(!device.has_value() || *device == current,
              "zerokern cuda: kernel_image_error probes the current device (cuda:", current,
              ") only, got cuda:", device.value_or(current));
  const cudaError_t e = zk_probe_kernel_image();
  return e == cudaSuccess ? std::string() : std::string(cudaGetErrorString(e));
}

}  // namespace

// lion_binding.cpp (ZeroLion)
void zk_lion_step(const at::Tensor& master, const at::Tensor& exp_avg, const at::Tensor& grad,
                  const std::optional<at::Tensor>& param_out, double lr, double beta1,
                  double beta2, double weight_decay, const at::Tensor& step,
                  const at::Tensor& grad_scale, const at::Tensor& found_inf,
                  const std::optional<at::Tensor>& hp);

// adamw8bit_binding.cpp (ZeroAdamW(state_bits=8))
void zk_adamw8bit_step(const at::Tensor& master, const at::Tensor& m_q,
                       const at::Tensor& m_absmax, const at::Tensor& v_q,
                       const at::Tensor& v_absmax, const at::Tensor& grad,
                       const std::optional<at::Tensor>& param_out, double lr, double beta1,
                       double beta2, double eps, double weight_decay, const at::Tensor& step,
                       const at::Tensor& grad_scale, const at::Tensor& found_inf,
                       const at::Tensor& code_s, const at::Tensor& code_u,
                       const at::Tensor& mid_s, const at::Tensor& mid_u,
                       const std::optional<at::Tensor>& hp);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() =
      "zerokern CUDA kernels (fused Adam/AdamW, Lion and 8-bit AdamW steps, gradient statistics)";
  m.def("adam_step", &adam_step,
        "Fused Adam/AdamW step on flat fp32 shards; writes nothing when found_inf is set; "
        "then step += 1 unless found_inf. hp (float64[5] on device: lr, beta1, beta2, eps, "
        "weight_decay) replaces the float arguments when given.",
        py::arg("master"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("grad"),
        py::arg("param_out"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("adamw"), py::arg("step"), py::arg("grad_scale"),
        py::arg("found_inf"), py::arg("hp") = py::none());
  m.def("grad_stats", &grad_stats,
        "found_inf |= any(!isfinite(grad)); sumsq += sum(float(grad)^2), deterministic.",
        py::arg("grad"), py::arg("found_inf"), py::arg("sumsq"));
  m.def("lion_step", &zk_lion_step,
        "Fused Lion step on flat fp32 shards (kernels/lion.py); writes nothing when found_inf "
        "is set; then step += 1 unless found_inf. hp (float64[5] on device: lr, beta1, beta2, "
        "weight_decay, unused) replaces the float arguments when given.",
        py::arg("master"), py::arg("exp_avg"), py::arg("grad"), py::arg("param_out"),
        py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("weight_decay"),
        py::arg("step"), py::arg("grad_scale"), py::arg("found_inf"), py::arg("hp") = py::none());
  m.def("adamw8bit_step", &zk_adamw8bit_step,
        "Fused AdamW step with 8-bit block-quantized moments (kernels/adamw8bit.py), bitwise "
        "the CPU op; writes nothing when found_inf is set; then step += 1 unless found_inf. "
        "hp (float64[5] on device: lr, beta1, beta2, eps, weight_decay) replaces the float "
        "arguments when given.",
        py::arg("master"), py::arg("m_q"), py::arg("m_absmax"), py::arg("v_q"),
        py::arg("v_absmax"), py::arg("grad"), py::arg("param_out"), py::arg("lr"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("step"), py::arg("grad_scale"), py::arg("found_inf"), py::arg("code_s"),
        py::arg("code_u"), py::arg("mid_s"), py::arg("mid_u"), py::arg("hp") = py::none());
  m.def("kernel_image_error", &kernel_image_error,
        "'' if this build runs on the current CUDA device, else why not (no kernel image). "
        "device: None or the current device's index (no other device is touched).",
        py::arg("device") = py::none());
}
