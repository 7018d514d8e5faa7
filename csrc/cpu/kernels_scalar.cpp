// Portable scalar kernels: the fallback for CPUs without AVX2/F16C and the spec the SIMD paths
// follow operation for operation (same FMA placement, so all ISAs give identical bits).
#include "cpu_kernels.h"

namespace zk_cpu {
namespace {

template <int G>
inline float load_grad(const void* p, int64_t i) {
  if constexpr (G == kF32) return static_cast<const float*>(p)[i];
  else if constexpr (G == kF16) return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
  else return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
}

template <int O>
inline void store_out(void* p, int64_t i, float x) {
  if constexpr (O == kOutF16) static_cast<uint16_t*>(p)[i] = f32_to_f16(x);
  else if constexpr (O == kOutBF16) static_cast<uint16_t*>(p)[i] = f32_to_bf16(x);
}

// std::fma keeps the rounding identical to the vector paths' vfmadd. Each kernel is instantiated
// twice: plain (a call to glibc's correctly rounded fmaf: ~3 GB/s at n = 2^24) and with
// target("fma"), where std::fma is one instruction (~10 GB/s); the table takes the second when
// the CPU has FMA.
#define ZK_FMA __attribute__((target("fma")))
#define ZK_BODY __attribute__((always_inline)) inline

template <int G, int O, bool ADAMW>
ZK_BODY void adam_body(const AdamPtrs& ptrs, const AdamScalars& scalars, int64_t begin, int64_t end) {
  const AdamPtrs P = ptrs;  // local copies: otherwise every store forces reloads
  const AdamScalars S = scalars;
  for (int64_t i = begin; i < end; ++i) {
    float g = load_grad<G>(P.grad, i) * S.gs;
    float p = P.master[i];
    if (ADAMW) p = p * S.decay;
    else g = std::fma(S.wd, p, g);
    float m = std::fma(S.b1, P.m[i], S.omb1 * g);
    float v = std::fma(S.b2, P.v[i], S.omb2 * (g * g));
    float denom = std::fma(std::sqrt(v), S.rsqrt_bc2, S.eps);
    p = std::fma(-S.step_size, m / denom, p);
    P.master[i] = p;
    P.m[i] = m;
    P.v[i] = v;
    store_out<O>(P.out, i, p);
  }
}

// Eight independent float accumulators, summed pairwise at the end (fixed order).
template <int G>
ZK_BODY float sumsq_body(const void* grad, int64_t begin, int64_t end) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = begin;
  for (; i + 8 <= end; i += 8)
    for (int k = 0; k < 8; ++k) {
      float x = load_grad<G>(grad, i + k);
      acc[k] = std::fma(x, x, acc[k]);
    }
  for (int k = 0; i < end; ++i, ++k) {
    float x = load_grad<G>(grad, i);
    acc[k] = std::fma(x, x, acc[k]);
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

template <int G, int O, bool ADAMW>
void adam_chunk(const AdamPtrs& P, const AdamScalars& S, int64_t b, int64_t e) {
  adam_body<G, O, ADAMW>(P, S, b, e);
}
template <int G, int O, bool ADAMW>
ZK_FMA void adam_chunk_fma(const AdamPtrs& P, const AdamScalars& S, int64_t b, int64_t e) {
  adam_body<G, O, ADAMW>(P, S, b, e);
}
template <int G>
float sumsq_chunk(const void* g, int64_t b, int64_t e) { return sumsq_body<G>(g, b, e); }
template <int G>
ZK_FMA float sumsq_chunk_fma(const void* g, int64_t b, int64_t e) { return sumsq_body<G>(g, b, e); }

template <int G, int O>
void fill_adam(IsaKernels& k, bool fma) {
  k.adam[G][O][0] = fma ? &adam_chunk_fma<G, O, false> : &adam_chunk<G, O, false>;
  k.adam[G][O][1] = fma ? &adam_chunk_fma<G, O, true> : &adam_chunk<G, O, true>;
}

template <int G>
void fill_grad(IsaKernels& k, bool fma) {
  fill_adam<G, kOutNone>(k, fma);
  fill_adam<G, kOutF16>(k, fma);
  fill_adam<G, kOutBF16>(k, fma);
  k.sumsq[G] = fma ? &sumsq_chunk_fma<G> : &sumsq_chunk<G>;
}

IsaKernels make_table() {
  __builtin_cpu_init();
  const bool fma = __builtin_cpu_supports("fma");
  IsaKernels k{};
  fill_grad<kF32>(k, fma);
  fill_grad<kF16>(k, fma);
  fill_grad<kBF16>(k, fma);
  return k;
}

}  // namespace

const IsaKernels& scalar_kernels() {
  static const IsaKernels table = make_table();
  return table;
}

}  // namespace zk_cpu
