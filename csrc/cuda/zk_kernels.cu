// zerokern CUDA kernels: fused Adam/AdamW step and gradient statistics over flat shards.
// Pure CUDA (raw pointers, stream as an argument, no torch headers): `nvcc -arch=sm_90 -c` builds
// this file alone. Numerics contract: DESIGN.md §3. Launcher declarations: zk_kernels.cuh.
//
// Precision notes: no fast-math intrinsics. The per-element sqrt and division use __fsqrt_rn /
// __fdiv_rn, which are IEEE round-to-nearest even if someone adds --use_fast_math; bias
// corrections are computed in fp64 once per block. 16-bit outputs use the cvt.rn conversions that
// torch's CUDA .to(dtype) uses, so the cast-back is bitwise equal to it.
#include "zk_kernels.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstring>

namespace {

// Elements per thread-iteration: 8 x 16-bit = one 128-bit access for grad/param_out, and two
// float4 accesses for each fp32 array.
constexpr int kVec = 8;

// adam: 256 threads x 4 resident blocks/SM = 1024 threads/SM caps registers at 64 (no spills
// expected: ~32 live fp32 values per thread-iteration) while keeping ~7 x 16 B loads in flight per
// thread, far more than Little's law needs to saturate HBM3.
constexpr int kAdamThreads = 256;
constexpr int kAdamBlocksPerSM = 4;

// grad_stats stage 1: 256 threads x 8 resident blocks/SM (registers capped at 32) and a grid of
// min(1024, 8 x SMs, n / 4096) blocks: one full wave, no tail wave. The grid depends only on n and
// the SM count (never on timing), so the partials, their order and the result bits are identical
// run to run on a given GPU model.
constexpr int kStatsThreads = 256;
constexpr int kStatsBlocksPerSM = 8;
constexpr int kStatsMaxBlocks = 1024;
constexpr int64_t kStatsElemsPerBlock = int64_t(kStatsThreads) * kVec * 2;
// grad_stats stage 2: one block with one thread per possible partial.
constexpr int kStatsFinalThreads = kStatsMaxBlocks;

constexpr int kMaxDevices = 64;

struct NoOut {};  // tag type: param_out absent

// ------------------------------------------------------------------ element conversions ------

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ uint32_t bits_of(__half2 h) {
  uint32_t u;
  memcpy(&u, &h, sizeof(u));
  return u;
}
__device__ __forceinline__ uint32_t bits_of(__nv_bfloat162 h) {
  uint32_t u;
  memcpy(&u, &h, sizeof(u));
  return u;
}
__device__ __forceinline__ float2 unpack2(uint32_t u, const __half*) {
  __half2 h;
  memcpy(&h, &u, sizeof(h));
  return __half22float2(h);
}
__device__ __forceinline__ float2 unpack2(uint32_t u, const __nv_bfloat16*) {
  __nv_bfloat162 h;
  memcpy(&h, &u, sizeof(h));
  return __bfloat1622float2(h);
}

// ---------------------------------------------- 8-element vector loads/stores (16 B aligned) --

__device__ __forceinline__ void load8(const float* p, int64_t g, float (&x)[kVec]) {
  const float4* q = reinterpret_cast<const float4*>(p + g * kVec);
  const float4 a = q[0];
  const float4 b = q[1];
  x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
  x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
}

template <typename T>  // T = __half or __nv_bfloat16: one 128-bit load
__device__ __forceinline__ void load8(const T* p, int64_t g, float (&x)[kVec]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p + g * kVec);
  const float2 f0 = unpack2(u.x, p), f1 = unpack2(u.y, p);
  const float2 f2 = unpack2(u.z, p), f3 = unpack2(u.w, p);
  x[0] = f0.x; x[1] = f0.y; x[2] = f1.x; x[3] = f1.y;
  x[4] = f2.x; x[5] = f2.y; x[6] = f3.x; x[7] = f3.y;
}

