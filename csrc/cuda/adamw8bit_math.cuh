// zerokern 8-bit AdamW (issue 23): the per-element arithmetic of the CUDA kernel (adamw8bit.cu),
// in a header that also compiles as plain C++ for the host (tests/kernels/q8_host_emulation.cpp
// runs it on the CPU against the reference, bit for bit, with no GPU).
//
// [Note: 8-bit step on CUDA, operation by operation]
// zerokern/kernels/adamw8bit.py [Note: the 8-bit step, bit for bit] is the contract: every
// product, sum, quotient and square root is one IEEE round-to-nearest fp32 operation in the
// reference's order, and nothing is fused. nvcc contracts a*b + c into one FMA by default
// (-fmad=true), which would move m or v by an ulp and flip a quantization code, so on the device
// every operation is an explicit __fmul_rn / __fadd_rn / __fsub_rn / __fdiv_rn / __fsqrt_rn: the
// `.rn` forms ptxas never contracts, and IEEE even under --use_fast_math. The op's other kernels
// (Adam, Lion) keep nvcc's default contraction: this file does not change the build flags.
// tests/kernels/test_nvcc_compile_adamw8bit.py checks the PTX: no fma.*.f32, no fp64 after the
// prologue, 128-bit accesses. On the host the same functions are plain operators, compiled with
// -ffp-contract=off.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define ZK_Q8_FN __host__ __device__ __forceinline__
#else
#include <cmath>
#define ZK_Q8_FN inline
using std::pow;
using std::sqrt;
#endif

// Elements per quantization block (kernels/quant8.py BLOCK) and the map's midpoint count.
#define ZK_Q8_BLOCK 128
#define ZK_Q8_MIDS 255

// fp32 per-step constants, formed in fp64 and rounded once (quant8.step_scalars).
struct ZkQ8Scalars {
  float gs, decay, b1, omb1, b2, omb2, step_size, rsqrt_bc2, eps;
};

// The step's scalars from fp64 hyperparameters and t = step + 1, each rounded once to fp32, as
// the CPU op's host code and quant8.step_scalars: once per CTA on the device (thread 0), never in
// the element loop. The one operation not correctly rounded on either side is pow (CUDA's fp64
// pow is within 2 ulp, glibc's within 1): the fp32 scalars can then differ only when
// 1 - beta^t lies within ~2^-51 (relative) of an fp32 rounding boundary, as for zk_kernels.cu's
// Adam; the bitwise GPU tests would show such a step.
ZK_Q8_FN ZkQ8Scalars zk_q8_scalars(double lr, double b1, double b2, double eps, double wd,
                                   double t, float gs) {
  const double bc1 = 1.0 - pow(b1, t), bc2 = 1.0 - pow(b2, t);
  ZkQ8Scalars s;
  s.gs = gs;
  s.decay = static_cast<float>(1.0 - lr * wd);
  s.b1 = static_cast<float>(b1);
  s.omb1 = static_cast<float>(1.0 - b1);
  s.b2 = static_cast<float>(b2);
  s.omb2 = static_cast<float>(1.0 - b2);
  s.step_size = static_cast<float>(lr / bc1);
  s.rsqrt_bc2 = static_cast<float>(1.0 / sqrt(bc2));
  s.eps = static_cast<float>(eps);
  return s;
}

ZK_Q8_FN float zk_q8_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

ZK_Q8_FN float zk_q8_add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

ZK_Q8_FN float zk_q8_sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

ZK_Q8_FN float zk_q8_div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

ZK_Q8_FN float zk_q8_sqrt(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

// The running absmax: exact, so any order gives the same bits; a NaN propagates, as torch's
// amax in the reference (the CPU op likewise; csrc/cpu/adamw8bit_cpu.h q8_nan_absmax).
ZK_Q8_FN float zk_q8_max(float acc, float x) { return (acc < x || x != x) && acc == acc ? x : acc; }

ZK_Q8_FN float zk_q8_abs(float x) {
#if defined(__CUDA_ARCH__)
  return fabsf(x);
#else
  return std::fabs(x);
#endif
}

// One element: m and v arrive dequantized and leave as the new unquantized moments; returns the
// new master value. g = graw * grad_scale; p*decay; m = b1*m + (1-b1)*g;
// v = b2*v + (1-b2)*(g*g); p - step_size * (m / (sqrt(v)*rsqrt_bc2 + eps)).
ZK_Q8_FN float zk_q8_update(float p, float graw, float& m, float& v, const ZkQ8Scalars& s) {
  const float g = zk_q8_mul(graw, s.gs);
  const float x = zk_q8_mul(p, s.decay);
  m = zk_q8_add(zk_q8_mul(s.b1, m), zk_q8_mul(s.omb1, g));
  v = zk_q8_add(zk_q8_mul(s.b2, v), zk_q8_mul(s.omb2, zk_q8_mul(g, g)));
  const float den = zk_q8_add(zk_q8_mul(zk_q8_sqrt(v), s.rsqrt_bc2), s.eps);
  return zk_q8_sub(x, zk_q8_mul(s.step_size, zk_q8_div(m, den)));
}

// The divisor of a block: its absmax, or 1 for an all-zero block (absmax 0, codes of 0).
ZK_Q8_FN float zk_q8_safe(float absmax) { return absmax > 0.f ? absmax : 1.f; }

// The nearest code of x (already divided by the block's absmax): the count of the 255 sorted
// midpoints strictly below x, as torch.bucketize(right=False); a NaN gives 255 as it does
// (!(mid >= x): csrc/cpu/adamw8bit_cpu.h [Note: branchless nearest code]). Eight branch-free
// steps; the largest index read is 254.
ZK_Q8_FN uint8_t zk_q8_nearest(const float* mids, float x) {
  int pos = 0;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int step = 128; step > 0; step >>= 1) {
    if (!(mids[pos + step - 1] >= x)) pos += step;
  }
  return static_cast<uint8_t>(pos);
}
