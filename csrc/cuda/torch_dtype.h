// The zk_dtype_t of a torch tensor: the one mapping the CUDA bindings (binding.cpp,
// lion_binding.cpp, adamw8bit_binding.cpp) share.
#pragma once

#include <torch/extension.h>

#include "zk_kernels.cuh"

inline zk_dtype_t zk_dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return ZK_DTYPE_F32;
    case at::kHalf: return ZK_DTYPE_F16;
    case at::kBFloat16: return ZK_DTYPE_BF16;
    case at::kDouble: return ZK_DTYPE_F64;
    case at::kInt: return ZK_DTYPE_I32;
    case at::kLong: return ZK_DTYPE_I64;
    case at::kBool: return ZK_DTYPE_BOOL;
    default: return ZK_DTYPE_NONE;
  }
}
