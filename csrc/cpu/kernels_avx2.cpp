// AVX2 + FMA + F16C kernels (8 fp32 lanes): Adam step and sum of squares. AVX2 has no 16-bit
// masked loads, so chunk tails go through small zero-padded stack buffers and the same vector code.
#include <immintrin.h>

#include <algorithm>

#include "cpu_kernels.h"

#define ZK_AVX2 __attribute__((target("avx2,fma,f16c")))
#define ZK_AVX2_INLINE ZK_AVX2 __attribute__((always_inline)) inline

namespace zk_cpu {
namespace {

template <int G>
ZK_AVX2_INLINE __m256 load_grad8(const void* base, int64_t i) {
  if constexpr (G == kF32) return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  else {
    __m128i h = _mm_loadu_si128((const __m128i*)(static_cast<const uint16_t*>(base) + i));
    if constexpr (G == kF16) return _mm256_cvtph_ps(h);
    else return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// fp32 -> bf16 bits, RNE with integer ops; NaN -> 0xFFFF like torch. The high halves are
// gathered with pshufb + permute (8 ops in all; the srli/packus variant took 10).
ZK_AVX2_INLINE __m128i f32_to_bf16_8(__m256 x) {
  __m256i b = _mm256_castps_si256(x);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), lsb);
  r = _mm256_or_si256(r, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));  // NaN: all ones
  const __m256i hi16 = _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1,
                                        2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1);
  r = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(r, hi16), 0x08);  // qwords 0 and 2 -> low half
  return _mm256_castsi256_si128(r);
}

template <int O, bool STREAM>
ZK_AVX2_INLINE void store_out8(void* base, int64_t i, __m256 x) {
  if constexpr (O != kOutNone) {
    __m128i h;
    if constexpr (O == kOutF16) h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    else h = f32_to_bf16_8(x);
    __m128i* p = (__m128i*)(static_cast<uint16_t*>(base) + i);
    if (STREAM) _mm_stream_si128(p, h);  // p is 16-byte aligned here
    else _mm_storeu_si128(p, h);
  }
}

struct VecScalars {
  __m256 gs, decay, wd, b1, b2, omb1, omb2, neg_step, rsqrt_bc2, eps;
};

// One 8-lane Adam update; the operation order mirrors kernels_scalar.cpp exactly.
template <int G, int O, bool ADAMW, bool STREAM = false>
ZK_AVX2_INLINE void adam8(const AdamPtrs& P, const VecScalars& S, int64_t i) {
  __m256 g = _mm256_mul_ps(load_grad8<G>(P.grad, i), S.gs);
  __m256 p = _mm256_loadu_ps(P.master + i);
  __m256 m = _mm256_loadu_ps(P.m + i);
  __m256 v = _mm256_loadu_ps(P.v + i);
  if constexpr (ADAMW) p = _mm256_mul_ps(p, S.decay);
  else g = _mm256_fmadd_ps(S.wd, p, g);
  m = _mm256_fmadd_ps(S.b1, m, _mm256_mul_ps(S.omb1, g));
  v = _mm256_fmadd_ps(S.b2, v, _mm256_mul_ps(S.omb2, _mm256_mul_ps(g, g)));
  __m256 denom = _mm256_fmadd_ps(_mm256_sqrt_ps(v), S.rsqrt_bc2, S.eps);
  p = _mm256_fmadd_ps(S.neg_step, _mm256_div_ps(m, denom), p);
  _mm256_storeu_ps(P.master + i, p);
  _mm256_storeu_ps(P.m + i, m);
  _mm256_storeu_ps(P.v + i, v);
  store_out8<O, STREAM>(P.out, i, p);
}

