// zerokern CUDA Lion step (issue 23): one fused pass per element over a flat fp32 shard.
// Pure CUDA (`nvcc -arch=sm_90 -c lion.cu` builds it alone). Numerics: zerokern/kernels/lion.py;
// derived scalars in fp64 once per block, rounded once to fp32 (as zk_kernels.cu's Adam); the
// 16-bit outputs use cvt.rn (__float2half_rn / __float2bfloat16_rn), bitwise torch CUDA's
// .to(dtype). A grid-stride loop with one element per thread-iteration: coalesced 32/16-bit
// accesses, not the 128-bit vector loads zk_adam_kernel uses (a later step of the kernel ladder;
// Lion moves 14 bytes/element against Adam's 28, so it is further from the floor per launch).
// Rounding: every product and sum is an explicit _rn intrinsic, which nvcc never contracts into
// an FMA (its default --fmad=true turned b1*m + (1-b1)*g into fma.rn.f32): csrc/cpu/lion_cpu.cpp
// [Note: Lion rounds every product]; checked on the PTX by tests/kernels/test_lion_cancellation.py.
#include "lion.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace {

constexpr int kLionThreads = 256;
constexpr int kLionMaxBlocks = 4096;

struct NoOutL {};

__device__ __forceinline__ float lion_to_f32(float x) { return x; }
__device__ __forceinline__ float lion_to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float lion_to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ void lion_store(__half* p, int64_t i, float x) {
  p[i] = __float2half_rn(x);
}
__device__ __forceinline__ void lion_store(__nv_bfloat16* p, int64_t i, float x) {
  p[i] = __float2bfloat16_rn(x);
}
__device__ __forceinline__ void lion_store(NoOutL*, int64_t, float) {}

__device__ __forceinline__ bool lion_flag(const void* p, int dtype) {
  return dtype == ZK_DTYPE_BOOL ? (*static_cast<const unsigned char*>(p) != 0)
                                : (*static_cast<const float*>(p) != 0.0f);
}

struct LionArgs {  // by value: the kernel's parameter space
  double lr, beta1, beta2, weight_decay;
  const double* hp;
  const float* grad_scale;
  const void* found_inf;
  int found_inf_dtype;
};

template <typename G, typename O>
__global__ void __launch_bounds__(kLionThreads)
    zk_lion_kernel(float* __restrict__ master, float* __restrict__ exp_avg,
                   const G* __restrict__ grad, O* __restrict__ out, int64_t n, LionArgs a) {
  __shared__ float sc[7];  // decay, lr, b1, 1-b1, b2, 1-b2, grad_scale
  __shared__ int skip;
  if (threadIdx.x == 0) {
    skip = lion_flag(a.found_inf, a.found_inf_dtype);
    const double lr = a.hp ? a.hp[0] : a.lr, b1 = a.hp ? a.hp[1] : a.beta1;
    const double b2 = a.hp ? a.hp[2] : a.beta2, wd = a.hp ? a.hp[3] : a.weight_decay;
    sc[0] = float(__dsub_rn(1.0, __dmul_rn(lr, wd)));  // as the reference: two roundings
    sc[1] = float(lr);
    sc[2] = float(b1);
    sc[3] = float(1.0 - b1);
    sc[4] = float(b2);
    sc[5] = float(1.0 - b2);
    sc[6] = *a.grad_scale;
  }
  __syncthreads();
  if (skip) return;
  const float decay = sc[0], lr = sc[1], b1 = sc[2], omb1 = sc[3], b2 = sc[4], omb2 = sc[5];
  const float gs = sc[6];
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float g = __fmul_rn(lion_to_f32(grad[i]), gs);
    const float m = exp_avg[i];
    float p = __fmul_rn(master[i], decay);
    const float c = __fadd_rn(__fmul_rn(b1, m), __fmul_rn(omb1, g));  // each product rounded
    const float sgn = c > 0.f ? 1.f : (c < 0.f ? -1.f : 0.f);  // torch.sign: NaN and -0 give +0
    p = __fsub_rn(p, __fmul_rn(lr, sgn));
    master[i] = p;
    exp_avg[i] = __fadd_rn(__fmul_rn(b2, m), __fmul_rn(omb2, g));
    lion_store(out, i, p);
  }
}

__global__ void zk_lion_step_increment_kernel(void* step, int step_dtype, const void* found_inf,
                                              int found_inf_dtype) {
  if (lion_flag(found_inf, found_inf_dtype)) return;
  switch (step_dtype) {
    case ZK_DTYPE_I64: *static_cast<long long*>(step) += 1; break;
    case ZK_DTYPE_I32: *static_cast<int*>(step) += 1; break;
    case ZK_DTYPE_F32: *static_cast<float*>(step) += 1.0f; break;
    default: *static_cast<double*>(step) += 1.0; break;
  }
}

template <typename G, typename O>
void launch_lion(float* master, float* exp_avg, const void* grad, void* out, int64_t n,
                 const LionArgs& a, cudaStream_t stream) {
  const int64_t want = (n + kLionThreads - 1) / kLionThreads;
  const int blocks = int(want < kLionMaxBlocks ? want : kLionMaxBlocks);
  zk_lion_kernel<G, O><<<blocks, kLionThreads, 0, stream>>>(
      master, exp_avg, static_cast<const G*>(grad), static_cast<O*>(out), n, a);
}

template <typename G>
void launch_lion_out(float* master, float* exp_avg, const void* grad, void* out,
                     zk_dtype_t out_dtype, int64_t n, const LionArgs& a, cudaStream_t stream) {
  if (out_dtype == ZK_DTYPE_F16) launch_lion<G, __half>(master, exp_avg, grad, out, n, a, stream);
  else if (out_dtype == ZK_DTYPE_BF16)
    launch_lion<G, __nv_bfloat16>(master, exp_avg, grad, out, n, a, stream);
  else launch_lion<G, NoOutL>(master, exp_avg, grad, nullptr, n, a, stream);
}

}  // namespace

extern "C" cudaError_t zk_lion_step_launch(float* master, float* exp_avg, const void* grad,
                                           zk_dtype_t grad_dtype, void* param_out,
                                           zk_dtype_t param_out_dtype, int64_t n, double lr,
                                           double beta1, double beta2, double weight_decay,
                                           void* step, zk_dtype_t step_dtype,
                                           const float* grad_scale, const void* found_inf,
                                           zk_dtype_t found_inf_dtype, const double* hp,
                                           cudaStream_t stream) {
  const LionArgs a{lr, beta1, beta2, weight_decay, hp, grad_scale, found_inf,
                   int(found_inf_dtype)};
  if (n > 0) {
    switch (grad_dtype) {
      case ZK_DTYPE_F32:
        launch_lion_out<float>(master, exp_avg, grad, param_out, param_out_dtype, n, a, stream);
        break;
      case ZK_DTYPE_F16:
        launch_lion_out<__half>(master, exp_avg, grad, param_out, param_out_dtype, n, a, stream);
        break;
      case ZK_DTYPE_BF16:
        launch_lion_out<__nv_bfloat16>(master, exp_avg, grad, param_out, param_out_dtype, n, a,
                                       stream);
        break;
      default: return cudaErrorInvalidValue;
    }
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  zk_lion_step_increment_kernel<<<1, 1, 0, stream>>>(step, int(step_dtype), found_inf,
                                                    int(found_inf_dtype));
  return cudaGetLastError();
}