__device__ __forceinline__ void store8(float* p, int64_t g, const float (&x)[kVec]) {
  float4* q = reinterpret_cast<float4*>(p + g * kVec);
  q[0] = make_float4(x[0], x[1], x[2], x[3]);
  q[1] = make_float4(x[4], x[5], x[6], x[7]);
}

__device__ __forceinline__ void store8(__half* p, int64_t g, const float (&x)[kVec]) {
  uint4 u;
  u.x = bits_of(__floats2half2_rn(x[0], x[1]));
  u.y = bits_of(__floats2half2_rn(x[2], x[3]));
  u.z = bits_of(__floats2half2_rn(x[4], x[5]));
  u.w = bits_of(__floats2half2_rn(x[6], x[7]));
  *reinterpret_cast<uint4*>(p + g * kVec) = u;
}

__device__ __forceinline__ void store8(__nv_bfloat16* p, int64_t g, const float (&x)[kVec]) {
  uint4 u;
  u.x = bits_of(__floats2bfloat162_rn(x[0], x[1]));
  u.y = bits_of(__floats2bfloat162_rn(x[2], x[3]));
  u.z = bits_of(__floats2bfloat162_rn(x[4], x[5]));
  u.w = bits_of(__floats2bfloat162_rn(x[6], x[7]));
  *reinterpret_cast<uint4*>(p + g * kVec) = u;
}

__device__ __forceinline__ void store8(NoOut*, int64_t, const float (&)[kVec]) {}

__device__ __forceinline__ void store1(__half* p, int64_t i, float x) { p[i] = __float2half_rn(x); }
__device__ __forceinline__ void store1(__nv_bfloat16* p, int64_t i, float x) {
  p[i] = __float2bfloat16_rn(x);
}
__device__ __forceinline__ void store1(NoOut*, int64_t, float) {}

// ------------------------------------------------------------------ device scalars ------------

__device__ __forceinline__ bool read_flag(const void* p, int dtype) {
  return dtype == ZK_DTYPE_BOOL ? (*static_cast<const unsigned char*>(p) != 0)
                                : (*static_cast<const float*>(p) != 0.0f);
}

__device__ __forceinline__ double read_step(const void* p, int dtype) {
  switch (dtype) {
    case ZK_DTYPE_I64: return static_cast<double>(*static_cast<const long long*>(p));
    case ZK_DTYPE_I32: return static_cast<double>(*static_cast<const int*>(p));
    case ZK_DTYPE_F32: return static_cast<double>(*static_cast<const float*>(p));
    default: return *static_cast<const double*>(p);
  }
}

// !isfinite(x) as one compare: false for every finite x, true for +-inf and NaN.
__device__ __forceinline__ bool not_finite(float x) {
  return !(fabsf(x) < __int_as_float(0x7f800000));
}

// ------------------------------------------------------------------ adam ----------------------

struct AdamArgs {  // by value in the kernel's parameter space (constant bank, no registers)
  double lr, beta1, beta2, eps, weight_decay;
  const double* hp;  // nullable: device {lr, beta1, beta2, eps, weight_decay}
  const void* step;
  const float* grad_scale;
  const void* found_inf;
  int step_dtype;
  int found_inf_dtype;
  int adamw;
};

struct AdamScalars {  // fp32 per-step constants, derived once per block in fp64
  float step_size, rsqrt_bc2, decay, b1, omb1, b2, omb2, eps, wd, gscale;
};

__device__ __forceinline__ void adam_elem(float& p, float& m, float& v, float graw,
                                          const AdamScalars& s, bool adamw) {
  float g = graw * s.gscale;
  if (adamw) {
    p = p * s.decay;
  } else {
    g = g + s.wd * p;
  }
  m = s.b1 * m + s.omb1 * g;
  v = s.b2 * v + s.omb2 * (g * g);
  const float denom = __fsqrt_rn(v) * s.rsqrt_bc2 + s.eps;
  p = p - s.step_size * __fdiv_rn(m, denom);
}

