// master="compact"'s AdamW step fused on the CPU (zerokern/state/compact_master.py [Note: the
// compact master]; [Note: fused compact step on the CPU] there has the reason and the numbers):
// one pass over low halves (int16), tie bits (uint8), bf16 params, m, v and the grad that
// rebuilds each fp32 master in registers, applies the Adam kernel's update (kernels_scalar.cpp,
// operation for operation, with the host scalars adam_cpu.cpp computes) and writes the bf16
// param (RNE), the new low half and tie bit, m and v, and ORs a NaN master into a flag. Bit for
// bit the chain compact_expand -> adam_step(param_out = the params) -> compact_store
// (tests/state/test_compact_cpu_fused.py, every ISA).
//
// Paths: AVX-512 (16 lanes = two tie bytes, which are a __mmask16 as they lie in memory),
// AVX2 (8 lanes = one tie byte), scalar (the spec; std::fma, FMA-instruction clone where the CPU
// has it), chosen by the extension's ISA dispatch (current_isa(), op.force_isa). n is a multiple
// of 8, so a work item of whole tie bytes owns its bytes: no races between threads.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_kernels.h"
#include "step_scalars.h"

namespace zk_cpu {
namespace {

// Elements per work item (as adam_cpu.cpp's kAdamChunk); below kCompactParallelMin elements
// one thread does it all (waking the pool costs more).
constexpr int64_t kCompactChunk = 4096;
constexpr int64_t kCompactParallelMin = 32768;

struct CompactPtrs {
  uint16_t* low;     // (n,) low halves
  uint8_t* ties;     // (n/8,) tie bits, element i = bit i % 8 of byte i / 8
  uint16_t* param;   // (n,) bf16 params: the masters' rounded high halves
  float* m;
  float* v;
  const void* grad;  // GradType elements
};

// Updates elements [begin, end) (multiples of 8); returns whether a new master is NaN.
using CompactChunkFn = bool (*)(const CompactPtrs&, const AdamScalars&, int64_t, int64_t);

// ---------------------------------------------------------------- scalar (the spec) ---------

template <int G>
inline float load_grad1(const void* p, int64_t i) {
  if constexpr (G == kF32) return static_cast<const float*>(p)[i];
  else if constexpr (G == kF16) return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
  else return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
}

template <int G, bool ADAMW>
__attribute__((always_inline)) inline bool compact_body(const CompactPtrs& ptrs,
                                                        const AdamScalars& scalars,
                                                        int64_t begin, int64_t end) {
  const CompactPtrs P = ptrs;  // local copies: otherwise every store forces reloads
  const AdamScalars S = scalars;
  uint32_t nan = 0;
  for (int64_t j = begin / 8; j < end / 8; ++j) {
    const uint32_t tb = P.ties[j];
    uint32_t nt = 0;
    for (int k = 0; k < 8; ++k) {
      const int64_t i = j * 8 + k;
      // expand: carry = 1 iff low > 0x8000, or low == 0x8000 with the tie bit (compact_cpu.cpp)
      const uint32_t lo = P.low[i];
      const uint32_t carry = (lo + ((tb >> k) & 1u) + 0x7FFFu) >> 16;
      float p = bits_f32(((uint32_t(P.param[i]) - carry) << 16) | lo);
      // the Adam update, kernels_scalar.cpp's adam_body operation for operation
      float g = load_grad1<G>(P.grad, i) * S.gs;
      if (ADAMW) p = p * S.decay;
      else g = std::fma(S.wd, p, g);
      const float m = std::fma(S.b1, P.m[i], S.omb1 * g);
      const float v = std::fma(S.b2, P.v[i], S.omb2 * (g * g));
      const float denom = std::fma(std::sqrt(v), S.rsqrt_bc2, S.eps);
      p = std::fma(-S.step_size, m / denom, p);
      P.m[i] = m;
      P.v[i] = v;
      // compact: the param (RNE, NaN -> 0xFFFF), the low half, the tie bit, the NaN test
      const uint32_t x = f32_bits(p);
      P.param[i] = f32_to_bf16(p);
      P.low[i] = uint16_t(x);
      nt |= (uint32_t((x & 0xFFFFu) == 0x8000u) & (x >> 16) & 1u) << k;
      nan |= uint32_t((x & 0x7FFFFFFFu) > 0x7F800000u);
    }
    P.ties[j] = uint8_t(nt);
  }
  return nan != 0;
}

template <int G, bool ADAMW>
bool compact_scalar(const CompactPtrs& P, const AdamScalars& S, int64_t b, int64_t e) {
  return compact_body<G, ADAMW>(P, S, b, e);
}
// std::fma as one instruction (kernels_scalar.cpp: a glibc call otherwise); the same bits.
template <int G, bool ADAMW>
__attribute__((target("fma"))) bool compact_scalar_fma(const CompactPtrs& P,
                                                       const AdamScalars& S, int64_t b,
                                                       int64_t e) {
  return compact_body<G, ADAMW>(P, S, b, e);
}

// ---------------------------------------------------------------- AVX2 (8 lanes) -------------

#define ZK_C_AVX2 __attribute__((target("avx2,fma,f16c")))
#define ZK_C_AVX2_INLINE ZK_C_AVX2 __attribute__((always_inline)) inline

template <int G>
ZK_C_AVX2_INLINE __m256 load_grad8(const void* base, int64_t i) {
  if constexpr (G == kF32) return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  else {
    __m128i h = _mm_loadu_si128((const __m128i*)(static_cast<const uint16_t*>(base) + i));
    if constexpr (G == kF16) return _mm256_cvtph_ps(h);
    else return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// The low 16 bits of each 32-bit lane, packed into 8 uint16 (bytes 0,1 of each dword).
ZK_C_AVX2_INLINE __m128i low16_8(__m256i r) {
  const __m256i lo16 = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                        0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_shuffle_epi8(r, lo16), 0x08));
}

struct Vec8 {
  __m256 gs, decay, wd, b1, b2, omb1, omb2, neg_step, rsqrt_bc2, eps;
};

// One tie byte's 8 elements; returns the NaN lanes as a movemask.
template <int G, bool ADAMW>
ZK_C_AVX2_INLINE int compact8(const CompactPtrs& P, const Vec8& S, int64_t i) {
  const __m256i lo = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(P.low + i)));
  const __m256i b = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(P.param + i)));
  const __m256i tie = _mm256_and_si256(
      _mm256_srlv_epi32(_mm256_set1_epi32(P.ties[i / 8]), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
      _mm256_set1_epi32(1));
  const __m256i carry = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(lo, tie), _mm256_set1_epi32(0x7FFF)), 16);
  __m256 p = _mm256_castsi256_ps(
      _mm256_or_si256(_mm256_slli_epi32(_mm256_sub_epi32(b, carry), 16), lo));
  // kernels_avx2.cpp's adam8
  __m256 g = _mm256_mul_ps(load_grad8<G>(P.grad, i), S.gs);
  __m256 m = _mm256_loadu_ps(P.m + i);
  __m256 v = _mm256_loadu_ps(P.v + i);
  if constexpr (ADAMW) p = _mm256_mul_ps(p, S.decay);
  else g = _mm256_fmadd_ps(S.wd, p, g);
  m = _mm256_fmadd_ps(S.b1, m, _mm256_mul_ps(S.omb1, g));
  v = _mm256_fmadd_ps(S.b2, v, _mm256_mul_ps(S.omb2, _mm256_mul_ps(g, g)));
  const __m256 denom = _mm256_fmadd_ps(_mm256_sqrt_ps(v), S.rsqrt_bc2, S.eps);
  p = _mm256_fmadd_ps(S.neg_step, _mm256_div_ps(m, denom), p);
  _mm256_storeu_ps(P.m + i, m);
  _mm256_storeu_ps(P.v + i, v);
  // param: RNE on the bits, NaN -> 0xFFFF (kernels_avx2.cpp's f32_to_bf16_8)
  const __m256i x = _mm256_castps_si256(p);
  const __m256 unord = _mm256_cmp_ps(p, p, _CMP_UNORD_Q);
  __m256i r = _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7FFF)),
                               _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1)));
  r = _mm256_srli_epi32(_mm256_or_si256(r, _mm256_castps_si256(unord)), 16);
  _mm_storeu_si128((__m128i*)(P.param + i), low16_8(r));
  _mm_storeu_si128((__m128i*)(P.low + i), low16_8(x));
  // tie bit: low half == 0x8000 and bit 16 set (moved to the sign bit for movemask)
  const __m256i at_tie = _mm256_cmpeq_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0xFFFF)),
                                            _mm256_set1_epi32(0x8000));
  P.ties[i / 8] = uint8_t(_mm256_movemask_ps(
      _mm256_castsi256_ps(_mm256_and_si256(at_tie, _mm256_slli_epi32(x, 15)))));
  return _mm256_movemask_ps(unord);
}

