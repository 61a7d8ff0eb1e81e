// Can a pool hand out VMM memory before it is mapped, with the stream made to wait for the
// map? The GPT loop through cupool.torch.enable() pays the arena's map and unmap calls 1:1
// in step time when the launching thread makes them, and nothing when another thread makes
// them (docs/BENCHMARKS.md, fourteenth session). So: the allocating thread enqueues on the
// block's stream a wait for a host word (cuStreamWaitValue32 on mapped pinned memory) and
// returns; a worker thread maps and grants the memory, then writes the word. The
// questions, each answered on its own (the answers of 2026-11-28 on an H200 are in
// docs/BENCHMARKS.md: the order holds, but copies and memsets on memory not mapped yet fail
// when queued, so the map must be made before the pointer is returned; a map of a handle
// mapped elsewhere costs what a plain map costs, which lets the unmap wait):
//
//   order     kernels queued behind the wait write and check the range; the worker maps it
//             only after the GPU has reached the wait (it sleeps first). Does the GPU see
//             the mapping (no fault, right sums), or does the map deadlock behind the
//             waiting stream (a watchdog gives up after 5 s)?  Non-blocking stream, and the
//             legacy stream.
//   cost      the host's time for one cuStreamWaitValue32 whose value is already there,
//             after a kernel on a non-blocking stream and a stream synchronisation (the
//             state every real program is in, where an event query costs ~1.5 us).
//   order, steal=1  the same order test where the worker also unmaps the range's previous
//             mapping first (a stolen chunk: unmap where it was, map here).
//   api       (`./async_map api`) a kernel, a memset and copies queued on the range before
//             it is mapped, as programs queue them on fresh memory.
//   alias     (`./async_map alias`) what a map costs while the handle is still mapped at
//             another range, against a plain map, and the unmap after each.
//
// Output lines:
//   ASYNCMAP order stream=nonblocking|legacy steal=0|1 iterations=N faults=0 wrong=0 stuck=0
//   ASYNCMAP cost stream=.. wait_value_ns_median=X p99=Y
//   ASYNCMAP api kernel|memset|copy_to|copy_from=CUresult ms=X, then sync=CUresult
//   ASYNCMAP alias bytes=N plain_map_ns=.. plain_unmap_ns=.. alias_map_ns=.. alias_unmap_ns=..
// Build: nvcc -O2 -std=c++17 -arch=native -I gpu gpu/tools/async_map.cu -o async_map -lcuda -lpthread
#include <cuda.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "common.cuh"

static const size_t BYTES = 64ull << 20;

__global__ void fill(uint32_t *p, size_t n, uint32_t v) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    p[i] = v + (uint32_t)i;
}

__global__ void check(const uint32_t *p, size_t n, uint32_t v, unsigned long long *wrong) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    if (p[i] != v + (uint32_t)i) atomicAdd(wrong, 1ull);
}

struct Range {
  CUdeviceptr va[2];
  CUmemGenericAllocationHandle handle;
  CUmemAccessDesc access;
};

static Range make_range(int dev) {
  Range r;
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  for (auto &va : r.va) CU_CK(cuMemAddressReserve(&va, BYTES, 0, 0, 0));
  CU_CK(cuMemCreate(&r.handle, BYTES, &prop, 0));
  r.access.location = prop.location;
  r.access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return r;
}

