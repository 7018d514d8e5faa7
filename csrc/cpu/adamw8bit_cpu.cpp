// zerokern CPU 8-bit AdamW step (issue 23): dequantize, AdamW update, requantize, one pass per
// 128-element block, numerics exactly zerokern/kernels/adamw8bit.py [Note: the 8-bit step, bit
// for bit]: every operation an IEEE-rounded fp32 add/mul/div/sqrt in the reference's order (no
// FMA: the op builds with -ffp-contract=off, kernels/build.py); the nearest code is the count of
// midpoints strictly below the value, a NaN above all (torch.bucketize(right=False)). The
// scalar path is here; AVX2 and AVX-512 paths (adamw8bit_avx2.cpp, adamw8bit_avx512.cpp) are
// picked by the extension's ISA dispatch (op.force_isa). The code maps and midpoints come
// from Python (the same fp32 tensors the reference uses).
//
// [Note: 8-bit CPU kernel speed] (issue 23; benchmarks/results/adamw8bit-cpu-kernel.md)
// Measured 2026-11-26 on the shared 2-core AMD EPYC (Zen 4) dev box, load average ~2, 2 threads,
// one step, fp32 grads, wall ms at n = 2^20 / 2^22 / 2^24 (median of 11, interleaved):
//   this op, AVX-512   1.6 / 7.5 / 25.7      (AVX2 3.3 / 15.7 / 56.4; scalar 17.7 / 78.1 / 377)
//   before (scalar, std::lower_bound)        36.7 / 124.8 / 935.5 (481 in a quieter run)
//   bitsandbytes 0.50.2 AdamW8bit, CPU       18.7 / 58.2 / 278.3
//   zerokern fp32 adam_step (memory-bound)   0.7 / 6.0 / 16.6
// So ~20x the old loop and ~10x bitsandbytes; 1.3-4x the fp32 kernel, because the step is
// compute-bound: of ~2.8 ns/element on one thread, the two searches take ~1.8 ([Note:
// branchless nearest code] in adamw8bit_cpu.h). The old scalar loop lost to the branchless scalar
// search by 1.6-2.5x, and to the vector paths by the rest.
//
// Issue 40 (Intel Xeon, AVX-512): the AVX-512 path finds codes by bucket ([Note: bucketed nearest
// code], adamw8bit_cpu.h) without the quantizer's two divisions, dequantizes v from byte planes
// of the map (Q8Planes, filled per call), prefetches its streams and streams param_out; measured
// in adamw8bit_avx512.cpp ([Note: 8-bit AVX-512 step cost]) and
// benchmarks/results/adamw8bit-cpu-kernel-issue40-*.md.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "adamw8bit_cpu.h"
#include "step_scalars.h"

