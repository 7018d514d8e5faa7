// zerokern CPU block quantization (ZeRO++'s qwZ / qgZ payloads): one fused pass per block of
// zerokern/kernels/blockquant.py's contract, bitwise the reference on finite input:
//   scale = absmax / Q (fp32, IEEE division), code = clamp(rne(x / scale), -Q, Q), scale 0 for
//   an all-zero block (codes 0); x' = code * scale in fp32, then RNE to the out dtype.
// A block holding inf or NaN gets a non-finite scale (NaN wins, as torch's amax), so every
// element of it dequantizes to inf or NaN; its codes are 0 there (the reference's are
// whatever the float -> int8 cast gives: unspecified, the scale carries the non-finite).
// Two paths, the same bits:
// - AVX-512 (when the dispatcher's ISA is avx512: adam_cpu.cpp's current_isa(), so force_isa
//   switches it too): blocks in groups of 16, whose 16 absmaxes are one vector (integer maxima
//   of |x|'s bits, one transposing reduction), so the scales and reciprocals are one vdivps
//   each; the codes from a product by the reciprocal with the IEEE division only near a
//   rounding boundary ([Note: codes without a division per element]), converted to integers
//   rounding to nearest even, narrowed by vpackssdw / vpacksswb (int4: nibble pairs joined on
//   the bytes); the next group's absmaxes are taken while this group's codes are computed
//   ([Note: the quantizer's instruction budget]). A block whose scale is non-finite or 0 gets
//   codes 0. Dequantize: vpmovsxbd, vcvtdq2ps, one vmulps (int4: vpermps from the block's 16
//   values code · s), the out dtype's RNE conversion (kernels_avx512.cpp's).
//   Compiled without -march: the target attribute confines AVX-512 to these bodies.
// - portable C++ the compiler vectorises (the scalar ISA, and CPUs without AVX-512): blocks
//   <= 128 elements staged in a stack array so the absmax, the division and the codes are
//   separate loops.
// dequantize_add (qgZ's decode-and-sum, comm/quantized.py) is dequantize to fp32 followed by
// acc += that, one rounding each (the op builds with -ffp-contract=off: no FMA), so it is
// bitwise `acc + dequantize(codes, scale)`.
// Speed against a copy of the same bytes: blockquant.py [Note: the CPU codec].
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_kernels.h"

