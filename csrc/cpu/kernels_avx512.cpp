// AVX-512 kernels (16 fp32 lanes): Adam step and sum of squares, with masked loads/stores for
// chunk tails. Compiled without -march; the target attribute confines AVX-512 to these bodies.
#include <immintrin.h>

#include <algorithm>

#include "cpu_kernels.h"

#define ZK_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define ZK_AVX512_INLINE ZK_AVX512 __attribute__((always_inline)) inline

namespace zk_cpu {
namespace {

// ---- loads: 16 elements (masked: lanes outside k read as 0 and never fault) ----

template <int G, bool MASKED>
ZK_AVX512_INLINE __m512 load_grad16(const void* base, int64_t i, __mmask16 k) {
  if constexpr (G == kF32) {
    const float* p = static_cast<const float*>(base) + i;
    return MASKED ? _mm512_maskz_loadu_ps(k, p) : _mm512_loadu_ps(p);
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(base) + i;
    __m256i h = MASKED ? _mm256_maskz_loadu_epi16(k, p) : _mm256_loadu_si256((const __m256i*)p);
    if constexpr (G == kF16) return _mm512_cvtph_ps(h);
    else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

template <bool MASKED>
ZK_AVX512_INLINE __m512 load16(const float* p, __mmask16 k) {
  return MASKED ? _mm512_maskz_loadu_ps(k, p) : _mm512_loadu_ps(p);
}

template <bool MASKED>
ZK_AVX512_INLINE void store16(float* p, __m512 x, __mmask16 k) {
  if (MASKED) _mm512_mask_storeu_ps(p, k, x);
  else _mm512_storeu_ps(p, x);
}

// fp32 -> bf16 bits, RNE with integer ops; NaN -> 0xFFFF like torch (vcvtneps2bf16 would give
// a different NaN pattern, so it is not used).
ZK_AVX512_INLINE __m256i f32_to_bf16_16(__m512 x) {
  __m512i b = _mm512_castps_si512(x);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), lsb);
  r = _mm512_srli_epi32(r, 16);
  __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0xFFFF));
  return _mm512_cvtepi32_epi16(r);
}

template <int O, bool MASKED, bool STREAM>
ZK_AVX512_INLINE void store_out16(void* base, int64_t i, __m512 x, __mmask16 k) {
  if constexpr (O == kOutNone) return;
  else {
    uint16_t* p = static_cast<uint16_t*>(base) + i;
    __m256i h;
    if constexpr (O == kOutF16) h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    else h = f32_to_bf16_16(x);
    if (MASKED) _mm256_mask_storeu_epi16(p, k, h);
    else if (STREAM) _mm256_stream_si256((__m256i*)p, h);  // p is 32-byte aligned here
    else _mm256_storeu_si256((__m256i*)p, h);
  }
}

struct VecScalars {
  __m512 gs, decay, wd, b1, b2, omb1, omb2, neg_step, rsqrt_bc2, eps;
};

// One 16-lane Adam update; the operation order mirrors kernels_scalar.cpp exactly.
template <int G, int O, bool ADAMW, bool MASKED, bool STREAM = false>
ZK_AVX512_INLINE void adam16(const AdamPtrs& P, const VecScalars& S, int64_t i, __mmask16 k) {
  __m512 g = _mm512_mul_ps(load_grad16<G, MASKED>(P.grad, i, k), S.gs);
  __m512 p = load16<MASKED>(P.master + i, k);
  __m512 m = load16<MASKED>(P.m + i, k);
  __m512 v = load16<MASKED>(P.v + i, k);
  if constexpr (ADAMW) p = _mm512_mul_ps(p, S.decay);
  else g = _mm512_fmadd_ps(S.wd, p, g);
  m = _mm512_fmadd_ps(S.b1, m, _mm512_mul_ps(S.omb1, g));
  v = _mm512_fmadd_ps(S.b2, v, _mm512_mul_ps(S.omb2, _mm512_mul_ps(g, g)));
  __m512 denom = _mm512_fmadd_ps(_mm512_sqrt_ps(v), S.rsqrt_bc2, S.eps);
  p = _mm512_fmadd_ps(S.neg_step, _mm512_div_ps(m, denom), p);
  store16<MASKED>(P.master + i, p, k);
  store16<MASKED>(P.m + i, m, k);
  store16<MASKED>(P.v + i, v, k);
  store_out16<O, MASKED, STREAM>(P.out, i, p, k);
}