namespace zk_cpu {
namespace {

constexpr int64_t kBlocksPerItem = 64;  // 8192 elements per work item, as lion_cpu.cpp
// Stream param_out (Q8Args::stream_out) from n = 2^21, as adam_cpu.cpp's kStreamMin: beyond the
// last-level cache the non-temporal stores skip reading param_out's lines before writing them.
constexpr int64_t kQ8StreamMin = int64_t(1) << 21;

template <int G>
inline float load_g(const void* g, int64_t i) {
  if (G == kF32) return static_cast<const float*>(g)[i];
  const uint16_t h = static_cast<const uint16_t*>(g)[i];
  return G == kF16 ? f16_to_f32(h) : bf16_to_f32(h);
}

// [Note: branchless nearest code] in adamw8bit_cpu.h.
inline uint8_t nearest(const float* mids, float x) {
  int pos = 0;
  for (int s = 128; s >= 1; s >>= 1) pos += !(mids[pos + s - 1] >= x) ? s : 0;
  return static_cast<uint8_t>(pos);
}

template <int G, int O>
void q8_blocks(const Q8Args& a, int64_t b0, int64_t b1) {
  float m[kQ8Block], v[kQ8Block];
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t base = b * kQ8Block;
    const float am = a.ma[b], av = a.va[b];
    float mmax = 0.f, vmax = 0.f;
    bool nan_m = false, nan_v = false;
    for (int64_t j = 0; j < kQ8Block; ++j) {
      const int64_t i = base + j;
      const float g = load_g<G>(a.grad, i) * a.gs;
      float mj = a.code_s[a.mq[i]] * am;
      float vj = a.code_u[a.vq[i]] * av;
      float x = a.p[i] * a.decay;
      const float t1 = a.b1 * mj;
      const float t2 = a.omb1 * g;
      mj = t1 + t2;
      const float gg = g * g;
      const float t3 = a.b2 * vj;
      const float t4 = a.omb2 * gg;
      vj = t3 + t4;
      const float den = std::sqrt(vj) * a.rsqrt_bc2 + a.eps;
      const float r = mj / den;
      x = x - a.step_size * r;
      a.p[i] = x;
      if (O == kOutF16) static_cast<uint16_t*>(a.out)[i] = f32_to_f16(x);
      if (O == kOutBF16) static_cast<uint16_t*>(a.out)[i] = f32_to_bf16(x);
      m[j] = mj;
      v[j] = vj;
      mmax = std::max(mmax, std::fabs(mj));
      vmax = std::max(vmax, std::fabs(vj));
      nan_m |= mj != mj;
      nan_v |= vj != vj;
    }
    if (nan_m) mmax = q8_nan_absmax(m);
    if (nan_v) vmax = q8_nan_absmax(v);
    a.ma[b] = mmax;
    a.va[b] = vmax;
    const float sm = mmax > 0.f ? mmax : 1.f, sv = vmax > 0.f ? vmax : 1.f;  // NaN: 1, as torch
    for (int64_t j = 0; j < kQ8Block; ++j) {
      a.mq[base + j] = nearest(a.mid_s, m[j] / sm);
      a.vq[base + j] = nearest(a.mid_u, v[j] / sv);
    }
  }
}

struct ScalarQ8 {
  Q8Kernels k;
  ScalarQ8() {
    fill<kF32>();
    fill<kF16>();
    fill<kBF16>();
  }
  template <int G>
  void fill() {
    k.blocks[G][kOutNone] = &q8_blocks<G, kOutNone>;
    k.blocks[G][kOutF16] = &q8_blocks<G, kOutF16>;
    k.blocks[G][kOutBF16] = &q8_blocks<G, kOutBF16>;
  }
};

// maps_finite: every code of both maps is finite (the library's maps are); the AVX-512 path's
// clean-block test (adamw8bit_avx512.cpp) relies on it, so other maps take the scalar path.
// ZEROKERN_Q8_AVX512_BASE (tests): the AVX-512 variant without AVX512_BF16 / AVX512_VBMI, as on
// Skylake-X and Cascade Lake, also on a CPU that has them.
const Q8Kernels& q8_kernels(bool maps_finite) {
  static const ScalarQ8 scalar;
  static const bool bf16_vbmi = cpu_has_bf16_vbmi();
  switch (current_isa()) {
    case kAvx512:
      if (!maps_finite) return scalar.k;
      return q8_avx512_kernels(bf16_vbmi && std::getenv("ZEROKERN_Q8_AVX512_BASE") == nullptr);
    case kAvx2: return q8_avx2_kernels();
    default: return scalar.k;
  }
}

bool all_finite(const float* x, int n) {
  bool ok = true;
  for (int i = 0; i < n; ++i) ok &= std::isfinite(x[i]);
  return ok;
}

// The bucket tables of a map ([Note: bucketed nearest code]), built once per distinct set of
// midpoints (~1.5 M compares) and kept for the process: entries are never freed, so a pointer
// handed to a running step stays valid. nullptr where the maps fail the table's conditions.
const Q8Buckets* q8_buckets(const float* mids, bool signed_map) {
  struct Entry {
    float mids[255];
    bool signed_map;
    std::unique_ptr<Q8Buckets> t;
  };
  static std::mutex mu;
  static std::vector<std::unique_ptr<Entry>> cache;
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& e : cache)
    if (e->signed_map == signed_map && std::memcmp(e->mids, mids, sizeof e->mids) == 0)
      return e->t->ok ? e->t.get() : nullptr;
  if (cache.size() >= 16) return nullptr;  // not the library's maps: the search serves them
  auto e = std::make_unique<Entry>();
  std::memcpy(e->mids, mids, sizeof e->mids);
  e->signed_map = signed_map;
  e->t = std::make_unique<Q8Buckets>();
  q8_fill_buckets(*e->t, mids, signed_map);
  cache.push_back(std::move(e));
  return cache.back()->t->ok ? cache.back()->t.get() : nullptr;
}

void q8_check(const at::Tensor& t, const char* name, int64_t n, at::ScalarType dt) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.numel() == n, name, " must have ", n, " elements, got ", t.numel());
  TORCH_CHECK(t.scalar_type() == dt, name, " has the wrong dtype ", t.scalar_type());
}

}  // namespace