template <int G, bool ADAMW>
ZK_C_AVX2 bool compact_avx2(const CompactPtrs& ptrs, const AdamScalars& s, int64_t b, int64_t e) {
  const CompactPtrs P = ptrs;
  const Vec8 S{_mm256_set1_ps(s.gs),   _mm256_set1_ps(s.decay), _mm256_set1_ps(s.wd),
               _mm256_set1_ps(s.b1),   _mm256_set1_ps(s.b2),    _mm256_set1_ps(s.omb1),
               _mm256_set1_ps(s.omb2), _mm256_set1_ps(-s.step_size),
               _mm256_set1_ps(s.rsqrt_bc2), _mm256_set1_ps(s.eps)};
  int nan = 0;
  for (int64_t i = b; i < e; i += 8) nan |= compact8<G, ADAMW>(P, S, i);
  return nan != 0;
}

// ---------------------------------------------------------------- AVX-512 (16 lanes) --------

#define ZK_C_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define ZK_C_AVX512_INLINE ZK_C_AVX512 __attribute__((always_inline)) inline

template <int G, bool MASKED>
ZK_C_AVX512_INLINE __m512 load_grad16(const void* base, int64_t i, __mmask16 k) {
  if constexpr (G == kF32) {
    const float* p = static_cast<const float*>(base) + i;
    return MASKED ? _mm512_maskz_loadu_ps(k, p) : _mm512_loadu_ps(p);
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(base) + i;
    __m256i h = MASKED ? _mm256_maskz_loadu_epi16(k, p) : _mm256_loadu_si256((const __m256i*)p);
    if constexpr (G == kF16) return _mm512_cvtph_ps(h);
    else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

template <bool MASKED>
ZK_C_AVX512_INLINE __m512i load_u16x16(const uint16_t* p, __mmask16 k) {
  return _mm512_cvtepu16_epi32(MASKED ? _mm256_maskz_loadu_epi16(k, p)
                                      : _mm256_loadu_si256((const __m256i*)p));
}

template <bool MASKED>
ZK_C_AVX512_INLINE void store_u16x16(uint16_t* p, __m512i x, __mmask16 k) {
  if (MASKED) _mm512_mask_cvtepi32_storeu_epi16(p, k, x);
  else _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(x));
}

struct Vec16 {
  __m512 gs, decay, wd, b1, b2, omb1, omb2, neg_step, rsqrt_bc2, eps;
};

// Two tie bytes' 16 elements (MASKED: only the first 8, k = 0x00FF, one tie byte: n is a
// multiple of 8, not 16). The two bytes, read as a little-endian uint16, are the lanes' mask.
template <int G, bool ADAMW, bool MASKED>
ZK_C_AVX512_INLINE __mmask16 compact16(const CompactPtrs& P, const Vec16& S, int64_t i,
                                       __mmask16 k) {
  uint16_t tb;
  if (MASKED) tb = P.ties[i / 8];
  else std::memcpy(&tb, P.ties + i / 8, 2);
  const __m512i lo = load_u16x16<MASKED>(P.low + i, k);
  const __m512i b = load_u16x16<MASKED>(P.param + i, k);
  const __m512i lo_t = _mm512_mask_add_epi32(lo, __mmask16(tb), lo, _mm512_set1_epi32(1));
  const __m512i carry = _mm512_srli_epi32(_mm512_add_epi32(lo_t, _mm512_set1_epi32(0x7FFF)), 16);
  __m512 p = _mm512_castsi512_ps(
      _mm512_or_si512(_mm512_slli_epi32(_mm512_sub_epi32(b, carry), 16), lo));
  // kernels_avx512.cpp's adam16
  __m512 g = _mm512_mul_ps(load_grad16<G, MASKED>(P.grad, i, k), S.gs);
  __m512 m = MASKED ? _mm512_maskz_loadu_ps(k, P.m + i) : _mm512_loadu_ps(P.m + i);
  __m512 v = MASKED ? _mm512_maskz_loadu_ps(k, P.v + i) : _mm512_loadu_ps(P.v + i);
  if constexpr (ADAMW) p = _mm512_mul_ps(p, S.decay);
  else g = _mm512_fmadd_ps(S.wd, p, g);
  m = _mm512_fmadd_ps(S.b1, m, _mm512_mul_ps(S.omb1, g));
  v = _mm512_fmadd_ps(S.b2, v, _mm512_mul_ps(S.omb2, _mm512_mul_ps(g, g)));
  const __m512 denom = _mm512_fmadd_ps(_mm512_sqrt_ps(v), S.rsqrt_bc2, S.eps);
  p = _mm512_fmadd_ps(S.neg_step, _mm512_div_ps(m, denom), p);
  if (MASKED) {
    _mm512_mask_storeu_ps(P.m + i, k, m);
    _mm512_mask_storeu_ps(P.v + i, k, v);
  } else {
    _mm512_storeu_ps(P.m + i, m);
    _mm512_storeu_ps(P.v + i, v);
  }
  // param: RNE on the bits, NaN -> 0xFFFF (kernels_avx512.cpp's f32_to_bf16_16)
  const __m512i x = _mm512_castps_si512(p);
  const __mmask16 nan = _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q);
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7FFF)),
                               _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1)));
  r = _mm512_mask_mov_epi32(_mm512_srli_epi32(r, 16), nan, _mm512_set1_epi32(0xFFFF));
  store_u16x16<MASKED>(P.param + i, r, k);
  store_u16x16<MASKED>(P.low + i, x, k);  // vpmovdw truncates: the low halves
  // tie bit: low half == 0x8000 and bit 16 set
  const __mmask16 nt = _mm512_mask_cmpeq_epi32_mask(
      _mm512_test_epi32_mask(x, _mm512_set1_epi32(0x10000)),
      _mm512_and_si512(x, _mm512_set1_epi32(0xFFFF)), _mm512_set1_epi32(0x8000));
  if (MASKED) {
    P.ties[i / 8] = uint8_t(nt);
  } else {
    const uint16_t nt16 = nt;
    std::memcpy(P.ties + i / 8, &nt16, 2);
  }
  return nan & k;
}