namespace zk_cpu {
namespace {

constexpr int64_t kBlocksPerTask = 64;  // 64 x 128 elements per work item

template <int T>
inline float load_x(const void* x, int64_t i) {
  if (T == kF32) return static_cast<const float*>(x)[i];
  const uint16_t h = static_cast<const uint16_t*>(x)[i];
  return T == kF16 ? f16_to_f32(h) : bf16_to_f32(h);
}

// Round half to even by the 1.5·2^23 trick: exact for |v| < 2^22 (here |v| <= Q + 1), and
// unlike nearbyint it vectorises without -ffast-math. NaN (a non-finite block) stays NaN and
// its clamp below is then unspecified, as the header says.
inline float rne_small(float v) {
  const float magic = 12582912.f;
  return (v + magic) - magic;
}

template <int T, int BITS>
void quant_range(const void* x, void* codes, float* scale, int64_t block, int64_t b0,
                 int64_t b1) {
  constexpr float q = BITS == 8 ? 127.f : 7.f;
  float v[128];
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t o = b * block;
    float amax = 0.f;
    int nan = 0;
    for (int64_t k = 0; k < block; ++k) {
      v[k] = load_x<T>(x, o + k);
      const float a = std::fabs(v[k]);
      nan |= a != a;
      amax = a > amax ? a : amax;
    }
    const float s = nan ? std::nanf("") : amax / q;
    scale[b] = s;
    const float safe = s > 0.f ? s : 1.f;
    for (int64_t k = 0; k < block; ++k) {
      float c = rne_small(v[k] / safe);
      c = c < -q ? -q : c;
      v[k] = c > q ? q : c;
    }
    if (BITS == 8) {
      int8_t* c = static_cast<int8_t*>(codes) + o;
      for (int64_t k = 0; k < block; ++k) c[k] = static_cast<int8_t>(static_cast<int>(v[k]));
    } else {
      uint8_t* c = static_cast<uint8_t*>(codes) + o / 2;
      for (int64_t k = 0; k < block / 2; ++k) {
        const int lo = static_cast<int>(v[2 * k]) & 0xF, hi = static_cast<int>(v[2 * k + 1]) & 0xF;
        c[k] = static_cast<uint8_t>(lo | (hi << 4));
      }
    }
  }
}

// O == kAcc: out is fp32 and the values are added to it (dequantize_add).
constexpr int kAcc = 3;

template <int BITS, int O>
void dequant_range(const void* codes, const float* scale, void* out, int64_t block, int64_t b0,
                   int64_t b1) {
  float v[128];
  for (int64_t b = b0; b < b1; ++b) {
    const float s = scale[b];
    const int64_t o = b * block;
    if (BITS == 8) {
      const int8_t* c = static_cast<const int8_t*>(codes) + o;
      for (int64_t k = 0; k < block; ++k) v[k] = float(c[k]) * s;
    } else {
      const uint8_t* c = static_cast<const uint8_t*>(codes) + o / 2;
      for (int64_t k = 0; k < block / 2; ++k) {
        // sign-extend each nibble: (n ^ 8) - 8
        v[2 * k] = float(((c[k] & 0xF) ^ 8) - 8) * s;
        v[2 * k + 1] = float(((c[k] >> 4) ^ 8) - 8) * s;
      }
    }
    if (O == kF32) {
      float* d = static_cast<float*>(out) + o;
      for (int64_t k = 0; k < block; ++k) d[k] = v[k];
    } else if (O == kAcc) {
      float* d = static_cast<float*>(out) + o;
      for (int64_t k = 0; k < block; ++k) d[k] = d[k] + v[k];
    } else {
      uint16_t* d = static_cast<uint16_t*>(out) + o;
      for (int64_t k = 0; k < block; ++k) d[k] = O == kBF16 ? f32_to_bf16(v[k]) : f32_to_f16(v[k]);
    }
  }
}


// ---- AVX-512 ------------------------------------------------------------------------------------
#define ZK_BQ_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c")))
#define ZK_BQ_INLINE ZK_BQ_AVX512 __attribute__((always_inline)) inline

template <int T>
ZK_BQ_INLINE __m512 bq_load16(const void* x, int64_t i) {
  if constexpr (T == kF32) return _mm512_loadu_ps(static_cast<const float*>(x) + i);
  else {
    __m256i h = _mm256_loadu_si256((const __m256i*)(static_cast<const uint16_t*>(x) + i));
    if constexpr (T == kF16) return _mm512_cvtph_ps(h);  // exact, as f16_to_f32
    else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// fp32 -> bf16 bits, RNE with integer ops, NaN -> 0xFFFF (f32_to_bf16, kernels_avx512.cpp's).
ZK_BQ_INLINE __m256i bq_to_bf16(__m512 x) {
  __m512i b = _mm512_castps_si512(x);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)),
                                                 lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0xFFFF));
  return _mm512_cvtepi32_epi16(r);
}