template <int G, int O, bool ADAMW>
ZK_AVX512 void adam_chunk(const AdamPtrs& ptrs, const AdamScalars& s, int64_t begin, int64_t end) {
  const AdamPtrs P = ptrs;  // local copy: otherwise every store forces a reload of the pointers
  const VecScalars S{_mm512_set1_ps(s.gs),   _mm512_set1_ps(s.decay), _mm512_set1_ps(s.wd),
                     _mm512_set1_ps(s.b1),   _mm512_set1_ps(s.b2),    _mm512_set1_ps(s.omb1),
                     _mm512_set1_ps(s.omb2), _mm512_set1_ps(-s.step_size),
                     _mm512_set1_ps(s.rsqrt_bc2), _mm512_set1_ps(s.eps)};
  // No software prefetch (1-2 KiB ahead measured 2-10% slower: the hardware prefetchers already
  // follow these 5 streams) and regular stores for master/m/v (streaming them measured 35-60%
  // slower: the loads just brought those lines into the cache).
  int64_t i = begin;
  const uintptr_t out_addr = reinterpret_cast<uintptr_t>(P.out) + 2 * uintptr_t(i);
  const bool stream = O != kOutNone && P.stream_out && (out_addr & 1) == 0;
  if (stream) {
    // Peel up to 15 elements so the param_out stores are 32-byte aligned, then stream them.
    const int64_t head = std::min<int64_t>(((32 - (out_addr & 31)) & 31) / 2, end - i);
    if (head) adam16<G, O, ADAMW, true>(P, S, i, __mmask16((1u << head) - 1));
    for (i += head; i + 16 <= end; i += 16) adam16<G, O, ADAMW, false, true>(P, S, i, 0xFFFF);
  }
  for (; i + 16 <= end; i += 16) adam16<G, O, ADAMW, false>(P, S, i, 0xFFFF);
  if (i < end) adam16<G, O, ADAMW, true>(P, S, i, __mmask16((1u << (end - i)) - 1));
  if (stream) _mm_sfence();  // order the non-temporal stores before the caller's later reads
}

// Four 16-lane accumulators (64 partial sums) hide the FMA latency; reduced in a fixed order.
template <int G>
ZK_AVX512 float sumsq_chunk(const void* grad, int64_t begin, int64_t end) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = begin;
  for (; i + 64 <= end; i += 64) {
    __m512 x0 = load_grad16<G, false>(grad, i, 0xFFFF);
    __m512 x1 = load_grad16<G, false>(grad, i + 16, 0xFFFF);
    __m512 x2 = load_grad16<G, false>(grad, i + 32, 0xFFFF);
    __m512 x3 = load_grad16<G, false>(grad, i + 48, 0xFFFF);
    a0 = _mm512_fmadd_ps(x0, x0, a0);
    a1 = _mm512_fmadd_ps(x1, x1, a1);
    a2 = _mm512_fmadd_ps(x2, x2, a2);
    a3 = _mm512_fmadd_ps(x3, x3, a3);
  }
  for (; i + 16 <= end; i += 16) {
    __m512 x = load_grad16<G, false>(grad, i, 0xFFFF);
    a0 = _mm512_fmadd_ps(x, x, a0);
  }
  if (i < end) {
    __m512 x = load_grad16<G, true>(grad, i, __mmask16((1u << (end - i)) - 1));
    a1 = _mm512_fmadd_ps(x, x, a1);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

ZK_DEFINE_FILL_HELPERS()

}  // namespace

ZK_DEFINE_ISA_TABLE(avx512_kernels)

}  // namespace zk_cpu