template <int G, bool ADAMW>
ZK_C_AVX512 bool compact_avx512(const CompactPtrs& ptrs, const AdamScalars& s, int64_t b,
                                int64_t e) {
  const CompactPtrs P = ptrs;
  const Vec16 S{_mm512_set1_ps(s.gs),   _mm512_set1_ps(s.decay), _mm512_set1_ps(s.wd),
                _mm512_set1_ps(s.b1),   _mm512_set1_ps(s.b2),    _mm512_set1_ps(s.omb1),
                _mm512_set1_ps(s.omb2), _mm512_set1_ps(-s.step_size),
                _mm512_set1_ps(s.rsqrt_bc2), _mm512_set1_ps(s.eps)};
  __mmask16 nan = 0;
  int64_t i = b;
  for (; i + 16 <= e; i += 16) nan |= compact16<G, ADAMW, false>(P, S, i, 0xFFFF);
  if (i < e) nan |= compact16<G, ADAMW, true>(P, S, i, 0x00FF);  // e - i == 8
  return nan != 0;
}

// ---------------------------------------------------------------- dispatch -------------------

struct CompactTable {
  CompactChunkFn fn[3][3][2];  // [Isa][GradType][adamw]
};

template <int G>
void fill_compact(CompactTable& t, bool fma) {
  t.fn[kScalar][G][0] = fma ? &compact_scalar_fma<G, false> : &compact_scalar<G, false>;
  t.fn[kScalar][G][1] = fma ? &compact_scalar_fma<G, true> : &compact_scalar<G, true>;
  t.fn[kAvx2][G][0] = &compact_avx2<G, false>;
  t.fn[kAvx2][G][1] = &compact_avx2<G, true>;
  t.fn[kAvx512][G][0] = &compact_avx512<G, false>;
  t.fn[kAvx512][G][1] = &compact_avx512<G, true>;
}

