// AVX2 + F16C 8-bit AdamW blocks (8 fp32 lanes, 16 vectors per 128-element block): the scalar
// path's operations in its order (adamw8bit_cpu.cpp), each an IEEE-rounded vector
// mul/add/div/sqrt intrinsic. No FMA: none is written, and the op builds with -ffp-contract=off
// (kernels/build.py). The search probes ([Note: branchless nearest code]) of steps s >= 2 are
// read from the tables with one 8-entry permute per register and a blend tree; the last step
// (128 values: 16 permutes and 15 blends) is one gather instead. Measured on the loaded AMD EPYC
// (Zen 4) dev box, one thread, n = 2^20: 6.3 ns/element; 8.1 with the last step permuted too;
// 12.9 with all 8 probes gathered (AVX2 gathers are slow there). Compiled without -march; the
// target attribute confines AVX2 to these bodies.
#include <immintrin.h>

#include "adamw8bit_cpu.h"

#define ZK_Q8_AVX2 __attribute__((target("avx2,f16c")))
#define ZK_Q8_AVX2_INLINE ZK_Q8_AVX2 __attribute__((always_inline)) inline

namespace zk_cpu {
namespace {

template <int G>
ZK_Q8_AVX2_INLINE __m256 q8_load_grad8(const void* base, int64_t i) {
  if constexpr (G == kF32) return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  else {
    __m128i h = _mm_loadu_si128((const __m128i*)(static_cast<const uint16_t*>(base) + i));
    if constexpr (G == kF16) return _mm256_cvtph_ps(h);  // exact, as f16_to_f32
    else return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// fp32 -> bf16 bits, RNE with integer ops; NaN -> 0xFFFF like torch (as kernels_avx2.cpp).
ZK_Q8_AVX2_INLINE __m128i q8_f32_to_bf16_8(__m256 x) {
  __m256i b = _mm256_castps_si256(x);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), lsb);
  r = _mm256_or_si256(r, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
  const __m256i hi16 = _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1,
                                        2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1);
  r = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(r, hi16), 0x08);
  return _mm256_castsi256_si128(r);
}

ZK_Q8_AVX2_INLINE __m256 q8_decode8(const uint8_t* q, const float* codes) {
  __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)q));
  return _mm256_i32gather_ps(codes, idx, 4);
}

// table[j] for 8 indices j < 8 * R: one permute per 8-entry register, then a blend tree on the
// index bits 3, 4, ... (blendv reads the sign bit, so each bit is shifted to bit 31).
template <int R>
ZK_Q8_AVX2_INLINE __m256 q8_lookup8(const float* table, __m256i j) {
  __m256 r[R];
  for (int k = 0; k < R; ++k) r[k] = _mm256_permutevar8x32_ps(_mm256_load_ps(table + 8 * k), j);
  int bit = 3;
  for (int w = R; w > 1; w >>= 1, ++bit) {
    const __m256 sel = _mm256_castsi256_ps(_mm256_sll_epi32(j, _mm_cvtsi32_si128(31 - bit)));
    for (int k = 0; k < w / 2; ++k) r[k] = _mm256_blendv_ps(r[2 * k], r[2 * k + 1], sel);
  }
  return r[0];
}

ZK_Q8_AVX2_INLINE __m256i q8_step8(__m256i pos, __m256 probe, __m256 x, int s) {
  __m256 pass = _mm256_cmp_ps(probe, x, _CMP_NGE_UQ);
  return _mm256_add_epi32(pos, _mm256_and_si256(_mm256_castps_si256(pass), _mm256_set1_epi32(s)));
}

ZK_Q8_AVX2_INLINE __m256i q8_nearest8(__m256 x, const Q8Search& t, const float* mids) {
  __m256i pos = _mm256_setzero_si256();
  for (int s = 128; s >= 16; s >>= 1) {
    __m256i j = _mm256_add_epi32(_mm256_srli_epi32(pos, 4), _mm256_set1_epi32(s / 16 - 1));
    pos = q8_step8(pos, q8_lookup8<2>(t.t15, j), x, s);
  }
  pos = q8_step8(pos, q8_lookup8<2>(t.t7, _mm256_srli_epi32(pos, 4)), x, 8);
  pos = q8_step8(pos, q8_lookup8<4>(t.t3, _mm256_srli_epi32(pos, 3)), x, 4);
  pos = q8_step8(pos, q8_lookup8<8>(t.t1, _mm256_srli_epi32(pos, 2)), x, 2);
  pos = q8_step8(pos, _mm256_i32gather_ps(mids, pos, 4), x, 1);  // mids[pos], pos even
  return pos;
}

