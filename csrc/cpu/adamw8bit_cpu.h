// Shared by the 8-bit AdamW CPU kernels (adamw8bit_cpu.cpp: entry, scalar path; adamw8bit_avx2.cpp,
// adamw8bit_avx512.cpp: vector paths): the per-call arguments, the search tables and the scalar
// helpers every path must match bit for bit (zerokern/kernels/adamw8bit.py [Note: the 8-bit step,
// bit for bit]).
#pragma once

#include <cmath>
#include <cstdint>

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
inline float q8_nan_absmax(const float* x) {
  for (int64_t j = 0; j < kQ8Block; ++j)
    if (x[j] != x[j]) return std::fabs(x[j]);
  return 0.f;
}

}  // namespace zk_cpu