// Fused Adam/AdamW over n elements: 128-bit grid-stride main loop over n_vec groups of 8, then a
// scalar loop over [8*n_vec, n) (the tail, or everything when a pointer is misaligned).
// Thread 0 reads found_inf and derives the step constants in fp64 once per block, so the hot loop
// carries no fp64 and no per-element flag load; a skipped step makes every block exit unwritten.
template <typename G, typename O>
__global__ void __launch_bounds__(kAdamThreads, kAdamBlocksPerSM)
zk_adam_kernel(float* __restrict__ master, float* __restrict__ exp_avg,
               float* __restrict__ exp_avg_sq, const G* __restrict__ grad, O* __restrict__ out,
               int64_t n, int64_t n_vec, const AdamArgs a) {
  __shared__ AdamScalars s_sc;
  __shared__ int s_skip;
  if (threadIdx.x == 0) {
    const bool skip = read_flag(a.found_inf, a.found_inf_dtype);
    s_skip = skip ? 1 : 0;
    if (!skip) {
      double lr = a.lr, b1 = a.beta1, b2 = a.beta2, eps = a.eps, wd = a.weight_decay;
      if (a.hp != nullptr) {
        lr = a.hp[0]; b1 = a.hp[1]; b2 = a.hp[2]; eps = a.hp[3]; wd = a.hp[4];
      }
      const double t = read_step(a.step, a.step_dtype) + 1.0;
      const double bc1 = 1.0 - pow(b1, t);
      const double bc2 = 1.0 - pow(b2, t);
      AdamScalars s;
      s.step_size = static_cast<float>(lr / bc1);
      s.rsqrt_bc2 = static_cast<float>(1.0 / sqrt(bc2));
      s.decay = static_cast<float>(1.0 - lr * wd);
      s.b1 = static_cast<float>(b1);
      s.omb1 = static_cast<float>(1.0 - b1);
      s.b2 = static_cast<float>(b2);
      s.omb2 = static_cast<float>(1.0 - b2);
      s.eps = static_cast<float>(eps);
      s.wd = static_cast<float>(wd);
      s.gscale = *a.grad_scale;
      s_sc = s;
    }
  }
  __syncthreads();
  if (s_skip) return;  // block-uniform
  const AdamScalars s = s_sc;
  const bool adamw = a.adamw != 0;

  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t g = tid; g < n_vec; g += stride) {
    float p[kVec], m[kVec], v[kVec], gr[kVec];
    load8(master, g, p);
    load8(exp_avg, g, m);
    load8(exp_avg_sq, g, v);
    load8(grad, g, gr);
#pragma unroll
    for (int j = 0; j < kVec; ++j) adam_elem(p[j], m[j], v[j], gr[j], s, adamw);
    store8(master, g, p);
    store8(exp_avg, g, m);
    store8(exp_avg_sq, g, v);
    store8(out, g, p);
  }
  for (int64_t i = n_vec * kVec + tid; i < n; i += stride) {
    float p = master[i], m = exp_avg[i], v = exp_avg_sq[i];
    adam_elem(p, m, v, to_f32(grad[i]), s, adamw);
    master[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    store1(out, i, p);
  }
}

// step += 1 unless found_inf. One thread; launched on the same stream after zk_adam_kernel, so
// every block of that kernel has already read the old step.
__global__ void zk_step_increment_kernel(void* step, int step_dtype, const void* found_inf,
                                         int found_inf_dtype) {
  if (read_flag(found_inf, found_inf_dtype)) return;
  switch (step_dtype) {
    case ZK_DTYPE_I64: *static_cast<long long*>(step) += 1; break;
    case ZK_DTYPE_I32: *static_cast<int*>(step) += 1; break;
    case ZK_DTYPE_F32: *static_cast<float*>(step) += 1.0f; break;
    default: *static_cast<double*>(step) += 1.0; break;
  }
}