// Codes of x[0..127] / scale into q[0..127] (16 codes per iteration: two vectors packed).
ZK_Q8_AVX2_INLINE void q8_quantize_block(const float* x, float scale, const Q8Search& t,
                                         const float* mids, uint8_t* q) {
  const __m256 sc = _mm256_set1_ps(scale);
  for (int64_t j = 0; j < kQ8Block; j += 16) {
    __m256i c0 = q8_nearest8(_mm256_div_ps(_mm256_load_ps(x + j), sc), t, mids);
    __m256i c1 = q8_nearest8(_mm256_div_ps(_mm256_load_ps(x + j + 8), sc), t, mids);
    __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32(c0, c1), 0xD8);  // 16 x u16, in order
    __m128i b = _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    _mm_storeu_si128((__m128i*)(q + j), b);
  }
}

template <int G, int O>
ZK_Q8_AVX2 void q8_blocks(const Q8Args& a, int64_t b0, int64_t b1) {
  alignas(32) float m[kQ8Block], v[kQ8Block];
  const __m256 gs = _mm256_set1_ps(a.gs), decay = _mm256_set1_ps(a.decay);
  const __m256 b1v = _mm256_set1_ps(a.b1), omb1 = _mm256_set1_ps(a.omb1);
  const __m256 b2v = _mm256_set1_ps(a.b2), omb2 = _mm256_set1_ps(a.omb2);
  const __m256 step = _mm256_set1_ps(a.step_size), rbc2 = _mm256_set1_ps(a.rsqrt_bc2);
  const __m256 eps = _mm256_set1_ps(a.eps);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t base = b * kQ8Block;
    const __m256 am = _mm256_set1_ps(a.ma[b]), av = _mm256_set1_ps(a.va[b]);
    __m256 mmax = _mm256_setzero_ps(), vmax = _mm256_setzero_ps();
    __m256 nan_m = _mm256_setzero_ps(), nan_v = _mm256_setzero_ps();
    for (int64_t j = 0; j < kQ8Block; j += 8) {
      const int64_t i = base + j;
      const __m256 g = _mm256_mul_ps(q8_load_grad8<G>(a.grad, i), gs);
      __m256 mj = _mm256_mul_ps(q8_decode8(a.mq + i, a.code_s), am);
      __m256 vj = _mm256_mul_ps(q8_decode8(a.vq + i, a.code_u), av);
      __m256 x = _mm256_mul_ps(_mm256_loadu_ps(a.p + i), decay);
      mj = _mm256_add_ps(_mm256_mul_ps(b1v, mj), _mm256_mul_ps(omb1, g));
      vj = _mm256_add_ps(_mm256_mul_ps(b2v, vj), _mm256_mul_ps(omb2, _mm256_mul_ps(g, g)));
      const __m256 den = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(vj), rbc2), eps);
      x = _mm256_sub_ps(x, _mm256_mul_ps(step, _mm256_div_ps(mj, den)));
      _mm256_storeu_ps(a.p + i, x);
      if constexpr (O == kOutF16)
        _mm_storeu_si128((__m128i*)(static_cast<uint16_t*>(a.out) + i),
                         _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      if constexpr (O == kOutBF16)
        _mm_storeu_si128((__m128i*)(static_cast<uint16_t*>(a.out) + i), q8_f32_to_bf16_8(x));
      _mm256_store_ps(m + j, mj);
      _mm256_store_ps(v + j, vj);
      // max of |.| (exact in any order); NaN lanes are tracked apart (max_ps drops them).
      mmax = _mm256_max_ps(mmax, _mm256_and_ps(mj, abs_mask));
      vmax = _mm256_max_ps(vmax, _mm256_and_ps(vj, abs_mask));
      nan_m = _mm256_or_ps(nan_m, _mm256_cmp_ps(mj, mj, _CMP_UNORD_Q));
      nan_v = _mm256_or_ps(nan_v, _mm256_cmp_ps(vj, vj, _CMP_UNORD_Q));
    }
    alignas(32) float lm[8], lv[8];
    _mm256_store_ps(lm, mmax);
    _mm256_store_ps(lv, vmax);
    float mm = lm[0], vm = lv[0];
    for (int k = 1; k < 8; ++k) {
      mm = lm[k] > mm ? lm[k] : mm;
      vm = lv[k] > vm ? lv[k] : vm;
    }
    if (_mm256_movemask_ps(nan_m)) mm = q8_nan_absmax(m);  // rare: torch's amax propagates NaN
    if (_mm256_movemask_ps(nan_v)) vm = q8_nan_absmax(v);
    a.ma[b] = mm;
    a.va[b] = vm;
    q8_quantize_block(m, mm > 0.f ? mm : 1.f, *a.search_s, a.mid_s, a.mq + base);
    q8_quantize_block(v, vm > 0.f ? vm : 1.f, *a.search_u, a.mid_u, a.vq + base);
  }
}

}  // namespace

const Q8Kernels& q8_avx2_kernels() {
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
