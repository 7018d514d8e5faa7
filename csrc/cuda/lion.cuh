// zerokern CUDA Lion step (issue 23): C-style launcher (raw pointers, stream as an argument, no
// torch). Numerics: zerokern/kernels/lion.py. Implemented in lion.cu.
#pragma once

#include "zk_kernels.cuh"

#ifdef __cplusplus
extern "C" {
#endif

// Fused Lion step over n elements of a flat fp32 shard, then (same stream) step += 1 unless
// *found_inf. Nothing is written at all when *found_inf is nonzero.
//   master, exp_avg : fp32[n], updated in place
//   grad            : grad_dtype in {F32, F16, BF16}, [n]
//   param_out       : NULL with ZK_DTYPE_NONE, or F16/BF16 [n] (round-to-nearest-even)
//   hp              : NULL, or device fp64[5] = {lr, beta1, beta2, weight_decay, unused}
//                     replacing the double arguments (read on the device, no sync)
cudaError_t zk_lion_step_launch(float* master, float* exp_avg, const void* grad,
                                zk_dtype_t grad_dtype, void* param_out, zk_dtype_t param_out_dtype,
                                int64_t n, double lr, double beta1, double beta2,
                                double weight_decay, void* step, zk_dtype_t step_dtype,
                                const float* grad_scale, const void* found_inf,
                                zk_dtype_t found_inf_dtype, const double* hp, cudaStream_t stream);

#ifdef __cplusplus
}  // extern "C"
#endif
