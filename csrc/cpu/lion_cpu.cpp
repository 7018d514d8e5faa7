// zerokern CPU Lion step (issue 23): one fused pass over a flat fp32 shard, numerics as
// zerokern/kernels/lion.py (lion-pytorch's Lion; DESIGN §3's skip / step / cast-back contract).
// Portable C++ the compiler vectorises (no -march: the .so stays valid on any x86-64); the
// fp16/bf16 conversions are cpu_kernels.h's, bitwise torch's round-to-nearest-even.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cstdint>

#include "cpu_kernels.h"
#include "step_scalars.h"

// [Note: Lion rounds every product] c = b1*m + (1-b1)*g is rounded as torch ops round it (the
// reference backend, and lion-pytorch's exp_avg.clone().mul_(b1).add(g, alpha=1-b1) on torch's
// DEFAULT CPU kernels; its AVX2 / AVX-512 kernels fuse add(alpha=) into an FMA, so lion-pytorch's
// bits depend on the host): each product rounded, then the sum; the momentum likewise. Contracted
// into an FMA, b1*m + (1-b1)*g where the rounded products cancel to exactly 0 comes out as the
// product's rounding error instead, and sign() gives +-1 against 0: the parameter moves by lr
// (tests/kernels/test_lion_cancellation.py). The build passes -ffp-contract=off (build.py,
// setup.py); these pragmas keep the contraction off where the file is built with other flags
// (GCC honors the optimize pragma per function, Clang the STDC one; GCC ignores the latter).
// Measured: under -march=x86-64-v3 -ffp-contract=fast lion_chunk had 3-33 FMAs per variant
// without them, none with them, still vectorized; under the project's flags the code is the same.
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace zk_cpu {
namespace {

// Elements per work item: 8192 x 14 B (fp32 master + m, 16-bit grad and out) ~ 112 KiB, as
// adam_cpu.cpp's chunk, far above the OpenMP scheduling cost.
constexpr int64_t kLionChunk = 8192;

struct LionScalars {
  float gs, decay, lr, b1, omb1, b2, omb2;
};

template <int G>
inline float load_grad(const void* g, int64_t i) {
  if (G == kF32) return static_cast<const float*>(g)[i];
  const uint16_t h = static_cast<const uint16_t*>(g)[i];
  return G == kF16 ? f16_to_f32(h) : bf16_to_f32(h);
}

// sign as torch.sign computes it, (c > 0) - (c < 0): +-1 for a nonzero number (subnormals and
// infinities included), +0 for +-0 and for NaN (torch.sign(nan) is 0, and so is the reference
// backend's). On the bits, with integer masks: GCC vectorizes those, where it keeps float
// compares (which may raise FE_INVALID) and their selects as branches, a scalar loop (measured:
// 16.8 ms for 2^22 fp32 elements, 10% of the read-modify-write ceiling; now 1.70 ms, 97%).
inline float sign_of(float c) {
  const uint32_t b = f32_bits(c);
  const uint32_t a = b & 0x7FFFFFFFu;
  // all ones where a is in [1, 0x7F800000] (a - 1 wraps for 0), else zero
  const uint32_t nonzero = 0u - uint32_t(a - 1u < 0x7F800000u);
  return bits_f32(nonzero & ((b & 0x80000000u) | 0x3F800000u));
}

// Vectorized by GCC (SSE2, the build has no -march) where the grad converts without branches
// (fp32, bf16): master, exp_avg, grad and param_out never overlap (four distinct buffers:
// __restrict__), sign_of has no branch, and noinline keeps the loop a function of its own
// (inlined into parallel_for's lambda, GCC reported "control flow in loop" and left it
// scalar). The per-element operations and their order are unchanged, so are the bits
// (-ffp-contract=off and the pragmas above keep the products and sums apart).
template <int G, int O>
__attribute__((noinline)) void lion_chunk(float* __restrict__ p, float* __restrict__ m,
                                          const void* __restrict__ grad,
                                          void* __restrict__ out, const LionScalars& s,
                                          int64_t b, int64_t e) {
  const LionScalars k = s;  // a local copy: no store can alias it either
  for (int64_t i = b; i < e; ++i) {
    const float g = load_grad<G>(grad, i) * k.gs;
    float x = p[i] * k.decay;
    const float c = k.b1 * m[i] + k.omb1 * g;
    x = x - k.lr * sign_of(c);
    m[i] = k.b2 * m[i] + k.omb2 * g;
    p[i] = x;
    if (O == kOutF16) static_cast<uint16_t*>(out)[i] = f32_to_f16(x);
    if (O == kOutBF16) static_cast<uint16_t*>(out)[i] = f32_to_bf16(x);
  }
}

template <int G>
void run_grad(int otype, float* p, float* m, const void* grad, void* out, const LionScalars& s,
              int64_t n) {
  at::parallel_for(0, (n + kLionChunk - 1) / kLionChunk, 1, [&](int64_t c0, int64_t c1) {
    const int64_t b = c0 * kLionChunk, e = std::min(n, c1 * kLionChunk);
    if (otype == kOutF16) lion_chunk<G, kOutF16>(p, m, grad, out, s, b, e);
    else if (otype == kOutBF16) lion_chunk<G, kOutBF16>(p, m, grad, out, s, b, e);
    else lion_chunk<G, kOutNone>(p, m, grad, out, s, b, e);
  });
}

void check_vec(const at::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.numel() == n, name, " must have ", n, " elements, got ", t.numel());
}

void check_one(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.numel() == 1, name, " must have exactly one element, got ", t.numel());
}

}  // namespace

