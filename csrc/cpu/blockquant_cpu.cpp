// zerokern CPU block quantization (ZeRO++'s qwZ / qgZ payloads): one fused pass per block of
// zerokern/kernels/blockquant.py's contract, bitwise the reference on finite input:
//   scale = absmax / Q (fp32, IEEE division), code = clamp(rne(x / scale), -Q, Q), scale 0 for
//   an all-zero block (codes 0); x' = code * scale in fp32, then RNE to the out dtype.
// A block holding inf or NaN gets a non-finite scale (NaN wins, as torch's amax), so every
// element of it dequantizes to inf or NaN; its codes are 0 there (the reference's are
// whatever the float -> int8 cast gives: unspecified, the scale carries the non-finite).
// Portable C++ the compiler vectorises (no -march, as lion_cpu.cpp); blocks <= 128 elements
// are staged in a stack array so the absmax, the division and the codes are separate loops.
// Measured against the torch reference ops on this VM (1 thread, 2^20 fp32 elements): see
// blockquant.py [Note: the CPU codec].
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

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
    } else {
      uint16_t* d = static_cast<uint16_t*>(out) + o;
      for (int64_t k = 0; k < block; ++k) d[k] = O == kBF16 ? f32_to_bf16(v[k]) : f32_to_f16(v[k]);
    }
  }
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
  const int t = kind_of(x, "x");
  const void* xp = x.data_ptr();
  void* cp = codes.data_ptr();
  float* sp = scale.data_ptr<float>();
  over_blocks(n / block, [&](int64_t b0, int64_t b1) {
    if (bits == 8) {
      if (t == kF32) quant_range<kF32, 8>(xp, cp, sp, block, b0, b1);
      else if (t == kBF16) quant_range<kBF16, 8>(xp, cp, sp, block, b0, b1);
      else quant_range<kF16, 8>(xp, cp, sp, block, b0, b1);
    } else {
      if (t == kF32) quant_range<kF32, 4>(xp, cp, sp, block, b0, b1);
      else if (t == kBF16) quant_range<kBF16, 4>(xp, cp, sp, block, b0, b1);
      else quant_range<kF16, 4>(xp, cp, sp, block, b0, b1);
    }
  });
}

void blockquant_dequantize(at::Tensor codes, at::Tensor scale, at::Tensor out, int64_t block,
                           int64_t bits) {
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4, got ", bits);
  const int64_t n = scale.numel() * block;
  check(scale, "scale", n / block);
  check(codes, "codes", bits == 8 ? n : n / 2);
  check(out, "out", n);
  TORCH_CHECK(scale.scalar_type() == at::kFloat, "scale must be float32");
  const int o = kind_of(out, "out");
  const void* cp = codes.data_ptr();
  const float* sp = scale.data_ptr<float>();
  void* op = out.data_ptr();
  over_blocks(n / block, [&](int64_t b0, int64_t b1) {
    if (bits == 8) {
      if (o == kF32) dequant_range<8, kF32>(cp, sp, op, block, b0, b1);
      else if (o == kBF16) dequant_range<8, kBF16>(cp, sp, op, block, b0, b1);
      else dequant_range<8, kF16>(cp, sp, op, block, b0, b1);
    } else {
      if (o == kF32) dequant_range<4, kF32>(cp, sp, op, block, b0, b1);
      else if (o == kBF16) dequant_range<4, kBF16>(cp, sp, op, block, b0, b1);
      else dequant_range<4, kF16>(cp, sp, op, block, b0, b1);
    }
  });
}

}  // namespace zk_cpu
