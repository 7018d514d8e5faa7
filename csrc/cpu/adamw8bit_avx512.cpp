// AVX-512 8-bit AdamW blocks (16 fp32 lanes, 8 vectors per 128-element block): the scalar path's
// operations in its order (adamw8bit_cpu.cpp), each an IEEE-rounded vector mul/add/div/sqrt
// intrinsic, so every lane gives the scalar path's bits. The update has no FMA (the op builds
// with -ffp-contract=off, kernels/build.py; GCC fuses mul+add in an avx512f body otherwise); the
// one fnmadd written decides a code ([Note: bucketed nearest code], adamw8bit_cpu.h), where a
// single rounding is the point. Compiled without -march; the target attribute confines AVX-512
// to these bodies.
//
// Cost (issue 40; Intel Xeon with AVX-512, the shared 2-core box, one thread, bf16 grads and
// param_out, n = 2^16 in cache, ns/element, best of 400 interleaved with the previous kernel):
//   previous kernel (8-step permute search on m / s, two divisions)   1.70
//   buckets (16-lane gathers), no division in the quantizer           1.48
//   + the per-block NaN checks, the unsigned key without the sign     1.44
//   + one 64-bit gather per half (mid and E|base in one entry)        1.35
// What is left: the gathers (2 dequantize, 2 x 2 buckets per 16 elements) ~0.4, the update
// (div, sqrt, bf16 out) ~0.9 (all three replaced by permutes: 1.02). Tried and dropped: the
// dequantize from 4 byte planes with AVX512-VBMI vpermi2b (64 codes per 22 ops) ran 3% slower
// than its 2 gathers; the quantizer's exact division instead of the one-rounding test, 10% slower.
// At n >= 2^24 the loads wait on memory after each block's compute; prefetching 8 blocks ahead
// overlaps them: 2 threads, 2^24, interleaved, 8% less time in the quieter of three runs (the
// loaded two, load 5-11 on the 2 cores, could not tell). The whole step against the previous
// kernel, same run: benchmarks/results/adamw8bit-cpu-kernel-issue40-20261129.md.
#include <immintrin.h>

#include "adamw8bit_cpu.h"

#define ZK_Q8_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")))
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

// [Note: bucketed nearest code] (adamw8bit_cpu.h): the codes of 16 values m / s without the
// division (s in [kQ8FastMin, kQ8FastMax], rs = RN(1 / s)); returns the lanes it cannot decide.
// HAS_NAN: the block holds a NaN (its code is 255; without NaN the compare is skipped).
// SIGNED: the key's sign half. The unsigned map skips it: a negative x' (sign bit set: a negative
// int32) clamps to bucket 0, whose count is 0 = the code of any x <= 0 there (its smallest
// midpoint is positive), and a NaN's wrapped key is overwritten below.
template <bool SIGNED, bool HAS_NAN>
ZK_Q8_AVX512_INLINE __mmask16 q8_bucket16(__m512 m, __m512 s, __m512 rs, const Q8Buckets& t,
                                          __m512i& code) {
  const __m512i b = _mm512_castps_si512(_mm512_mul_ps(m, rs));
  const __m512i mag = SIGNED ? _mm512_and_si512(b, _mm512_set1_epi32(0x7FFFFFFF)) : b;
  __m512i k = _mm512_sub_epi32(
      _mm512_srai_epi32(_mm512_add_epi32(mag, _mm512_set1_epi32(kQ8KeyOffset)), kQ8KeyShift),
      _mm512_set1_epi32(kQ8KeyExp0 << kQ8KeyBits));
  k = _mm512_min_epi32(_mm512_max_epi32(k, _mm512_setzero_si512()),
                       _mm512_set1_epi32(kQ8Keys - 1));
  if constexpr (SIGNED)
    k = _mm512_mask_add_epi32(k, _mm512_movepi32_mask(b), k, _mm512_set1_epi32(kQ8Keys));
  const __m512i lo = _mm512_i32gather_epi64(_mm512_castsi512_si256(k), t.entry, 8);
  const __m512i hi = _mm512_i32gather_epi64(_mm512_extracti64x4_epi64(k, 1), t.entry, 8);
  const __m512i even =
      _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512 mid = _mm512_castsi512_ps(_mm512_permutex2var_epi32(lo, even, hi));
  const __m512i eb =
      _mm512_permutex2var_epi32(lo, _mm512_add_epi32(even, _mm512_set1_epi32(1)), hi);
  const __m512 d = _mm512_mul_ps(
      _mm512_castsi512_ps(_mm512_andnot_si512(_mm512_set1_epi32(0xFF), eb)), s);
  const __m512 r = _mm512_fnmadd_ps(mid, s, m);  // m - mid * s, rounded once
  const __mmask16 up = _mm512_cmp_ps_mask(r, d, _CMP_GT_OQ);
  const __m512i base = _mm512_and_si512(eb, _mm512_set1_epi32(0xFF));
  code = _mm512_mask_add_epi32(base, up, base, _mm512_set1_epi32(1));
  if constexpr (HAS_NAN)
    code = _mm512_mask_mov_epi32(code, _mm512_cmp_ps_mask(m, m, _CMP_UNORD_Q),
                                 _mm512_set1_epi32(255));
  return _mm512_cmp_ps_mask(r, d, _CMP_EQ_OQ);
}

