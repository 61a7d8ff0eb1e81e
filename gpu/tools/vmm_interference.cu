// Does a VMM call cost a program more than the calling thread's wait? The GPT loop's step
// through cupool.torch.enable() is 7-12% slower than PyTorch's own allocator, about three
// times the driver time of the arena's map and unmap calls (docs/BENCHMARKS.md, twelfth
// session). Two ways a call could cost more than its own time:
//
//   gpu     a train of short kernels runs on a stream while the host maps, grants and
//           unmaps 2 MiB handles elsewhere: does the GPU take longer over the train (a call
//           that stalls or drains the GPU's work)?
//   launch  a second thread launches kernels while the first maps and unmaps: do its
//           launches wait (a lock the calls hold in the driver)?
//   mappings  with 1, 64, 512 and 2048 mappings of 2 MiB handles held: the host's time for
//           a memset, a copy from the newest and a launch (does the driver's work per call
//           grow with the mappings, as an arena of small chunks holds many?)
//
// Each case runs with and without the calls, ROUNDS times, taking turns. Output lines:
//   VMMINTF mode=gpu calls=N train_ms=X (N map+grant+unmap cycles during the train)
//   VMMINTF mode=launch calls=on|off launch_ns_median=X launch_ns_p99=Y cycles=N
//   VMMINTF mode=mappings mappings=N memset_ns=X copy_ns=Y launch_ns=Z (medians)
// Build: nvcc -O2 -std=c++17 -arch=sm_90 -I gpu gpu/tools/vmm_interference.cu -o vmm_intf -lcuda -lpthread
#include <cuda.h>

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

#include "common.cuh"

__global__ void spin_ns(unsigned long long ns) {
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

__global__ void empty_kernel() {}

// One 2 MiB handle and a reserved range to map it at, over and over.
struct Mover {
  CUdeviceptr va = 0;
  CUmemGenericAllocationHandle handle = 0;
  size_t size = 0;
  CUmemAccessDesc access = {};

  explicit Mover(CUdevice dev) {
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    CU_CK(cuMemGetAllocationGranularity(&size, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    CU_CK(cuMemAddressReserve(&va, size, 0, 0, 0));
    CU_CK(cuMemCreate(&handle, size, &prop, 0));
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }

  // A move as the arena makes one: map and grant, then unmap.
  void cycle() {
    CU_CK(cuMemMap(va, size, 0, handle, 0));
    CU_CK(cuMemSetAccess(va, size, &access, 1));
    CU_CK(cuMemUnmap(va, size));
  }
};

static double percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[(size_t)(q * (v.size() - 1))];
}

// GPU time of KERNELS kernels of KERNEL_NS each, queued on `s`, while the host makes
// `calls` move cycles once they are queued. Returns ms between the train's two events.
static float kernel_train(cudaStream_t s, Mover &m, int calls, int kernels, unsigned kernel_ns) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  CK(cudaEventRecord(a, s));
  for (int i = 0; i < kernels; i++) spin_ns<<<1, 1, 0, s>>>(kernel_ns);
  CK(cudaEventRecord(b, s));
  for (int i = 0; i < calls; i++) m.cycle();
  CK(cudaEventSynchronize(b));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, a, b));
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  return ms;
}

