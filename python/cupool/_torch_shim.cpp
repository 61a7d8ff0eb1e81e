// cupool.torch.enable(shim=True): PyTorch's pluggable allocator over cupool's hooks, plus
// the answers the pluggable allocator cannot give from plain C functions:
// - cacheInfo (cuDNN's benchmark mode asks it for the largest workspace it may take;
//   PyTorch's pluggable allocator raises "does not yet support cacheInfo");
// - out of memory: the pluggable allocator hands a NULL pointer to the tensor; here it
//   raises torch.OutOfMemoryError instead, as PyTorch's own allocator does;
// - CUDA IPC of tensors (torch.multiprocessing): shareIpcHandle and getIpcDevPtr, which
//   the pluggable allocator refuses ("does not yet support shareIPcHandle"), over cupool's
//   IPC calls where the driver's legacy IPC cannot describe the block (VMM memory);
// - allocation and free without the pluggable allocator's per-block bookkeeping (a map
//   entry under a mutex and a heap-allocated deleter context per tensor): a tensor's
//   deleter is cupool_torch_delete with the block itself as its context, and cupool knows
//   the block's stream (Note [shim deleter] in src/ffi/torch.rs).
// Built at enable() time against the installed PyTorch (torch.utils.cpp_extension), since
// PyTorch's C++ ABI differs between versions. Everything else is the pluggable allocator.
#include <torch/extension.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

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
// cupool_torch_delete: frees a block on the stream it was allocated on.
using DeleteFn = void (*)(void*);
// cupool_ipc_get_handle, cupool_ipc_open_handle, cupool_ipc_close_handle: 0 on success;
// handles are 64 bytes laid out as cudaIpcMemHandle_t.
using IpcGetFn = int (*)(cudaIpcMemHandle_t*, const void*);
using IpcOpenFn = int (*)(void**, const cudaIpcMemHandle_t*, unsigned int);
using IpcCloseFn = int (*)(void*);

// Set once by install(), before the allocator hands out anything.
DeleteFn g_delete = nullptr;
IpcCloseFn g_ipc_close = nullptr;

// Every block's deleter: its context is the block itself.
void delete_block(void* ptr) {
  if (ptr != nullptr) g_delete(ptr);
}

struct CupoolAllocator final : Pluggable {
  CupoolAllocator(AllocFn alloc, FreeFn free, MemInfoFn mem_info, IpcGetFn ipc_get,
                  IpcOpenFn ipc_open)
      : Pluggable(alloc, free),
        alloc_(alloc),
        mem_info_(mem_info),
        ipc_get_(ipc_get),
        ipc_open_(ipc_open) {}

  c10::DataPtr allocate(size_t size) override {
    c10::DeviceIndex device = -1;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    c10::Device where(c10::DeviceType::CUDA, device);
    if (size == 0) return {nullptr, nullptr, &delete_block, where};
    void* p = alloc_or_raise(size, device, c10::cuda::getCurrentCUDAStream(device).stream());
    return {p, p, &delete_block, where};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &delete_block; }

