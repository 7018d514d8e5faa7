// master="compact" on the CPU (zerokern/compact_master.py [Note: the compact master]): expand an
// fp32 master from its low halves, tie bits and bf16 params, and compact it back, one pass each.
// Bit patterns as unsigned integers; element i's tie bit is bit (i % 8) of byte i / 8.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>

namespace zk_cpu {
namespace {

constexpr int64_t kGrain = 4096;  // bytes of tie bits (32768 elements) per work item

void check(const at::Tensor& t, at::ScalarType dt, int64_t n, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == dt && t.numel() == n,
              "compact master: ", what, " must be a contiguous CPU ", c10::toString(dt),
              " tensor of ", n, " elements");
}

// The loops, built for AVX2 and plain x86-64, picked at load time (the build has no -march).
__attribute__((target_clones("avx2", "default")))
void expand_range(uint32_t* o, const uint16_t* l, const uint8_t* t, const uint16_t* b,
                  int64_t jb, int64_t je) {
  for (int64_t j = jb; j < je; ++j) {
    const uint32_t tb = t[j];
    for (int k = 0; k < 8; ++k) {
      const int64_t i = j * 8 + k;
      const uint32_t u = l[i];
      const uint32_t carry = (u + ((tb >> k) & 1u) + 0x7FFFu) >> 16;
      o[i] = ((uint32_t(b[i]) - carry) << 16) | u;
    }
  }
}

__attribute__((target_clones("avx2", "default")))
uint32_t store_range(const uint32_t* m, uint16_t* l, uint8_t* t, int64_t jb, int64_t je) {
  uint32_t nan = 0;
  for (int64_t j = jb; j < je; ++j) {
    uint32_t tb = 0;
    for (int k = 0; k < 8; ++k) {
      const int64_t i = j * 8 + k;
      const uint32_t x = m[i];
      const uint32_t lo = x & 0xFFFFu;
      l[i] = uint16_t(lo);
      tb |= (uint32_t(lo == 0x8000u) & (x >> 16) & 1u) << k;
      nan |= uint32_t((x & 0x7FFFFFFFu) > 0x7F800000u);
    }
    t[j] = uint8_t(tb);
  }
  return nan;
}

}  // namespace

// out (n,) fp32 = ((param - carry) << 16) | low, carry = 1 iff low > 0x8000 or (low == 0x8000
// and its tie bit): (low + tie + 0x7FFF) >> 16.
void compact_expand(at::Tensor out, at::Tensor low, at::Tensor ties, at::Tensor param) {
  const int64_t n = out.numel();
  TORCH_CHECK(n % 8 == 0, "compact master: n must be a multiple of 8, got ", n);
  check(out, at::kFloat, n, "out");
  check(low, at::kShort, n, "low");
  check(ties, at::kByte, n / 8, "ties");
  check(param, at::kBFloat16, n, "param");
  auto* o = reinterpret_cast<uint32_t*>(out.data_ptr());
  const auto* l = reinterpret_cast<const uint16_t*>(low.data_ptr());
  const auto* t = ties.data_ptr<uint8_t>();
  const auto* b = reinterpret_cast<const uint16_t*>(param.data_ptr());
  at::parallel_for(0, n / 8, kGrain, [&](int64_t jb, int64_t je) {
    expand_range(o, l, t, b, jb, je);
  });
}

// low = master & 0xFFFF; tie bit = (low == 0x8000) & (master >> 16) & 1; nan_flag |= any NaN.
void compact_store(at::Tensor low, at::Tensor ties, at::Tensor master, at::Tensor nan_flag) {
  const int64_t n = master.numel();
  TORCH_CHECK(n % 8 == 0, "compact master: n must be a multiple of 8, got ", n);
  check(master, at::kFloat, n, "master");
  check(low, at::kShort, n, "low");
  check(ties, at::kByte, n / 8, "ties");
  check(nan_flag, at::kBool, 1, "nan_flag");
  const auto* m = reinterpret_cast<const uint32_t*>(master.data_ptr());
  auto* l = reinterpret_cast<uint16_t*>(low.data_ptr());
  auto* t = ties.data_ptr<uint8_t>();
  std::atomic<bool> any_nan{false};
  at::parallel_for(0, n / 8, kGrain, [&](int64_t jb, int64_t je) {
    if (store_range(m, l, t, jb, je)) any_nan.store(true, std::memory_order_relaxed);
  });
  if (any_nan.load()) *nan_flag.data_ptr<bool>() = true;
}

}  // namespace zk_cpu