int main(int argc, char **argv) {
  const int rounds = argc > 1 ? atoi(argv[1]) : 7;
  CK(cudaFree(0));
  CUdevice dev;
  CU_CK(cuCtxGetDevice(&dev));
  CUcontext ctx;
  CU_CK(cuCtxGetCurrent(&ctx));
  Mover mover(dev);
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  // gpu: 4000 kernels of 5 µs (20 ms of GPU work, queued in a few ms), 0 or 100 cycles.
  const int kernels = 4000, calls = 100;
  const unsigned kernel_ns = 5000;
  kernel_train(s, mover, 10, kernels, kernel_ns);  // warm
  for (int r = 0; r < rounds; r++) {
    for (int with : {0, calls}) {
      double t0 = now_ns();
      float ms = kernel_train(s, mover, with, kernels, kernel_ns);
      printf("VMMINTF mode=gpu calls=%d train_ms=%.3f host_ms=%.3f\n", with, ms,
             (now_ns() - t0) / 1e6);
    }
  }

  // launch: a second thread launches 20000 empty kernels, timing each launch.
  for (int r = 0; r < rounds; r++) {
    for (bool with : {false, true}) {
      std::atomic<bool> done{false};
      std::atomic<long> cycles{0};
      std::thread mover_thread([&] {
        CU_CK(cuCtxSetCurrent(ctx));
        while (!done.load()) {
          if (with) {
            mover.cycle();
            cycles++;
          } else {
            std::this_thread::yield();
          }
        }
      });
      std::vector<double> launch;
      launch.reserve(20000);
      for (int i = 0; i < 20000; i++) {
        double t0 = now_ns();
        empty_kernel<<<1, 1, 0, s>>>();
        launch.push_back(now_ns() - t0);
        if (i % 1000 == 999) CK(cudaStreamSynchronize(s));
      }
      done = true;
      mover_thread.join();
      CK(cudaStreamSynchronize(s));
      printf("VMMINTF mode=launch calls=%s launch_ns_median=%.0f launch_ns_p99=%.0f cycles=%ld\n",
             with ? "on" : "off", percentile(launch, 0.5), percentile(launch, 0.99),
             cycles.load());
    }
  }
  // mappings: what a memset, a copy and a launch cost the host with many mappings held
  // (one 2 MiB handle each, as an arena of small chunks holds them).
  {
    size_t g = mover.size;
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    const int max_maps = 2048;
    CUdeviceptr base;
    CU_CK(cuMemAddressReserve(&base, (size_t)max_maps * g, 0, 0, 0));
    std::vector<CUmemGenericAllocationHandle> handles;
    void *dst = nullptr;
    CK(cudaMalloc(&dst, 1 << 20));
    for (int target : {1, 64, 512, 2048}) {
      while ((int)handles.size() < target) {
        CUmemGenericAllocationHandle h;
        CU_CK(cuMemCreate(&h, g, &prop, 0));
        CUdeviceptr at = base + handles.size() * g;
        CU_CK(cuMemMap(at, g, 0, h, 0));
        CU_CK(cuMemSetAccess(at, g, &mover.access, 1));
        handles.push_back(h);
      }
      // The block the program works on: the last mapping made.
      void *p = (void *)(base + (handles.size() - 1) * g);
      for (int r = 0; r < rounds; r++) {
        std::vector<double> memset_ns, copy_ns, launch_ns;
        for (int i = 0; i < 2000; i++) {
          double t0 = now_ns();
          CK(cudaMemsetAsync(p, 0, 4096, s));
          double t1 = now_ns();
          CK(cudaMemcpyAsync(dst, p, 4096, cudaMemcpyDeviceToDevice, s));
          double t2 = now_ns();
          empty_kernel<<<1, 1, 0, s>>>();
          double t3 = now_ns();
          memset_ns.push_back(t1 - t0);
          copy_ns.push_back(t2 - t1);
          launch_ns.push_back(t3 - t2);
          if (i % 500 == 499) CK(cudaStreamSynchronize(s));
        }
        CK(cudaStreamSynchronize(s));
        printf("VMMINTF mode=mappings mappings=%d memset_ns=%.0f copy_ns=%.0f launch_ns=%.0f\n",
               (int)handles.size(), percentile(memset_ns, 0.5), percentile(copy_ns, 0.5),
               percentile(launch_ns, 0.5));
      }
    }
    for (size_t k = 0; k < handles.size(); k++) {
      CU_CK(cuMemUnmap(base + k * g, g));
      CU_CK(cuMemRelease(handles[k]));
    }
    CU_CK(cuMemAddressFree(base, (size_t)max_maps * g));
    CK(cudaFree(dst));
  }
  CU_CK(cuMemRelease(mover.handle));
  CU_CK(cuMemAddressFree(mover.va, mover.size));
  CK(cudaStreamDestroy(s));
  return 0;
}