// [Note: codes without a division per element] y = x * r with r = fl(q / absmax) (relative
// error <= 2^-24 against 1/s, s = fl(absmax / q) being within 2^-24 of absmax / q too) and the
// product rounded once more: |y - x/s| <= 128 · 3 · 2^-24 < 2^-15 for |x / s| <= q + 1 < 128,
// and fl(x / s) is within 2^-17 of x / s. So where y is farther than 2^-13 from every
// half-integer k + 1/2 (the only places where rounding to an integer changes its result),
// rne(fl(x / s)) = rne(y); the test is |y - rne(y)| > 1/2 - 2^-13, y - rne(y) being one
// vreduceps (exact). Where a lane of 4 vectors (2 for a block of 32) is nearer (about 1 in 64
// for spread-out values; every exact tie), those vectors take the IEEE division; so does a
// block whose scale is below 2^-120 (q / absmax could overflow). s itself is the IEEE
// division. No clamp: |x| <= absmax makes |x / s| < q + 2^-16, so rne(x / s) is within
// [-q, q] already (and so is rne(y)).
//
// [Note: the quantizer's instruction budget] 512-bit ops issue on 2 ports only, so the
// quantizer counts vector uops per 64 elements (a copy of the same bytes: ~6 loads and stores):
// - Scales 16 blocks at a time: a block's absmax is a tree of integer maxima of |x|'s bits
//   (finite floats order as their bits; a NaN's bits exceed inf's, so "NaN in the block" is one
//   compare of the result); one transposing reduction (shuffles of halves, quarters, pairs,
//   ~3 uops a block instead of a horizontal max each) turns the 16 blocks' vectors into one
//   vector of absmaxes, and the scales and reciprocals are one vdivps each for the 16. bf16
//   input is reduced as 16-bit integers, 32 elements per uop, without widening.
// - Codes: per 16 elements mul, vreduceps, convert; per 4 vectors 3 vrangeps (the largest
//   |y - rne(y)|), one compare and one branch. Narrowing: vpackssdw / vpacksswb over 4 vectors
//   and one vpermd putting the 128-bit lanes' pieces in order (vpmovsdb would be 2 uops a
//   vector); int4 joins nibble pairs on the bytes (a 16-bit shift, a vpternlogd, vpmovwb).
//   bf16 input is widened by vpunpck{l,h}wd with zero (1 uop per 16 elements, the elements
//   permuted within 128-bit lanes), which vpackssdw undoes. The tie test is a third of these
//   uops (measured: without it, bf16 -> int4 at 2^20 ran 1.45x faster).
// - Memory: the next group's absmax loads are issued between this group's blocks of codes
//   (whose loads then hit L1), and the group after that is prefetched, so the loads of one
//   overlap the arithmetic of the other instead of a burst of loads, then a burst of work.
constexpr int64_t kGroup = 16;  // blocks whose scales are one vector

// The absmax bits of 16 vectors (one per block), lane j of the result = max over vector j.
// W16: the vectors hold |bf16| bits as 32 16-bit lanes, reduced as such; the halves of each
// 32-bit lane (one block's) are folded once at the end, into fp32 bit positions.
template <bool W16>
ZK_BQ_INLINE __m512i bq_max(__m512i a, __m512i b) {
  return W16 ? _mm512_max_epu16(a, b) : _mm512_max_epu32(a, b);
}
template <bool W16>
ZK_BQ_INLINE __m512i bq_transpose_max16(__m512i* m) {
  for (int j = 0; j < 8; ++j)  // halves: 256-bit half h of result j = block 2j + h
    m[j] = bq_max<W16>(_mm512_shuffle_i64x2(m[2 * j], m[2 * j + 1], 0x44),
                       _mm512_shuffle_i64x2(m[2 * j], m[2 * j + 1], 0xEE));
  for (int j = 0; j < 4; ++j)  // quarters: 128-bit lane c of result j = block 4j + c
    m[j] = bq_max<W16>(_mm512_shuffle_i64x2(m[2 * j], m[2 * j + 1], 0x88),
                       _mm512_shuffle_i64x2(m[2 * j], m[2 * j + 1], 0xDD));
  for (int j = 0; j < 2; ++j)  // pairs: lane c holds blocks 8j + c (2 lanes), 8j + 4 + c (2)
    m[j] = bq_max<W16>(_mm512_unpacklo_epi64(m[2 * j], m[2 * j + 1]),
                       _mm512_unpackhi_epi64(m[2 * j], m[2 * j + 1]));
  const __m512 a = _mm512_castsi512_ps(m[0]), b = _mm512_castsi512_ps(m[1]);
  __m512i t = bq_max<W16>(_mm512_castps_si512(_mm512_shuffle_ps(a, b, 0x88)),
                          _mm512_castps_si512(_mm512_shuffle_ps(a, b, 0xDD)));
  if constexpr (W16)
    t = _mm512_max_epu32(_mm512_slli_epi32(t, 16),
                         _mm512_and_si512(t, _mm512_set1_epi32(0xFFFF0000)));
  // lane 4c + k holds block c + 4k
  return _mm512_permutexvar_epi32(
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), t);
}

