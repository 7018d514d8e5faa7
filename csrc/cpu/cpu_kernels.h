// Shared declarations for the zerokern CPU kernels: per-chunk kernel tables (one per ISA) and the
// portable fp16/bf16 conversions every path must match bit for bit (DESIGN §3).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace zk_cpu {

// Element types seen by the kernels. Index order is used by the kernel tables below.
enum GradType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };
enum OutType : int { kOutNone = 0, kOutF16 = 1, kOutBF16 = 2 };

// Per-step scalars, already reduced to float on the host from float64 (DESIGN §3).
struct AdamScalars {
  float gs;         // grad_scale
  float decay;      // 1 - lr*wd (AdamW)
  float wd;         // weight decay (Adam + L2)
  float b1, b2;     // betas
  float omb1, omb2; // 1 - beta, rounded from float64
  float step_size;  // lr / (1 - beta1^t)
  float rsqrt_bc2;  // 1 / sqrt(1 - beta2^t)
  float eps;
};

// The step's host scalars (adam_step and the compact master's fused step share them, so the
// two stay bit for bit): bias corrections in float64, since fp32 pow loses 1e-5..1e-3
// relative for beta2 >= 0.999.
inline AdamScalars adam_scalars(double step_value, double lr, double beta1, double beta2,
                                double eps, double weight_decay, float grad_scale) {
  const double t = step_value + 1.0;
  const double bc1 = 1.0 - std::pow(beta1, t);
  const double bc2 = 1.0 - std::pow(beta2, t);
  AdamScalars s;
  s.gs = grad_scale;
  s.decay = float(1.0 - lr * weight_decay);
  s.wd = float(weight_decay);
  s.b1 = float(beta1);
  s.b2 = float(beta2);
  s.omb1 = float(1.0 - beta1);
  s.omb2 = float(1.0 - beta2);
  s.step_size = float(lr / bc1);
  s.rsqrt_bc2 = float(1.0 / std::sqrt(bc2));
  s.eps = float(eps);
  return s;
}

struct AdamPtrs {
  float* master;
  float* m;
  float* v;
  const void* grad;  // GradType elements
  void* out;         // OutType elements, or nullptr
  // Write param_out with non-temporal stores: set when the step's footprint exceeds the L3, where
  // skipping the read-for-ownership of param_out measured 3-9% faster (bf16, n = 2^22..2^26) and
  // 5-10% slower when everything fits in cache (n <= 2^20).
  bool stream_out;
};

// Updates elements [begin, end) of one chunk.
using AdamChunkFn = void (*)(const AdamPtrs&, const AdamScalars&, int64_t begin, int64_t end);
// Returns the float32 sum of squares of elements [begin, end) (lane order fixed per ISA).
using SumsqChunkFn = float (*)(const void* grad, int64_t begin, int64_t end);

struct IsaKernels {
  AdamChunkFn adam[3][3][2];  // [GradType][OutType][adamw]
  SumsqChunkFn sumsq[3];      // [GradType]
};

// Defines `const IsaKernels& ACCESSOR()` from the including file's adam_chunk<G, O, STREAM> and
// sumsq_chunk<G> templates: one table per SIMD ISA file, filled once (a function-local static).
// A macro, not a template: function templates cannot be passed as template arguments.
#define ZK_DEFINE_ISA_TABLE(ACCESSOR)                                   \
  const IsaKernels& ACCESSOR() {                                        \
    static const IsaKernels table = [] {                                \
      IsaKernels k{};                                                   \
      zk_fill_grad<kF32>(k);                                            \
      zk_fill_grad<kF16>(k);                                            \
      zk_fill_grad<kBF16>(k);                                           \
      return k;                                                         \
    }();                                                                \
    return table;                                                       \
  }

