// The host-side reads of a step's 0-d tensors (found_inf, step), shared by every CPU step op
// (adam_cpu.cpp, compact_adam_cpu.cpp, adamw8bit_cpu.cpp, lion_cpu.cpp) so they read, check and
// advance them alike.
#pragma once

#include <torch/extension.h>

namespace zk_cpu {

// found_inf is a 0-d bool or float32 tensor; any nonzero value means "skip".
inline bool read_flag(const at::Tensor& f) {
  if (f.scalar_type() == at::kBool) return *f.data_ptr<bool>();
  return *f.data_ptr<float>() != 0.0f;
}

inline double read_step(const at::Tensor& s) {
  switch (s.scalar_type()) {
    case at::kLong: return double(*s.data_ptr<int64_t>());
    case at::kInt: return double(*s.data_ptr<int32_t>());
    case at::kFloat: return double(*s.data_ptr<float>());
    case at::kDouble: return *s.data_ptr<double>();
    default: TORCH_CHECK(false, "step must be int64, int32, float32 or float64, got ",
                         s.scalar_type());
  }
  return 0.0;
}

inline void increment_step(at::Tensor& s) {
  switch (s.scalar_type()) {
    case at::kLong: *s.data_ptr<int64_t>() += 1; break;
    case at::kInt: *s.data_ptr<int32_t>() += 1; break;
    case at::kFloat: *s.data_ptr<float>() += 1.0f; break;
    default: *s.data_ptr<double>() += 1.0; break;
  }
}

}  // namespace zk_cpu
