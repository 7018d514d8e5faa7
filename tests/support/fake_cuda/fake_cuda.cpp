// A fake CUDA device for CPU-only torch builds, for tests only (issue 34).
//
// A CPU-only build registers no CUDA device guard and no CUDA hooks, so autograd on fake
// `cuda` tensors (FakeTensorMode) aborts the process ("PyTorch is not linked with support for
// cuda devices") and copies/indexing raise. This registers:
// * a device guard for DeviceType::CUDA with kFakeDevices devices, one (default) stream each,
//   and no-op events: every stream is the default stream, so autograd never has to order two;
// * CUDA hooks whose pinned-memory allocator is the CPU allocator plus a registry of the
//   blocks it handed out, so `pin_memory=True`, `.pin_memory()` and `is_pinned()` work and a
//   test can tell a pinned host buffer from a pageable one.
// No data ever lives on the fake device: tensors there are FakeTensors (meta storage).
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

namespace {

constexpr c10::DeviceIndex kFakeDevices = 8;
thread_local c10::DeviceIndex cur_device = 0;

struct FakeCudaGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return c10::DeviceType::CUDA; }
  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old(c10::DeviceType::CUDA, cur_device);
    if (d.has_index()) cur_device = d.index();
    return old;
  }
  c10::Device getDevice() const override { return {c10::DeviceType::CUDA, cur_device}; }
  void setDevice(c10::Device d) const override {
    if (d.has_index()) cur_device = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.has_index()) cur_device = d.index();
  }
  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    return c10::Stream(c10::Stream::DEFAULT, s.device());
  }
  c10::DeviceIndex deviceCount() const noexcept override { return kFakeDevices; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  void record(void**, const c10::Stream&, const c10::DeviceIndex,
              const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
};

// Pinned host memory: CPU memory whose blocks are remembered, so is_pinned() can answer.
std::mutex pinned_mu;
std::map<const char*, size_t> pinned_blocks;  // start -> bytes

void forget_pinned(void* ctx) {
  {
    std::lock_guard<std::mutex> lk(pinned_mu);
    pinned_blocks.erase(static_cast<const char*>(ctx));
  }
  std::free(ctx);
}

struct FakePinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    size_t bytes = ((n == 0 ? 1 : n) + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, bytes);
    // Zeroed: a device-to-host copy from a FakeTensor writes nothing, so a host flag read
    // after one (an overflow or NaN flag) reads 0, "nothing happened", not stale heap bytes.
    std::memset(p, 0, bytes);
    {
      std::lock_guard<std::mutex> lk(pinned_mu);
      pinned_blocks[static_cast<const char*>(p)] = n;
    }
    return {p, p, &forget_pinned, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &forget_pinned; }
  void copy_data(void* dst, const void* src, std::size_t n) const override {
    std::memcpy(dst, src, n);
  }
};

FakePinnedAllocator pinned_allocator;

struct FakeCudaHooks final : at::CUDAHooksInterface {
  explicit FakeCudaHooks(at::CUDAHooksArgs) {}
  void init() const override {}
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasCUDA() const override { return true; }
  c10::DeviceIndex deviceCount() const override { return kFakeDevices; }
  c10::DeviceIndex current_device() const override { return cur_device; }
  c10::DeviceIndex getCurrentDevice() const override { return cur_device; }
  void setCurrentDevice(c10::DeviceIndex d) const override { cur_device = d; }
  int getNumGPUs() const override { return kFakeDevices; }
  void deviceSynchronize(c10::DeviceIndex) const override {}
  c10::Allocator* getPinnedMemoryAllocator() const override { return &pinned_allocator; }
  bool isPinnedPtr(const void* data) const override {
    const char* p = static_cast<const char*>(data);
    std::lock_guard<std::mutex> lk(pinned_mu);
    auto it = pinned_blocks.upper_bound(p);
    if (it == pinned_blocks.begin()) return false;
    --it;
    return p < it->first + std::max<size_t>(it->second, 1);
  }
};

}  // namespace

C10_REGISTER_GUARD_IMPL(CUDA, FakeCudaGuard);
namespace at {
// getCUDAHooks() creates the class registered under the key "CUDAHooks" on its first call.
C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", FakeCudaHooks);
}  // namespace at

// cudaHostRegister / cudaHostUnregister stand-ins (torch.cuda.cudart() in the harness): the
// registered range reads as pinned.
extern "C" int zk_fake_cuda_host_register(void* ptr, size_t n, unsigned int) {
  std::memset(ptr, 0, n);  // (fresh memory; zeroed for the reason above)
  std::lock_guard<std::mutex> lk(pinned_mu);
  pinned_blocks[static_cast<const char*>(ptr)] = n;
  return 0;
}
extern "C" int zk_fake_cuda_host_unregister(void* ptr) {
  std::lock_guard<std::mutex> lk(pinned_mu);
  pinned_blocks.erase(static_cast<const char*>(ptr));
  return 0;
}

// For tests: live fake-pinned host blocks (ctypes: zk_fake_cuda_pinned_blocks()).
extern "C" int64_t zk_fake_cuda_pinned_blocks() {
  std::lock_guard<std::mutex> lk(pinned_mu);
  return static_cast<int64_t>(pinned_blocks.size());
}