// One order test: `iterations` times, queue wait + fill + check on `s`, then let the worker
// map (after unmapping the other range, with `steal`) and write the word.
static void order(const char *label, CUstream s, Range &r, bool steal, int iterations) {
  volatile uint32_t *word;
  CU_CK(cuMemHostAlloc((void **)&word, sizeof(uint32_t), CU_MEMHOSTALLOC_DEVICEMAP));
  *word = 0;
  CUdeviceptr dword;
  CU_CK(cuMemHostGetDevicePointer(&dword, (void *)word, 0));
  unsigned long long *wrong;
  CK(cudaMalloc(&wrong, sizeof(*wrong)));
  CK(cudaMemset(wrong, 0, sizeof(*wrong)));
  size_t n = BYTES / sizeof(uint32_t);
  int stuck = 0, faults = 0;
  int at = 0;  // the range mapped now (with `steal`: the other one is the chunk's old place)
  if (steal) {
    CU_CK(cuMemMap(r.va[at], BYTES, 0, r.handle, 0));
    CU_CK(cuMemSetAccess(r.va[at], BYTES, &r.access, 1));
  }
  for (int i = 1; i <= iterations; i++) {
    int to = steal ? 1 - at : 0;
    CU_CK(cuStreamWaitValue32(s, dword, (cuuint32_t)i, CU_STREAM_WAIT_VALUE_GEQ));
    fill<<<264, 512, 0, (cudaStream_t)s>>>((uint32_t *)r.va[to], n, (uint32_t)i);
    check<<<264, 512, 0, (cudaStream_t)s>>>((uint32_t *)r.va[to], n, (uint32_t)i, wrong);
    CK(cudaGetLastError());
    std::thread worker([&, i, to] {
      std::this_thread::sleep_for(std::chrono::microseconds(200));  // the GPU waits by now
      if (steal) CU_CK(cuMemUnmap(r.va[1 - to], BYTES));
      CU_CK(cuMemMap(r.va[to], BYTES, 0, r.handle, 0));
      CU_CK(cuMemSetAccess(r.va[to], BYTES, &r.access, 1));
      __sync_synchronize();
      *word = (uint32_t)i;
    });
    double give_up = now_ns() + 5e9;
    CUresult q;
    while ((q = cuStreamQuery(s)) == CUDA_ERROR_NOT_READY && now_ns() < give_up)
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    worker.join();
    if (q == CUDA_ERROR_NOT_READY) {
      stuck++;
      break;
    }
    if (q != CUDA_SUCCESS) {
      faults++;
      break;
    }
    if (!steal) CU_CK(cuMemUnmap(r.va[to], BYTES));
    at = to;
  }
  if (steal) CU_CK(cuMemUnmap(r.va[at], BYTES));
  unsigned long long h_wrong = 0;
  if (!stuck && !faults) CK(cudaMemcpy(&h_wrong, wrong, sizeof(h_wrong), cudaMemcpyDeviceToHost));
  printf("ASYNCMAP order stream=%s steal=%d iterations=%d faults=%d wrong=%llu stuck=%d\n", label,
         steal, iterations, faults, h_wrong, stuck);
  printf("%s async_map_order_%s%s\n", (!stuck && !faults && !h_wrong) ? "PASS" : "FAIL", label,
         steal ? "_steal" : "");
  fflush(stdout);
  if (!stuck && !faults) {
    CK(cudaFree(wrong));
    CU_CK(cuMemFreeHost((void *)word));
  }
}

static void cost(const char *label, CUstream s) {
  volatile uint32_t *word;
  CU_CK(cuMemHostAlloc((void **)&word, sizeof(uint32_t), CU_MEMHOSTALLOC_DEVICEMAP));
  *word = 1;
  CUdeviceptr dword;
  CU_CK(cuMemHostGetDevicePointer(&dword, (void *)word, 0));
  // The slow-query state: a kernel on a non-blocking stream, only that stream synchronised.
  cudaStream_t other;
  CK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
  unsigned long long *scratch;
  CK(cudaMalloc(&scratch, 4096));
  fill<<<1, 32, 0, other>>>((uint32_t *)scratch, 1024, 0);
  CK(cudaStreamSynchronize(other));
  std::vector<double> ns;
  for (int i = 0; i < 20000; i++) {
    double t = now_ns();
    CU_CK(cuStreamWaitValue32(s, dword, 1, CU_STREAM_WAIT_VALUE_GEQ));
    ns.push_back(now_ns() - t);
    if (i % 1000 == 999) CU_CK(cuStreamSynchronize(s));
  }
  CU_CK(cuStreamSynchronize(s));
  std::sort(ns.begin(), ns.end());
  printf("ASYNCMAP cost stream=%s wait_value_ns_median=%.0f p99=%.0f\n", label, ns[ns.size() / 2],
         ns[ns.size() * 99 / 100]);
  fflush(stdout);
}