// ------------------------------------------------------------------ grad_stats ----------------

constexpr int kStatsAcc = 4;  // independent fp32 accumulators per thread (ILP; 32-register cap)

__device__ __forceinline__ void stats_acc8(const float (&x)[kVec], float (&acc)[kStatsAcc],
                                           bool& bad) {
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    acc[j % kStatsAcc] = fmaf(x[j], x[j], acc[j % kStatsAcc]);
    bad |= not_finite(x[j]);
  }
}

// Stage 1: each block grid-strides over the grad (two 128-bit loads in flight per thread-iteration,
// since this kernel moves only 2-4 B/element), then writes one fp32 sum of squares and one
// non-finite flag. Fixed lane/warp order: deterministic for a given n and grid.
template <typename G>
__global__ void __launch_bounds__(kStatsThreads, kStatsBlocksPerSM)
zk_grad_stats_partial_kernel(const G* __restrict__ grad, int64_t n, int64_t n_vec,
                             float* __restrict__ partials, int* __restrict__ flags) {
  float acc[kStatsAcc];
#pragma unroll
  for (int j = 0; j < kStatsAcc; ++j) acc[j] = 0.0f;
  bool bad = false;

  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t g = tid;
  if constexpr (sizeof(G) == 2) {  // fp32 grads already have two 128-bit loads per iteration
    for (; g + stride < n_vec; g += 2 * stride) {
      float x[kVec], y[kVec];
      load8(grad, g, x);
      load8(grad, g + stride, y);
      stats_acc8(x, acc, bad);
      stats_acc8(y, acc, bad);
    }
  }
  for (; g < n_vec; g += stride) {
    float x[kVec];
    load8(grad, g, x);
    stats_acc8(x, acc, bad);
  }
  for (int64_t i = n_vec * kVec + tid; i < n; i += stride) {
    const float x = to_f32(grad[i]);
    acc[0] = fmaf(x, x, acc[0]);
    bad |= not_finite(x);
  }

  float sum = (acc[0] + acc[1]) + (acc[2] + acc[3]);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, off);

  __shared__ float warp_sums[kStatsThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = sum;
  const int any_bad = __syncthreads_or(bad ? 1 : 0);  // also orders the warp_sums writes
  if (threadIdx.x == 0) {
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kStatsThreads / 32; ++w) total += warp_sums[w];
    partials[blockIdx.x] = total;
    flags[blockIdx.x] = any_bad;
  }
}

// Stage 2: one block, one thread per partial (<= 1024), fp64 tree reduction in a fixed order,
// then the read-modify-write of found_inf and sumsq. No atomics anywhere.
__global__ void __launch_bounds__(kStatsFinalThreads)
zk_grad_stats_final_kernel(const float* __restrict__ partials, const int* __restrict__ flags,
                           int nparts, void* found_inf, int found_inf_dtype, void* sumsq,
                           int sumsq_dtype) {
  __shared__ double sh[kStatsFinalThreads];
  const int t = threadIdx.x;
  double x = 0.0;
  int bad = 0;
  if (t < nparts) {
    x = static_cast<double>(partials[t]);
    bad = flags[t];
  }
  sh[t] = x;
  bad = __syncthreads_or(bad);
#pragma unroll 1
  for (int half = kStatsFinalThreads / 2; half > 0; half >>= 1) {
    if (t < half) sh[t] += sh[t + half];
    __syncthreads();
  }
  if (t == 0) {
    if (bad) {
      if (found_inf_dtype == ZK_DTYPE_BOOL) {
        *static_cast<bool*>(found_inf) = true;
      } else {
        *static_cast<float*>(found_inf) = 1.0f;
      }
    }
    if (sumsq_dtype == ZK_DTYPE_F64) {
      *static_cast<double*>(sumsq) += sh[0];
    } else {
      float* s = static_cast<float*>(sumsq);
      *s = static_cast<float>(static_cast<double>(*s) + sh[0]);
    }
  }
}

