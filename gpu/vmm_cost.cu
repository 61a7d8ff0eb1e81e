// What the driver's virtual memory management calls cost, so that the VMM arena's policies
// (how often to map, unmap and grant access; whether to batch runs of granules) rest on
// measured figures. Driver API only; no cupool.
//
// For each operation, medians over REPEATS rounds of N granules, in ns per granule:
//   create / release         cuMemCreate / cuMemRelease of one granule
//   map1 + access1           cuMemMap of one granule, cuMemSetAccess of that granule
//   map1 + accessN           N cuMemMap, then one cuMemSetAccess over the whole run
//   unmap1                   cuMemUnmap granule by granule
//   unmapN                   one cuMemUnmap over a run of N granules mapped one by one
//   big: map+access, unmap   one handle of N granules, mapped, granted and unmapped whole
// each with the GPU idle and with a kernel still running on another stream (does the
// call wait for the GPU?). Lines: "VMMCOST op=... gpu=idle|busy n=N ns_per_granule=X".
#include <cuda.h>

#include <algorithm>
#include <vector>

#include "common.cuh"

__global__ void spin(long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char **argv) {
  const int repeats = argc > 1 ? atoi(argv[1]) : 15;
  CU_CK(cuInit(0));
  CUdevice dev;
  CU_CK(cuDeviceGet(&dev, 0));
  CUcontext ctx;
  CU_CK(cuDevicePrimaryCtxRetain(&ctx, dev));
  CU_CK(cuCtxSetCurrent(ctx));
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  size_t g = 0;
  CU_CK(cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  CUmemAccessDesc access = {};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  int clock_khz = 0;
  CU_CK(cuDeviceGetAttribute(&clock_khz, CU_DEVICE_ATTRIBUTE_CLOCK_RATE, dev));
  CUstream side;
  CU_CK(cuStreamCreate(&side, CU_STREAM_NON_BLOCKING));
  printf("VMMCOST granularity=%zu\n", g);

  const int ns_list[] = {1, 8, 64};
  for (int n : ns_list) {
    CUdeviceptr base;
    CU_CK(cuMemAddressReserve(&base, n * g, 0, 0, 0));
    std::vector<CUmemGenericAllocationHandle> h(n);
    for (int busy = 0; busy < 2; busy++) {
      const char *gpu = busy ? "busy" : "idle";
      std::vector<double> create, release, map_each, map_run, unmap_each, unmap_run;
      for (int r = 0; r < repeats; r++) {
        if (busy) {
          // ~20 ms of GPU work on another stream, so every call below finds it running.
          spin<<<1, 1, 0, (cudaStream_t)side>>>((long long)clock_khz * 20);
        }
        double t = now_ns();
        for (int i = 0; i < n; i++) CU_CK(cuMemCreate(&h[i], g, &prop, 0));
        create.push_back((now_ns() - t) / n);
        // Map and grant granule by granule.
        t = now_ns();
        for (int i = 0; i < n; i++) {
          CU_CK(cuMemMap(base + i * g, g, 0, h[i], 0));
          CU_CK(cuMemSetAccess(base + i * g, g, &access, 1));
        }
        map_each.push_back((now_ns() - t) / n);
        t = now_ns();
        for (int i = 0; i < n; i++) CU_CK(cuMemUnmap(base + i * g, g));
        unmap_each.push_back((now_ns() - t) / n);
        // Map granule by granule, grant the whole run at once, unmap the whole run.
        t = now_ns();
        for (int i = 0; i < n; i++) CU_CK(cuMemMap(base + i * g, g, 0, h[i], 0));
        CU_CK(cuMemSetAccess(base, n * g, &access, 1));
        map_run.push_back((now_ns() - t) / n);
        t = now_ns();
        CU_CK(cuMemUnmap(base, n * g));
        unmap_run.push_back((now_ns() - t) / n);
        t = now_ns();
        for (int i = 0; i < n; i++) CU_CK(cuMemRelease(h[i]));
        release.push_back((now_ns() - t) / n);
        CU_CK(cuStreamSynchronize(side));
      }
      printf("VMMCOST op=create gpu=%s n=%d ns_per_granule=%.0f\n", gpu, n, median(create));
      printf("VMMCOST op=map1+access1 gpu=%s n=%d ns_per_granule=%.0f\n", gpu, n,
             median(map_each));
      printf("VMMCOST op=map1+accessN gpu=%s n=%d ns_per_granule=%.0f\n", gpu, n,
             median(map_run));
      printf("VMMCOST op=unmap1 gpu=%s n=%d ns_per_granule=%.0f\n", gpu, n, median(unmap_each));
      printf("VMMCOST op=unmapN gpu=%s n=%d ns_per_granule=%.0f\n", gpu, n, median(unmap_run));
      printf("VMMCOST op=release gpu=%s n=%d ns_per_granule=%.0f\n", gpu, n, median(release));
      // One handle of n granules.
      std::vector<double> big_map, big_unmap;
      for (int r = 0; r < repeats; r++) {
        if (busy) spin<<<1, 1, 0, (cudaStream_t)side>>>((long long)clock_khz * 20);
        CUmemGenericAllocationHandle big;
        CU_CK(cuMemCreate(&big, n * g, &prop, 0));
        double t = now_ns();
        CU_CK(cuMemMap(base, n * g, 0, big, 0));
        CU_CK(cuMemSetAccess(base, n * g, &access, 1));
        big_map.push_back((now_ns() - t) / n);
        t = now_ns();
        CU_CK(cuMemUnmap(base, n * g));
        big_unmap.push_back((now_ns() - t) / n);
        CU_CK(cuMemRelease(big));
        CU_CK(cuStreamSynchronize(side));
      }
      printf("VMMCOST op=big_map+access gpu=%s n=%d ns_per_granule=%.0f\n", gpu, n,
             median(big_map));
      printf("VMMCOST op=big_unmap gpu=%s n=%d ns_per_granule=%.0f\n", gpu, n,
             median(big_unmap));
    }
    CU_CK(cuMemAddressFree(base, n * g));
  }
  // Does an unmap wait for unrelated GPU work? Time one unmap right after launching 20 ms.
  {
    CUdeviceptr base;
    CU_CK(cuMemAddressReserve(&base, g, 0, 0, 0));
    CUmemGenericAllocationHandle h;
    CU_CK(cuMemCreate(&h, g, &prop, 0));
    std::vector<double> waits;
    for (int r = 0; r < repeats; r++) {
      CU_CK(cuMemMap(base, g, 0, h, 0));
      CU_CK(cuMemSetAccess(base, g, &access, 1));
      spin<<<1, 1, 0, (cudaStream_t)side>>>((long long)clock_khz * 20);
      double t = now_ns();
      CU_CK(cuMemUnmap(base, g));
      waits.push_back(now_ns() - t);
      CU_CK(cuStreamSynchronize(side));
    }
    printf("VMMCOST op=unmap_during_20ms_kernel n=1 ns=%.0f\n", median(waits));
    CU_CK(cuMemRelease(h));
    CU_CK(cuMemAddressFree(base, g));
  }
  printf("VMMCOST done\n");
  return 0;
}