// |x|'s bits, reduced over a block to one vector of 16 lanes (any lane order; bf16: 32).
template <int T, int V>
ZK_BQ_INLINE __m512i bq_block_absmax(const void* x, int64_t o) {
  if constexpr (T == kBF16) {  // 16-bit integers, then the two halves of each lane
    const __m512i abs = _mm512_set1_epi32(0x7FFF7FFF);
    __m512i m[V / 2];
    for (int k = 0; k < V / 2; ++k)
      m[k] = _mm512_and_si512(
          _mm512_loadu_si512(static_cast<const uint16_t*>(x) + o + 32 * k), abs);
    for (int w = V / 4; w >= 1; w /= 2)
      for (int k = 0; k < w; ++k) m[k] = _mm512_max_epu16(m[k], m[k + w]);
    return m[0];  // 16-bit lanes: bq_transpose_max16<true> folds them
  } else {
    const __m512i abs = _mm512_set1_epi32(0x7FFFFFFF);
    __m512i m[V];
    for (int k = 0; k < V; ++k)
      m[k] = _mm512_and_si512(_mm512_castps_si512(bq_load16<T>(x, o + 16 * k)), abs);
    for (int w = V / 2; w >= 1; w /= 2)  // a tree, not a chain
      for (int k = 0; k < w; ++k) m[k] = _mm512_max_epu32(m[k], m[k + w]);
    return m[0];
  }
}

// The codes rne(x / s) of N vectors (N = 2 or 4) by the reciprocal r, or by the division where
// a lane of y = x·r is near a half-integer (any lane of the N: one branch per N vectors; the
// largest |y - rne(y)| of them by vrangeps, max of |.|), or by the division everywhere (DIV: a
// scale below 2^-120).
template <int N, bool DIV>
ZK_BQ_INLINE void bq_codes(const __m512* v, __m512i* c, __m512 rv, __m512 sv) {
  constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  bool divide = DIV;
  if constexpr (!DIV) {
    __m512 y[N], d[N];
    for (int k = 0; k < N; ++k) {
      y[k] = _mm512_mul_ps(v[k], rv);
      d[k] = _mm512_reduce_ps(y[k], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    __m512 far = _mm512_range_ps(d[0], d[1], 0x0B);  // max |d|, sign cleared
    if constexpr (N == 4) far = _mm512_range_ps(far, _mm512_range_ps(d[2], d[3], 0x0B), 0x0B);
    divide = _mm512_cmp_ps_mask(far, _mm512_set1_ps(0.5f - 0x1p-13f), _CMP_GT_OQ) != 0;

    if (!divide)
      for (int k = 0; k < N; ++k) c[k] = _mm512_cvt_roundps_epi32(y[k], kRne);
  }
  if (divide)
    for (int k = 0; k < N; ++k) c[k] = _mm512_cvt_roundps_epi32(_mm512_div_ps(v[k], sv), kRne);
}

// 64 int8 codes in order (bytes of a zmm) -> 32 bytes of nibble pairs, element 2i low:
// byte 2i of (words >> 4) has byte 2i+1's low nibble on top; vpternlogd picks the nibbles.
ZK_BQ_INLINE __m256i bq_nibbles64(__m512i c) {
  return _mm512_cvtepi16_epi8(_mm512_ternarylogic_epi32(
      _mm512_set1_epi16(0x0F), c, _mm512_srli_epi16(c, 4), 0xCA));  // 0xCA: a ? b : c
}
ZK_BQ_INLINE __m128i bq_nibbles32(__m256i c) {
  return _mm256_cvtepi16_epi8(_mm256_ternarylogic_epi32(
      _mm256_set1_epi16(0x0F), c, _mm256_srli_epi16(c, 4), 0xCA));
}

template <int BITS>
ZK_BQ_INLINE void bq_store64(void* codes, int64_t i, __m512i b) {  // 64 codes in order
  if constexpr (BITS == 8) _mm512_storeu_si512(static_cast<int8_t*>(codes) + i, b);
  else _mm256_storeu_si256((__m256i*)(static_cast<uint8_t*>(codes) + i / 2), bq_nibbles64(b));
}
template <int BITS>
ZK_BQ_INLINE void bq_store32(void* codes, int64_t i, __m256i b) {  // 32 codes in order
  if constexpr (BITS == 8) _mm256_storeu_si256((__m256i*)(static_cast<int8_t*>(codes) + i), b);
  else _mm_storeu_si128((__m128i*)(static_cast<uint8_t*>(codes) + i / 2), bq_nibbles32(b));
}

// The codes of one block (scale s, reciprocal r > 0, or DIV), 64 elements at a time (32 for
// a block of 32).
template <int T, int BITS, int V, bool DIV>
ZK_BQ_INLINE void bq_block_codes(const void* x, void* codes, int64_t o, __m512 rv, __m512 sv) {
  constexpr int N = V >= 4 ? 4 : 2;  // vectors of 16 per step
  for (int k = 0; k < V; k += N) {
    const int64_t i = o + 16 * k;
    __m512 v[N];
    __m512i c[N];
    if constexpr (T == kBF16) {
      // vpunpck{l,h}wd with zero: per 128-bit lane, elements 0-3 and 4-7 of its 8
      const __m512i z = _mm512_setzero_si512();
      for (int u = 0; u < N / 2; ++u) {
        const __m512i h = _mm512_loadu_si512(static_cast<const uint16_t*>(x) + i + 32 * u);
        v[2 * u] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, h));
        v[2 * u + 1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, h));
      }
      bq_codes<N, DIV>(v, c, rv, sv);
      // vpackssdw undoes the unpacking: 32 words in element order per load
      const __m512i w0 = _mm512_packs_epi32(c[0], c[1]);
      if constexpr (N == 4) {
        // vpacksswb: qword 2c + u of lane c = elements 32u + 8c..: qwords 0 2 4 6 1 3 5 7
        bq_store64<BITS>(codes, i, _mm512_permutexvar_epi64(
            _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7),
            _mm512_packs_epi16(w0, _mm512_packs_epi32(c[2], c[3]))));
      } else {
        bq_store32<BITS>(codes, i, _mm512_cvtsepi16_epi8(w0));
      }
    } else {
      for (int u = 0; u < N; ++u) v[u] = bq_load16<T>(x, i + 16 * u);
      bq_codes<N, DIV>(v, c, rv, sv);
      // vpackssdw + vpacksswb leave dword 4c + u of lane c = elements 16u + 4c..: vpermd
      const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
      const __m512i w0 = _mm512_packs_epi32(c[0], c[1]);
      if constexpr (N == 4) {
        bq_store64<BITS>(codes, i, _mm512_permutexvar_epi32(
            idx, _mm512_packs_epi16(w0, _mm512_packs_epi32(c[2], c[3]))));
      } else {
        bq_store32<BITS>(codes, i, _mm512_castsi512_si256(
            _mm512_permutexvar_epi32(idx, _mm512_packs_epi16(w0, w0))));
      }
    }
  }
}

