// AVX-512 8-bit AdamW blocks (16 fp32 lanes, 8 vectors per 128-element block): the scalar path's
// operations in its order (adamw8bit_cpu.cpp), each an IEEE-rounded vector mul/add/div/sqrt
// intrinsic, so every lane gives the scalar path's bits. The update has no FMA (the op builds
// with -ffp-contract=off, kernels/build.py; GCC fuses mul+add in an avx512f body otherwise).
// Compiled without -march; the target attribute confines AVX-512 to these bodies.
//
// [Note: 8-bit AVX-512 step cost] (issue 40; Intel Xeon (Sapphire Rapids class) with AVX-512,
// the shared 2-core box, one thread, bf16 grads and param_out, n = 2^16 in cache, ns/element,
// median of 400 steps interleaved with the kernel before, same process; a standalone harness)
//   first issue-40 kernel (buckets: two qword gathers, the E * s test)       1.41
//   one 32-bit entry per bucket, an integer compare of x' (no division,
//     no E * s), redo the block where x' is within 5 floats of the midpoint  (quantize -35%)
//   + bf16 out by vcvtneps2bf16, v's max as unsigned integers (the NaN
//     check without the two sums)                                           1.15
//   + the pointers copied out of the args (no reloads), the fast branches
//     marked likely (they were the jumped-to ones)                          1.07
//   + software pipelining: block b + 1's update before block b's codes      1.05 (0.75x)
//   + vpermb for the codes' bytes (vpmovdb: 2 uops)                         ~same (kept: 1 uop)
// Without AVX512_BF16/VBMI (ZEROKERN_Q8_AVX512_BASE) 1.14. Ablations of the new kernel: the
// update alone 0.60 (its 2 dequantize gathers ~0.17), the quantizer 0.45 (its 2 gathers ~0.16),
// the div and sqrt ~0.15: the step is bound on the two 512-bit ALU ports and the gathers' loads,
// not on the divider. The whole step at n = 2^24 and 2^26 against the kernel before and the
// fp32-state adam_step: benchmarks/results/adamw8bit-cpu-kernel-issue40-20261129-r2*.md.
// Tried before (the first issue-40 round) and dropped: the dequantize from 4 byte planes with
// AVX512-VBMI vpermi2b (64 codes per 22 ops) ran 3% slower than its 2 gathers; the quantizer's
// exact division, 10% slower. Prefetching 8 blocks ahead: 8% less time at 2^24, 2 threads.
//
// Round 3 (issue 40; the same box, one thread, n = 2^16 in cache, ns/element, median of 300-600
// steps alternated in one process with the kernel above (aeab527), a standalone harness that
// links both builds; load average 5-13 from other sessions, so only the ratios are kept):
//   aeab527                                                        0.93 bf16 / 0.88 fp32 grads
//   bucket entry with the code on top and the midpoint as a carry ([Note: bucketed nearest
//     code]): 5-6 uops per value after the gather instead of 10-11; codes of block b
//     interleaved per 16 elements with block b + 1's update ([Note: 8-bit AVX-512
//     interleave])                                                 0.85 / 0.80
//   + v dequantized from byte planes (m keeps its gather: both by planes 3% slower, the planes'
//     permutes and unpacks share port 5 with the codes' vpermb and vptestmd), bf16 grads
//     widened by one vpermb, bf16 param_out by pairs (vcvtne2ps2bf16), the Q8Args pointers
//     copied to locals (25 scalar reloads per 64 elements), codes of two vectors stored by one
//     vpermt2b                                                     0.75 / 0.72 (0.79x / 0.80x)
// Without AVX512_BF16/VBMI (ZEROKERN_Q8_AVX512_BASE) 0.90 / 0.80 (0.89x of aeab527's base).
// Ablations of the round-3 kernel (bf16): without the 2 quantizer gathers 0.67, without the
// sqrt 0.67, without the div 0.70, without both 0.69 and all three 0.59: the ports 0 and 5 are
// the bound (~53 vector uops per 16 elements, ~3 of them gathers that also hold the load
// ports); an exact sqrt from rsqrt14 and 4 FMAs (no divider) ran 3% slower, not faster.
// Tried and dropped: grad * grad_scale skipped when grad_scale is 1 (no gain), the bf16 grad by
// a zero-extension and a shift (same), the codes' close test split over two mask chains (same).
//
// Round 4 (issue 40; the same box, one thread, n = 2^16 in cache, the round-3 harness rebuilt
// against e140ddc, medians of 300-400 alternated pairs, ratios to e140ddc; load average 2-6 from
// other sessions, whose memory traffic swung the 2^24-2^26 timings 2-5x within minutes, so the
// in-cache ratios are what this round kept):
//   which ports bind: 4 extra vpsrld (port 0 only) per 16 elements +8%, 4 vpermd (port 5) +3.5%,
//     4 vpaddd (port 0 or 5) +3.3%: every vector uop on ports 0/5 costs ~1%, port 0's ~2%
//   uops moved from port 0 to port 5 (the gathers' all-ones masks by vpcmpeqd, not kmovw; the
//     bucket keys by vpshufb, not vpsrld): +1%, so both ports are full, not port 0 alone
//   uops removed: grad * grad_scale skipped at gs = 1: -2% bf16 / -0.7% fp32 grads (not kept: one
//     more template dimension, 18 more instantiations, for 1-2%); the two maxima reduced in one
//     tree (12 vector ops per block, not 18): +-1%
//   fewer loads for more port-5 uops: m by byte planes too +1-4%, in one 64-element half +2%
//   the dequantize one block ahead into a buffer (off the update's dependency chain): +4% as its
//     own loop, +4-6% interleaved per 64 elements (16 more stores and loads per 64)
//   ablations (not exact): the 2 quantizer gathers removed -17%, sqrt and div as muls -9%
// Microbenchmarks: a 512-bit dword gather from an L1 table issues every 6-8 cycles, two 256-bit
// ones every 5.8-7.2 (no gain, and 2 more uops); sqrt 12-13 and div 10.7 cycles per 16 lanes,
// the same in two 256-bit halves. So the step is bound on the vector uops of ports 0 and 5 (~55
// per 16 elements by count, the gathers' own included), each an operation of the reference's
// order, a lookup or its indexing. 0.7x of the fp32 step would take ~15% fewer of them; a lookup
// without gathers (tables in registers: the bucket tables are 256 KiB) needs as many permutes,
// compares and blends as the ~5 uops of the gather it replaces, as the byte planes showed.
// Round 5 (2026-11-30; both builds loaded in one process, alternated per repetition, two
// threads): the time per element is flat from in-cache to DRAM (0.47 ns at 2^20, 0.49-0.52 at
// 2^24, 0.47 at 2^26) and halves with the second thread, so the kernel is compute-bound at every
// size; on a quiet memory system it is 0.76-0.81x of the bandwidth-bound fp32-state step
// (benchmarks/results/adamw8bit-cpu-kernel-issue40-20261130-bound.md). Tried and dropped: the
// read streams prefetched into L2 (prefetcht1) 16-64 blocks ahead besides the L1 prefetch,
// 0.90-1.02x at 2^24, 0.94-0.97x at 2^26 over four runs, 0.99-1.02x in the last: noise.
// Correction (round 6): that A/B loaded both builds under one module name, and Python hands back
// the first module for the second load, so it timed one build against itself; the prefetch
// result above is void. Round 6 measured it again with the harness below: still noise.
//
// Round 6 (2026-11-30; a harness that loads each build under its own module name
// (TORCH_EXTENSION_NAME) and links it -Bsymbolic, so each runs its own code, checked by output
// bits differing where the code differs; alternated per repetition; load average < 1):
//   marginal cost per 16 elements (one thread, n = 2^16, ~50 cycles at 3.5 GHz): + 4 vpaddd
//     +4.3%, + 4 vpsrld (port 0) +7.0%, + 4 vpermd (port 5) +2.3%, + 1 vsqrtps +13.5%: port 0
//     is the busier port, and the divider (vsqrtps 12 cycles, vdivps 10 per 16 lanes, not
//     overlapping: 22 of the ~50) is close to binding
//   ablations (not exact): the three gathers as permutes -14%, sqrt and div as muls -7.5%, all
//     four -29%: the rest, ~36 vector uops, still runs at about one per cycle
//   tried and dropped: m dequantized from byte planes +4% (as round 4); the update staged four
//     vectors at a time (sqrts, then m's codes, divs, v's codes) +8.5% (27 more spills); the
//     codes found 2, 3 or 4 blocks behind the update instead of 1 (a ring of m/v buffers, so
//     a block's absmax reduction is long done when its codes start) +2% over the same ring at
//     depth 1, itself +2% over this loop: the block recurrence is not what binds; the gathers' masks by
//     vpcmpeqd +0.2%; prefetch 2/6/8/12/16 blocks ahead and an L2 prefetch 32 ahead at 2^24,
//     two threads: -1 to +5%, noise; -mtune=sapphirerapids/icelake-server: +0%
//   kept: GCC's pre-allocation scheduler (the pragma below the includes): 0.974x bf16, 0.963x
//     fp32 grads in cache; at 2^24 and 2^26 on two threads, against cb1c210's build in
//     benchmarks/adamw8bit_cpu_kernel.py: 0.94-0.97x and 1.00-1.03x in two runs (noise-level)
// Still ~0.8x of the fp32-state step at 2^24 and 2^26, two threads: the three gathers (~14%)
// and the divider (~8%) are fixed costs of the exact reference, and the rest is issue-bound.
#include <immintrin.h>