// What the driver does when work naming a range that is not mapped yet is queued behind a
// wait: a kernel, a memset, a copy to it, a copy from it. A worker thread maps the range and
// writes the word 500 ms after the wait was queued. Each call's result and how long it
// took are printed as it returns: a call that waits for the map takes ~500 ms.
static void api(CUstream s, Range &r) {
  volatile uint32_t *word;
  CU_CK(cuMemHostAlloc((void **)&word, sizeof(uint32_t), CU_MEMHOSTALLOC_DEVICEMAP));
  *word = 0;
  CUdeviceptr dword, other;
  CU_CK(cuMemHostGetDevicePointer(&dword, (void *)word, 0));
  CU_CK(cuMemAlloc(&other, BYTES));
  // Load the kernel's module now: a lazy load behind the wait would wait for it.
  fill<<<1, 32, 0, (cudaStream_t)s>>>((uint32_t *)other, 32, 0);
  CK(cudaStreamSynchronize((cudaStream_t)s));
  CU_CK(cuStreamWaitValue32(s, dword, 1, CU_STREAM_WAIT_VALUE_GEQ));
  std::thread worker([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    CU_CK(cuMemMap(r.va[0], BYTES, 0, r.handle, 0));
    CU_CK(cuMemSetAccess(r.va[0], BYTES, &r.access, 1));
    __sync_synchronize();
    *word = 1;
  });
  double t = now_ns();
  auto lap = [&t] {
    double now = now_ns(), ms = (now - t) / 1e6;
    t = now;
    return ms;
  };
  fill<<<264, 512, 0, (cudaStream_t)s>>>((uint32_t *)r.va[0], BYTES / 4, 1);
  int k = (int)cudaGetLastError();
  printf("ASYNCMAP api kernel=%d ms=%.3f\n", k, lap());
  int m = (int)cuMemsetD8Async(r.va[0], 0, BYTES, s);
  printf("ASYNCMAP api memset=%d ms=%.3f\n", m, lap());
  int c = (int)cuMemcpyDtoDAsync(r.va[0], other, BYTES, s);
  printf("ASYNCMAP api copy_to=%d ms=%.3f\n", c, lap());
  int f = (int)cuMemcpyDtoDAsync(other, r.va[0], BYTES, s);
  printf("ASYNCMAP api copy_from=%d ms=%.3f\n", f, lap());
  worker.join();
  printf("ASYNCMAP api sync=%d\n", (int)cuStreamSynchronize(s));
  CU_CK(cuMemUnmap(r.va[0], BYTES));
}

// What a map costs while the handle is still mapped at another range (a move that leaves
// the unmap of the old place for later), against a map of an unmapped handle, on one
// thread with nothing else running: medians of `n` rounds, ns, for a handle of `bytes`.
static void alias(size_t bytes, int n) {
  CUdevice dev;
  CU_CK(cuCtxGetDevice(&dev));
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = (int)dev;
  CUdeviceptr va[2];
  for (auto &v : va) CU_CK(cuMemAddressReserve(&v, bytes, 0, 0, 0));
  CUmemGenericAllocationHandle h;
  CU_CK(cuMemCreate(&h, bytes, &prop, 0));
  CUmemAccessDesc access = {prop.location, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  std::vector<double> plain_map, plain_unmap, alias_map, alias_unmap;
  auto map = [&](CUdeviceptr v) {
    CU_CK(cuMemMap(v, bytes, 0, h, 0));
    CU_CK(cuMemSetAccess(v, bytes, &access, 1));
  };
  for (int i = 0; i < n; i++) {
    double t = now_ns();
    map(va[0]);
    double m = now_ns();
    CU_CK(cuMemUnmap(va[0], bytes));
    plain_map.push_back(m - t);
    plain_unmap.push_back(now_ns() - m);
  }
  map(va[0]);
  for (int i = 0; i < n; i++) {
    CUdeviceptr old = va[i % 2], fresh = va[(i + 1) % 2];
    double t = now_ns();
    map(fresh);  // the handle is still mapped at `old`
    double m = now_ns();
    CU_CK(cuMemUnmap(old, bytes));
    alias_map.push_back(m - t);
    alias_unmap.push_back(now_ns() - m);
  }
  CU_CK(cuMemUnmap(va[n % 2], bytes));
  CU_CK(cuMemRelease(h));
  for (auto v : va) CU_CK(cuMemAddressFree(v, bytes));
  auto med = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  printf("ASYNCMAP alias bytes=%zu plain_map_ns=%.0f plain_unmap_ns=%.0f alias_map_ns=%.0f "
         "alias_unmap_ns=%.0f\n",
         bytes, med(plain_map), med(plain_unmap), med(alias_map), med(alias_unmap));
}

int main(int argc, char **argv) {
  setvbuf(stdout, nullptr, _IONBF, 0);
  bool api_only = argc > 1 && !strcmp(argv[1], "api");
  CK(cudaFree(0));
  if (argc > 1 && !strcmp(argv[1], "alias")) {
    for (int round = 0; round < 3; round++)
      for (size_t mib : {2, 8, 64}) alias(mib << 20, 1000);
    return 0;
  }
  CUdevice dev;
  CU_CK(cuCtxGetDevice(&dev));
  int memops = 0;
  CU_CK(cuDeviceGetAttribute(&memops, CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR, dev));
  printf("ASYNCMAP device=%d wait_value_nor=%d\n", (int)dev, memops);
  Range r = make_range((int)dev);
  CUstream nb;
  CU_CK(cuStreamCreate(&nb, CU_STREAM_NON_BLOCKING));
  if (api_only) {
    api(nb, r);
    return 0;
  }
  cost("nonblocking", nb);
  cost("legacy", (CUstream)0);
  order("nonblocking", nb, r, false, 200);
  order("legacy", (CUstream)0, r, false, 200);
  order("nonblocking", nb, r, true, 200);
  return 0;
}