  void* raw_alloc(size_t nbytes) override {
    if (nbytes == 0) return nullptr;
    c10::DeviceIndex device = -1;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    return alloc_or_raise(nbytes, device, c10::cuda::getCurrentCUDAStream(device).stream());
  }

  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    if (nbytes == 0) return nullptr;
    c10::DeviceIndex device = -1;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    return alloc_or_raise(nbytes, device, stream);
  }

  void raw_delete(void* ptr) override { delete_block(ptr); }

  // A block of `size` bytes on `device` in stream order on `stream`; out of memory raises
  // torch.OutOfMemoryError, as PyTorch's own allocator does (the pluggable allocator would
  // give the tensor a NULL pointer).
  void* alloc_or_raise(size_t size, c10::DeviceIndex device, cudaStream_t stream) {
    void* p = alloc_(size, device, stream);
    if (p == nullptr) {
      size_t free_bytes = 0, total = 0;
      if (mem_info_(device, &free_bytes, &total) != 0) {
        free_bytes = total = 0;
      }
      // The message is made without iostreams: the stream inserters this extension gets
      // from the compiler's libstdc++ crashed inside PyTorch's process on an H100 host
      // (a segfault in ostream << unsigned long); one std::string goes to c10 as it is.
      std::string message = "CUDA out of memory (cupool). Tried to allocate " +
                            std::to_string(size) + " bytes on device " +
                            std::to_string(int(device)) + "; " + std::to_string(free_bytes) +
                            " bytes free of " + std::to_string(total) +
                            ", after cupool released its idle cache and retried.";
      TORCH_CHECK_WITH(OutOfMemoryError, false, message);
    }
    return p;
  }

  // CUDA IPC, in PyTorch's own handle format (version byte 2, type 'c' for a plain driver
  // allocation, then the 64-byte handle). `ptr` is what getBaseAllocation answered: with
  // vmm:off the driver allocation (segment) the block lives in, whose driver handle any
  // consumer opens, cupool or PyTorch's own allocator, and the offset PyTorch adds finds the
  // block. With vmm:on a block above 1 MiB is VMM memory, which legacy CUDA IPC cannot
  // export: getBaseAllocation names the block itself and cupool_ipc_get_handle makes a
  // cupool handle of it (its memory's file descriptors; Note [ipc of arena blocks]), which a
  // consumer on cupool opens (this shim, or the preload's cudaIpcOpenMemHandle); PyTorch's
  // own allocator refuses it with CUDA's invalid-argument error and maps nothing.
  c10::cuda::CUDACachingAllocator::ShareableHandle shareIpcHandle(void* ptr) override {
    cudaIpcMemHandle_t h;
    cudaError_t err = cudaIpcGetMemHandle(&h, ptr);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();  // not sticky: clear it for PyTorch's later checks
      int status = ipc_get_(&h, ptr);
      if (status != 0) {
        std::string message =
            std::string("cupool: cannot share this CUDA tensor with another process (") +
            cudaGetErrorName(err) + ", then cupool_ipc_get_handle status " +
            std::to_string(status) + ")";
        TORCH_CHECK(false, message);
      }
    }
    std::string handle;
    handle.push_back(kHandleVersion);
    handle.push_back(kCudaMallocHandle);
    handle.append(reinterpret_cast<const char*>(&h), sizeof h);
    return {0, handle};
  }

  // Opens a handle of shareIpcHandle's format (or PyTorch's 'c' handles, the same, or a
  // bare cudaIpcMemHandle_t of older PyTorch), through cupool_ipc_open_handle, which opens
  // cupool's handles and hands the driver's to cudaIpcOpenMemHandle's driver call. One
  // mapping per handle while any storage uses it: CUDA opens a handle once per context.
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    const char* raw = nullptr;
    if (handle.size() == 2 + sizeof(cudaIpcMemHandle_t) && handle[0] == kHandleVersion &&
        handle[1] == kCudaMallocHandle) {
      raw = handle.data() + 2;
    } else if (handle.size() == sizeof(cudaIpcMemHandle_t)) {
      raw = handle.data();
    }
    if (raw == nullptr) {
      // One std::string, no stream inserters (see allocate above).
      std::string message = "cupool: cannot open this CUDA IPC handle (" +
                            std::to_string(handle.size()) +
                            " bytes): only plain driver allocations and cupool's handles "
                            "('c' handles) are supported, not PyTorch's expandable segments";
      TORCH_CHECK(false, message);
    }
    std::lock_guard<std::mutex> guard(ipc_mutex_);
    auto found = opened_.find(handle);
    if (found != opened_.end()) {
      if (auto live = found->second.lock()) return live;
    }
    cudaIpcMemHandle_t h;
    std::memcpy(&h, raw, sizeof h);
    void* dev = nullptr;
    int status = ipc_open_(&dev, &h, cudaIpcMemLazyEnablePeerAccess);
    if (status != 0) {
      (void)cudaGetLastError();
      TORCH_CHECK(false, "cupool: cupool_ipc_open_handle failed with status " +
                             std::to_string(status) +
                             " (the exporter has exited, or the system refused its memory)");
    }
    int device = 0;
    (void)cudaGetDevice(&device);
    std::shared_ptr<void> sp(dev, [device](void* p) {
      int current = 0;
      (void)cudaGetDevice(&current);
      (void)cudaSetDevice(device);
      (void)g_ipc_close(p);
      (void)cudaSetDevice(current);
    });
    opened_[handle] = sp;
    return sp;
  }

  // What a cuDNN workspace may take now: the device's free memory as the driver reports
  // it (cupool's idle cache is not counted, so the answer errs on the small side; PyTorch's
  // own allocator answers with its largest cached block).
  void cacheInfo(c10::DeviceIndex device, size_t* largest_block) override {
    size_t free_bytes = 0, total = 0;
    *largest_block = mem_info_(device, &free_bytes, &total) == 0 ? free_bytes : 0;
  }

 private:
  static constexpr char kHandleVersion = 2;
  static constexpr char kCudaMallocHandle = 'c';
  AllocFn alloc_;
  MemInfoFn mem_info_;
  IpcGetFn ipc_get_;
  IpcOpenFn ipc_open_;
  std::mutex ipc_mutex_;
  std::unordered_map<std::string, std::weak_ptr<void>> opened_;
};

template <typename F>
F fn(uintptr_t address) {
  return reinterpret_cast<F>(address);
}

// Installs cupool as PyTorch's CUDA allocator; the addresses are the hooks' in libcupool
// (0: leave that hook unset).
void install(uintptr_t alloc, uintptr_t free, uintptr_t init, uintptr_t reset,
             uintptr_t fraction, uintptr_t record_stream, uintptr_t base_alloc,
             uintptr_t mem_info, uintptr_t delete_fn, uintptr_t ipc_get, uintptr_t ipc_open,
             uintptr_t ipc_close) {
  TORCH_CHECK(alloc && free && mem_info && delete_fn && ipc_get && ipc_open && ipc_close,
              "cupool shim: alloc, free, mem_info, delete and the ipc calls are needed");
  g_delete = fn<DeleteFn>(delete_fn);
  g_ipc_close = fn<IpcCloseFn>(ipc_close);
  auto a = std::make_shared<CupoolAllocator>(fn<AllocFn>(alloc), fn<FreeFn>(free),
                                             fn<MemInfoFn>(mem_info), fn<IpcGetFn>(ipc_get),
                                             fn<IpcOpenFn>(ipc_open));
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