#include "adamw8bit_cpu.h"

// GCC's first scheduling pass (before register allocation; off by default on x86) for this
// file's bodies: it spreads each 16-element group's long sqrt/div/gather chains among the
// others' independent work. Round 6 ([Note: 8-bit AVX-512 step cost]): 2.6-3.7% less time per
// element in cache, one thread, bf16 and fp32 grads; every bit equal. Scheduling moves no
// floating-point operation across another's rounding, so the results cannot change.
#pragma GCC optimize("schedule-insns")

#define ZK_Q8_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")))
#define ZK_Q8_AVX512_INLINE ZK_Q8_AVX512 __attribute__((always_inline)) inline

// Two instructions of newer AVX-512 CPUs (Ice Lake / Sapphire Rapids, Zen 4), used only where
// the CPU has them (BF16VBMI, q8_avx512_kernels): inline assembly, so the bodies keep the base
// target above and run on every AVX-512 CPU (Skylake-X, Cascade Lake included).
// vcvtneps2bf16 (AVX512_BF16): fp32 -> bf16, round to nearest even.
ZK_Q8_AVX512_INLINE __m256i q8_cvtneps2bf16(__m512 x) {
  __m256i r;
  asm("vcvtneps2bf16 %1, %0" : "=v"(r) : "v"(x));
  return r;
}
// vpermb (AVX512_VBMI): byte idx[i] of t, for 64 bytes.
ZK_Q8_AVX512_INLINE __m512i q8_vpermb(__m512i idx, __m512i t) {
  __m512i r;
  asm("vpermb %2, %1, %0" : "=v"(r) : "v"(idx), "v"(t));
  return r;
}

