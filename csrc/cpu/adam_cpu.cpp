// zerokern CPU extension: argument checks, host-side scalars, ISA dispatch and the OpenMP chunk
// loops for adam_step / grad_stats (numerics: DESIGN §3). The per-chunk kernels live in
// kernels_{scalar,avx2,avx512}.cpp.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>
#include <vector>

#include "cpu_kernels.h"
#include "step_scalars.h"

namespace zk_cpu {
namespace {

// Elements per adam_step work item: 4096 x 28 B = 112 KiB per chunk keeps the tail handling
// per chunk while being far above the OpenMP scheduling cost.
constexpr int64_t kAdamChunk = 4096;
// Elements per grad_stats partial. Fixed, so the sum does not depend on the thread count.
constexpr int64_t kStatsChunk = 16384;
// Below this many elements one thread is faster than waking the pool (fork/join ~ several us).
constexpr int64_t kParallelMin = 32768;

// Stream param_out (AdamPtrs::stream_out) from n = 2^21 (~60 MB touched per step, beyond a
// 32 MiB L3): measured crossover n = 2^20..2^21 here. A fixed constant, because the L3 size that
// sysconf reports in VMs is unreliable (it claims 320 MiB on this 32 MiB box).
constexpr int64_t kStreamMin = int64_t(1) << 21;

// __builtin_cpu_init() first: g_isa is initialised from a static constructor, which may run
// before libgcc's own CPU-model constructor.
bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}

int best_isa() { return cpu_has_avx512() ? kAvx512 : cpu_has_avx2() ? kAvx2 : kScalar; }

std::atomic<int> g_isa{best_isa()};

const IsaKernels& kernels() {
  switch (g_isa.load(std::memory_order_relaxed)) {
    case kAvx512: return avx512_kernels();
    case kAvx2: return avx2_kernels();
    default: return scalar_kernels();
  }
}

int grad_type_of(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return kF32;
    case at::kHalf: return kF16;
    case at::kBFloat16: return kBF16;
    default: TORCH_CHECK(false, name, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
  return kF32;
}

void check_cpu_contig(const at::Tensor& t, const char* name, int64_t numel) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.numel() == numel, name, " must have ", numel, " elements, got ", t.numel());
}

void check_scalar(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.numel() == 1, name, " must have exactly one element, got ", t.numel());
}

void check_flag(const at::Tensor& f) {
  check_scalar(f, "found_inf");
  TORCH_CHECK(f.scalar_type() == at::kBool || f.scalar_type() == at::kFloat,
              "found_inf must be bool or float32, got ", f.scalar_type());
}

// Runs fn(chunk_index) for every chunk; OpenMP's static schedule hands each thread one
// contiguous range, which keeps the hardware prefetchers on long sequential streams.
template <typename Fn>
void for_each_chunk(int64_t n, int64_t chunk, const Fn& fn) {
  const int64_t nchunks = (n + chunk - 1) / chunk;
  if (n < kParallelMin || at::get_num_threads() == 1 || at::in_parallel_region()) {
    for (int64_t c = 0; c < nchunks; ++c) fn(c);
    return;
  }
#pragma omp parallel for schedule(static) num_threads(at::get_num_threads())
  for (int64_t c = 0; c < nchunks; ++c) fn(c);
}

}  // namespace