// The fill helpers ZK_DEFINE_ISA_TABLE expands to; declared in each ISA file's anonymous
// namespace by ZK_DEFINE_FILL_HELPERS, so they bind to that file's kernels.
#define ZK_DEFINE_FILL_HELPERS()                                        \
  template <int G, int O>                                               \
  void zk_fill_adam(IsaKernels& k) {                                    \
    k.adam[G][O][0] = &adam_chunk<G, O, false>;                         \
    k.adam[G][O][1] = &adam_chunk<G, O, true>;                          \
  }                                                                     \
  template <int G>                                                      \
  void zk_fill_grad(IsaKernels& k) {                                    \
    zk_fill_adam<G, kOutNone>(k);                                       \
    zk_fill_adam<G, kOutF16>(k);                                        \
    zk_fill_adam<G, kOutBF16>(k);                                       \
    k.sumsq[G] = &sumsq_chunk<G>;                                       \
  }

// The instruction set in use (adam_cpu.cpp's dispatch, op.force_isa): every op reads it.
enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };
int current_isa();

const IsaKernels& scalar_kernels();
const IsaKernels& avx2_kernels();
const IsaKernels& avx512_kernels();

// ---- portable conversions (no F16C): the scalar path and all vector tails use these ----

inline uint32_t f32_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
inline float bits_f32(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

inline float bf16_to_f32(uint16_t h) { return bits_f32(uint32_t(h) << 16); }

// Matches torch CPU's float->bfloat16: round-to-nearest-even, every NaN -> 0xFFFF.
inline uint16_t f32_to_bf16(float x) {
  if (x != x) return 0xFFFF;
  uint32_t b = f32_bits(x);
  return uint16_t((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

// Exact fp16 -> fp32, like vcvtph2ps (which keeps NaN payloads and sets the quiet bit).
inline float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t e = (h >> 10) & 0x1F, mant = h & 0x3FF;
  if (e == 0x1F) return bits_f32(sign | 0x7F800000u | (mant << 13) | (mant ? 0x400000u : 0u));
  if (e != 0) return bits_f32(sign | ((e + 112) << 23) | (mant << 13));
  // zero / subnormal: mant * 2^-24 is exact in float
  float mag = float(mant) * 5.9604644775390625e-08f;
  return sign ? -mag : mag;
}

// fp32 -> fp16 with round-to-nearest-even, bitwise like vcvtps2ph(RNE): subnormals rounded,
// overflow -> inf, NaN -> sign | 0x7E00 | top 10 payload bits.
inline uint16_t f32_to_f16(float x) {
  uint32_t b = f32_bits(x);
  uint16_t sign = uint16_t((b >> 16) & 0x8000);
  uint32_t a = b & 0x7FFFFFFFu;
  if (a >= 0x7F800000u) return a == 0x7F800000u ? (sign | 0x7C00) : (sign | 0x7E00 | ((a >> 13) & 0x3FF));
  if (a >= 0x477FF000u) return sign | 0x7C00;  // >= 65520 rounds to inf (65504 has odd mantissa)
  if (a >= 0x38800000u) {                       // normal half: rebias exponent, round on bit 13
    a += 0xC8000FFFu + ((a >> 13) & 1u);        // -(112 << 23) + 0xFFF, modulo 2^32
    return sign | uint16_t(a >> 13);
  }
  // subnormal half: value in units of 2^-24 = m * 2^(e - 126), rounded to nearest even
  uint32_t e = a >> 23;
  uint32_t shift = 126 - e;  // >= 14 here
  if (shift > 24) return sign;
  uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
  uint32_t q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return sign | uint16_t(q);
}

// Scans [begin, end) for inf/NaN: the rare path after a chunk's partial sum came out non-finite.
inline bool has_nonfinite(const void* grad, int type, int64_t begin, int64_t end) {
  if (type == kF32) {
    const uint32_t* g = static_cast<const uint32_t*>(grad);
    for (int64_t i = begin; i < end; ++i)
      if ((g[i] & 0x7F800000u) == 0x7F800000u) return true;
  } else {
    const uint16_t* g = static_cast<const uint16_t*>(grad);
    const uint16_t exp_mask = type == kF16 ? 0x7C00 : 0x7F80;
    for (int64_t i = begin; i < end; ++i)
      if ((g[i] & exp_mask) == exp_mask) return true;
  }
  return false;
}

}  // namespace zk_cpu
