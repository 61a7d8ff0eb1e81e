// Helpers shared by the GPU suite's CUDA programs: checked CUDA calls, PASS/FAIL lines,
// a steady clock, and the kernels that write, check and delay.
#pragma once
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

// A failed CUDA call ends the program: the suite counts a program that exits non-zero
// without its own FAIL line as a failure of that program.
#define CK(call)                                                                          \
  do {                                                                                    \
    cudaError_t ck_err_ = (call);                                                         \
    if (ck_err_ != cudaSuccess) {                                                         \
      printf("FAIL cuda_call: %s:%d %s -> %s\n", __FILE__, __LINE__, #call,                \
             cudaGetErrorName(ck_err_));                                                  \
      fflush(stdout);                                                                     \
      exit(2);                                                                            \
    }                                                                                     \
  } while (0)

#ifdef __cuda_cuda_h__
// The same for a driver API call, in programs that include <cuda.h> first.
#define CU_CK(call)                                                                       \
  do {                                                                                    \
    CUresult cu_err_ = (call);                                                            \
    if (cu_err_ != CUDA_SUCCESS) {                                                        \
      const char *cu_name_ = "?";                                                         \
      cuGetErrorName(cu_err_, &cu_name_);                                                 \
      printf("FAIL cuda_call: %s:%d %s -> %s\n", __FILE__, __LINE__, #call, cu_name_);    \
      fflush(stdout);                                                                     \
      exit(2);                                                                            \
    }                                                                                     \
  } while (0)
#endif

static int g_failures = 0;

// Prints "PASS name" or "FAIL name: detail"; the suite counts these lines.
static inline bool check(const char *name, bool ok, const char *fmt = "", ...) {
  char detail[512] = "";
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(detail, sizeof detail, fmt, ap);
  va_end(ap);
  printf("%s %s%s%s\n", ok ? "PASS" : "FAIL", name, detail[0] ? ": " : "", detail);
  fflush(stdout);
  if (!ok) g_failures++;
  return ok;
}

static inline void info(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  printf("INFO ");
  vprintf(fmt, ap);
  printf("\n");
  va_end(ap);
  fflush(stdout);
}

static inline double now_ns() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

// Byte i of pattern `seed`: varies with both, so a block holding another block's or
// another round's data never matches by accident.
__host__ __device__ inline uint8_t pattern_byte(size_t i, uint32_t seed) {
  uint32_t x = (uint32_t)i * 2654435761u ^ (uint32_t)(i >> 32) ^ (seed * 0x9E3779B9u);
  x ^= x >> 15;
  return (uint8_t)(x ^ (x >> 8));
}

__global__ void fill_pattern(uint8_t *p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    p[i] = pattern_byte(i, seed);
}

// Counts bytes that differ from pattern `seed` into *mismatches.
__global__ void count_mismatches(const uint8_t *p, size_t n, uint32_t seed,
                                 unsigned long long *mismatches) {
  unsigned long long local = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    local += p[i] != pattern_byte(i, seed);
  if (local) atomicAdd(mismatches, local);
}

// Host-visible transform checked by the round-trip test: p[i] = p[i] ^ 0xA5 + (i & 7).
__global__ void transform_bytes(uint8_t *p, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    p[i] = (uint8_t)((p[i] ^ 0xA5) + (i & 7));
}

__device__ inline uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Waits `delay_ns` on the device, then writes pattern `seed`: the late writer of the
// stream-ordering tests. Every thread waits, so the whole grid writes late.
__global__ void spin_then_fill(uint8_t *p, size_t n, uint32_t seed, uint64_t delay_ns) {
  uint64_t start = global_timer_ns();
  while (global_timer_ns() - start < delay_ns) {
  }
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    p[i] = pattern_byte(i, seed);
}

static inline unsigned grid_for(size_t n) {
  size_t blocks = (n + 255) / 256;
  return (unsigned)(blocks < 1 ? 1 : blocks > 1024 ? 1024 : blocks);
}

// Mismatched bytes of a device block against pattern `seed` (synchronises `stream`).
static inline unsigned long long device_mismatches(const void *p, size_t n, uint32_t seed,
                                                   cudaStream_t stream) {
  unsigned long long *d_count, h_count = 0;
  CK(cudaMallocHost(&d_count, sizeof *d_count));  // mapped host memory: no device alloc
  *d_count = 0;
  count_mismatches<<<grid_for(n), 256, 0, stream>>>((const uint8_t *)p, n, seed, d_count);
  CK(cudaGetLastError());
  CK(cudaStreamSynchronize(stream));
  h_count = *d_count;
  CK(cudaFreeHost(d_count));
  return h_count;
}

// One counter of the preloaded pool's statistics (all devices, `cupool_stats_json`), -1
// without the preload. `key` may also reach into a level: `"name\":{\"current"`.
static inline long long pool_counter(const char *key) {
  typedef int (*stats_json_fn)(int, char *, size_t, size_t *);
  static stats_json_fn stats_json = (stats_json_fn)dlsym(RTLD_DEFAULT, "cupool_stats_json");
  static char buf[8192];
  if (!stats_json || stats_json(-1, buf, sizeof buf, nullptr) != 0) return -1;
  char quoted[96];
  snprintf(quoted, sizeof quoted, "\"%s\":", key);
  const char *at = strstr(buf, quoted);
  return at ? atoll(at + strlen(quoted)) : -1;
}