namespace zk_cpu {
namespace {

// vpermb with zeroing (AVX512_VBMI): byte idx[i] of t where bit i of k, else 0.
ZK_Q8_AVX512_INLINE __m512i q8_vpermb_z(__mmask64 k, __m512i idx, __m512i t) {
  __m512i r;
  asm("vpermb %2, %1, %0%{%3%}%{z%}" : "=v"(r) : "v"(idx), "v"(t), "Yk"(k));
  return r;
}

// 16 grads as floats. A bf16 grad is its bits shifted up 16: with VBMI one zeroing vpermb puts
// bf16 i into bytes 2..3 of dword i (else a zero-extension and a shift).
template <int G, bool VBMI>
ZK_Q8_AVX512_INLINE __m512 q8_load_grad16(const void* base, int64_t i) {
  if constexpr (G == kF32) return _mm512_loadu_ps(static_cast<const float*>(base) + i);
  else {
    __m256i h = _mm256_loadu_si256((const __m256i*)(static_cast<const uint16_t*>(base) + i));
    if constexpr (G == kF16) return _mm512_cvtph_ps(h);  // exact, as f16_to_f32
    else if constexpr (VBMI) {
      const __m512i idx = _mm512_set_epi8(
          31, 30, 0, 0, 29, 28, 0, 0, 27, 26, 0, 0, 25, 24, 0, 0, 23, 22, 0, 0, 21, 20, 0, 0, 19, 18,
          0, 0, 17, 16, 0, 0, 15, 14, 0, 0, 13, 12, 0, 0, 11, 10, 0, 0, 9, 8, 0, 0, 7, 6, 0, 0, 5, 4,
          0, 0, 3, 2, 0, 0, 1, 0, 0, 0);
      return _mm512_castsi512_ps(
          q8_vpermb_z(0xCCCCCCCCCCCCCCCCull, idx, _mm512_castsi256_si512(h)));
    } else {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
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

// vpermt2b (AVX512_VBMI): byte idx[i] & 127 of the 128-byte table (t0, t1), for 64 bytes.
ZK_Q8_AVX512_INLINE __m512i q8_vpermt2b(__m512i t0, __m512i idx, __m512i t1) {
  asm("vpermt2b %2, %1, %0" : "+v"(t0) : "v"(idx), "vm"(t1));
  return t0;
}

// [Note: 8-bit decode by byte planes] The codes of 64 bytes q[0..63] as 4 vectors of 16 floats,
// without gathers: each byte k of the 256 codes is a 256-byte plane (Q8Planes), looked up by two
// vpermt2b (the low 7 bits, in the two 128-byte halves) and a blend on bit 7; the 4 byte vectors
// are then interleaved into dwords by unpacks. The unpacks work within 128-bit lanes, so the
// indices are first transposed as 4x4 dwords (lane L of output j holds elements 16j + 4L..+3).
// 22 vector uops per 64 codes against 4 gathers (16 loads each) and 4 zero-extensions.
ZK_Q8_AVX512_INLINE void q8_decode64(const uint8_t* q, const uint8_t (*plane)[256], __m512* out) {
  const __m512i tr = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512i idx = _mm512_permutexvar_epi32(tr, _mm512_loadu_si512(q));
  const __mmask64 hi = _mm512_movepi8_mask(idx);
  __m512i b[4];
  for (int k = 0; k < 4; ++k) {
    const __m512i lo = q8_vpermt2b(_mm512_load_si512(plane[k]), idx,
                                   _mm512_load_si512(plane[k] + 64));
    const __m512i up = q8_vpermt2b(_mm512_load_si512(plane[k] + 128), idx,
                                   _mm512_load_si512(plane[k] + 192));
    b[k] = _mm512_mask_blend_epi8(hi, lo, up);
  }
  const __m512i w01l = _mm512_unpacklo_epi8(b[0], b[1]), w01h = _mm512_unpackhi_epi8(b[0], b[1]);
  const __m512i w23l = _mm512_unpacklo_epi8(b[2], b[3]), w23h = _mm512_unpackhi_epi8(b[2], b[3]);
  out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(w01l, w23l));
  out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(w01l, w23l));
  out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(w01h, w23h));
  out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(w01h, w23h));
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

// The exact codes of 16 values x / s ([Note: branchless nearest code]): the division and the
// search (a NaN's code is 255).
ZK_Q8_AVX512_INLINE __m128i q8_exact16(const float* x, __m512 s, const Q8Search& search) {
  return _mm512_cvtepi32_epi8(q8_nearest16(_mm512_div_ps(_mm512_load_ps(x), s), search));
}

// [Note: bucketed nearest code] (adamw8bit_cpu.h): the codes of 16 values x[0..15] / s, given
// rs = RN(1/s), written to q; far keeps the lanes (of all calls) whose x' was not close to a
// midpoint: a block whose far mask lost a lane is redone by the caller (q8_all_far).
// SIGNED: z = |bits| (vpabsd), the signed map's table; else z = the bits (v >= +0).
template <bool SIGNED>
ZK_Q8_AVX512_INLINE __m512i q8_bucket_d16(const float* x, __m512 rs, const uint32_t* entry,
                                          __mmask16& far) {
  __m512i z = _mm512_castps_si512(_mm512_mul_ps(_mm512_load_ps(x), rs));
  if constexpr (SIGNED) z = _mm512_abs_epi32(z);
  const __m512i d =
      _mm512_add_epi32(z, _mm512_i32gather_epi32(_mm512_srli_epi32(z, kQ8KeyShift), entry, 4));
  far = _mm512_mask_test_epi32_mask(far, d, _mm512_set1_epi32(kQ8CloseBits));
  return d;
}

template <bool SIGNED, bool VBMI>
ZK_Q8_AVX512_INLINE void q8_bucket16(const float* x, __m512 rs, const uint32_t* entry, uint8_t* q,
                                     __mmask16& far) {
  const __m512i d = q8_bucket_d16<SIGNED>(x, rs, entry, far);
  if constexpr (VBMI) {  // the codes are the top bytes of d: one vpermb (vpmovdb: 2 uops)
    const __m128i code = _mm512_castsi512_si128(q8_vpermb(
        _mm512_castsi128_si512(_mm_setr_epi8(3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47, 51, 55,
                                             59, 63)), d));
    _mm_storeu_si128((__m128i*)q, code);
  } else {
    _mm_storeu_si128((__m128i*)q, _mm512_cvtepi32_epi8(_mm512_srli_epi32(d, 24)));
  }
}

// The codes (top bytes) of two vectors of d into q[0..31]: one vpermt2b (VBMI).
ZK_Q8_AVX512_INLINE void q8_codes32(__m512i d0, __m512i d1, uint8_t* q) {
  const __m512i idx = _mm512_set_epi8(
      0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
      0, 127, 123, 119, 115, 111, 107, 103, 99, 95, 91, 87, 83, 79, 75, 71, 67, 63, 59, 55, 51, 47,
      43, 39, 35, 31, 27, 23, 19, 15, 11, 7, 3);
  _mm256_storeu_si256((__m256i*)q, _mm512_castsi512_si256(q8_vpermt2b(d0, idx, d1)));
}

// Whether every lane stayed far from the midpoints (else the caller redoes the block).
ZK_Q8_AVX512_INLINE bool q8_all_far(__mmask16 far) { return far == 0xFFFF; }

// The codes of x[0..127] / s by bucket into q; false where some value was close to a midpoint.
template <bool SIGNED, bool VBMI>
ZK_Q8_AVX512_INLINE bool q8_bucket_block(const float* x, float s, const Q8Buckets& t, uint8_t* q) {
  const __m512 rs = _mm512_set1_ps(1.f / s);
  __mmask16 far = 0xFFFF;
  for (int j = 0; j < kQ8Block; j += 16) q8_bucket16<SIGNED, VBMI>(x + j, rs, t.entry, q + j, far);
  return q8_all_far(far);
}

// The exact codes of x[0..127] / s into q (the division and the search).
ZK_Q8_AVX512_INLINE void q8_exact_block(const float* x, float s, const Q8Search& search,
                                        uint8_t* q) {
  const __m512 sv = _mm512_set1_ps(s);
  for (int j = 0; j < kQ8Block; j += 16)
    _mm_storeu_si128((__m128i*)(q + j), q8_exact16(x + j, sv, search));
}

// Codes of x[0..127] / s into q: the buckets where the block allows them, else (or where a value
// is undecided) the division and the search.
template <bool SIGNED, bool VBMI>
ZK_Q8_AVX512_INLINE void q8_quantize_block(const float* x, float s, bool clean, const Q8Buckets* bk,
                                           const Q8Search& search, uint8_t* q) {
  if (__builtin_expect(clean && bk != nullptr && s >= kQ8FastMin && s <= kQ8FastMax, 1) &&
      __builtin_expect(q8_bucket_block<SIGNED, VBMI>(x, s, *bk, q), 1))
    return;
  q8_exact_block(x, s, search, q);
}

// Prefetch the streams kQ8Ahead blocks ahead: without it the loads of a block wait on memory
// after its compute (one thread, n = 2^24, the previous kernel: 3.3 ns/element, its in-cache
// compute 1.7 plus the transfer at the single-thread RMW rate 1.6; see the header). Round 3:
// 4 blocks (was 8); the harness at n = 2^24, bf16, one thread, caches flushed, against aeab527:
// ahead 0 / 2 / 4 / 6 / 8 / 16: 0.97 / 0.82 / 0.81-0.83 / 0.80 / 0.86 / 0.94x.
#ifndef ZK_Q8_AHEAD
#define ZK_Q8_AHEAD 4
#endif
constexpr int64_t kQ8Ahead = ZK_Q8_AHEAD;
// Round 4: where param_out goes out by non-temporal stores (STREAM), its lines are not prefetched:
// the stores overwrite whole lines without reading them, and a prefetch read 2 more B/element
// (bf16) from memory for nothing. One thread, n = 2^24, bf16: 0.95-1.02x (no change, the thread
// is not bandwidth-bound); on 2 threads this round's noise (other sessions' memory traffic) hid
// it.
#ifndef ZK_Q8_NOPF_STREAMED_OUT
#define ZK_Q8_NOPF_STREAMED_OUT 1
#endif

template <int G, int O, bool STREAM>
ZK_Q8_AVX512_INLINE void q8_prefetch(const Q8Args& a, int64_t b) {
  const int64_t i = (b + kQ8Ahead) * kQ8Block;
  const char* p = reinterpret_cast<const char*>(a.p + i);
  for (int l = 0; l < 512; l += 64) __builtin_prefetch(p + l, 1, 3);
  constexpr int gbytes = G == kF32 ? 512 : 256;
  const char* g = static_cast<const char*>(a.grad) + i * (gbytes / kQ8Block);
  for (int l = 0; l < gbytes; l += 64) __builtin_prefetch(g + l, 0, 3);
  if constexpr (O != kOutNone && !(STREAM && ZK_Q8_NOPF_STREAMED_OUT)) {
    const char* o = static_cast<const char*>(a.out) + i * 2;
    for (int l = 0; l < 256; l += 64) __builtin_prefetch(o + l, 1, 3);
  }
  for (int l = 0; l < 128; l += 64) {
    __builtin_prefetch(a.mq + i + l, 1, 3);
    __builtin_prefetch(a.vq + i + l, 1, 3);
  }
}

// bf16 bits of 16 floats: vcvtneps2bf16 (round to nearest even) where no lane is a NaN or a
// denormal (it flushes denormals to zero and keeps NaN payloads; torch gives 0xFFFF for a NaN),
// else the integer rounding. BF16VBMI: the CPU has AVX512_BF16 and AVX512_VBMI (q8_avx512_kernels).
template <bool BF16VBMI>
ZK_Q8_AVX512_INLINE __m256i q8_bf16_16(__m512 x) {
  if constexpr (BF16VBMI) {
    if (__builtin_expect(!_mm512_fpclass_ps_mask(x, 0x01 | 0x80 | 0x20), 1))  // QNaN|SNaN|denormal
      return q8_cvtneps2bf16(x);
  }
  return q8_f32_to_bf16_16(x);
}

// The streams the update reads and writes, copied out of Q8Args into locals: the compiler
// reloads a field of Q8Args after every vector store (the intrinsic types may alias anything),
// 25 scalar loads per 64 elements in the interleaved loop before.
struct Q8Io {
  float* p;
  const void* grad;
  void* out;
};

// The step's scalars in registers.
struct Q8Vec {
  __m512 gs, decay, b1, omb1, b2, omb2, step, rbc2, eps;
};

// The update of 16 elements at i (block b's am, av): the new master (stored, and param_out), the
// new m and v into m[0..15], v[0..15] and their maxima (|m| as floats, v as unsigned integers:
// see below) into mmax, vmax.
template <int G, int O, bool BF16VBMI, bool STREAM, bool PAIRS = false>
ZK_Q8_AVX512_INLINE __m512 q8_update16(Q8Io a, const Q8Vec& c, int64_t i, __m512 cm,
                                       __m512 cv, __m512 am, __m512 av, float* m, float* v,
                                       __m512& mmax, __m512i& vmax) {
  const __m512 g = _mm512_mul_ps(q8_load_grad16<G, BF16VBMI>(a.grad, i), c.gs);
  __m512 mj = _mm512_mul_ps(cm, am);
  __m512 vj = _mm512_mul_ps(cv, av);
  __m512 x = _mm512_mul_ps(_mm512_loadu_ps(a.p + i), c.decay);
  mj = _mm512_add_ps(_mm512_mul_ps(c.b1, mj), _mm512_mul_ps(c.omb1, g));
  vj = _mm512_add_ps(_mm512_mul_ps(c.b2, vj), _mm512_mul_ps(c.omb2, _mm512_mul_ps(g, g)));
  const __m512 den = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(vj), c.rbc2), c.eps);
  x = _mm512_sub_ps(x, _mm512_mul_ps(c.step, _mm512_div_ps(mj, den)));
  _mm512_storeu_ps(a.p + i, x);
  if constexpr (O != kOutNone && !(PAIRS && O == kOutBF16 && BF16VBMI)) {
    __m256i h;
    if constexpr (O == kOutF16)
      h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    else h = q8_bf16_16<BF16VBMI>(x);
    __m256i* o = (__m256i*)(static_cast<uint16_t*>(a.out) + i);
    if constexpr (STREAM) _mm256_stream_si256(o, h);  // 32-byte aligned (the caller checks)
    else _mm256_storeu_si256(o, h);
  }
  _mm512_store_ps(m, mj);
  _mm512_store_ps(v, vj);
  // max of |m| (exact in any order): vrangeps imm 0xB = the larger magnitude, sign cleared
  // (it skips a NaN operand). v's max as unsigned integers: the float order for v >= +0,
  // and any NaN, inf or negative v (sign bit) lands at or above 0x7F800000 (q8_scales' check).
  mmax = _mm512_range_ps(mmax, mj, 0xB);
  vmax = _mm512_max_epu32(vmax, _mm512_castps_si512(vj));
  return x;
}