const CompactTable& compact_table() {
  static const CompactTable table = [] {
    __builtin_cpu_init();
    const bool fma = __builtin_cpu_supports("fma");
    CompactTable t{};
    fill_compact<kF32>(t, fma);
    fill_compact<kF16>(t, fma);
    fill_compact<kBF16>(t, fma);
    return t;
  }();
  return table;
}

// A skipped step writes nothing; like the chain's compact_store on the unchanged expansion, the
// flag still reports a NaN master (compact_cpu.cpp's expand formula).
__attribute__((target_clones("avx2", "default")))
bool expanded_has_nan(const uint16_t* l, const uint8_t* t, const uint16_t* b, int64_t jb,
                      int64_t je) {
  uint32_t nan = 0;
  for (int64_t j = jb; j < je; ++j) {
    const uint32_t tb = t[j];
    for (int k = 0; k < 8; ++k) {
      const int64_t i = j * 8 + k;
      const uint32_t u = l[i];
      const uint32_t carry = (u + ((tb >> k) & 1u) + 0x7FFFu) >> 16;
      const uint32_t x = ((uint32_t(b[i]) - carry) << 16) | u;
      nan |= uint32_t((x & 0x7FFFFFFFu) > 0x7F800000u);
    }
  }
  return nan != 0;
}

