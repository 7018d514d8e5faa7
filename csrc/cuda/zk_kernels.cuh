// zerokern CUDA kernels: C-style launchers (raw pointers, stream as an argument, no torch).
// Numerics follow DESIGN.md §3; the byte floors in §6. Implemented in zk_kernels.cu.
#pragma once

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Element type of an array or a 0-d scalar tensor handed to a launcher.
typedef enum zk_dtype {
  ZK_DTYPE_NONE = 0,  // "no tensor" (param_out absent)
  ZK_DTYPE_F32 = 1,
  ZK_DTYPE_F16 = 2,
  ZK_DTYPE_BF16 = 3,
  ZK_DTYPE_F64 = 4,
  ZK_DTYPE_I32 = 5,
  ZK_DTYPE_I64 = 6,
  ZK_DTYPE_BOOL = 7
} zk_dtype_t;

// Fused Adam/AdamW step over n elements of a flat fp32 shard, then (same stream) step += 1 unless
// *found_inf. Nothing is written at all when *found_inf is nonzero.
//   master, exp_avg, exp_avg_sq : fp32[n], updated in place
//   grad                        : grad_dtype in {F32, F16, BF16}, [n]
//   param_out                   : NULL with ZK_DTYPE_NONE, or F16/BF16 [n] (round-to-nearest-even)
//   step                        : device scalar, step_dtype in {I64, I32, F32, F64}; t = step + 1
//   grad_scale                  : device fp32 scalar multiplying grad
//   found_inf                   : device scalar, found_inf_dtype in {BOOL, F32}; nonzero = skip
//   hp                          : NULL, or device fp64[5] = {lr, beta1, beta2, eps, weight_decay}
//                                 replacing the double arguments (read on the device, no sync)
// Vector path per element range (issue 24): a head of h < 8 elements runs scalar when that makes
// every pointer 16-byte aligned (zk_adam_aligned_head); only arrays with no common h run scalar
// throughout. Never synchronizes.
cudaError_t zk_adam_step_launch(float* master, float* exp_avg, float* exp_avg_sq,
                                const void* grad, zk_dtype_t grad_dtype, void* param_out,
                                zk_dtype_t param_out_dtype, int64_t n, double lr, double beta1,
                                double beta2, double eps, double weight_decay, int adamw,
                                void* step, zk_dtype_t step_dtype, const float* grad_scale,
                                const void* found_inf, zk_dtype_t found_inf_dtype,
                                const double* hp, cudaStream_t stream);

// Bytes of device workspace zk_grad_stats_launch needs for n elements (depends on n only).
size_t zk_grad_stats_workspace_bytes(int64_t n);

// found_inf |= any(!isfinite(float(grad))) (writes true / 1.0f, never clears);
// sumsq += sum(float(grad)^2). Deterministic two-stage reduction, no atomics: a grid fixed by n and
// the device's SM count (<= 1024 blocks, one resident wave) writes per-block partials into
// workspace, then one block reduces them in fp64 in a fixed tree order. Same n, same GPU model:
// same bits. workspace: >= zk_grad_stats_workspace_bytes(n) bytes, 16-byte aligned, any content.
//   grad      : grad_dtype in {F32, F16, BF16}, [n]
//   found_inf : found_inf_dtype in {BOOL, F32}
//   sumsq     : sumsq_dtype in {F32, F64}
cudaError_t zk_grad_stats_launch(const void* grad, zk_dtype_t grad_dtype, int64_t n,
                                 void* found_inf, zk_dtype_t found_inf_dtype, void* sumsq,
                                 zk_dtype_t sumsq_dtype, void* workspace, cudaStream_t stream);

// The scalar head, 0..7 elements, after which master, exp_avg, exp_avg_sq (fp32), grad and
// param_out (element sizes grad_size, out_size; out may be NULL) are all 16-byte aligned; -1 if
// no such head exists (the whole array then takes the scalar path). Host only, pure arithmetic.
int64_t zk_adam_aligned_head(const void* master, const void* exp_avg, const void* exp_avg_sq,
                             const void* grad, int grad_size, const void* out, int out_size,
                             int64_t n);

// cudaSuccess if this build holds a kernel image (SASS or PTX) the current device can run, else
// the error cudaFuncGetAttributes gives (cudaErrorNoKernelImageForDevice): a prebuilt op's
// architecture check before first use (issue 24). Does not synchronize.
cudaError_t zk_probe_kernel_image(void);

#ifdef __cplusplus
}  // extern "C"
#endif