void adamw8bit_step(at::Tensor master, at::Tensor m_q, at::Tensor m_absmax, at::Tensor v_q,
                    at::Tensor v_absmax, at::Tensor grad, std::optional<at::Tensor> param_out,
                    double lr, double beta1, double beta2, double eps, double weight_decay,
                    at::Tensor step, at::Tensor grad_scale, at::Tensor found_inf,
                    at::Tensor code_s, at::Tensor code_u, at::Tensor mid_s, at::Tensor mid_u) {
  const int64_t n = master.numel();
  TORCH_CHECK(n % kQ8Block == 0, "master must have a multiple of 128 elements, got ", n);
  const int64_t nb = n / kQ8Block;
  q8_check(master, "master", n, at::kFloat);
  q8_check(m_q, "m_q", n, at::kByte);
  q8_check(v_q, "v_q", n, at::kByte);
  q8_check(m_absmax, "m_absmax", nb, at::kFloat);
  q8_check(v_absmax, "v_absmax", nb, at::kFloat);
  q8_check(code_s, "code_s", 256, at::kFloat);
  q8_check(code_u, "code_u", 256, at::kFloat);
  q8_check(mid_s, "mid_s", 255, at::kFloat);
  q8_check(mid_u, "mid_u", 255, at::kFloat);
  const auto gt = grad.scalar_type();
  TORCH_CHECK(gt == at::kFloat || gt == at::kHalf || gt == at::kBFloat16,
              "grad must be float32, float16 or bfloat16, got ", gt);
  q8_check(grad, "grad", n, gt);
  int otype = kOutNone;
  void* out = nullptr;
  if (param_out.has_value()) {
    const auto dt = param_out->scalar_type();
    TORCH_CHECK(dt == at::kHalf || dt == at::kBFloat16,
                "param_out must be float16 or bfloat16 (or None), got ", dt);
    q8_check(*param_out, "param_out", n, dt);
    otype = dt == at::kHalf ? kOutF16 : kOutBF16;
    out = param_out->data_ptr();
  }
  TORCH_CHECK(step.numel() == 1 && grad_scale.numel() == 1 && found_inf.numel() == 1,
              "step, grad_scale and found_inf must have one element each");
  TORCH_CHECK(grad_scale.scalar_type() == at::kFloat, "grad_scale must be float32");
  const double t = read_step(step) + 1.0;  // (step_scalars.h; checks step's dtype first)
  if (read_flag(found_inf)) return;  // nothing is written, step included (DESIGN §3)
  // float64, rounded once: reference.bias_corrections and adamw8bit._scalars.
  const double bc1 = 1.0 - std::pow(beta1, t), bc2 = 1.0 - std::pow(beta2, t);
  Q8Search search_s, search_u;  // [Note: branchless nearest code]
  q8_fill_search(search_s, mid_s.data_ptr<float>());
  q8_fill_search(search_u, mid_u.data_ptr<float>());
  Q8Args a{master.data_ptr<float>(), m_q.data_ptr<uint8_t>(), m_absmax.data_ptr<float>(),
                 v_q.data_ptr<uint8_t>(), v_absmax.data_ptr<float>(), grad.data_ptr(), out,
                 *grad_scale.data_ptr<float>(), float(1.0 - lr * weight_decay), float(beta1),
                 float(1.0 - beta1), float(beta2), float(1.0 - beta2), float(lr / bc1),
                 float(1.0 / std::sqrt(bc2)), float(eps), code_s.data_ptr<float>(),
                 code_u.data_ptr<float>(), mid_s.data_ptr<float>(), mid_u.data_ptr<float>(),
                 &search_s, &search_u, nullptr, nullptr, nullptr, n >= kQ8StreamMin};
  Q8Planes planes;
  if (current_isa() == kAvx512) {  // the AVX-512 path reads them (adamw8bit_avx512.cpp)
    a.buckets_s = q8_buckets(mid_s.data_ptr<float>(), true);
    a.buckets_u = q8_buckets(mid_u.data_ptr<float>(), false);
    q8_fill_planes(planes, code_s.data_ptr<float>(), code_u.data_ptr<float>());
    a.planes = &planes;
  }
  const int gtype = gt == at::kFloat ? kF32 : gt == at::kHalf ? kF16 : kBF16;
  const bool maps_finite = all_finite(code_s.data_ptr<float>(), 256) &&
                           all_finite(code_u.data_ptr<float>(), 256);
  const Q8BlocksFn fn = q8_kernels(maps_finite).blocks[gtype][otype];
  at::parallel_for(0, (nb + kBlocksPerItem - 1) / kBlocksPerItem, 1, [&](int64_t c0, int64_t c1) {
    fn(a, c0 * kBlocksPerItem, std::min(nb, c1 * kBlocksPerItem));
  });
  increment_step(step);
}

}  // namespace zk_cpu