void check_vec(const at::Tensor& t, at::ScalarType dt, int64_t n, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == dt && t.numel() == n,
              "compact_adam_step: ", what, " must be a contiguous CPU ", c10::toString(dt),
              " tensor of ", n, " elements");
}

void check_one(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.numel() == 1, "compact_adam_step: ", what,
              " must be a one-element CPU tensor");
}

}  // namespace

// The compact master's AdamW step over one piece (see the top of the file). Arguments as
// adam_step's, with the master given as (low, ties, param) and nan_flag a 0-d bool |= NaN.
void compact_adam_step(at::Tensor low, at::Tensor ties, at::Tensor param, at::Tensor exp_avg,
                       at::Tensor exp_avg_sq, at::Tensor grad, at::Tensor nan_flag, double lr,
                       double beta1, double beta2, double eps, double weight_decay, bool adamw,
                       at::Tensor step, at::Tensor grad_scale, at::Tensor found_inf) {
  const int64_t n = low.numel();
  TORCH_CHECK(n % 8 == 0, "compact_adam_step: n must be a multiple of 8, got ", n);
  check_vec(low, at::kShort, n, "low");
  check_vec(ties, at::kByte, n / 8, "ties");
  check_vec(param, at::kBFloat16, n, "param");
  check_vec(exp_avg, at::kFloat, n, "exp_avg");
  check_vec(exp_avg_sq, at::kFloat, n, "exp_avg_sq");
  const auto gdt = grad.scalar_type();
  TORCH_CHECK(gdt == at::kFloat || gdt == at::kHalf || gdt == at::kBFloat16,
              "compact_adam_step: grad must be float32, float16 or bfloat16, got ", gdt);
  check_vec(grad, gdt, n, "grad");
  check_vec(nan_flag, at::kBool, 1, "nan_flag");
  check_one(step, "step");
  check_one(grad_scale, "grad_scale");
  check_one(found_inf, "found_inf");
  TORCH_CHECK(grad_scale.scalar_type() == at::kFloat, "compact_adam_step: grad_scale must be "
              "float32, got ", grad_scale.scalar_type());
  const auto fdt = found_inf.scalar_type();
  TORCH_CHECK(fdt == at::kBool || fdt == at::kFloat, "compact_adam_step: found_inf must be bool "
              "or float32, got ", fdt);
  const double step_value = read_step(step);
  const bool skip = read_flag(found_inf);
  auto* l = reinterpret_cast<uint16_t*>(low.data_ptr());
  auto* t = ties.data_ptr<uint8_t>();
  auto* b = reinterpret_cast<uint16_t*>(param.data_ptr());
  std::atomic<bool> any_nan{false};
  if (skip) {  // nothing written, step included; a NaN master still reported
    at::parallel_for(0, n / 8, kCompactChunk / 8, [&](int64_t jb, int64_t je) {
      if (expanded_has_nan(l, t, b, jb, je)) any_nan.store(true, std::memory_order_relaxed);
    });
    if (any_nan.load()) *nan_flag.data_ptr<bool>() = true;
    return;
  }
  // adam_step's host scalars (cpu_kernels.h), so the fused op stays bit for bit its update
  const AdamScalars s = adam_scalars(step_value, lr, beta1, beta2, eps, weight_decay,
                                     *grad_scale.data_ptr<float>());

  const int gtype = gdt == at::kFloat ? kF32 : gdt == at::kHalf ? kF16 : kBF16;
  const CompactChunkFn fn = compact_table().fn[current_isa()][gtype][adamw ? 1 : 0];
  const CompactPtrs ptrs{l, t, b, exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(),
                         grad.data_ptr()};
  const int64_t nchunks = (n + kCompactChunk - 1) / kCompactChunk;
  // grain: below kCompactParallelMin elements at::parallel_for stays on this thread
  at::parallel_for(0, nchunks, kCompactParallelMin / kCompactChunk, [&](int64_t c0, int64_t c1) {
    const bool bad = fn(ptrs, s, c0 * kCompactChunk, std::min(n, c1 * kCompactChunk));
    if (bad) any_nan.store(true, std::memory_order_relaxed);
  });
  if (any_nan.load()) *nan_flag.data_ptr<bool>() = true;
  increment_step(step);
}

}  // namespace zk_cpu
