// zerokern CUDA 8-bit AdamW step (issue 23): dequantize -> AdamW -> requantize in one pass.
// Pure CUDA (`nvcc -arch=sm_90 -c adamw8bit.cu` builds it alone). Numerics: kernels/adamw8bit.py
// [Note: the 8-bit step, bit for bit], bitwise the reference and the CPU op
// (csrc/cpu/adamw8bit_cpu.cpp); the element arithmetic is adamw8bit_math.cuh's ([Note: 8-bit
// step on CUDA, operation by operation]). 16-bit outputs use cvt.rn (__floats2half2_rn /
// __floats2bfloat162_rn), bitwise torch's .to(dtype).
//
// [Note: one 16-lane group per 128-element block]
// A quantization block needs its absmax before any of its codes, so the block is the unit of
// work: 16 lanes x 8 elements = 128, two blocks per warp. Each lane loads its 8 elements with
// 128-bit accesses (2 x float4 for master and an fp32 grad, one uint4 for a 16-bit grad or
// param_out, one 64-bit uint2 for each code array), updates them, the group reduces |m| and |v|
// with four __shfl_xor_sync over its own half-warp (max is exact: any order, same bits), then
// quantizes by a binary search over the midpoints held in shared memory (the maps, 4 KiB, are
// read once per CTA). No fp64 after the prologue: thread 0 forms the scalars in fp64 once per
// CTA, as zk_adam_kernel. 256 threads x 4 CTAs/SM caps registers at 64.
//
// [Note: 8-bit kernel, measured without a GPU] (nvcc 13.0, -arch=sm_90, cpp_extension's flags;
// tests/kernels/test_nvcc_compile_adamw8bit.py keeps each of these true)
// - ptxas: 61-64 registers per instantiation (fp32 grad + 16-bit out 61, fp16 grad + out 63,
//   the rest 64) within the cap of 64, 0 bytes of spills and stack, 4128 B of shared memory
//   (the four maps); the step increment kernel 8 registers.
// - PTX per instantiation: ld.global.v4.f32 x2 (master), ld.global.nc.v4.f32 x2 (fp32 grad) or
//   ld.global.nc.v4.u32 x1 (16-bit grad), ld.global.v2.u32 x2 (m_q, v_q); st.global.v4.f32 x2,
//   st.global.wb.v4.u32 x1 (16-bit param_out), st.global.v2.u32 x2. A plain uint4 assignment
//   for param_out came out as four st.global.u32 here (unlike zk_kernels.cu), hence __stwb.
// - 88 mul.rn.f32, 24 add.rn.f32, 8 sub.rn.f32, 24 div.rn.f32, 8 sqrt.rn.f32 per lane-trip
//   (8 elements), no fma/mad.f32; fp64 only in the once-per-CTA prologue, on no CFG cycle.
// - Traffic: ~14-18 B per element (master 8, grad 2-4, codes 4, param_out 0-2, absmax 1/16)
//   against 16 shared-memory lookups for the two code searches: which one bounds it is not
//   known, no GPU has run it.
#include "adamw8bit.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstring>

#include "adamw8bit_math.cuh"
#include "adamw8bit_vec.cuh"