template <int T, int BITS, int V>  // V = block / 16
ZK_BQ_AVX512 void quant_avx512(const void* x, void* codes, float* scale, int64_t b0, int64_t b1) {
  constexpr float q = BITS == 8 ? 127.f : 7.f;
  constexpr int64_t block = 16 * V;
  constexpr int64_t kInBytes = T == kF32 ? 4 : 2;
  alignas(64) float recip[kGroup];
  __m512i m[kGroup];  // the absmax vectors of the group to come
  for (int j = 0; j < kGroup; ++j)
    m[j] = b0 + j < b1 ? bq_block_absmax<T, V>(x, (b0 + j) * block) : _mm512_setzero_si512();
  for (int64_t g0 = b0; g0 < b1; g0 += kGroup) {
    const int nb = int(std::min<int64_t>(kGroup, b1 - g0));
    const __m512i abits = bq_transpose_max16<T == kBF16>(m);  // the group's scales and reciprocals
    const __m512 amax = _mm512_castsi512_ps(abits);
    const __m512 s = _mm512_mask_mov_ps(
        _mm512_div_ps(amax, _mm512_set1_ps(q)),
        _mm512_cmpgt_epu32_mask(abits, _mm512_set1_epi32(0x7F800000)),
        _mm512_set1_ps(std::nanf("")));
    _mm512_mask_storeu_ps(scale + g0, __mmask16((1u << nb) - 1), s);
    // 0: codes 0 (an all-zero or non-finite block); -1: divide; else the reciprocal
    const __mmask16 ok = _mm512_cmp_ps_mask(s, _mm512_setzero_ps(), _CMP_GT_OQ) &
                         _mm512_cmp_ps_mask(s, _mm512_set1_ps(INFINITY), _CMP_LT_OQ);
    const __mmask16 big = _mm512_cmp_ps_mask(s, _mm512_set1_ps(0x1p-120f), _CMP_GE_OQ);
    _mm512_store_ps(recip, _mm512_maskz_mov_ps(
        ok, _mm512_mask_mov_ps(_mm512_set1_ps(-1.f), big,
                               _mm512_div_ps(_mm512_set1_ps(q), amax))));
    for (int j = 0; j < kGroup; ++j) {
      // the next group's block j first: its loads overlap this group's codes ([Note: the
      // quantizer's instruction budget])
      const int64_t next = g0 + kGroup + j;
      if (next + kGroup < b1) {  // and the one after that on its way to L1
        const char* p = static_cast<const char*>(x) + (next + kGroup) * block * kInBytes;
        for (int64_t l = 0; l < block * kInBytes; l += 64) _mm_prefetch(p + l, _MM_HINT_T0);
      }
      m[j] = next < b1 ? bq_block_absmax<T, V>(x, next * block) : _mm512_setzero_si512();
      if (j >= nb) continue;
      const int64_t o = (g0 + j) * block;
      const float r = recip[j];
      if (r == 0.f) {
        if (BITS == 8) std::memset(static_cast<int8_t*>(codes) + o, 0, block);
        else std::memset(static_cast<uint8_t*>(codes) + o / 2, 0, block / 2);
        continue;
      }
      const __m512 sv = _mm512_set1_ps(scale[g0 + j]), rv = _mm512_set1_ps(r);
      if (r > 0.f) bq_block_codes<T, BITS, V, false>(x, codes, o, rv, sv);
      else bq_block_codes<T, BITS, V, true>(x, codes, o, rv, sv);
    }
  }
}

