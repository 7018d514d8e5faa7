// AVX-512 8-bit AdamW blocks (16 fp32 lanes, 8 vectors per 128-element block): the scalar path's
// operations in its order (adamw8bit_cpu.cpp), each an IEEE-rounded vector mul/add/div/sqrt
// intrinsic, so every lane gives the scalar path's bits. No FMA: none is written, and the op
// builds with -ffp-contract=off (kernels/build.py; GCC fuses mul+add in an avx512f body
// otherwise). Compiled without -march; the target attribute confines AVX-512 to these bodies.
#include <immintrin.h>

#include "adamw8bit_cpu.h"

#define ZK_Q8_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c")))
#define ZK_Q8_AVX512_INLINE ZK_Q8_AVX512 __attribute__((always_inline)) inline

namespace zk_cpu {
namespace {

template <int G>
ZK_Q8_AVX512_INLINE __m512 q8_load_grad16(const void* base, int64_t i) {
  if constexpr (G == kF32) return _mm512_loadu_ps(static_cast<const float*>(base) + i);
  else {
    __m256i h = _mm256_loadu_si256((const __m256i*)(static_cast<const uint16_t*>(base) + i));
    if constexpr (G == kF16) return _mm512_cvtph_ps(h);  // exact, as f16_to_f32
    else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// fp32 -> bf16 bits, RNE with integer ops; NaN -> 0xFFFF like torch (as kernels_avx512.cpp).
ZK_Q8_AVX512_INLINE __m256i q8_f32_to_bf16_16(__m512 x) {
  __m512i b = _mm512_castps_si512(x);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), lsb);
  r = _mm512_srli_epi32(r, 16);
  __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0xFFFF));
  return _mm512_cvtepi32_epi16(r);
}

// codes[q] for 16 byte codes (one 64-byte-line table lookup per lane).
ZK_Q8_AVX512_INLINE __m512 q8_decode16(const uint8_t* q, const float* codes) {
  __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)q));
  return _mm512_i32gather_ps(idx, codes, 4);
}

// One search step: pos += s where !(probe >= x) ([Note: branchless nearest code]).
ZK_Q8_AVX512_INLINE __m512i q8_step(__m512i pos, __m512 probe, __m512 x, int s) {
  __mmask16 k = _mm512_cmp_ps_mask(probe, x, _CMP_NGE_UQ);
  return _mm512_mask_add_epi32(pos, k, pos, _mm512_set1_epi32(s));
}

// The nearest code of 16 values: 8 steps, every probe an in-register permute of the tables.
ZK_Q8_AVX512_INLINE __m512i q8_nearest16(__m512 x, const Q8Search& t) {
  __m512i h = _mm512_setzero_si512();  // pos / 16 while s >= 16
  h = q8_step(h, _mm512_set1_ps(t.c128), x, 8);
  h = q8_step(h, _mm512_permutexvar_ps(h, _mm512_load_ps(t.c64)), x, 4);
  h = q8_step(h, _mm512_permutexvar_ps(h, _mm512_load_ps(t.c32)), x, 2);
  h = q8_step(h, _mm512_permutexvar_ps(h, _mm512_load_ps(t.t15)), x, 1);
  __m512i pos = _mm512_slli_epi32(h, 4);
  pos = q8_step(pos, _mm512_permutexvar_ps(h, _mm512_load_ps(t.t7)), x, 8);
  __m512i j = _mm512_srli_epi32(pos, 3);  // 0..31
  pos = q8_step(pos, _mm512_permutex2var_ps(_mm512_load_ps(t.t3), j, _mm512_load_ps(t.t3 + 16)),
                x, 4);
  j = _mm512_srli_epi32(pos, 2);  // 0..63: bit 5 picks the register pair
  {
    __m512 lo = _mm512_permutex2var_ps(_mm512_load_ps(t.t1), j, _mm512_load_ps(t.t1 + 16));
    __m512 hi = _mm512_permutex2var_ps(_mm512_load_ps(t.t1 + 32), j, _mm512_load_ps(t.t1 + 48));
    __mmask16 b5 = _mm512_test_epi32_mask(j, _mm512_set1_epi32(32));
    pos = q8_step(pos, _mm512_mask_blend_ps(b5, lo, hi), x, 2);
  }
  j = _mm512_srli_epi32(pos, 1);  // 0..127: bits 5 and 6 pick among four register pairs
  {
    __m512 r[4];
    for (int q = 0; q < 4; ++q)
      r[q] = _mm512_permutex2var_ps(_mm512_load_ps(t.t0 + 32 * q), j,
                                    _mm512_load_ps(t.t0 + 32 * q + 16));
    __mmask16 b5 = _mm512_test_epi32_mask(j, _mm512_set1_epi32(32));
    __mmask16 b6 = _mm512_test_epi32_mask(j, _mm512_set1_epi32(64));
    __m512 lo = _mm512_mask_blend_ps(b5, r[0], r[1]), hi = _mm512_mask_blend_ps(b5, r[2], r[3]);
    pos = q8_step(pos, _mm512_mask_blend_ps(b6, lo, hi), x, 1);
  }
  return pos;
}