namespace {

constexpr int kQ8Lanes = ZK_Q8_BLOCK / kQ8Vec;  // 16 lanes per block of 128
constexpr int kQ8Threads = 256;
constexpr int kQ8BlocksPerSM = 4;
constexpr int kQ8GroupsPerCta = kQ8Threads / kQ8Lanes;
constexpr int kQ8MaxDevices = 64;

struct Q8Args {  // by value: the kernel's parameter space
  double lr, beta1, beta2, eps, weight_decay;
  const double* hp;
  const void* step;
  const float* grad_scale;
  const void* found_inf;
  const float* code_s;
  const float* code_u;
  const float* mid_s;
  const float* mid_u;
  int step_dtype;
  int found_inf_dtype;
  int vec;  // ZK_Q8_VEC_* bits
};

__device__ __forceinline__ bool q8_flag(const void* p, int dtype) {
  return dtype == ZK_DTYPE_BOOL ? (*static_cast<const unsigned char*>(p) != 0)
                                : (*static_cast<const float*>(p) != 0.0f);
}

__device__ __forceinline__ double q8_step(const void* p, int dtype) {
  switch (dtype) {
    case ZK_DTYPE_I64: return static_cast<double>(*static_cast<const long long*>(p));
    case ZK_DTYPE_I32: return static_cast<double>(*static_cast<const int*>(p));
    case ZK_DTYPE_F32: return static_cast<double>(*static_cast<const float*>(p));
    default: return *static_cast<const double*>(p);
  }
}

// ------------------------------------------------------------------ the kernel ----------------

template <typename G, typename O>
__global__ void __launch_bounds__(kQ8Threads, kQ8BlocksPerSM)
zk_adamw8bit_kernel(float* __restrict__ master, uint8_t* __restrict__ m_q,
                    float* __restrict__ m_absmax, uint8_t* __restrict__ v_q,
                    float* __restrict__ v_absmax, const G* __restrict__ grad,
                    O* __restrict__ out, int64_t nb, const Q8Args a) {
  __shared__ float s_code_s[256], s_code_u[256], s_mid_s[ZK_Q8_MIDS], s_mid_u[ZK_Q8_MIDS];
  __shared__ ZkQ8Scalars s_sc;
  __shared__ int s_skip;
  if (threadIdx.x == 0) {  // the fp64 prologue, once per CTA (as the CPU op's host code)
    const bool skip = q8_flag(a.found_inf, a.found_inf_dtype);
    s_skip = skip ? 1 : 0;
    if (!skip) {
      double lr = a.lr, b1 = a.beta1, b2 = a.beta2, eps = a.eps, wd = a.weight_decay;
      if (a.hp != nullptr) {
        lr = a.hp[0]; b1 = a.hp[1]; b2 = a.hp[2]; eps = a.hp[3]; wd = a.hp[4];
      }
      s_sc = zk_q8_scalars(lr, b1, b2, eps, wd, q8_step(a.step, a.step_dtype) + 1.0,
                           *a.grad_scale);
    }
  }
  for (int i = threadIdx.x; i < 256; i += blockDim.x) {
    s_code_s[i] = a.code_s[i];
    s_code_u[i] = a.code_u[i];
    if (i < ZK_Q8_MIDS) {
      s_mid_s[i] = a.mid_s[i];
      s_mid_u[i] = a.mid_u[i];
    }
  }
  __syncthreads();
  if (s_skip) return;  // CTA-uniform: a skipped step writes nothing
  const ZkQ8Scalars s = s_sc;
  const bool v_master = a.vec & ZK_Q8_VEC_MASTER, v_grad = a.vec & ZK_Q8_VEC_GRAD;
  const bool v_out = a.vec & ZK_Q8_VEC_OUT, v_mq = a.vec & ZK_Q8_VEC_MQ;
  const bool v_vq = a.vec & ZK_Q8_VEC_VQ;
  const int lane = threadIdx.x % kQ8Lanes;
  // The shuffles stay inside this lane's half-warp, whose 16 lanes share every loop trip.
  const unsigned half = (threadIdx.x & 16) ? 0xffff0000u : 0x0000ffffu;
  const int64_t groups = int64_t(gridDim.x) * kQ8GroupsPerCta;
  for (int64_t b = int64_t(blockIdx.x) * kQ8GroupsPerCta + threadIdx.x / kQ8Lanes; b < nb;
       b += groups) {
    const int64_t i0 = b * ZK_Q8_BLOCK + int64_t(lane) * kQ8Vec;
    float p[kQ8Vec], g[kQ8Vec], m[kQ8Vec], v[kQ8Vec];
    uint32_t cm[kQ8Vec], cv[kQ8Vec];
    q8_load(master + i0, v_master, p);
    q8_load(grad + i0, v_grad, g);
    q8_load_codes(m_q + i0, v_mq, cm);
    q8_load_codes(v_q + i0, v_vq, cv);
    const float am = m_absmax[b], av = v_absmax[b];
    float mmax = 0.f, vmax = 0.f;
#pragma unroll
    for (int j = 0; j < kQ8Vec; ++j) {
      m[j] = zk_q8_mul(s_code_s[cm[j]], am);
      v[j] = zk_q8_mul(s_code_u[cv[j]], av);
      p[j] = zk_q8_update(p[j], g[j], m[j], v[j], s);
      mmax = zk_q8_max(mmax, zk_q8_abs(m[j]));
      vmax = zk_q8_max(vmax, zk_q8_abs(v[j]));
    }
#pragma unroll
    for (int off = kQ8Lanes / 2; off > 0; off >>= 1) {
      mmax = zk_q8_max(mmax, __shfl_xor_sync(half, mmax, off));
      vmax = zk_q8_max(vmax, __shfl_xor_sync(half, vmax, off));
    }
    const float sm = zk_q8_safe(mmax), sv = zk_q8_safe(vmax);
#pragma unroll
    for (int j = 0; j < kQ8Vec; ++j) {
      cm[j] = zk_q8_nearest(s_mid_s, zk_q8_div(m[j], sm));
      cv[j] = zk_q8_nearest(s_mid_u, zk_q8_div(v[j], sv));
    }
    q8_store(master + i0, v_master, p);
    q8_store(q8_at(out, i0), v_out, p);
    q8_store_codes(m_q + i0, v_mq, cm);
    q8_store_codes(v_q + i0, v_vq, cv);
    if (lane == 0) {  // every lane read the old absmax before the shuffles above
      m_absmax[b] = mmax;
      v_absmax[b] = vmax;
    }
  }
}

// step += 1 unless found_inf, after the step kernel on the same stream.
__global__ void zk_adamw8bit_increment_kernel(void* step, int step_dtype, const void* found_inf,
                                              int found_inf_dtype) {
  if (q8_flag(found_inf, found_inf_dtype)) return;
  switch (step_dtype) {
    case ZK_DTYPE_I64: *static_cast<long long*>(step) += 1; break;
    case ZK_DTYPE_I32: *static_cast<int*>(step) += 1; break;
    case ZK_DTYPE_F32: *static_cast<float*>(step) += 1.0f; break;
    default: *static_cast<double*>(step) += 1.0; break;
  }
}

// ------------------------------------------------------------------ host side ----------------

bool q8_aligned(const void* p, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

cudaError_t q8_sm_count(int* out) {  // once per device; cudaDeviceGetAttribute does not sync
  static std::atomic<int> cache[kQ8MaxDevices];
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const bool cacheable = dev >= 0 && dev < kQ8MaxDevices;
  if (cacheable && cache[dev].load(std::memory_order_relaxed) > 0) {
    *out = cache[dev].load(std::memory_order_relaxed);
    return cudaSuccess;
  }
  int c = 0;
  e = cudaDeviceGetAttribute(&c, cudaDevAttrMultiProcessorCount, dev);
  if (e != cudaSuccess) return e;
  if (c < 1) c = 1;
  if (cacheable) cache[dev].store(c, std::memory_order_relaxed);
  *out = c;
  return cudaSuccess;
}

template <typename G, typename O>
cudaError_t launch_q8(float* master, uint8_t* m_q, float* m_absmax, uint8_t* v_q,
                      float* v_absmax, const void* grad, void* out, int64_t nb, Q8Args a,
                      cudaStream_t stream) {
  int sms = 0;
  const cudaError_t e = q8_sm_count(&sms);
  if (e != cudaSuccess) return e;
  a.vec = zk_adamw8bit_vector_mask(master, m_q, v_q, grad, sizeof(G), out);
  const int64_t blocks = zk_adamw8bit_grid(nb, sms);
  zk_adamw8bit_kernel<G, O><<<static_cast<unsigned>(blocks), kQ8Threads, 0, stream>>>(
      master, m_q, m_absmax, v_q, v_absmax, static_cast<const G*>(grad), static_cast<O*>(out),
      nb, a);
  return cudaGetLastError();
}

template <typename G>
cudaError_t launch_q8_out(float* master, uint8_t* m_q, float* m_absmax, uint8_t* v_q,
                          float* v_absmax, const void* grad, void* out, zk_dtype_t out_dtype,
                          int64_t nb, const Q8Args& a, cudaStream_t stream) {
  switch (out_dtype) {
    case ZK_DTYPE_NONE:
      return launch_q8<G, NoOutQ8>(master, m_q, m_absmax, v_q, v_absmax, grad, nullptr, nb, a,
                                   stream);
    case ZK_DTYPE_F16:
      return launch_q8<G, __half>(master, m_q, m_absmax, v_q, v_absmax, grad, out, nb, a,
                                  stream);
    case ZK_DTYPE_BF16:
      return launch_q8<G, __nv_bfloat16>(master, m_q, m_absmax, v_q, v_absmax, grad, out, nb,
                                         a, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

extern "C" int zk_adamw8bit_vector_mask(const void* master, const void* m_q, const void* v_q,
                                        const void* grad, int grad_size,
                                        const void* param_out) {
  int mask = 0;
  if (q8_aligned(master, 16)) mask |= ZK_Q8_VEC_MASTER;
  if (q8_aligned(grad, 16) && (grad_size == 4 || grad_size == 2)) mask |= ZK_Q8_VEC_GRAD;
  if (param_out == nullptr || q8_aligned(param_out, 16)) mask |= ZK_Q8_VEC_OUT;
  if (q8_aligned(m_q, 8)) mask |= ZK_Q8_VEC_MQ;
  if (q8_aligned(v_q, 8)) mask |= ZK_Q8_VEC_VQ;
  return mask;
}

extern "C" int64_t zk_adamw8bit_grid(int64_t nb, int sms) {
  if (nb <= 0) return 1;
  int64_t blocks = (nb + kQ8GroupsPerCta - 1) / kQ8GroupsPerCta;
  const int64_t cap = int64_t(sms < 1 ? 1 : sms) * kQ8BlocksPerSM;
  return blocks < cap ? blocks : cap;
}

extern "C" cudaError_t zk_adamw8bit_step_launch(
    float* master, uint8_t* m_q, float* m_absmax, uint8_t* v_q, float* v_absmax,
    const void* grad, zk_dtype_t grad_dtype, void* param_out, zk_dtype_t param_out_dtype,
    int64_t n, double lr, double beta1, double beta2, double eps, double weight_decay,
    void* step, zk_dtype_t step_dtype, const float* grad_scale, const void* found_inf,
    zk_dtype_t found_inf_dtype, const double* hp, const float* code_s, const float* code_u,
    const float* mid_s, const float* mid_u, cudaStream_t stream) {
  if (n < 0 || n % ZK_Q8_BLOCK != 0 || step == nullptr || grad_scale == nullptr ||
      found_inf == nullptr || (found_inf_dtype != ZK_DTYPE_BOOL && found_inf_dtype != ZK_DTYPE_F32))
    return cudaErrorInvalidValue;
  if (step_dtype != ZK_DTYPE_I64 && step_dtype != ZK_DTYPE_I32 && step_dtype != ZK_DTYPE_F32 &&
      step_dtype != ZK_DTYPE_F64)
    return cudaErrorInvalidValue;
  if ((param_out_dtype == ZK_DTYPE_NONE) != (param_out == nullptr)) return cudaErrorInvalidValue;
  const int64_t nb = n / ZK_Q8_BLOCK;
  if (nb > 0) {
    if (master == nullptr || m_q == nullptr || m_absmax == nullptr || v_q == nullptr ||
        v_absmax == nullptr || grad == nullptr || code_s == nullptr || code_u == nullptr ||
        mid_s == nullptr || mid_u == nullptr)
      return cudaErrorInvalidValue;
    Q8Args a;
    a.lr = lr;
    a.beta1 = beta1;
    a.beta2 = beta2;
    a.eps = eps;
    a.weight_decay = weight_decay;
    a.hp = hp;
    a.step = step;
    a.grad_scale = grad_scale;
    a.found_inf = found_inf;
    a.code_s = code_s;
    a.code_u = code_u;
    a.mid_s = mid_s;
    a.mid_u = mid_u;
    a.step_dtype = step_dtype;
    a.found_inf_dtype = found_inf_dtype;
    a.vec = 0;
    cudaError_t e;
    switch (grad_dtype) {
      case ZK_DTYPE_F32:
        e = launch_q8_out<float>(master, m_q, m_absmax, v_q, v_absmax, grad, param_out,
                                 param_out_dtype, nb, a, stream);
        break;
      case ZK_DTYPE_F16:
        e = launch_q8_out<__half>(master, m_q, m_absmax, v_q, v_absmax, grad, param_out,
                                  param_out_dtype, nb, a, stream);
        break;
      case ZK_DTYPE_BF16:
        e = launch_q8_out<__nv_bfloat16>(master, m_q, m_absmax, v_q, v_absmax, grad, param_out,
                                         param_out_dtype, nb, a, stream);
        break;
      default: return cudaErrorInvalidValue;
    }
    if (e != cudaSuccess) return e;
  }
  zk_adamw8bit_increment_kernel<<<1, 1, 0, stream>>>(step, step_dtype, found_inf,
                                                    found_inf_dtype);
  return cudaGetLastError();
}
