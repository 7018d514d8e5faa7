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
// search and without the division: one table entry per value, read with a gather, and three
// vector operations after it.
// - x' = RN(m * RN(1/s)) instead of x: x' is within 3 floats of x (two roundings and RN(1/s)'s
//   relative error, each <= 2^-24: |x'/x - 1| < 3.0001 * 2^-24, and an ulp is >= 2^-24 of the
//   value; s in [2^-64, 2^64] keeps RN(1/s) normal), and |x'| <= 1 + 2^-22.
// - z: an integer that counts floats in value order. The unsigned map (v >= +0): z = the bits of
//   x'. The signed map: z = |bits| as an int32 (vpabsd): a positive float's bits, or 2^31 minus a
//   negative float's magnitude bits (-0: 2^31), which rises with the value too; with |x'| <= 2
//   the two ranges [0, 2^30] and (2^30, 2^31] do not meet. So x is within 3 of x' in z.
// - The table entry of key k = z >> 16 (a bucket of 2^16 floats) describes the window of z in
//   [k 2^16 - G, k 2^16 + 2^16 - 1 + G] (G = kQ8Guard >= 3, so it holds x): base, the count of
//   midpoints below the window, and the one midpoint in it if any, at z = Z (q8_fill_buckets
//   refuses maps with two midpoints in a window: the maps' midpoints are sparse enough).
//   The code of x is then base + [Z < z(x)].
// - Entry e = ((base + 1) << 24) + kQ8Delta - 1 - (Z - k 2^16) - (k << 16), modulo 2^32; so
//   d = z + e = ((base + 1) << 24) + t with t = z - Z - 1 + kQ8Delta, |t| < 2^24: the top byte of
//   d is base + [t >= 0] = base + [z - Z >= 1 - kQ8Delta], the code wherever x' is not close to
//   the midpoint. Close means t in [0, 16): the low 24 bits of d below 16, one vptestmd on bits
//   4..23 (z - Z in [1 - kQ8Delta, 16 - kQ8Delta] = [-7, 8]); such a block is redone by the
//   division and the search ([Note: branchless nearest code]). Elsewhere the answer holds for x:
//   t >= 16 means z(x) - Z >= 16 - kQ8Delta - 3 >= 1, t < 0 means z(x) - Z <= 3 - kQ8Delta <= 0
//   (so 3 <= kQ8Delta <= 13). A window without a midpoint: e = (base << 24) + 2^23 - (k << 16),
//   so t = 2^23 + z - k 2^16 is never close and the top byte is base.
// - Per value: the product, (vpabsd), the key's shift, the gather, one add, one vpermb for the
//   code bytes (byte 3 of each d) and one vptestmd accumulated in a mask: 6-7 vector uops. The
//   fast path takes blocks with s in [kQ8FastMin, kQ8FastMax] whose new moments are all finite
//   (no NaN: a NaN's code is 255 and the absmax NaN; the division and the search give that).
constexpr int kQ8KeyShift = 16;
constexpr int kQ8Keys = 1 << (32 - kQ8KeyShift);
constexpr int64_t kQ8Guard = 4;   // window margin around a bucket, in floats (>= 3)
constexpr uint32_t kQ8Delta = 8;  // the close band's offset (3..13: see above)
constexpr uint32_t kQ8CloseBits = 0x00FFFFF0u;  // t in [0, 16) iff these bits of d are clear
constexpr float kQ8FastMin = 0x1p-64f, kQ8FastMax = 0x1p64f;

struct Q8Buckets {
  bool ok;  // false: the maps break the one-midpoint-per-window condition (vector search only)
  alignas(64) uint32_t entry[kQ8Keys];
};

inline float q8_from_bits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// z of a float with |x| <= 2 ([Note: bucketed nearest code]), as the vector path computes it.
inline int64_t q8_z(float x, bool signed_map) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  if (!signed_map) return b;
  return b & 0x80000000u ? int64_t(0x80000000u) - (b & 0x7FFFFFFFu) : int64_t(b);
}