// ------------------------------------------------------------------ host helpers --------------

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// SM count of the current device, queried once per device (cudaDeviceGetAttribute does not sync).
cudaError_t sm_count(int* out) {
  static std::atomic<int> cache[kMaxDevices];  // static storage: zero-initialized
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const bool cacheable = dev >= 0 && dev < kMaxDevices;
  if (cacheable) {
    const int c = cache[dev].load(std::memory_order_relaxed);
    if (c > 0) {
      *out = c;
      return cudaSuccess;
    }
  }
  int c = 0;
  e = cudaDeviceGetAttribute(&c, cudaDevAttrMultiProcessorCount, dev);
  if (e != cudaSuccess) return e;
  if (c < 1) c = 1;
  if (cacheable) cache[dev].store(c, std::memory_order_relaxed);
  *out = c;
  return cudaSuccess;
}

// Upper bound on the stage-1 grid, from n alone (sizes the workspace).
int64_t stats_blocks_max(int64_t n) {
  if (n <= 0) return 0;
  const int64_t b = (n + kStatsElemsPerBlock - 1) / kStatsElemsPerBlock;
  return b < kStatsMaxBlocks ? b : kStatsMaxBlocks;
}

bool flag_dtype_ok(zk_dtype_t d) { return d == ZK_DTYPE_BOOL || d == ZK_DTYPE_F32; }

template <typename G, typename O>
cudaError_t launch_adam_range(float* master, float* exp_avg, float* exp_avg_sq, const G* grad,
                              O* param_out, int64_t n, bool vec, const AdamArgs& a,
                              cudaStream_t stream) {
  const int64_t n_vec = vec ? n / kVec : 0;
  const int64_t work = n_vec + (n - n_vec * kVec);  // thread-iterations on the first sweep
  int sms = 0;
  cudaError_t e = sm_count(&sms);
  if (e != cudaSuccess) return e;
  int64_t blocks = (work + kAdamThreads - 1) / kAdamThreads;
  const int64_t cap = int64_t(sms) * kAdamBlocksPerSM;
  if (blocks > cap) blocks = cap;
  if (blocks < 1) blocks = 1;
  zk_adam_kernel<G, O><<<static_cast<unsigned>(blocks), kAdamThreads, 0, stream>>>(
      master, exp_avg, exp_avg_sq, grad, param_out, n, n_vec, a);
  return cudaGetLastError();
}

template <typename O>
O* offset_out(O* p, int64_t h) { return p == nullptr ? p : p + h; }
NoOut* offset_out(NoOut* p, int64_t) { return p; }

// [Note: vector path per element range] (issue 24) A view at an odd element offset (a param
// group's shard sliced by the user, a 2-byte shift of a 16-bit grad) used to send the whole
// array down the scalar path, ~2-4x slower. Elements i of every array share one index, so a
// scalar head of h elements, when one h aligns all five pointers, leaves a body that loads 128
// bits at a time: two launches (the head's is one block) instead of a scalar sweep. Both read
// step and found_inf before the separate step increment, so they apply the same step.
template <typename G, typename O>
cudaError_t launch_adam(float* master, float* exp_avg, float* exp_avg_sq, const void* grad,
                        void* param_out, int64_t n, const AdamArgs& a, cudaStream_t stream) {
  const G* g = static_cast<const G*>(grad);
  O* out = static_cast<O*>(param_out);
  const int64_t h = zk_adam_aligned_head(master, exp_avg, exp_avg_sq, grad, sizeof(G),
                                         param_out, sizeof(O), n);
  if (h < 0) return launch_adam_range<G, O>(master, exp_avg, exp_avg_sq, g, out, n, false, a,
                                            stream);
  if (h > 0) {
    const cudaError_t e = launch_adam_range<G, O>(master, exp_avg, exp_avg_sq, g, out, h, false,
                                                  a, stream);
    if (e != cudaSuccess || h == n) return e;
  }
  return launch_adam_range<G, O>(master + h, exp_avg + h, exp_avg_sq + h, g + h,
                                 offset_out(out, h), n - h, true, a, stream);
}