// 32 finite fp32 -> bf16 bits in order, RNE as bq_to_bf16 (b + 0x7FFF + lsb, the top half):
// the lsb by vptestmd and a masked add, the halves narrowed by vpackusdw + vpermq (a NaN would
// need bq_to_bf16's fix-up: a block whose scale is not finite takes that path).
ZK_BQ_INLINE __m512i bq_to_bf16x2(__m512 a, __m512 b) {
  const __m512i lsb = _mm512_set1_epi32(0x10000), one = _mm512_set1_epi32(1);
  const __m512i half = _mm512_set1_epi32(0x7FFF);
  __m512i r[2] = {_mm512_castps_si512(a), _mm512_castps_si512(b)};
  for (__m512i& x : r) {
    const __m512i t = _mm512_add_epi32(x, half);
    x = _mm512_srli_epi32(_mm512_mask_add_epi32(t, _mm512_test_epi32_mask(x, lsb), t, one), 16);
  }
  return _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7),
                                  _mm512_packus_epi32(r[0], r[1]));
}

// Write 32 dequantized values f0, f1 to out at element i (O: kF32, kAcc, kF16, kBF16;
// FINITE: the scale is finite, so are the values).
template <int O, bool FINITE>
ZK_BQ_INLINE void bq_emit32(void* out, int64_t i, __m512 f0, __m512 f1) {
  if constexpr (O == kF32) {
    _mm512_storeu_ps(static_cast<float*>(out) + i, f0);
    _mm512_storeu_ps(static_cast<float*>(out) + i + 16, f1);
  } else if constexpr (O == kAcc) {
    float* d = static_cast<float*>(out) + i;
    _mm512_storeu_ps(d, _mm512_add_ps(_mm512_loadu_ps(d), f0));
    _mm512_storeu_ps(d + 16, _mm512_add_ps(_mm512_loadu_ps(d + 16), f1));
  } else if constexpr (O == kBF16 && FINITE) {
    _mm512_storeu_si512(static_cast<uint16_t*>(out) + i, bq_to_bf16x2(f0, f1));
  } else {
    constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    uint16_t* d = static_cast<uint16_t*>(out) + i;
    _mm256_storeu_si256((__m256i*)d, O == kBF16 ? bq_to_bf16(f0) : _mm512_cvtps_ph(f0, kRne));
    _mm256_storeu_si256((__m256i*)(d + 16),
                        O == kBF16 ? bq_to_bf16(f1) : _mm512_cvtps_ph(f1, kRne));
  }
}