// Fewer than 8 elements (chunk head/tail): the same vector code on zero-padded stack copies,
// since AVX2 has no masked 16-bit loads/stores.
template <int G, int O, bool ADAMW>
ZK_AVX2_INLINE void adam_partial8(const AdamPtrs& P, const VecScalars& S, int64_t i, int64_t r) {
  constexpr size_t gsz = G == kF32 ? 4 : 2;
  alignas(32) unsigned char gbuf[8 * 4] = {};
  alignas(32) float pbuf[8] = {}, mbuf[8] = {}, vbuf[8] = {};
  alignas(32) uint16_t obuf[8] = {};
  std::memcpy(gbuf, static_cast<const unsigned char*>(P.grad) + i * gsz, r * gsz);
  std::memcpy(pbuf, P.master + i, r * 4);
  std::memcpy(mbuf, P.m + i, r * 4);
  std::memcpy(vbuf, P.v + i, r * 4);
  const AdamPtrs T{pbuf, mbuf, vbuf, gbuf, obuf, false};
  adam8<G, O, ADAMW>(T, S, 0);
  std::memcpy(P.master + i, pbuf, r * 4);
  std::memcpy(P.m + i, mbuf, r * 4);
  std::memcpy(P.v + i, vbuf, r * 4);
  if (O != kOutNone) std::memcpy(static_cast<uint16_t*>(P.out) + i, obuf, r * 2);
}

template <int G, int O, bool ADAMW>
ZK_AVX2 void adam_chunk(const AdamPtrs& ptrs, const AdamScalars& s, int64_t begin, int64_t end) {
  const AdamPtrs P = ptrs;  // local copy: otherwise every store forces a reload of the pointers
  const VecScalars S{_mm256_set1_ps(s.gs),   _mm256_set1_ps(s.decay), _mm256_set1_ps(s.wd),
                     _mm256_set1_ps(s.b1),   _mm256_set1_ps(s.b2),    _mm256_set1_ps(s.omb1),
                     _mm256_set1_ps(s.omb2), _mm256_set1_ps(-s.step_size),
                     _mm256_set1_ps(s.rsqrt_bc2), _mm256_set1_ps(s.eps)};
  int64_t i = begin;
  const uintptr_t out_addr = reinterpret_cast<uintptr_t>(P.out) + 2 * uintptr_t(i);
  const bool stream = O != kOutNone && P.stream_out && (out_addr & 1) == 0;
  if (stream) {
    // Peel up to 7 elements so the param_out stores are 16-byte aligned, then stream them.
    const int64_t head = std::min<int64_t>(((16 - (out_addr & 15)) & 15) / 2, end - i);
    if (head) adam_partial8<G, O, ADAMW>(P, S, i, head);
    for (i += head; i + 8 <= end; i += 8) adam8<G, O, ADAMW, true>(P, S, i);
  }
  for (; i + 8 <= end; i += 8) adam8<G, O, ADAMW>(P, S, i);
  if (i < end) adam_partial8<G, O, ADAMW>(P, S, i, end - i);
  if (stream) _mm_sfence();  // order the non-temporal stores before the caller's later reads
}

// Four 8-lane accumulators hide the FMA latency; the tail is added in a fixed scalar order.
template <int G>
ZK_AVX2 float sumsq_chunk(const void* grad, int64_t begin, int64_t end) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = begin;
  for (; i + 32 <= end; i += 32) {
    __m256 x0 = load_grad8<G>(grad, i), x1 = load_grad8<G>(grad, i + 8);
    __m256 x2 = load_grad8<G>(grad, i + 16), x3 = load_grad8<G>(grad, i + 24);
    a0 = _mm256_fmadd_ps(x0, x0, a0);
    a1 = _mm256_fmadd_ps(x1, x1, a1);
    a2 = _mm256_fmadd_ps(x2, x2, a2);
    a3 = _mm256_fmadd_ps(x3, x3, a3);
  }
  for (; i + 8 <= end; i += 8) {
    __m256 x = load_grad8<G>(grad, i);
    a0 = _mm256_fmadd_ps(x, x, a0);
  }
  __m256 a = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  float s = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
  for (; i < end; ++i) {
    float x;
    if constexpr (G == kF32) x = static_cast<const float*>(grad)[i];
    else if constexpr (G == kF16) x = f16_to_f32(static_cast<const uint16_t*>(grad)[i]);
    else x = bf16_to_f32(static_cast<const uint16_t*>(grad)[i]);
    s = std::fma(x, x, s);
  }
  return s;
}

ZK_DEFINE_FILL_HELPERS()

}  // namespace

ZK_DEFINE_ISA_TABLE(avx2_kernels)

}  // namespace zk_cpu