template <typename G>
cudaError_t launch_adam_out(float* master, float* exp_avg, float* exp_avg_sq, const void* grad,
                            void* param_out, zk_dtype_t out_dtype, int64_t n, const AdamArgs& a,
                            cudaStream_t stream) {
  switch (out_dtype) {
    case ZK_DTYPE_NONE:
      return launch_adam<G, NoOut>(master, exp_avg, exp_avg_sq, grad, nullptr, n, a, stream);
    case ZK_DTYPE_F16:
      return launch_adam<G, __half>(master, exp_avg, exp_avg_sq, grad, param_out, n, a, stream);
    case ZK_DTYPE_BF16:
      return launch_adam<G, __nv_bfloat16>(master, exp_avg, exp_avg_sq, grad, param_out, n, a,
                                           stream);
    default:
      return cudaErrorInvalidValue;
  }
}

template <typename G>
cudaError_t launch_stats(const void* grad, int64_t n, int64_t blocks, float* partials, int* flags,
                         cudaStream_t stream) {
  const int64_t n_vec = aligned16(grad) ? n / kVec : 0;
  zk_grad_stats_partial_kernel<G><<<static_cast<unsigned>(blocks), kStatsThreads, 0, stream>>>(
      static_cast<const G*>(grad), n, n_vec, partials, flags);
  return cudaGetLastError();
}

}  // namespace

// ------------------------------------------------------------------ exported launchers --------

extern "C" cudaError_t zk_adam_step_launch(
    float* master, float* exp_avg, float* exp_avg_sq, const void* grad, zk_dtype_t grad_dtype,
    void* param_out, zk_dtype_t param_out_dtype, int64_t n, double lr, double beta1, double beta2,
    double eps, double weight_decay, int adamw, void* step, zk_dtype_t step_dtype,
    const float* grad_scale, const void* found_inf, zk_dtype_t found_inf_dtype, const double* hp,
    cudaStream_t stream) {
  if (n < 0 || step == nullptr || grad_scale == nullptr || found_inf == nullptr ||
      !flag_dtype_ok(found_inf_dtype))
    return cudaErrorInvalidValue;
  if (step_dtype != ZK_DTYPE_I64 && step_dtype != ZK_DTYPE_I32 && step_dtype != ZK_DTYPE_F32 &&
      step_dtype != ZK_DTYPE_F64)
    return cudaErrorInvalidValue;
  if ((param_out_dtype == ZK_DTYPE_NONE) != (param_out == nullptr)) return cudaErrorInvalidValue;

  if (n > 0) {
    if (master == nullptr || exp_avg == nullptr || exp_avg_sq == nullptr || grad == nullptr)
      return cudaErrorInvalidValue;
    AdamArgs a;
    a.lr = lr;
    a.beta1 = beta1;
    a.beta2 = beta2;
    a.eps = eps;
    a.weight_decay = weight_decay;
    a.hp = hp;
    a.step = step;
    a.grad_scale = grad_scale;
    a.found_inf = found_inf;
    a.step_dtype = step_dtype;
    a.found_inf_dtype = found_inf_dtype;
    a.adamw = adamw ? 1 : 0;
    cudaError_t e;
    switch (grad_dtype) {
      case ZK_DTYPE_F32:
        e = launch_adam_out<float>(master, exp_avg, exp_avg_sq, grad, param_out, param_out_dtype,
                                   n, a, stream);
        break;
      case ZK_DTYPE_F16:
        e = launch_adam_out<__half>(master, exp_avg, exp_avg_sq, grad, param_out, param_out_dtype,
                                    n, a, stream);
        break;
      case ZK_DTYPE_BF16:
        e = launch_adam_out<__nv_bfloat16>(master, exp_avg, exp_avg_sq, grad, param_out,
                                           param_out_dtype, n, a, stream);
        break;
      default:
        return cudaErrorInvalidValue;
    }
    if (e != cudaSuccess) return e;
  }
  zk_step_increment_kernel<<<1, 1, 0, stream>>>(step, step_dtype, found_inf, found_inf_dtype);
  return cudaGetLastError();
}