// vcvtne2ps2bf16 (AVX512_BF16): 32 bf16 of lo (elements 0..15) and hi (16..31), RNE.
ZK_Q8_AVX512_INLINE __m512i q8_cvtne2ps2bf16(__m512 hi, __m512 lo) {
  __m512i r;
  asm("vcvtne2ps2bf16 %2, %1, %0" : "=v"(r) : "v"(hi), "v"(lo));
  return r;
}

// bf16 param_out of 32 masters at i (BF16VBMI): one vcvtne2ps2bf16 and one test for the pair
// (q8_bf16_16's way-out where a lane is a NaN or a denormal).
template <bool STREAM>
ZK_Q8_AVX512_INLINE void q8_bf16_out32(Q8Io a, int64_t i, __m512 x0, __m512 x1) {
  uint16_t* o = static_cast<uint16_t*>(a.out) + i;
  if (__builtin_expect(!_kortestz_mask16_u8(_mm512_fpclass_ps_mask(x0, 0x01 | 0x80 | 0x20),
                                            _mm512_fpclass_ps_mask(x1, 0x01 | 0x80 | 0x20)) == 0,
                       1)) {
    const __m512i h = q8_cvtne2ps2bf16(x1, x0);
    if constexpr (STREAM) _mm512_stream_si512((__m512i*)o, h);  // 64-byte aligned (the caller)
    else _mm512_storeu_si512(o, h);
  } else {
    _mm256_storeu_si256((__m256i*)o, q8_f32_to_bf16_16(x0));
    _mm256_storeu_si256((__m256i*)(o + 16), q8_f32_to_bf16_16(x1));
  }
}