// Fused Adam/AdamW step on one flat fp32 shard with cast-back into param_out (DESIGN §3).
void adam_step(at::Tensor master, at::Tensor exp_avg, at::Tensor exp_avg_sq, at::Tensor grad,
               std::optional<at::Tensor> param_out, double lr, double beta1, double beta2,
               double eps, double weight_decay, bool adamw, at::Tensor step,
               at::Tensor grad_scale, at::Tensor found_inf) {
  const int64_t n = master.numel();
  check_cpu_contig(master, "master", n);
  check_cpu_contig(exp_avg, "exp_avg", n);
  check_cpu_contig(exp_avg_sq, "exp_avg_sq", n);
  check_cpu_contig(grad, "grad", n);
  TORCH_CHECK(master.scalar_type() == at::kFloat && exp_avg.scalar_type() == at::kFloat &&
                  exp_avg_sq.scalar_type() == at::kFloat,
              "master, exp_avg and exp_avg_sq must be float32");
  const int gtype = grad_type_of(grad, "grad");
  int otype = kOutNone;
  void* out = nullptr;
  if (param_out.has_value()) {
    check_cpu_contig(*param_out, "param_out", n);
    const auto dt = param_out->scalar_type();
    TORCH_CHECK(dt == at::kHalf || dt == at::kBFloat16,
                "param_out must be float16 or bfloat16 (or None), got ", dt);
    otype = dt == at::kHalf ? kOutF16 : kOutBF16;
    out = param_out->data_ptr();
  }
  check_scalar(step, "step");
  const double step_value = read_step(step);
  check_scalar(grad_scale, "grad_scale");
  TORCH_CHECK(grad_scale.scalar_type() == at::kFloat, "grad_scale must be float32, got ",
              grad_scale.scalar_type());
  check_flag(found_inf);

  if (read_flag(found_inf)) return;  // skipped step: nothing is written, step included

  const AdamScalars s = adam_scalars(step_value, lr, beta1, beta2, eps, weight_decay,
                                     *grad_scale.data_ptr<float>());

  const AdamPtrs ptrs{master.data_ptr<float>(), exp_avg.data_ptr<float>(),
                      exp_avg_sq.data_ptr<float>(), grad.data_ptr(), out,
                      n >= kStreamMin};
  const AdamChunkFn fn = kernels().adam[gtype][otype][adamw ? 1 : 0];
  for_each_chunk(n, kAdamChunk, [&](int64_t c) {
    const int64_t b = c * kAdamChunk;
    fn(ptrs, s, b, std::min(n, b + kAdamChunk));
  });
  increment_step(step);
}

// found_inf |= any(!isfinite(grad)); sumsq += sum(float(grad)^2), deterministic in the thread
// count: fixed chunks -> float partials -> one sequential double sum in chunk order.
void grad_stats(at::Tensor grad, at::Tensor found_inf, at::Tensor sumsq) {
  const int64_t n = grad.numel();
  check_cpu_contig(grad, "grad", n);
  const int gtype = grad_type_of(grad, "grad");
  check_flag(found_inf);
  check_scalar(sumsq, "sumsq");
  TORCH_CHECK(sumsq.scalar_type() == at::kFloat || sumsq.scalar_type() == at::kDouble,
              "sumsq must be float32 or float64, got ", sumsq.scalar_type());

  const int64_t nchunks = (n + kStatsChunk - 1) / kStatsChunk;
  std::vector<double> partial(nchunks);
  std::vector<unsigned char> bad(nchunks, 0);
  const void* g = grad.data_ptr();
  const SumsqChunkFn fn = kernels().sumsq[gtype];
  // A non-finite element always makes its chunk's sum inf/NaN (squares are >= 0), so the hot
  // loop has no isfinite test; only a non-finite partial triggers an exact rescan.
  for_each_chunk(n, kStatsChunk, [&](int64_t c) {
    const int64_t b = c * kStatsChunk, e = std::min(n, b + kStatsChunk);
    const float p = fn(g, b, e);
    partial[c] = p;
    if (!std::isfinite(p)) bad[c] = has_nonfinite(g, gtype, b, e);
  });
  double total = 0.0;
  bool any_bad = false;
  for (int64_t c = 0; c < nchunks; ++c) {
    total += partial[c];
    any_bad |= bad[c] != 0;
  }
  if (any_bad) {
    if (found_inf.scalar_type() == at::kBool) *found_inf.data_ptr<bool>() = true;
    else *found_inf.data_ptr<float>() = 1.0f;
  }
  if (sumsq.scalar_type() == at::kDouble) *sumsq.data_ptr<double>() += total;
  else *sumsq.data_ptr<float>() = float(double(*sumsq.data_ptr<float>()) + total);
}