extern "C" int64_t zk_adam_aligned_head(const void* master, const void* exp_avg,
                                        const void* exp_avg_sq, const void* grad, int grad_size,
                                        const void* out, int out_size, int64_t n) {
  for (int64_t h = 0; h < kVec && h <= n; ++h) {
    const auto at = [h](const void* p, int size) {
      return aligned16(static_cast<const char*>(p) + h * size);
    };
    if (at(master, 4) && at(exp_avg, 4) && at(exp_avg_sq, 4) && at(grad, grad_size) &&
        (out == nullptr || at(out, out_size)))
      return h;
  }
  return -1;
}

extern "C" cudaError_t zk_probe_kernel_image(void) {
  cudaFuncAttributes attr;
  const cudaError_t e =
      cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(&zk_step_increment_kernel));
  if (e != cudaSuccess) cudaGetLastError();  // not sticky: clear it for the caller's next check
  return e;
}

extern "C" size_t zk_grad_stats_workspace_bytes(int64_t n) {
  // float partials[blocks], then int flags[blocks]; at least 16 bytes so it is never empty.
  const size_t b = static_cast<size_t>(stats_blocks_max(n));
  const size_t bytes = b * (sizeof(float) + sizeof(int));
  return bytes < 16 ? 16 : bytes;
}

extern "C" cudaError_t zk_grad_stats_launch(const void* grad, zk_dtype_t grad_dtype, int64_t n,
                                            void* found_inf, zk_dtype_t found_inf_dtype,
                                            void* sumsq, zk_dtype_t sumsq_dtype, void* workspace,
                                            cudaStream_t stream) {
  if (n < 0 || found_inf == nullptr || sumsq == nullptr || !flag_dtype_ok(found_inf_dtype) ||
      (sumsq_dtype != ZK_DTYPE_F32 && sumsq_dtype != ZK_DTYPE_F64))
    return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;  // nothing to add, nothing non-finite
  if (grad == nullptr || workspace == nullptr || !aligned16(workspace))
    return cudaErrorInvalidValue;
  int sms = 0;
  cudaError_t e = sm_count(&sms);
  if (e != cudaSuccess) return e;
  const int64_t max_blocks = stats_blocks_max(n);  // the workspace layout uses this bound
  int64_t blocks = int64_t(sms) * kStatsBlocksPerSM;  // one resident wave
  if (blocks > max_blocks) blocks = max_blocks;
  float* partials = static_cast<float*>(workspace);
  int* flags = reinterpret_cast<int*>(partials + max_blocks);
  switch (grad_dtype) {
    case ZK_DTYPE_F32: e = launch_stats<float>(grad, n, blocks, partials, flags, stream); break;
    case ZK_DTYPE_F16: e = launch_stats<__half>(grad, n, blocks, partials, flags, stream); break;
    case ZK_DTYPE_BF16:
      e = launch_stats<__nv_bfloat16>(grad, n, blocks, partials, flags, stream);
      break;
    default: return cudaErrorInvalidValue;
  }
  if (e != cudaSuccess) return e;
  zk_grad_stats_final_kernel<<<1, kStatsFinalThreads, 0, stream>>>(
      partials, flags, static_cast<int>(blocks), found_inf, found_inf_dtype, sumsq, sumsq_dtype);
  return cudaGetLastError();
}