// The update of 64 elements at i from their decoded codes (q8_update16 four times; bf16
// param_out by pairs where BF16VBMI).
template <int G, int O, bool BF16VBMI, bool STREAM>
ZK_Q8_AVX512_INLINE void q8_update64(Q8Io a, const Q8Vec& c, int64_t i, const __m512* cm,
                                     const __m512* cv, __m512 am, __m512 av, float* m, float* v,
                                     __m512& mmax, __m512i& vmax) {
#pragma GCC unroll 2
  for (int k = 0; k < 4; k += 2) {
    const __m512 x0 = q8_update16<G, O, BF16VBMI, STREAM, true>(
        a, c, i + 16 * k, cm[k], cv[k], am, av, m + 16 * k, v + 16 * k, mmax, vmax);
    const __m512 x1 = q8_update16<G, O, BF16VBMI, STREAM, true>(
        a, c, i + 16 * k + 16, cm[k + 1], cv[k + 1], am, av, m + 16 * k + 16, v + 16 * k + 16,
        mmax, vmax);
    if constexpr (O == kOutBF16 && BF16VBMI) q8_bf16_out32<STREAM>(a, i + 16 * k, x0, x1);
  }
}

// One block's update (q8_update16 over its 8 vectors). PLANES: decode by byte planes.
template <int G, int O, bool BF16VBMI, bool STREAM, bool PLANES>
ZK_Q8_AVX512_INLINE void q8_update_block(const Q8Args& a, const Q8Vec& c, int64_t b, float* m,
                                         float* v, __m512& mmax, __m512i& vmax) {
  const Q8Io io{a.p, a.grad, a.out};
  const uint8_t* mq = a.mq;
  const uint8_t* vq = a.vq;
  const float* code_s = a.code_s;
  const float* code_u = a.code_u;
  const __m512 am = _mm512_set1_ps(a.ma[b]), av = _mm512_set1_ps(a.va[b]);
  mmax = _mm512_setzero_ps();
  vmax = _mm512_setzero_si512();
  const int64_t base = b * kQ8Block;
  if (PLANES) {
    const uint8_t(*vplane)[256] = a.planes->plane[1];
    for (int j = 0; j < kQ8Block; j += 64) {
      __m512 cm[4], cv[4];
      for (int k = 0; k < 4; ++k) cm[k] = q8_decode16(mq + base + j + 16 * k, code_s);
      q8_decode64(vq + base + j, vplane, cv);
      q8_update64<G, O, BF16VBMI, STREAM>(io, c, base + j, cm, cv, am, av, m + j, v + j, mmax,
                                          vmax);
    }
    return;
  }
#pragma GCC unroll 8
  for (int j = 0; j < kQ8Block; j += 16)
    q8_update16<G, O, BF16VBMI, STREAM>(io, c, base + j, q8_decode16(mq + base + j, code_s),
                                        q8_decode16(vq + base + j, code_u), am, av, m + j,
                                        v + j, mmax, vmax);
}