template <int BITS, int O, int V, bool FINITE>
ZK_BQ_INLINE void bq_dequant_block(const void* codes, __m512 sv, void* out, int64_t o) {
  if constexpr (BITS == 8) {
    for (int k = 0; k < V; k += 2) {
      const int64_t i = o + 16 * k;
      const __m256i c = _mm256_loadu_si256((const __m256i*)(static_cast<const int8_t*>(codes) + i));
      const __m512 f0 = _mm512_mul_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(c))), sv);
      const __m512 f1 = _mm512_mul_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(c, 1))), sv);
      bq_emit32<O, FINITE>(out, i, f0, f1);
    }
  } else {
    // int4: the block's 16 possible values code · s (the same product, rounded once), looked
    // up by vpermps, which reads only the low 4 bits of each index lane: zero-extended bytes
    // whose low nibble is the code (the bytes interleaved with themselves shifted right by 4)
    const __m512 table = _mm512_mul_ps(
        _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1), sv);
    for (int k = 0; k < V; k += 2) {
      const int64_t i = o + 16 * k;
      const __m128i c = _mm_loadu_si128(
          (const __m128i*)(static_cast<const uint8_t*>(codes) + i / 2));
      const __m128i hi = _mm_srli_epi16(c, 4);  // byte j: byte j's high nibble at the bottom
      bq_emit32<O, FINITE>(
          out, i, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(c, hi)), table),
          _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(c, hi)), table));
    }
  }
}

template <int BITS, int O, int V>
ZK_BQ_AVX512 void dequant_avx512(const void* codes, const float* scale, void* out, int64_t b0,
                                 int64_t b1) {
  constexpr int64_t block = 16 * V;
  for (int64_t b = b0; b < b1; ++b) {
    const __m512 sv = _mm512_set1_ps(scale[b]);
    if (std::isfinite(scale[b])) bq_dequant_block<BITS, O, V, true>(codes, sv, out, b * block);
    else bq_dequant_block<BITS, O, V, false>(codes, sv, out, b * block);
  }
}

template <int T, int BITS>
void quant_avx512_any(const void* x, void* codes, float* scale, int64_t block, int64_t b0,
                      int64_t b1) {
  if (block == 128) quant_avx512<T, BITS, 8>(x, codes, scale, b0, b1);
  else if (block == 64) quant_avx512<T, BITS, 4>(x, codes, scale, b0, b1);
  else quant_avx512<T, BITS, 2>(x, codes, scale, b0, b1);
}

template <int BITS, int O>
void dequant_avx512_any(const void* codes, const float* scale, void* out, int64_t block,
                        int64_t b0, int64_t b1) {
  if (block == 128) dequant_avx512<BITS, O, 8>(codes, scale, out, b0, b1);
  else if (block == 64) dequant_avx512<BITS, O, 4>(codes, scale, out, b0, b1);
  else dequant_avx512<BITS, O, 2>(codes, scale, out, b0, b1);
}

// The quantize and dequantize bodies of the ISA in use (kernel tables, as the Adam kernels').
using QuantFn = void (*)(const void*, void*, float*, int64_t, int64_t, int64_t);
using DequantFn = void (*)(const void*, const float*, void*, int64_t, int64_t, int64_t);

QuantFn quant_fn(int t, int64_t bits) {
  static const QuantFn portable[2][3] = {
      {quant_range<kF32, 8>, quant_range<kF16, 8>, quant_range<kBF16, 8>},
      {quant_range<kF32, 4>, quant_range<kF16, 4>, quant_range<kBF16, 4>}};
  static const QuantFn avx512[2][3] = {
      {quant_avx512_any<kF32, 8>, quant_avx512_any<kF16, 8>, quant_avx512_any<kBF16, 8>},
      {quant_avx512_any<kF32, 4>, quant_avx512_any<kF16, 4>, quant_avx512_any<kBF16, 4>}};
  return (current_isa() == kAvx512 ? avx512 : portable)[bits == 8 ? 0 : 1][t];
}

