// zerokern CPU 8-bit AdamW step (issue 23): dequantize, AdamW update, requantize, one pass per
// 128-element block, numerics exactly zerokern/kernels/adamw8bit.py [Note: the 8-bit step, bit
// for bit]: every operation an IEEE-rounded fp32 add/mul/div/sqrt in the reference's order (no
// -march and ISO C++17, so no FMA contraction); the nearest code is the count of midpoints
// strictly below the value (torch.bucketize(right=False)). The code maps and midpoints come
// from Python (the same fp32 tensors the reference uses).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu_kernels.h"

namespace zk_cpu {
namespace {

constexpr int64_t kBlock = 128;
constexpr int64_t kBlocksPerItem = 64;  // 8192 elements per work item, as lion_cpu.cpp

struct Q8Scalars {
  float gs, decay, b1, omb1, b2, omb2, step_size, rsqrt_bc2, eps;
};

struct Q8Maps {
  const float* code_s;  // 256 signed codes
  const float* code_u;  // 256 unsigned codes
  const float* mid_s;   // 255 midpoints
  const float* mid_u;
};

template <int G>
inline float load_g(const void* g, int64_t i) {
  if (G == kF32) return static_cast<const float*>(g)[i];
  const uint16_t h = static_cast<const uint16_t*>(g)[i];
  return G == kF16 ? f16_to_f32(h) : bf16_to_f32(h);
}

inline uint8_t nearest(const float* mids, float x) {
  return static_cast<uint8_t>(std::lower_bound(mids, mids + 255, x) - mids);
}

template <int G, int O>
void q8_blocks(float* p, uint8_t* mq, float* ma, uint8_t* vq, float* va, const void* grad,
               void* out, const Q8Scalars& s, const Q8Maps& mp, int64_t b0, int64_t b1) {
  float m[kBlock], v[kBlock];
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t base = b * kBlock;
    const float am = ma[b], av = va[b];
    float mmax = 0.f, vmax = 0.f;
    for (int64_t j = 0; j < kBlock; ++j) {
      const int64_t i = base + j;
      const float g = load_g<G>(grad, i) * s.gs;
      float mj = mp.code_s[mq[i]] * am;
      float vj = mp.code_u[vq[i]] * av;
      float x = p[i] * s.decay;
      const float t1 = s.b1 * mj;
      const float t2 = s.omb1 * g;
      mj = t1 + t2;
      const float gg = g * g;
      const float t3 = s.b2 * vj;
      const float t4 = s.omb2 * gg;
      vj = t3 + t4;
      const float den = std::sqrt(vj) * s.rsqrt_bc2 + s.eps;
      const float r = mj / den;
      x = x - s.step_size * r;
      p[i] = x;
      if (O == kOutF16) static_cast<uint16_t*>(out)[i] = f32_to_f16(x);
      if (O == kOutBF16) static_cast<uint16_t*>(out)[i] = f32_to_bf16(x);
      m[j] = mj;
      v[j] = vj;
      mmax = std::max(mmax, std::fabs(mj));
      vmax = std::max(vmax, std::fabs(vj));
    }
    ma[b] = mmax;
    va[b] = vmax;
    const float sm = mmax > 0.f ? mmax : 1.f, sv = vmax > 0.f ? vmax : 1.f;
    for (int64_t j = 0; j < kBlock; ++j) {
      mq[base + j] = nearest(mp.mid_s, m[j] / sm);
      vq[base + j] = nearest(mp.mid_u, v[j] / sv);
    }
  }
}

template <int G>
void q8_run(int otype, float* p, uint8_t* mq, float* ma, uint8_t* vq, float* va,
            const void* grad, void* out, const Q8Scalars& s, const Q8Maps& mp, int64_t nb) {
  at::parallel_for(0, (nb + kBlocksPerItem - 1) / kBlocksPerItem, 1, [&](int64_t c0, int64_t c1) {
    const int64_t b = c0 * kBlocksPerItem, e = std::min(nb, c1 * kBlocksPerItem);
    if (otype == kOutF16) q8_blocks<G, kOutF16>(p, mq, ma, vq, va, grad, out, s, mp, b, e);
    else if (otype == kOutBF16) q8_blocks<G, kOutBF16>(p, mq, ma, vq, va, grad, out, s, mp, b, e);
    else q8_blocks<G, kOutNone>(p, mq, ma, vq, va, grad, out, s, mp, b, e);
  });
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
  TORCH_CHECK(n % kBlock == 0, "master must have a multiple of 128 elements, got ", n);
  const int64_t nb = n / kBlock;
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
  const bool skip = found_inf.scalar_type() == at::kBool ? *found_inf.data_ptr<bool>()
                                                          : *found_inf.data_ptr<float>() != 0.0f;
  if (skip) return;  // nothing is written, step included (DESIGN §3)
  double t;
  switch (step.scalar_type()) {
    case at::kLong: t = double(*step.data_ptr<int64_t>()) + 1.0; break;
    case at::kInt: t = double(*step.data_ptr<int32_t>()) + 1.0; break;
    case at::kFloat: t = double(*step.data_ptr<float>()) + 1.0; break;
    case at::kDouble: t = *step.data_ptr<double>() + 1.0; break;
    default: TORCH_CHECK(false, "step must be int64, int32, float32 or float64");
  }
  // float64, rounded once: reference.bias_corrections and adamw8bit._scalars.
  const double bc1 = 1.0 - std::pow(beta1, t), bc2 = 1.0 - std::pow(beta2, t);
  const Q8Scalars s{*grad_scale.data_ptr<float>(), float(1.0 - lr * weight_decay),
                    float(beta1), float(1.0 - beta1), float(beta2), float(1.0 - beta2),
                    float(lr / bc1), float(1.0 / std::sqrt(bc2)), float(eps)};
  const Q8Maps mp{code_s.data_ptr<float>(), code_u.data_ptr<float>(), mid_s.data_ptr<float>(),
                  mid_u.data_ptr<float>()};
  float* p = master.data_ptr<float>();
  uint8_t* mq = m_q.data_ptr<uint8_t>();
  uint8_t* vq = v_q.data_ptr<uint8_t>();
  float* ma = m_absmax.data_ptr<float>();
  float* va = v_absmax.data_ptr<float>();
  const void* g = grad.data_ptr();
  if (gt == at::kFloat) q8_run<kF32>(otype, p, mq, ma, vq, va, g, out, s, mp, nb);
  else if (gt == at::kHalf) q8_run<kF16>(otype, p, mq, ma, vq, va, g, out, s, mp, nb);
  else q8_run<kBF16>(otype, p, mq, ma, vq, va, g, out, s, mp, nb);
  switch (step.scalar_type()) {
    case at::kLong: *step.data_ptr<int64_t>() += 1; break;
    case at::kInt: *step.data_ptr<int32_t>() += 1; break;
    case at::kFloat: *step.data_ptr<float>() += 1.0f; break;
    default: *step.data_ptr<double>() += 1.0; break;
  }
}

}  // namespace zk_cpu