// A block's quantization scales: the absmaxes (also stored in ma, va) and whether both moments
// take the buckets ([Note: bucketed nearest code]: clean, scales in range, tables there).
struct Q8Scales {
  float sm, sv;  // the divisors: the absmax, or 1 for an all-zero (or NaN) block
  bool clean, fast;
};

// Block b's absmaxes from its update's m[], v[] and maxima, stored; the old ma[b], va[b] must
// still be there (the clean test reads them).
ZK_Q8_AVX512_INLINE Q8Scales q8_scales(const Q8Args& a, int64_t b, const float* m, const float* v,
                                       __m512 mmax, __m512i vmax) {
  float mm = _mm512_reduce_max_ps(mmax), vm;
  // Clean: every v finite and >= +0, so g and the old v are finite, and with finite old m
  // (its absmax finite; the maps' codes are finite: adamw8bit_cpu.cpp) every m is finite too.
  const uint32_t vmax_bits = _mm512_reduce_max_epu32(vmax);
  const bool clean = vmax_bits < 0x7F800000u && std::isfinite(a.ma[b]) && std::isfinite(a.va[b]);
  if (__builtin_expect(clean, 1)) {
    vm = q8_from_bits(vmax_bits);
  } else {  // rare: torch's amax (NaN propagates: the first NaN's |.|), v's max of |.|
    if (q8_has_nan(m)) mm = q8_nan_absmax(m);
    if (q8_has_nan(v)) {
      vm = q8_nan_absmax(v);
    } else {
      __m512 r = _mm512_setzero_ps();
      for (int j = 0; j < kQ8Block; j += 16) r = _mm512_range_ps(r, _mm512_load_ps(v + j), 0xB);
      vm = _mm512_reduce_max_ps(r);
    }
  }
  a.ma[b] = mm;
  a.va[b] = vm;
  Q8Scales s{mm > 0.f ? mm : 1.f, vm > 0.f ? vm : 1.f, clean, false};
  s.fast = clean && a.buckets_s != nullptr && a.buckets_u != nullptr && s.sm >= kQ8FastMin &&
           s.sm <= kQ8FastMax && s.sv >= kQ8FastMin && s.sv <= kQ8FastMax;
  return s;
}