pybind11::dict cpu_features() {
  __builtin_cpu_init();
  pybind11::dict d;
  d["avx512f"] = bool(__builtin_cpu_supports("avx512f"));
  d["avx512bw"] = bool(__builtin_cpu_supports("avx512bw"));
  d["avx512vl"] = bool(__builtin_cpu_supports("avx512vl"));
  d["avx512dq"] = bool(__builtin_cpu_supports("avx512dq"));
  d["avx512_bf16"] = bool(__builtin_cpu_supports("avx512bf16"));
  d["avx2"] = bool(__builtin_cpu_supports("avx2"));
  d["fma"] = bool(__builtin_cpu_supports("fma"));
  d["f16c"] = bool(__builtin_cpu_supports("f16c"));
  return d;
}

std::string selected_isa() {
  switch (g_isa.load()) {
    case kAvx512: return "avx512";
    case kAvx2: return "avx2";
    default: return "scalar";
  }
}

void force_isa(const std::string& name) {
  int isa;
  if (name == "auto") isa = best_isa();
  else if (name == "avx512") {
    if (!cpu_has_avx512())
      throw pybind11::value_error("force_isa('avx512'): this CPU lacks avx512f/bw/vl/dq+fma+f16c");
    isa = kAvx512;
  } else if (name == "avx2") {
    if (!cpu_has_avx2()) throw pybind11::value_error("force_isa('avx2'): this CPU lacks avx2+fma+f16c");
    isa = kAvx2;
  } else if (name == "scalar") {
    isa = kScalar;
  } else {
    throw pybind11::value_error("force_isa: name must be 'auto', 'avx512', 'avx2' or 'scalar', got '" +
                                name + "'");
  }
  g_isa.store(isa);
}

int current_isa() { return g_isa.load(std::memory_order_relaxed); }

}  // namespace zk_cpu

namespace zk_cpu {  // compact_cpu.cpp (master="compact")
void compact_expand(at::Tensor out, at::Tensor low, at::Tensor ties, at::Tensor param);
void compact_store(at::Tensor low, at::Tensor ties, at::Tensor master, at::Tensor nan_flag);
}  // namespace zk_cpu

namespace zk_cpu {  // compact_adam_cpu.cpp (master="compact", AdamW fused)
void compact_adam_step(at::Tensor low, at::Tensor ties, at::Tensor param, at::Tensor exp_avg,
                       at::Tensor exp_avg_sq, at::Tensor grad, at::Tensor nan_flag, double lr,
                       double beta1, double beta2, double eps, double weight_decay, bool adamw,
                       at::Tensor step, at::Tensor grad_scale, at::Tensor found_inf);
}  // namespace zk_cpu

namespace zk_cpu {  // lion_cpu.cpp (ZeroLion)
void lion_step(at::Tensor master, at::Tensor exp_avg, at::Tensor grad,
               std::optional<at::Tensor> param_out, double lr, double beta1, double beta2,
               double weight_decay, at::Tensor step, at::Tensor grad_scale, at::Tensor found_inf);
}  // namespace zk_cpu

namespace zk_cpu {  // adamw8bit_cpu.cpp (ZeroAdamW(state_bits=8))
void adamw8bit_step(at::Tensor master, at::Tensor m_q, at::Tensor m_absmax, at::Tensor v_q,
                    at::Tensor v_absmax, at::Tensor grad, std::optional<at::Tensor> param_out,
                    double lr, double beta1, double beta2, double eps, double weight_decay,
                    at::Tensor step, at::Tensor grad_scale, at::Tensor found_inf,
                    at::Tensor code_s, at::Tensor code_u, at::Tensor mid_s, at::Tensor mid_u);
}  // namespace zk_cpu

