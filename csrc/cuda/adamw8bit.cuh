// zerokern CUDA 8-bit AdamW step (issue 23): C-style launcher (raw pointers, stream as an
// argument, no torch). Numerics: zerokern/kernels/adamw8bit.py; implemented in adamw8bit.cu.
#pragma once

#include "zk_kernels.cuh"

#ifdef __cplusplus
extern "C" {
#endif

// Bits of zk_adamw8bit_vector_mask: which arrays take the vector accesses.
#define ZK_Q8_VEC_MASTER 1   // master, 2 x 128-bit per lane
#define ZK_Q8_VEC_GRAD 2     // grad, 128-bit (16-bit) or 2 x 128-bit (fp32) per lane
#define ZK_Q8_VEC_OUT 4      // param_out, 128-bit per lane
#define ZK_Q8_VEC_MQ 8       // m_q, 64-bit per lane
#define ZK_Q8_VEC_VQ 16      // v_q, 64-bit per lane

// Fused dequantize -> AdamW -> requantize over n elements (n a multiple of 128: n / 128 blocks),
// then (same stream) step += 1 unless *found_inf. Nothing is written when *found_inf is nonzero.
//   master            : fp32[n], updated in place
//   m_q, v_q          : uint8[n] codes (signed map for m, unsigned for v), updated in place
//   m_absmax, v_absmax: fp32[n / 128] block scales, updated in place
//   grad              : grad_dtype in {F32, F16, BF16}, [n]
//   param_out         : NULL with ZK_DTYPE_NONE, or F16/BF16 [n] (round-to-nearest-even)
//   step, grad_scale, found_inf, hp: as zk_adam_step_launch (hp: device fp64[5] = {lr, beta1,
//                       beta2, eps, weight_decay} or NULL)
//   code_s, code_u    : device fp32[256] code maps; mid_s, mid_u: device fp32[255] midpoints
// Never synchronizes.
cudaError_t zk_adamw8bit_step_launch(float* master, uint8_t* m_q, float* m_absmax, uint8_t* v_q,
                                     float* v_absmax, const void* grad, zk_dtype_t grad_dtype,
                                     void* param_out, zk_dtype_t param_out_dtype, int64_t n,
                                     double lr, double beta1, double beta2, double eps,
                                     double weight_decay, void* step, zk_dtype_t step_dtype,
                                     const float* grad_scale, const void* found_inf,
                                     zk_dtype_t found_inf_dtype, const double* hp,
                                     const float* code_s, const float* code_u,
                                     const float* mid_s, const float* mid_u,
                                     cudaStream_t stream);

// The ZK_Q8_VEC_* bits of the arrays whose base pointer allows the vector access (16 bytes for
// master, grad, param_out; 8 for the codes; out may be NULL). Each 128-element block starts a
// multiple of 128 elements further, so a base pointer's alignment is every block's: an array
// that is misaligned is misaligned throughout and takes scalar accesses, while the others keep
// theirs. Host only, pure arithmetic (tests call it through ctypes).
int zk_adamw8bit_vector_mask(const void* master, const void* m_q, const void* v_q,
                             const void* grad, int grad_size, const void* param_out);

// Grid size for nb blocks of 128 on a device with `sms` SMs: one 16-lane group per block of 128,
// 16 groups per 256-thread CTA, at most 4 resident CTAs per SM (grid-stride beyond). Host only.
int64_t zk_adamw8bit_grid(int64_t nb, int sms);

#ifdef __cplusplus
}  // extern "C"
#endif