// Block b's codes, each moment on its own (the buckets where they apply, else the search).
template <bool VBMI>
ZK_Q8_AVX512_INLINE void q8_quantize_both(const Q8Args& a, int64_t b, const float* m,
                                          const float* v, const Q8Scales& s) {
  q8_quantize_block<true, VBMI>(m, s.sm, s.clean, a.buckets_s, *a.search_s, a.mq + b * kQ8Block);
  q8_quantize_block<false, VBMI>(v, s.sv, s.clean, a.buckets_u, *a.search_u, a.vq + b * kQ8Block);
}

// [Note: 8-bit AVX-512 interleave] Blocks [b0, b1), software-pipelined: block b's codes are
// found while block b + 1 is updated (the codes wait on the block's absmax, a reduction at the
// end of its update), and the two are interleaved vector by vector in the program: update 16
// elements of b + 1, then the bucket codes of 16 of b's m and 16 of its v. Measured (round 3,
// the harness of [Note: 8-bit AVX-512 step cost]): the update alone takes 0.51 ns/element and
// the codes 0.43; issued as whole blocks (aeab527) their times nearly add up (0.93), issued as
// 64 elements of update then 64 of codes 0.82, vector by vector 0.72: the update's long sqrt/div
// chains and the codes' gathers then share the out-of-order window. Where a block is not fast
// (Q8Scales), the phases run one after the other.
template <int G, int O, bool BF16VBMI, bool STREAM, bool PLANES>
ZK_Q8_AVX512_INLINE void q8_blocks_impl(const Q8Args& a, int64_t b0, int64_t b1) {
  alignas(64) float m[2][kQ8Block], v[2][kQ8Block];
  const Q8Vec c{_mm512_set1_ps(a.gs),   _mm512_set1_ps(a.decay),     _mm512_set1_ps(a.b1),
                _mm512_set1_ps(a.omb1), _mm512_set1_ps(a.b2),        _mm512_set1_ps(a.omb2),
                _mm512_set1_ps(a.step_size), _mm512_set1_ps(a.rsqrt_bc2), _mm512_set1_ps(a.eps)};
  __m512 mmax;
  __m512i vmax;
  const Q8Io io{a.p, a.grad, a.out};
  const float* code_s = a.code_s;
  const float* code_u = a.code_u;
  const uint8_t(*vplane)[256] = PLANES ? a.planes->plane[1] : nullptr;
  if (kQ8Ahead > 0) q8_prefetch<G, O, STREAM>(a, b0);
  q8_update_block<G, O, BF16VBMI, STREAM, PLANES>(a, c, b0, m[0], v[0], mmax, vmax);
  Q8Scales s = q8_scales(a, b0, m[0], v[0], mmax, vmax);
  for (int64_t b = b0; b < b1; ++b) {
    const int cur = int((b - b0) & 1), nxt = cur ^ 1;
    const bool next = b + 1 < b1;
    if (next && kQ8Ahead > 0) q8_prefetch<G, O, STREAM>(a, b + 1);
    if (__builtin_expect(next && s.fast, 1)) {
      const int64_t base = (b + 1) * kQ8Block;
      const __m512 am = _mm512_set1_ps(a.ma[b + 1]), av = _mm512_set1_ps(a.va[b + 1]);
      const __m512 rsm = _mm512_set1_ps(1.f / s.sm), rsv = _mm512_set1_ps(1.f / s.sv);
      uint8_t* mq = a.mq + b * kQ8Block;
      uint8_t* vq = a.vq + b * kQ8Block;
      const uint8_t* mq_in = mq + kQ8Block;
      const uint8_t* vq_in = vq + kQ8Block;
      const uint32_t* entry_s = a.buckets_s->entry;
      const uint32_t* entry_u = a.buckets_u->entry;
      __mmask16 far = 0xFFFF;
      mmax = _mm512_setzero_ps();
      vmax = _mm512_setzero_si512();
      if (PLANES) {
        for (int j = 0; j < kQ8Block; j += 64) {
          __m512 cm[4], cv[4];  // m by gathers, v by planes: 3% faster than both by planes
          for (int k = 0; k < 4; ++k) cm[k] = q8_decode16(mq_in + j + 16 * k, code_s);
          q8_decode64(vq_in + j, vplane, cv);
          __m512 x[4];
          __m512i dm[4], dv[4];
#pragma GCC unroll 4
          for (int k = 0; k < 4; ++k) {  // finer than update64 then codes: 0.72 vs 0.82 ns
            const int jj = j + 16 * k;
            x[k] = q8_update16<G, O, BF16VBMI, STREAM, true>(io, c, base + jj, cm[k], cv[k], am,
                                                             av, m[nxt] + jj, v[nxt] + jj, mmax,
                                                             vmax);
            dm[k] = q8_bucket_d16<true>(m[cur] + jj, rsm, entry_s, far);
            dv[k] = q8_bucket_d16<false>(v[cur] + jj, rsv, entry_u, far);
            if (k & 1) {  // pairs: the codes by one vpermt2b, bf16 param_out by vcvtne2ps2bf16
              q8_codes32(dm[k - 1], dm[k], mq + jj - 16);
              q8_codes32(dv[k - 1], dv[k], vq + jj - 16);
              if constexpr (O == kOutBF16 && BF16VBMI)
                q8_bf16_out32<STREAM>(io, base + jj - 16, x[k - 1], x[k]);
            }
          }
        }
      } else {
#pragma GCC unroll 8
        for (int j = 0; j < kQ8Block; j += 16) {
          q8_update16<G, O, BF16VBMI, STREAM>(io, c, base + j, q8_decode16(mq_in + j, code_s),
                                              q8_decode16(vq_in + j, code_u), am, av, m[nxt] + j,
                                              v[nxt] + j, mmax, vmax);
          q8_bucket16<true, BF16VBMI>(m[cur] + j, rsm, entry_s, mq + j, far);
          q8_bucket16<false, BF16VBMI>(v[cur] + j, rsv, entry_u, vq + j, far);
        }
      }
      if (__builtin_expect(!q8_all_far(far), 0)) {  // rare: some value undecided, both redone
        q8_exact_block(m[cur], s.sm, *a.search_s, mq);
        q8_exact_block(v[cur], s.sv, *a.search_u, vq);
      }
    } else {
      if (next)
        q8_update_block<G, O, BF16VBMI, STREAM, PLANES>(a, c, b + 1, m[nxt], v[nxt], mmax, vmax);
      q8_quantize_both<BF16VBMI>(a, b, m[cur], v[cur], s);
    }
    if (next) s = q8_scales(a, b + 1, m[nxt], v[nxt], mmax, vmax);
  }
}

