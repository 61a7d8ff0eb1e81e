// cupool.torch.enable(shim=True): PyTorch's pluggable allocator over cupool's hooks, plus
// the two answers the pluggable allocator cannot give from plain C functions:
// - cacheInfo (cuDNN's benchmark mode asks it for the largest workspace it may take;
//   PyTorch's pluggable allocator raises "does not yet support cacheInfo");
// - out of memory: the pluggable allocator hands a NULL pointer to the tensor; here it
//   raises torch.OutOfMemoryError instead, as PyTorch's own allocator does.
// Built at enable() time against the installed PyTorch (torch.utils.cpp_extension), since
// PyTorch's C++ ABI differs between versions. Everything else is the pluggable allocator.
#include <torch/extension.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <cstdint>
#include <memory>
#include <string>

namespace {

using Pluggable = torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator;
using AllocFn = void* (*)(size_t, int, cudaStream_t);
using FreeFn = void (*)(void*, size_t, int, cudaStream_t);
using InitFn = void (*)(int);
using ResetFn = void (*)();
using FractionFn = void (*)(double, int);
using RecordStreamFn = void (*)(void*, cudaStream_t);
using BaseAllocFn = void* (*)(void*, size_t*);
// cupool_mem_get_info: free and total bytes of a device as cupool sees them (cached
// memory counts as free); 0 on success.
using MemInfoFn = int (*)(int, size_t*, size_t*);

struct CupoolAllocator final : Pluggable {
  CupoolAllocator(AllocFn alloc, FreeFn free, MemInfoFn mem_info)
      : Pluggable(alloc, free), mem_info_(mem_info) {}

  c10::DataPtr allocate(size_t size) override {
    c10::DataPtr p = Pluggable::allocate(size);
    if (size != 0 && p.get() == nullptr) {
      c10::DeviceIndex device = p.device().index();
      size_t free_bytes = 0, total = 0;
      if (mem_info_(device, &free_bytes, &total) != 0) {
        free_bytes = total = 0;
      }
      // The message is made without iostreams: the stream inserters this extension gets
      // from the compiler's libstdc++ crashed inside PyTorch's process on an H100 host
      // (a segfault in ostream << unsigned long); one std::string goes to c10 as it is.
      // The DataPtr's deleter frees NULL, which cupool ignores.
      std::string message = "CUDA out of memory (cupool). Tried to allocate " +
                            std::to_string(size) + " bytes on device " +
                            std::to_string(int(device)) + "; " + std::to_string(free_bytes) +
                            " bytes free of " + std::to_string(total) +
                            ", after cupool released its idle cache and retried.";
      TORCH_CHECK_WITH(OutOfMemoryError, false, message);
    }
    return p;
  }

  // What a cuDNN workspace may take now: the device's free memory as the driver reports
  // it (cupool's idle cache is not counted, so the answer errs on the small side; PyTorch's
  // own allocator answers with its largest cached block).
  void cacheInfo(c10::DeviceIndex device, size_t* largest_block) override {
    size_t free_bytes = 0, total = 0;
    *largest_block = mem_info_(device, &free_bytes, &total) == 0 ? free_bytes : 0;
  }

 private:
  MemInfoFn mem_info_;
};

template <typename F>
F fn(uintptr_t address) {
  return reinterpret_cast<F>(address);
}

// Installs cupool as PyTorch's CUDA allocator; the addresses are the hooks' in libcupool
// (0: leave that hook unset).
void install(uintptr_t alloc, uintptr_t free, uintptr_t init, uintptr_t reset,
             uintptr_t fraction, uintptr_t record_stream, uintptr_t base_alloc,
             uintptr_t mem_info) {
  TORCH_CHECK(alloc && free && mem_info, "cupool shim: alloc, free and mem_info are needed");
  auto a = std::make_shared<CupoolAllocator>(fn<AllocFn>(alloc), fn<FreeFn>(free),
                                             fn<MemInfoFn>(mem_info));
  if (init) a->set_init_fn(fn<InitFn>(init));
  if (reset) a->set_reset_fn(fn<ResetFn>(reset));
  if (fraction) a->set_memory_fraction_fn(fn<FractionFn>(fraction));
  if (record_stream) a->set_record_stream_fn(fn<RecordStreamFn>(record_stream));
  if (base_alloc) a->set_base_alloc_fn(fn<BaseAllocFn>(base_alloc));
  torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(a);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install", &install, "Install cupool as PyTorch's CUDA allocator");
}