// Codes of m[0..127] / sm and v[0..127] / sv: the two searches interleaved (independent
// dependency chains, so one fills the other's permute and compare latencies).
ZK_Q8_AVX512_INLINE void q8_quantize_blocks(const float* m, float sm, const float* v, float sv,
                                            const Q8Args& a, int64_t base) {
  const __m512 scm = _mm512_set1_ps(sm), scv = _mm512_set1_ps(sv);
  for (int64_t j = 0; j < kQ8Block; j += 16) {
    __m512i cm = q8_nearest16(_mm512_div_ps(_mm512_load_ps(m + j), scm), *a.search_s);
    __m512i cv = q8_nearest16(_mm512_div_ps(_mm512_load_ps(v + j), scv), *a.search_u);
    _mm_storeu_si128((__m128i*)(a.mq + base + j), _mm512_cvtepi32_epi8(cm));
    _mm_storeu_si128((__m128i*)(a.vq + base + j), _mm512_cvtepi32_epi8(cv));
  }
}

template <int G, int O>
ZK_Q8_AVX512 void q8_blocks(const Q8Args& a, int64_t b0, int64_t b1) {
  alignas(64) float m[kQ8Block], v[kQ8Block];
  const __m512 gs = _mm512_set1_ps(a.gs), decay = _mm512_set1_ps(a.decay);
  const __m512 b1v = _mm512_set1_ps(a.b1), omb1 = _mm512_set1_ps(a.omb1);
  const __m512 b2v = _mm512_set1_ps(a.b2), omb2 = _mm512_set1_ps(a.omb2);
  const __m512 step = _mm512_set1_ps(a.step_size), rbc2 = _mm512_set1_ps(a.rsqrt_bc2);
  const __m512 eps = _mm512_set1_ps(a.eps);
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t base = b * kQ8Block;
    const __m512 am = _mm512_set1_ps(a.ma[b]), av = _mm512_set1_ps(a.va[b]);
    __m512 mmax = _mm512_setzero_ps(), vmax = _mm512_setzero_ps();
    __mmask16 nan_m = 0, nan_v = 0;
    for (int64_t j = 0; j < kQ8Block; j += 16) {
      const int64_t i = base + j;
      const __m512 g = _mm512_mul_ps(q8_load_grad16<G>(a.grad, i), gs);
      __m512 mj = _mm512_mul_ps(q8_decode16(a.mq + i, a.code_s), am);
      __m512 vj = _mm512_mul_ps(q8_decode16(a.vq + i, a.code_u), av);
      __m512 x = _mm512_mul_ps(_mm512_loadu_ps(a.p + i), decay);
      mj = _mm512_add_ps(_mm512_mul_ps(b1v, mj), _mm512_mul_ps(omb1, g));
      vj = _mm512_add_ps(_mm512_mul_ps(b2v, vj), _mm512_mul_ps(omb2, _mm512_mul_ps(g, g)));
      const __m512 den = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(vj), rbc2), eps);
      x = _mm512_sub_ps(x, _mm512_mul_ps(step, _mm512_div_ps(mj, den)));
      _mm512_storeu_ps(a.p + i, x);
      if constexpr (O == kOutF16)
        _mm256_storeu_si256((__m256i*)(static_cast<uint16_t*>(a.out) + i),
                            _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      if constexpr (O == kOutBF16)
        _mm256_storeu_si256((__m256i*)(static_cast<uint16_t*>(a.out) + i), q8_f32_to_bf16_16(x));
      _mm512_store_ps(m + j, mj);
      _mm512_store_ps(v + j, vj);
      // max of |.| (exact in any order); NaN lanes are tracked apart (max_ps drops them).
      mmax = _mm512_max_ps(mmax, _mm512_castsi512_ps(
                                     _mm512_and_si512(_mm512_castps_si512(mj), abs_mask)));
      vmax = _mm512_max_ps(vmax, _mm512_castsi512_ps(
                                     _mm512_and_si512(_mm512_castps_si512(vj), abs_mask)));
      nan_m |= _mm512_cmp_ps_mask(mj, mj, _CMP_UNORD_Q);
      nan_v |= _mm512_cmp_ps_mask(vj, vj, _CMP_UNORD_Q);
    }
    float mm = _mm512_reduce_max_ps(mmax), vm = _mm512_reduce_max_ps(vmax);
    if (nan_m) mm = q8_nan_absmax(m);  // rare: a NaN moment (torch's amax propagates it)
    if (nan_v) vm = q8_nan_absmax(v);
    a.ma[b] = mm;
    a.va[b] = vm;
    q8_quantize_blocks(m, mm > 0.f ? mm : 1.f, v, vm > 0.f ? vm : 1.f, a, base);
  }
}

}  // namespace

const Q8Kernels& q8_avx512_kernels() {
  static const Q8Kernels table = [] {
    Q8Kernels k{};
    k.blocks[kF32][kOutNone] = &q8_blocks<kF32, kOutNone>;
    k.blocks[kF32][kOutF16] = &q8_blocks<kF32, kOutF16>;
    k.blocks[kF32][kOutBF16] = &q8_blocks<kF32, kOutBF16>;
    k.blocks[kF16][kOutNone] = &q8_blocks<kF16, kOutNone>;
    k.blocks[kF16][kOutF16] = &q8_blocks<kF16, kOutF16>;
    k.blocks[kF16][kOutBF16] = &q8_blocks<kF16, kOutBF16>;
    k.blocks[kBF16][kOutNone] = &q8_blocks<kBF16, kOutNone>;
    k.blocks[kBF16][kOutF16] = &q8_blocks<kBF16, kOutF16>;
    k.blocks[kBF16][kOutBF16] = &q8_blocks<kBF16, kOutBF16>;
    return k;
  }();
  return table;
}

}  // namespace zk_cpu