// The float of z (the inverse of q8_z on the range it covers).
inline float q8_float_of_z(int64_t z, bool signed_map) {
  if (!signed_map || z <= 0x40000000) return q8_from_bits(uint32_t(std::max<int64_t>(z, 0)));
  return q8_from_bits(0x80000000u | uint32_t(int64_t(0x80000000u) - std::min<int64_t>(z, 0x80000000)));
}

// Fills t from the 255 ascending midpoints of a map; t.ok says whether the fast path may use it.
// Keys the path cannot reach (|x'| > 2, or negative keys for the unsigned map) hold base 0.
inline void q8_fill_buckets(Q8Buckets& t, const float* mids, bool signed_map) {
  t.ok = true;
  for (int i = 0; i + 1 < 255; ++i)
    if (!(mids[i] < mids[i + 1])) t.ok = false;  // the counts below assume ascending midpoints
  auto count_below = [mids](float x) {           // midpoints < x
    return int(std::lower_bound(mids, mids + 255, x) - mids);
  };
  std::vector<int64_t> zs;  // the midpoints' z, sorted
  for (int i = 0; i < 255; ++i) {
    const float m = mids[i];
    // finite, normal and within [-2, 2] (signed) or [0, 2] (unsigned): the 3-float bound holds
    if (!std::isfinite(m) || std::fabs(m) < 0x1p-100f || std::fabs(m) > 2.f ||
        (!signed_map && m < 0.f)) {
      t.ok = false;
      continue;
    }
    zs.push_back(q8_z(m, signed_map));
  }
  std::sort(zs.begin(), zs.end());
  constexpr int64_t kSplit = 0x40000000;  // z <= kSplit: x >= +0 (and 2.0); above: x < 0 (signed)
  const int64_t zmax = signed_map ? 0x80000000LL : kSplit;  // the reachable z
  for (int64_t k = 0; k < kQ8Keys; ++k) {
    const int64_t lo = k << kQ8KeyShift;
    if (lo > zmax) {  // unreachable
      t.entry[k] = uint32_t(-(k << kQ8KeyShift));
      continue;
    }
    // the window, clipped to its sign's range of z (it never holds both signs' floats)
    int64_t w0 = lo - kQ8Guard, w1 = lo + (int64_t(1) << kQ8KeyShift) - 1 + kQ8Guard;
    if (lo <= kSplit) {
      w0 = std::max<int64_t>(w0, 0);
      w1 = std::min(w1, kSplit);
    } else {
      w0 = std::max(w0, kSplit + 1);
    }
    const auto first = std::lower_bound(zs.begin(), zs.end(), w0);
    const auto n_in = std::upper_bound(zs.begin(), zs.end(), w1) - first;
    if (n_in > 1) t.ok = false;  // two midpoints in one window
    const int found = n_in > 0 ? int(first - zs.begin()) : -1;
    const int base = count_below(q8_float_of_z(w0, signed_map));
    uint32_t e;
    if (found >= 0) {
      if (base > 254) t.ok = false;  // cannot happen: a midpoint lies above
      const int64_t c = zs[found] - lo;
      e = uint32_t((int64_t(base + 1) << 24) + kQ8Delta - 1 - c - (k << kQ8KeyShift));
    } else {
      e = uint32_t((int64_t(base) << 24) + (1 << 23) - (k << kQ8KeyShift));
    }
    t.entry[k] = e;
  }
}

// The two code maps as byte planes for the AVX-512 VBMI dequantize ([Note: 8-bit decode by byte
// planes], adamw8bit_avx512.cpp): plane[map][k][c] = byte k of code c (little-endian), map 0 the
// signed codes, 1 the unsigned.
struct Q8Planes {
  alignas(64) uint8_t plane[2][4][256];
};

inline void q8_fill_planes(Q8Planes& t, const float* code_s, const float* code_u) {
  for (int c = 0; c < 256; ++c) {
    uint8_t b[2][4];
    std::memcpy(b[0], &code_s[c], 4);
    std::memcpy(b[1], &code_u[c], 4);
    for (int map = 0; map < 2; ++map)
      for (int k = 0; k < 4; ++k) t.plane[map][k][c] = b[map][k];
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
  const Q8Planes* planes;      // the codes as byte planes (AVX-512 VBMI decode); may be nullptr
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