namespace zk_cpu {  // blockquant_cpu.cpp (ZeRO++'s quantized collectives)
void blockquant_quantize(at::Tensor x, at::Tensor codes, at::Tensor scale, int64_t block,
                         int64_t bits);
void blockquant_dequantize(at::Tensor codes, at::Tensor scale, at::Tensor out, int64_t block,
                           int64_t bits);
void blockquant_dequantize_add(at::Tensor codes, at::Tensor scale, at::Tensor acc, int64_t block,
                               int64_t bits);
}  // namespace zk_cpu

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace pybind11::literals;
  // [Note: the kernels release the GIL] (zerokern/kernels/native.py)
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.doc() = "zerokern CPU kernels (OpenMP + AVX-512/AVX2/F16C chosen at run time, scalar fallback)";
  m.def("adam_step", &zk_cpu::adam_step, nogil, "Fused Adam/AdamW step with cast-back (DESIGN §3)",
        "master"_a, "exp_avg"_a, "exp_avg_sq"_a, "grad"_a, "param_out"_a, "lr"_a, "beta1"_a,
        "beta2"_a, "eps"_a, "weight_decay"_a, "adamw"_a, "step"_a, "grad_scale"_a, "found_inf"_a);
  m.def("grad_stats", &zk_cpu::grad_stats, nogil, "found_inf |= any(!isfinite(grad)); sumsq += sum(grad^2)",
        "grad"_a, "found_inf"_a, "sumsq"_a);
  m.def("compact_expand", &zk_cpu::compact_expand, nogil,
        "master='compact': out = the fp32 master of (low halves, tie bits, bf16 params)",
        "out"_a, "low"_a, "ties"_a, "param"_a);
  m.def("compact_store", &zk_cpu::compact_store, nogil,
        "master='compact': low halves and tie bits of an fp32 master; nan_flag |= any NaN",
        "low"_a, "ties"_a, "master"_a, "nan_flag"_a);
  m.def("compact_adam_step", &zk_cpu::compact_adam_step, nogil,
        "master='compact': expand -> AdamW step -> compact in one pass; nan_flag |= any NaN",
        "low"_a, "ties"_a, "param"_a, "exp_avg"_a, "exp_avg_sq"_a, "grad"_a, "nan_flag"_a,
        "lr"_a, "beta1"_a, "beta2"_a, "eps"_a, "weight_decay"_a, "adamw"_a, "step"_a,
        "grad_scale"_a, "found_inf"_a);
  m.def("lion_step", &zk_cpu::lion_step, nogil, "Fused Lion step with cast-back (kernels/lion.py)",
        "master"_a, "exp_avg"_a, "grad"_a, "param_out"_a, "lr"_a, "beta1"_a, "beta2"_a,
        "weight_decay"_a, "step"_a, "grad_scale"_a, "found_inf"_a);
  m.def("adamw8bit_step", &zk_cpu::adamw8bit_step, nogil,
        "Fused AdamW step with 8-bit block-quantized moments (kernels/adamw8bit.py)",
        "master"_a, "m_q"_a, "m_absmax"_a, "v_q"_a, "v_absmax"_a, "grad"_a, "param_out"_a,
        "lr"_a, "beta1"_a, "beta2"_a, "eps"_a, "weight_decay"_a, "step"_a, "grad_scale"_a,
        "found_inf"_a, "code_s"_a, "code_u"_a, "mid_s"_a, "mid_u"_a);
  m.def("blockquant_quantize", &zk_cpu::blockquant_quantize, nogil,
        "codes and fp32 scales of x per block (kernels/blockquant.py's contract)",
        "x"_a, "codes"_a, "scale"_a, "block"_a, "bits"_a);
  m.def("blockquant_dequantize", &zk_cpu::blockquant_dequantize, nogil,
        "out = codes * scale per block, rounded to out's dtype", "codes"_a, "scale"_a, "out"_a,
        "block"_a, "bits"_a);
  m.def("blockquant_dequantize_add", &zk_cpu::blockquant_dequantize_add, nogil,
        "acc (fp32) += codes * scale per block (qgZ's decode-and-sum)", "codes"_a, "scale"_a,
        "acc"_a, "block"_a, "bits"_a);
  m.def("cpu_features", &zk_cpu::cpu_features, "CPU feature flags seen by the dispatcher");
  m.def("selected_isa", &zk_cpu::selected_isa, "ISA in use: 'avx512' | 'avx2' | 'scalar'");
  m.def("force_isa", &zk_cpu::force_isa, "Select 'auto' | 'avx512' | 'avx2' | 'scalar'", "name"_a);
}