template <int G, int O, bool BF16VBMI>
ZK_Q8_AVX512 void q8_blocks(const Q8Args& args, int64_t b0, int64_t b1) {
  const Q8Args a = args;  // a local copy: otherwise every store forces a reload of the pointers
  if (b0 >= b1) return;
#ifndef ZK_Q8_PLANES
#define ZK_Q8_PLANES 1
#endif
  constexpr bool P = BF16VBMI && ZK_Q8_PLANES;
  if (P && a.planes == nullptr) {  // not filled by the caller: the gathers
    q8_blocks_impl<G, O, BF16VBMI, false, false>(a, b0, b1);
    return;
  }
  // streamed: a 32-byte aligned param_out, 64 where bf16 goes out by pairs (q8_bf16_out32)
  constexpr uintptr_t align = P && O == kOutBF16 ? 63 : 31;
  if (O != kOutNone && a.stream_out && (reinterpret_cast<uintptr_t>(a.out) & align) == 0) {
    q8_blocks_impl<G, O, BF16VBMI, O != kOutNone, P>(a, b0, b1);
    _mm_sfence();  // order the non-temporal stores before the caller's later reads
  } else {
    q8_blocks_impl<G, O, BF16VBMI, false, P>(a, b0, b1);
  }
}

template <bool BF16VBMI>
Q8Kernels q8_avx512_table() {
  Q8Kernels k{};
  k.blocks[kF32][kOutNone] = &q8_blocks<kF32, kOutNone, BF16VBMI>;
  k.blocks[kF32][kOutF16] = &q8_blocks<kF32, kOutF16, BF16VBMI>;
  k.blocks[kF32][kOutBF16] = &q8_blocks<kF32, kOutBF16, BF16VBMI>;
  k.blocks[kF16][kOutNone] = &q8_blocks<kF16, kOutNone, BF16VBMI>;
  k.blocks[kF16][kOutF16] = &q8_blocks<kF16, kOutF16, BF16VBMI>;
  k.blocks[kF16][kOutBF16] = &q8_blocks<kF16, kOutBF16, BF16VBMI>;
  k.blocks[kBF16][kOutNone] = &q8_blocks<kBF16, kOutNone, BF16VBMI>;
  k.blocks[kBF16][kOutF16] = &q8_blocks<kBF16, kOutF16, BF16VBMI>;
  k.blocks[kBF16][kOutBF16] = &q8_blocks<kBF16, kOutBF16, BF16VBMI>;
  return k;
}

}  // namespace

bool cpu_has_bf16_vbmi() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vbmi");
}

const Q8Kernels& q8_avx512_kernels(bool bf16_vbmi) {
  static const Q8Kernels base = q8_avx512_table<false>(), newer = q8_avx512_table<true>();
  return bf16_vbmi ? newer : base;
}

}  // namespace zk_cpu