// o: kF32, kF16, kBF16 or kAcc
DequantFn dequant_fn(int o, int64_t bits) {
  static const DequantFn portable[2][4] = {
      {dequant_range<8, kF32>, dequant_range<8, kF16>, dequant_range<8, kBF16>,
       dequant_range<8, kAcc>},
      {dequant_range<4, kF32>, dequant_range<4, kF16>, dequant_range<4, kBF16>,
       dequant_range<4, kAcc>}};
  static const DequantFn avx512[2][4] = {
      {dequant_avx512_any<8, kF32>, dequant_avx512_any<8, kF16>, dequant_avx512_any<8, kBF16>,
       dequant_avx512_any<8, kAcc>},
      {dequant_avx512_any<4, kF32>, dequant_avx512_any<4, kF16>, dequant_avx512_any<4, kBF16>,
       dequant_avx512_any<4, kAcc>}};
  return (current_isa() == kAvx512 ? avx512 : portable)[bits == 8 ? 0 : 1][o];
}

int kind_of(const at::Tensor& t, const char* name) {
  const auto dt = t.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16,
              name, " must be float32, float16 or bfloat16, got ", dt);
  return dt == at::kFloat ? kF32 : (dt == at::kHalf ? kF16 : kBF16);
}

void check(const at::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.numel() == n, name, " must have ", n, " elements, got ", t.numel());
}

template <typename F>
void over_blocks(int64_t nblocks, F f) {
  at::parallel_for(0, (nblocks + kBlocksPerTask - 1) / kBlocksPerTask, 1,
                   [&](int64_t t0, int64_t t1) {
                     f(t0 * kBlocksPerTask, std::min(nblocks, t1 * kBlocksPerTask));
                   });
}

}  // namespace

void blockquant_quantize(at::Tensor x, at::Tensor codes, at::Tensor scale, int64_t block,
                         int64_t bits) {
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4, got ", bits);
  TORCH_CHECK(block == 32 || block == 64 || block == 128, "block must be 32, 64 or 128");
  const int64_t n = x.numel();
  TORCH_CHECK(n % block == 0, "x must hold a multiple of block elements");
  check(x, "x", n);
  check(codes, "codes", bits == 8 ? n : n / 2);
  check(scale, "scale", n / block);
  TORCH_CHECK(codes.scalar_type() == (bits == 8 ? at::kChar : at::kByte),
              "codes must be int8 (bits 8) or uint8 (bits 4)");
  TORCH_CHECK(scale.scalar_type() == at::kFloat, "scale must be float32");
  const QuantFn f = quant_fn(kind_of(x, "x"), bits);
  const void* xp = x.data_ptr();
  void* cp = codes.data_ptr();
  float* sp = scale.data_ptr<float>();
  over_blocks(n / block, [&](int64_t b0, int64_t b1) { f(xp, cp, sp, block, b0, b1); });
}

namespace {
void dequantize_to(at::Tensor codes, at::Tensor scale, at::Tensor out, int64_t block,
                   int64_t bits, bool add) {
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4, got ", bits);
  TORCH_CHECK(block == 32 || block == 64 || block == 128, "block must be 32, 64 or 128");
  const int64_t n = scale.numel() * block;
  check(scale, "scale", n / block);
  check(codes, "codes", bits == 8 ? n : n / 2);
  check(out, "out", n);
  TORCH_CHECK(scale.scalar_type() == at::kFloat, "scale must be float32");
  const int o = kind_of(out, "out");
  TORCH_CHECK(!add || o == kF32, "acc must be float32");
  const DequantFn f = dequant_fn(add ? kAcc : o, bits);
  const void* cp = codes.data_ptr();
  const float* sp = scale.data_ptr<float>();
  void* op = out.data_ptr();
  over_blocks(n / block, [&](int64_t b0, int64_t b1) { f(cp, sp, op, block, b0, b1); });
}
}  // namespace

void blockquant_dequantize(at::Tensor codes, at::Tensor scale, at::Tensor out, int64_t block,
                           int64_t bits) {
  dequantize_to(codes, scale, out, block, bits, false);
}

void blockquant_dequantize_add(at::Tensor codes, at::Tensor scale, at::Tensor acc,
                               int64_t block, int64_t bits) {
  dequantize_to(codes, scale, acc, block, bits, true);
}

}  // namespace zk_cpu