// Codes of 16 values x / s: the buckets where the block allows them (fast), else (or for an
// undecided lane) the division and the search.
template <bool SIGNED>
ZK_Q8_AVX512_INLINE __m512i q8_codes16(__m512 x, __m512 s, __m512 rs, bool fast, bool nan,
                                       const Q8Buckets* bk, const Q8Search& search) {
  if (fast) {
    __m512i c;
    if (!(nan ? q8_bucket16<SIGNED, true>(x, s, rs, *bk, c)
              : q8_bucket16<SIGNED, false>(x, s, rs, *bk, c)))
      return c;
  }
  return q8_nearest16(_mm512_div_ps(x, s), search);
}

ZK_Q8_AVX512_INLINE bool q8_fast(const Q8Buckets* bk, float s) {
  return bk != nullptr && s >= kQ8FastMin && s <= kQ8FastMax;
}

// Codes of m[0..127] / sm and v[0..127] / sv.
ZK_Q8_AVX512_INLINE void q8_quantize_blocks(const float* m, float sm, bool nan_m, const float* v,
                                            float sv, bool nan_v, const Q8Args& a, int64_t base) {
  const __m512 scm = _mm512_set1_ps(sm), scv = _mm512_set1_ps(sv);
  const __m512 rsm = _mm512_set1_ps(1.f / sm), rsv = _mm512_set1_ps(1.f / sv);
  const bool fm = q8_fast(a.buckets_s, sm), fv = q8_fast(a.buckets_u, sv);
  for (int64_t j = 0; j < kQ8Block; j += 16) {
    __m512i cm = q8_codes16<true>(_mm512_load_ps(m + j), scm, rsm, fm, nan_m, a.buckets_s,
                                  *a.search_s);
    __m512i cv = q8_codes16<false>(_mm512_load_ps(v + j), scv, rsv, fv, nan_v, a.buckets_u,
                                   *a.search_u);
    _mm_storeu_si128((__m128i*)(a.mq + base + j), _mm512_cvtepi32_epi8(cm));
    _mm_storeu_si128((__m128i*)(a.vq + base + j), _mm512_cvtepi32_epi8(cv));
  }
}

// Prefetch the streams kQ8Ahead blocks ahead: without it the loads of a block wait on memory
// after its compute (one thread, n = 2^24, the previous kernel: 3.3 ns/element, its in-cache
// compute 1.7 plus the transfer at the single-thread RMW rate 1.6; see the header).
#ifndef ZK_Q8_AHEAD
#define ZK_Q8_AHEAD 8
#endif
constexpr int64_t kQ8Ahead = ZK_Q8_AHEAD;

template <int G, int O>
ZK_Q8_AVX512_INLINE void q8_prefetch(const Q8Args& a, int64_t b) {
  const int64_t i = (b + kQ8Ahead) * kQ8Block;
  const char* p = reinterpret_cast<const char*>(a.p + i);
  for (int l = 0; l < 512; l += 64) __builtin_prefetch(p + l, 1, 3);
  constexpr int gbytes = G == kF32 ? 512 : 256;
  const char* g = static_cast<const char*>(a.grad) + i * (gbytes / kQ8Block);
  for (int l = 0; l < gbytes; l += 64) __builtin_prefetch(g + l, 0, 3);
  if constexpr (O != kOutNone) {
    const char* o = static_cast<const char*>(a.out) + i * 2;
    for (int l = 0; l < 256; l += 64) __builtin_prefetch(o + l, 1, 3);
  }
  for (int l = 0; l < 128; l += 64) {
    __builtin_prefetch(a.mq + i + l, 1, 3);
    __builtin_prefetch(a.vq + i + l, 1, 3);
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
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t base = b * kQ8Block;
    if (kQ8Ahead > 0) q8_prefetch<G, O>(a, b);
    const __m512 am = _mm512_set1_ps(a.ma[b]), av = _mm512_set1_ps(a.va[b]);
    __m512 mmax = _mm512_setzero_ps(), vmax = _mm512_setzero_ps();
    __m512 msum = _mm512_setzero_ps(), vsum = _mm512_setzero_ps();
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
      // max of |.| (exact in any order): vrangeps imm 0xB = the larger magnitude, sign cleared
      // (one op for and + max; it skips a NaN operand, as max_ps). The sums only flag a NaN:
      // a NaN moment makes its lane's sum NaN (so can inf + -inf: the scan below tells).
      mmax = _mm512_range_ps(mmax, mj, 0xB);
      vmax = _mm512_range_ps(vmax, vj, 0xB);
      msum = _mm512_add_ps(msum, mj);
      vsum = _mm512_add_ps(vsum, vj);
    }
    float mm = _mm512_reduce_max_ps(mmax), vm = _mm512_reduce_max_ps(vmax);
    bool nan_m = false, nan_v = false;  // rare: a NaN moment (torch's amax propagates it)
    if (_mm512_cmp_ps_mask(msum, msum, _CMP_UNORD_Q) && q8_has_nan(m)) {
      nan_m = true;
      mm = q8_nan_absmax(m);
    }
    if (_mm512_cmp_ps_mask(vsum, vsum, _CMP_UNORD_Q) && q8_has_nan(v)) {
      nan_v = true;
      vm = q8_nan_absmax(v);
    }
    a.ma[b] = mm;
    a.va[b] = vm;
    q8_quantize_blocks(m, mm > 0.f ? mm : 1.f, nan_m, v, vm > 0.f ? vm : 1.f, nan_v, a, base);
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
