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
// The fast vector paths find the code without the 8-step search and without dividing by the
// block's absmax s. The key of x is its sign and the top bits of |x| (exponent and kQ8KeyBits
// mantissa bits, clamped to [2^-23, 2): a bucket of kQ8Keys per sign; 2^-23 is below either map's
// smallest midpoint). The maps' midpoints are sparse enough that every bucket holds at most one
// (q8_fill_buckets checks it), so the code of x is base[key] (the count of midpoints below the
// bucket's smallest float) plus [mid[key] < x] (mid: +inf where the bucket holds none).
// - The key comes from x' = m * RN(1/s) instead of x = RN(m / s): |x' - x| <= 2 floats apart
//   (two roundings and RN(1/s)'s relative error < 2^-24), and no midpoint lies within
//   kQ8KeyGuard floats of a bucket's edge (checked), so x' and x see the same base and mid.
// - [mid < RN(m / s)] exactly, without the division: RN(m / s) > mid iff m / s > mid + E, with
//   E = (next float above mid - mid) / 2 (a quotient is never exactly halfway between two
//   floats: m = (mid + E) * s would need more significant bits than m has). For s > 0 that is
//   m - mid * s > E * s; t = fma(-mid, s, m) rounds m - mid * s once and E * s is exact (a power
//   of two times s), so t > E * s decides 1, t < E * s decides 0 (RN is monotone), and only
//   t == E * s would be undecided. It cannot happen: mid * s and m are multiples of ulp(E * s)
//   (s's mantissa S >= 2^23, m ~ mid * s), so m - mid * s = E * s + k ulp(E * s) with k != 0
//   (no quotient is halfway), exactly representable; the vector would take the division and
//   the search if it did (a check, no cost). The closest case (k = +-1) is in the tie tests.
// - The block takes the division and the search when s is outside [2^-64, 2^64] (E * s and the
//   reciprocal stay normal inside), and a NaN m's code is 255 as before.
// Entry: one 64-bit word per bucket, the midpoint's bits (low half) and E's bits (a power of
// two: zero mantissa) with base in the low 8 bits (high half): two 8-lane qword gathers per 16
// values (one 16-lane gather per half measured 7% slower for the whole step: a gather costs
// per element). Cost on the Intel Xeon (AVX-512) box, one
// thread, n = 2^16 in cache: see adamw8bit_avx512.cpp.
constexpr int kQ8KeyBits = 7;
constexpr int kQ8KeyShift = 23 - kQ8KeyBits;
// Bucket edges sit a quarter bucket below the binary grid: a third of the top decade's midpoints
// are dyadic (0.1 + 0.9 k / 64 in fp32: 119/128, ...) and would sit on a grid edge; offset, the
// nearest midpoint is 654 floats from an edge (either map).
constexpr uint32_t kQ8KeyOffset = 1u << (kQ8KeyShift - 2);
constexpr int kQ8KeyExp0 = 127 - 23;  // biased exponent of the first bucket's 2^-23
constexpr int kQ8Keys = 24 << kQ8KeyBits;  // [2^-23, 2) per sign
constexpr int kQ8KeyGuard = 4;
constexpr float kQ8FastMin = 0x1p-64f, kQ8FastMax = 0x1p64f;

struct Q8Buckets {
  bool ok;  // false: the maps break the one-midpoint or the guard condition (vector search only)
  // [0, K): x >= +0; [K, 2K): sign bit set. Low 32 bits: mid's; high: E's | base.
  alignas(64) uint64_t entry[2 * kQ8Keys];
};

// The key of x, as the vector paths compute it.
inline int q8_key(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  const int32_t k = int32_t(((b & 0x7FFFFFFFu) + kQ8KeyOffset) >> kQ8KeyShift) -
                    (kQ8KeyExp0 << kQ8KeyBits);
  return std::min(std::max(k, 0), kQ8Keys - 1) + ((b >> 31) ? kQ8Keys : 0);
}

inline float q8_from_bits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// Fills t from the 255 ascending midpoints; t.ok says whether the fast path may use it.
inline void q8_fill_buckets(Q8Buckets& t, const float* mids) {
  auto count_below = [mids](float x) {
    int c = 0;
    for (int i = 0; i < 255; ++i) c += mids[i] < x;
    return c;
  };
  t.ok = true;
  std::vector<float> mid(2 * kQ8Keys, INFINITY);
  for (int i = 0; i < 255; ++i) {
    const float m = mids[i];
    if (!std::isfinite(m)) { t.ok = false; continue; }
    const int k = q8_key(m);
    if (mid[k] != INFINITY) t.ok = false;  // two midpoints in one bucket
    mid[k] = m;
    uint32_t b;
    std::memcpy(&b, &m, 4);
    // floats above the bucket's edge
    const uint32_t low = ((b & 0x7FFFFFFFu) + kQ8KeyOffset) & ((1u << kQ8KeyShift) - 1);
    if (low < kQ8KeyGuard || low > (1u << kQ8KeyShift) - 1 - kQ8KeyGuard) t.ok = false;
    if (std::fabs(m) < 0x1p-23f) t.ok = false;  // in the clamped bucket 0
  }
  for (int k = 0; k < 2 * kQ8Keys; ++k) {
    const bool neg = k >= kQ8Keys;
    const int j = neg ? k - kQ8Keys : k;
    const uint32_t edge = (uint32_t(j + (kQ8KeyExp0 << kQ8KeyBits)) << kQ8KeyShift) - kQ8KeyOffset;
    const uint32_t next = edge + (1u << kQ8KeyShift);
    // The bucket's smallest float: +0 / its edge (x >= 0); -inf / just above -next (x < 0).
    float lo;
    if (!neg) lo = j == 0 ? 0.f : q8_from_bits(edge);
    else lo = j == kQ8Keys - 1 ? -INFINITY : q8_from_bits(0x80000000u | (next - 1));
    const float m = mid[k];
    const float e = std::isfinite(m) ? (std::nextafter(m, INFINITY) - m) / 2 : 0.f;
    uint32_t eb;
    std::memcpy(&eb, &e, 4);
    if (eb & 0xFF) t.ok = false;  // not a power of two (cannot happen for finite m)
    uint32_t mb;
    std::memcpy(&mb, &m, 4);
    t.entry[k] = uint64_t(eb | uint32_t(count_below(lo))) << 32 | mb;
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
};

// Updates blocks [b0, b1).
using Q8BlocksFn = void (*)(const Q8Args&, int64_t b0, int64_t b1);
struct Q8Kernels {
  Q8BlocksFn blocks[3][3];  // [GradType][OutType]
};
const Q8Kernels& q8_avx2_kernels();
const Q8Kernels& q8_avx512_kernels();

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