void lion_step(at::Tensor master, at::Tensor exp_avg, at::Tensor grad,
               std::optional<at::Tensor> param_out, double lr, double beta1, double beta2,
               double weight_decay, at::Tensor step, at::Tensor grad_scale,
               at::Tensor found_inf) {
  const int64_t n = master.numel();
  check_vec(master, "master", n);
  check_vec(exp_avg, "exp_avg", n);
  check_vec(grad, "grad", n);
  TORCH_CHECK(master.scalar_type() == at::kFloat && exp_avg.scalar_type() == at::kFloat,
              "master and exp_avg must be float32");
  const auto gt = grad.scalar_type();
  TORCH_CHECK(gt == at::kFloat || gt == at::kHalf || gt == at::kBFloat16,
              "grad must be float32, float16 or bfloat16, got ", gt);
  int otype = kOutNone;
  void* out = nullptr;
  if (param_out.has_value()) {
    check_vec(*param_out, "param_out", n);
    const auto dt = param_out->scalar_type();
    TORCH_CHECK(dt == at::kHalf || dt == at::kBFloat16,
                "param_out must be float16 or bfloat16 (or None), got ", dt);
    otype = dt == at::kHalf ? kOutF16 : kOutBF16;
    out = param_out->data_ptr();
  }
  check_one(step, "step");
  check_one(grad_scale, "grad_scale");
  TORCH_CHECK(grad_scale.scalar_type() == at::kFloat, "grad_scale must be float32");
  check_one(found_inf, "found_inf");
  read_step(step);  // step's dtype checked before anything is written (step_scalars.h)
  if (read_flag(found_inf)) return;  // nothing is written, step included (DESIGN §3)
  // Derived scalars in float64, rounded once (as adam_cpu.cpp and the reference).
  const LionScalars s{*grad_scale.data_ptr<float>(), float(1.0 - lr * weight_decay), float(lr),
                      float(beta1), float(1.0 - beta1), float(beta2), float(1.0 - beta2)};
  float* p = master.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  const void* g = grad.data_ptr();
  if (gt == at::kFloat) run_grad<kF32>(otype, p, m, g, out, s, n);
  else if (gt == at::kHalf) run_grad<kF16>(otype, p, m, g, out, s, n);
  else run_grad<kBF16>(otype, p, m, g, out, s, n);
  increment_step(step);
}

}  // namespace zk_cpu
