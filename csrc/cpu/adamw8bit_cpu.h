// Shared by the 8-bit AdamW CPU kernels (adamw8bit_cpu.cpp: entry, scalar path; adamw8bit_avx2.cpp,
// adamw8bit_avx512.cpp: vector paths): the per-call arguments, the search tables and the scalar
// helpers every path must match bit for bit (zerokern/kernels/adamw8bit.py [Note: the 8-bit step,
// bit for bit]).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"

namespace zk_cpu {

constexpr int64_t kQ8Block = 128;

// [Note: branchless nearest code]
// The nearest code of x is the count of the 255 ascending midpoints strictly below x, ties to the
// lower code; a NaN counts as above every midpoint (code 255), which is what torch.bucketize
// (right=False) gives the reference (std::lower_bound gave 0, a mismatch). The test
// !(mid >= x) is true exactly for mid < x or x NaN. The count is a fixed 8-step search
// (pos += s when the probe mids[pos + s - 1] passes, s = 128, 64, ..., 1): no branch, so no
// ~8 mispredictions per value as with std::lower_bound, and the probes never leave mids[0..254].
// The vector paths run the same 8 steps, reading each probe from the tables below with
// in-register permutes instead of gathers (AVX-512: permutexvar/permutex2var on 16-float
// registers; AVX2: 8-float permutes and a blend tree, with one gather for the last step). Level
// s probes mids[pos + s - 1], where pos is a multiple of 2s, so the index needs pos's high bits
// only. While s >= 16 the search runs on h = pos / 16 with one table per level (no index
// arithmetic): c128 = mids[127], c64[h] = mids[16h + 63], c32[h] = mids[16h + 31],
// t15[h] = mids[16h + 15]; then
//   s = 8:   mids[16j + 7]  at j = pos/16              (t7, 16 values: one AVX-512 register)
//   s = 4:   mids[8j + 3]   at j = pos/8               (t3, 32 values: two)
//   s = 2:   mids[4j + 1]   at j = pos/4               (t1, 64 values: four)
//   s = 1:   mids[2j]       at j = pos/2               (t0, 128 values: eight)
// (AVX2 runs s >= 16 on t15 at j = pos/16 + s/16 - 1.) Entries no search reaches hold +inf.
// Cost, AVX-512 on the dev box's Zen 4, one thread, n = 2^20: 2.8 ns/element for the whole
// step, of which the two searches take ~1.8; the 8 probes as gathers measured slower on AVX2
// (adamw8bit_avx2.cpp), and interleaving the m and v searches gained nothing (throughput-bound).
struct Q8Search {
  float c128;
  alignas(64) float c64[16];
  alignas(64) float c32[16];
  alignas(64) float t15[16];
  alignas(64) float t7[16];
  alignas(64) float t3[32];
  alignas(64) float t1[64];
  alignas(64) float t0[128];
};

inline void q8_fill_search(Q8Search& t, const float* mids) {
  t.c128 = mids[127];
  for (int j = 0; j < 16; ++j) t.c64[j] = 16 * j + 63 < 255 ? mids[16 * j + 63] : INFINITY;
  for (int j = 0; j < 16; ++j) t.c32[j] = 16 * j + 31 < 255 ? mids[16 * j + 31] : INFINITY;
  for (int j = 0; j < 16; ++j) t.t15[j] = j < 15 ? mids[16 * j + 15] : INFINITY;  // [15] unused
  for (int j = 0; j < 16; ++j) t.t7[j] = mids[16 * j + 7];
  for (int j = 0; j < 32; ++j) t.t3[j] = mids[8 * j + 3];
  for (int j = 0; j < 64; ++j) t.t1[j] = mids[4 * j + 1];
  for (int j = 0; j < 128; ++j) t.t0[j] = mids[2 * j];
}

// [Note: bucketed nearest code] (issue 40)
// The AVX-512 path finds the code of x = RN(m / s) (s: the block's absmax) without the 8-step
// search and without the division. The key of a float is its top 16 bits after adding
// kQ8KeyOffset to its bits: sign, exponent and 7 mantissa bits, so a bucket spans 2^16
// consecutive floats of one sign, and 2^16 buckets cover every float (a 256 KiB table per map,
// of which a step touches the few KiB of the binades its values reach). The maps' midpoints are
// sparse enough that every bucket holds at most one, at least kQ8KeyGuard floats from the
// bucket's edges (q8_fill_buckets checks both), so the code of x is base[key] (the count of
// midpoints below the bucket's lowest float) plus [mid[key] < x].
// - The key comes from x' = RN(m * RN(1/s)) instead of x: x' is within 3 floats of x (two
//   roundings and RN(1/s)'s relative error, each <= 2^-24: |x'/x - 1| < 3.0001 * 2^-24, and an
//   ulp is >= 2^-24 of the value), and no midpoint lies within kQ8KeyGuard = 4 floats of a
//   bucket edge, so where x and x' fall in neighbouring buckets both buckets give the same count.
// - [mid < x] is decided on x' when x' is more than kQ8Band floats from mid (x, within 3 floats
//   of x', is then on the same side): within a bucket the floats of x' and mid differ only in
//   the low 16 bits of bits + kQ8KeyOffset, so the test is an integer compare of those bits
//   (reversed for negative floats, whose order runs the other way). When x' is within kQ8Band
//   = 5 floats of the midpoint (at most 1 value in ~6000), the block's codes of that moment are
//   recomputed by the division and the search ([Note: branchless nearest code]).
// - Entry: one 32-bit word per bucket, e = (c << 8) - kQ8Bias + base, where c is the midpoint's
//   low 16 bits in the order the compare wants (positive bucket: low; negative: 0xFFFF - low),
//   or e = kQ8NoMid + base where the bucket holds none. With l the value's low 16 bits in the
//   same order, shifted left by 8, D = l - e = 256 (l' - c) + kQ8Bias - base (l' = l >> 8), so
//   one subtraction gives both answers: mid < x' iff D > kQ8Bias (signed), and x' within
//   kQ8Band floats of mid only if D <= 2 kQ8Bias (unsigned); for kQ8NoMid, D < -2^29 (signed):
//   neither. The code is e's low byte (kQ8Bias is a multiple of 256) plus the first answer: one
//   16-lane gather per 16 values.
// - The fast path takes blocks with s in [2^-64, 2^64] (the reciprocal stays normal) whose new
//   moments are all finite (no NaN: a NaN's code is 255 and the absmax NaN; the division and the
//   search give that).
constexpr int kQ8KeyShift = 16;
constexpr uint32_t kQ8KeyOffset = 1u << (kQ8KeyShift - 2);  // a quarter bucket: see below
// Bucket edges sit a quarter bucket below the binary grid: a third of the top decade's midpoints
// are dyadic (0.1 + 0.9 k / 64 in fp32: 119/128, ...) and would sit on a grid edge; offset, the
// nearest midpoint is 654 floats from an edge (either map).
constexpr int kQ8Keys = 1 << (32 - kQ8KeyShift);
constexpr uint32_t kQ8KeyGuard = 4;
constexpr uint32_t kQ8Band = 5;  // undecided: the floats of x' and mid differ by <= 5
constexpr uint32_t kQ8NoMid = 0x40000000u;
constexpr uint32_t kQ8Bias = (kQ8Band + 1) << 8;
constexpr float kQ8FastMin = 0x1p-64f, kQ8FastMax = 0x1p64f;

struct Q8Buckets {
  bool ok;  // false: the maps break the one-midpoint or the guard condition (vector search only)
  alignas(64) uint32_t entry[kQ8Keys];
};

// The key of x, as the vector path computes it.
inline uint32_t q8_key(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return (b + kQ8KeyOffset) >> kQ8KeyShift;
}

inline float q8_from_bits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// Fills t from the 255 ascending midpoints; t.ok says whether the fast path may use it.
inline void q8_fill_buckets(Q8Buckets& t, const float* mids) {
  t.ok = true;
  for (int i = 0; i + 1 < 255; ++i)
    if (!(mids[i] < mids[i + 1])) t.ok = false;  // the counts below assume ascending midpoints
  auto count_below = [mids](float x) {           // midpoints < x; a NaN above all
    return x != x ? 255 : int(std::lower_bound(mids, mids + 255, x) - mids);
  };
  std::vector<int> at(kQ8Keys, -1);
  for (int i = 0; i < 255; ++i) {
    const float m = mids[i];
    // finite and normal: the 3-float bound on x' holds near it
    if (!std::isfinite(m) || std::fabs(m) < 0x1p-100f) { t.ok = false; continue; }
    const uint32_t k = q8_key(m);
    if (at[k] >= 0) t.ok = false;  // two midpoints in one bucket
    at[k] = i;
    uint32_t b;
    std::memcpy(&b, &m, 4);
    const uint32_t low = (b + kQ8KeyOffset) & 0xFFFFu;  // floats above the bucket's edge
    if (low < kQ8KeyGuard || low > 0xFFFFu - kQ8KeyGuard) t.ok = false;
  }
  for (uint32_t k = 0; k < uint32_t(kQ8Keys); ++k) {
    const bool neg = k >= uint32_t(kQ8Keys / 2);
    const uint32_t mag_key = neg ? k - kQ8Keys / 2 : k;
    // The bucket's lowest float: the smallest magnitude (x >= 0) or the largest (x < 0).
    const int64_t first = (int64_t(mag_key) << kQ8KeyShift) - kQ8KeyOffset;  // may be < 0
    const int64_t last = first + (int64_t(1) << kQ8KeyShift) - 1;
    float lo;
    if (!neg) lo = q8_from_bits(uint32_t(std::max<int64_t>(first, 0)));
    else lo = q8_from_bits(0x80000000u | uint32_t(std::min<int64_t>(last, 0x7FFFFFFF)));
    const int base = count_below(lo);
    uint32_t e = kQ8NoMid;
    if (at[k] >= 0) {
      uint32_t b;
      std::memcpy(&b, &mids[at[k]], 4);
      const uint32_t low = (b + kQ8KeyOffset) & 0xFFFFu;
      e = ((neg ? 0xFFFFu - low : low) << 8) - kQ8Bias;  // modulo 2^32
      if (base > 254) t.ok = false;  // cannot happen: a midpoint lies above
    }
    t.entry[k] = e | uint32_t(base & 0xFF);
  }
}

struct Q8Args {
  float* p;
  uint8_t* mq;
  float* ma;
  uint8_t* vq;
  float* va;
  const void* grad;  // GradType elements
  void* out;         // OutType elements, or nullptr
  float gs, decay, b1, omb1, b2, omb2, step_size, rsqrt_bc2, eps;
  const float* code_s;  // 256 signed codes
  const float* code_u;  // 256 unsigned codes
  const float* mid_s;   // 255 midpoints
  const float* mid_u;
  const Q8Search* search_s;
  const Q8Search* search_u;
  const Q8Buckets* buckets_s;  // [Note: bucketed nearest code]; nullptr: the search only
  const Q8Buckets* buckets_u;
  // Write param_out with non-temporal stores (the AVX-512 path, where out is 32-byte aligned):
  // set from kQ8StreamMin elements (adamw8bit_cpu.cpp).
  bool stream_out;
};

// Updates blocks [b0, b1).
using Q8BlocksFn = void (*)(const Q8Args&, int64_t b0, int64_t b1);
struct Q8Kernels {
  Q8BlocksFn blocks[3][3];  // [GradType][OutType]
};
const Q8Kernels& q8_avx2_kernels();
// bf16_vbmi: the variant that uses AVX512_BF16 and AVX512_VBMI (only where cpu_has_bf16_vbmi()).
const Q8Kernels& q8_avx512_kernels(bool bf16_vbmi);
bool cpu_has_bf16_vbmi();

// The block's absmax as torch's amax gives it: the max of |x|, or, when the block holds a NaN,
// |that NaN| (the first; amax propagates NaN). The vector paths call it only for such a block.
inline bool q8_has_nan(const float* x) {
  for (int64_t j = 0; j < kQ8Block; ++j)
    if (x[j] != x[j]) return true;
  return false;
}

inline float q8_nan_absmax(const float* x) {
  for (int64_t j = 0; j < kQ8Block; ++j)
    if (x[j] != x[j]) return std::fabs(x[j]);
  return 0.f;
}

}  // namespace zk_cpu
