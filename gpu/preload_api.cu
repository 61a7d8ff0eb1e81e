// CUDA runtime behaviours that LD_PRELOAD=libcupool_preload.so must keep (issue "LD_PRELOAD").
// Built twice (static and shared cudart) and run with and without the preload; the suite
// diffs stdout. So stdout holds only deterministic facts: results and error codes, never
// addresses or timings. Line kinds:
//   plain lines      compared between the runs
//   CHECK name ok|BAD must be ok in every run (compared too)
//   PCHECK name ...   a requirement of the preloaded run only (native CUDA may differ): not compared
//   NODIFF ...        information, not compared
// With the preload, the pool's stats go to stderr as "CUPOOL_STATS {json}".
#include <dlfcn.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <vector>

#include "common.cuh"

#define CODE(call)                                                                          \
  do {                                                                                      \
    cudaError_t code_ = (call);                                                             \
    printf("%-58s -> %d %s\n", #call, (int)code_, cudaGetErrorName(code_));                 \
  } while (0)

static void report(const char *name, bool ok, const char *detail = "") {
  printf("CHECK %s %s%s%s\n", name, ok ? "ok" : "BAD", detail[0] ? " " : "", detail);
  fflush(stdout);
}

static bool preloaded() {
  return dlsym(RTLD_DEFAULT, "cupool_interposition_active") != nullptr;
}

static void print_pool_stats(const char *label) {
  typedef int (*stats_json_fn)(int, char *, size_t, size_t *);
  stats_json_fn fn = (stats_json_fn)dlsym(RTLD_DEFAULT, "cupool_stats_json");
  if (!fn) {
    fprintf(stderr, "CUPOOL_STATS %s absent\n", label);
    return;
  }
  char buf[8192];
  size_t needed = 0;
  int st = fn(-1, buf, sizeof buf, &needed);
  if (st == 0)
    fprintf(stderr, "CUPOOL_STATS %s %s\n", label, buf);
  else
    fprintf(stderr, "CUPOOL_STATS %s error %d\n", label, st);
}

// Pattern in, transform on the device, pattern out, through cudaMalloc'd memory.
static bool roundtrip(size_t n, uint32_t seed, cudaStream_t s) {
  void *p = nullptr;
  if (cudaMalloc(&p, n) != cudaSuccess) return false;
  std::vector<uint8_t> host(n), back(n);
  for (size_t i = 0; i < n; i++) host[i] = pattern_byte(i, seed);
  bool ok = cudaMemset(p, 0x7F, n) == cudaSuccess;
  ok = ok && cudaMemcpy(back.data(), p, n, cudaMemcpyDeviceToHost) == cudaSuccess;
  for (size_t i = 0; ok && i < n; i++) ok = back[i] == 0x7F;
  ok = ok && cudaMemcpy(p, host.data(), n, cudaMemcpyHostToDevice) == cudaSuccess;
  // A pageable host-to-device cudaMemcpy may return before the DMA has landed; the kernel
  // runs on a non-blocking stream, so wait for the device first.
  ok = ok && cudaDeviceSynchronize() == cudaSuccess;
  transform_bytes<<<grid_for(n), 256, 0, s>>>((uint8_t *)p, n);
  ok = ok && cudaGetLastError() == cudaSuccess;
  ok = ok && cudaStreamSynchronize(s) == cudaSuccess;
  ok = ok && cudaMemcpy(back.data(), p, n, cudaMemcpyDeviceToHost) == cudaSuccess;
  for (size_t i = 0; ok && i < n; i++) ok = back[i] == (uint8_t)((host[i] ^ 0xA5) + (i & 7));
  ok = (cudaFree(p) == cudaSuccess) && ok;
  return ok;
}

static void section_roundtrips() {
  printf("== round trips\n");
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const size_t sizes[] = {1, 255, 4096, 65537, (1 << 20) + 3, 64u << 20};
  for (int round = 0; round < 3; round++)  // later rounds reuse cached blocks
    for (size_t n : sizes) {
      char name[64];
      snprintf(name, sizeof name, "roundtrip_%zu_r%d", n, round);
      report(name, roundtrip(n, (uint32_t)(n + round), s));
    }
  // Many live blocks at once, each with its own pattern: overlapping blocks would show.
  std::vector<void *> live;
  std::vector<size_t> sizes_live;
  for (int i = 0; i < 200; i++) {
    size_t n = 512 + (size_t)i * 4099;
    void *p;
    if (cudaMalloc(&p, n) != cudaSuccess) break;
    fill_pattern<<<grid_for(n), 256, 0, s>>>((uint8_t *)p, n, 1000 + i);
    live.push_back(p);
    sizes_live.push_back(n);
  }
  unsigned long long bad = 0;
  for (size_t i = 0; i < live.size(); i++) bad += device_mismatches(live[i], sizes_live[i], 1000 + (uint32_t)i, s);
  int free_errors = 0;
  for (void *p : live) free_errors += cudaFree(p) != cudaSuccess;
  report("live_200_blocks", live.size() == 200 && bad == 0 && free_errors == 0);
  CK(cudaStreamDestroy(s));
}

static void section_errors() {
  printf("== frees of what the pool does not own, and errors\n");
  CODE(cudaFree(0));
  CODE(cudaGetLastError());
  void *managed = nullptr, *host = nullptr, *p = nullptr;
  CODE(cudaMallocManaged(&managed, 1 << 20));
  CODE(cudaMallocHost(&host, 1 << 20));
  CODE(cudaFree(host));  // pinned host memory passed to cudaFree
  CODE(cudaGetLastError());
  CODE(cudaFreeHost(host));
  CODE(cudaMalloc(&p, 1 << 20));
  CODE(cudaFree((char *)p + 256));  // interior pointer
  CODE(cudaGetLastError());
  CODE(cudaFree(p));
  CODE(cudaFree(p));  // double free
  CODE(cudaGetLastError());
  CODE(cudaFree(managed));
  CODE(cudaGetLastError());
  int stack_var = 0;
  CODE(cudaFree(&stack_var));
  CODE(cudaGetLastError());
  void *huge = nullptr;
  cudaError_t e = cudaMalloc(&huge, (size_t)1 << 40);
  cudaError_t l1 = cudaGetLastError();
  cudaError_t l2 = cudaGetLastError();
  printf("cudaMalloc(1 TiB) -> %d, cudaGetLastError -> %d then %d, pointer %s\n", (int)e, (int)l1,
         (int)l2, huge ? "set" : "null");
  // The pool still works after the OOM.
  void *q = nullptr;
  CODE(cudaMalloc(&q, 4 << 20));
  CODE(cudaMemset(q, 1, 4 << 20));
  CODE(cudaFree(q));
}

// A kernel on stream A writes late into a block; the block is freed and a block of the same
// size is allocated and written on stream B. A's late writes must not land in the new block.
static void section_races() {
  printf("== reuse across streams\n");
  const size_t n = 8u << 20;
  const char *kinds[] = {"blocking", "nonblocking", "legacy"};
  for (int ka = 0; ka < 2; ka++)
    for (int kb = 0; kb < 3; kb++) {
      cudaStream_t a, b = 0;
      CK(cudaStreamCreateWithFlags(&a, ka == 0 ? cudaStreamDefault : cudaStreamNonBlocking));
      if (kb < 2) CK(cudaStreamCreateWithFlags(&b, kb == 0 ? cudaStreamDefault : cudaStreamNonBlocking));
      void *p = nullptr, *q = nullptr;
      CK(cudaMalloc(&p, n));
      spin_then_fill<<<grid_for(n), 256, 0, a>>>((uint8_t *)p, n, 1, 50ull * 1000 * 1000);
      CK(cudaGetLastError());
      CK(cudaFree(p));
      CK(cudaMalloc(&q, n));
      fill_pattern<<<grid_for(n), 256, 0, b>>>((uint8_t *)q, n, 2);
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      unsigned long long bad = device_mismatches(q, n, 2, b);
      printf("NODIFF race %s->%s same address: %s\n", kinds[ka], kinds[kb], p == q ? "yes" : "no");
      char name[64];
      snprintf(name, sizeof name, "race_%s_to_%s", kinds[ka], kinds[kb]);
      report(name, bad == 0);
      CK(cudaFree(q));
      CK(cudaStreamDestroy(a));
      if (b) CK(cudaStreamDestroy(b));
    }
}

static void section_capture() {
  printf("== graph capture\n");
  const size_t n = 1 << 20;
  cudaStream_t cs;
  CK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
  // Global mode: allocations only around the capture.
  {
    void *before = nullptr, *after = nullptr;
    CODE(cudaMalloc(&before, n));
    CODE(cudaStreamBeginCapture(cs, cudaStreamCaptureModeGlobal));
    fill_pattern<<<grid_for(n), 256, 0, cs>>>((uint8_t *)before, n, 11);
    cudaGraph_t graph = nullptr;
    CODE(cudaStreamEndCapture(cs, &graph));
    CODE(cudaMalloc(&after, n));
    cudaGraphExec_t exec = nullptr;
    CODE(cudaGraphInstantiate(&exec, graph, 0));
    CODE(cudaGraphLaunch(exec, cs));
    CODE(cudaStreamSynchronize(cs));
    report("capture_global_result", device_mismatches(before, n, 11, cs) == 0);
    CODE(cudaFree(after));
    CODE(cudaGraphExecDestroy(exec));
    CODE(cudaGraphDestroy(graph));
    CODE(cudaFree(before));
  }
  // Relaxed mode: a cudaMalloc inside is legal; a cudaFree of a block the pool handed out
  // earlier must not break the capture under the preload (native CUDA may refuse it).
  {
    void *before = nullptr, *inside = nullptr, *victim = nullptr;
    CODE(cudaMalloc(&before, n));
    CODE(cudaMalloc(&victim, n));
    CODE(cudaStreamBeginCapture(cs, cudaStreamCaptureModeRelaxed));
    fill_pattern<<<grid_for(n), 256, 0, cs>>>((uint8_t *)before, n, 21);
    CODE(cudaMalloc(&inside, n));
    fill_pattern<<<grid_for(n), 256, 0, cs>>>((uint8_t *)inside, n, 22);
    cudaError_t free_code = cudaFree(victim);
    printf("NODIFF cudaFree(pool block) inside relaxed capture -> %d %s\n", (int)free_code,
           cudaGetErrorName(free_code));
    cudaGraph_t graph = nullptr;
    cudaError_t end = cudaStreamEndCapture(cs, &graph);
    printf("NODIFF relaxed cudaStreamEndCapture -> %d %s\n", (int)end, cudaGetErrorName(end));
    bool ok = end == cudaSuccess;
    cudaGraphExec_t exec = nullptr;
    if (ok) ok = cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess;
    if (ok) ok = cudaGraphLaunch(exec, cs) == cudaSuccess;
    if (ok) ok = cudaStreamSynchronize(cs) == cudaSuccess;
    if (ok) ok = device_mismatches(before, n, 21, cs) == 0 && device_mismatches(inside, n, 22, cs) == 0;
    printf("PCHECK capture_relaxed_free_keeps_capture %s\n", ok ? "ok" : "BAD");
    (void)cudaGetLastError();
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    if (free_code != cudaSuccess) cudaFree(victim);
    cudaFree(inside);
    cudaFree(before);
    (void)cudaGetLastError();
  }
  CK(cudaStreamDestroy(cs));
}

static void section_pass_through() {
  printf("== managed, host, pitch and stream-ordered allocations pass through\n");
  const size_t n = 1 << 20;
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  uint8_t *managed = nullptr;
  CODE(cudaMallocManaged((void **)&managed, n));
  for (size_t i = 0; i < n; i++) managed[i] = pattern_byte(i, 31);
  transform_bytes<<<grid_for(n), 256, 0, s>>>(managed, n);
  CODE(cudaStreamSynchronize(s));
  bool ok = true;
  for (size_t i = 0; i < n; i++) ok = ok && managed[i] == (uint8_t)((pattern_byte(i, 31) ^ 0xA5) + (i & 7));
  report("managed_data", ok);
  CODE(cudaFree(managed));
  void *host = nullptr, *mapped = nullptr;
  CODE(cudaMallocHost(&host, n));
  CODE(cudaHostAlloc(&mapped, n, cudaHostAllocMapped));
  fill_pattern<<<grid_for(n), 256, 0, s>>>((uint8_t *)mapped, n, 32);
  CODE(cudaStreamSynchronize(s));
  ok = true;
  for (size_t i = 0; i < n; i++) ok = ok && ((uint8_t *)mapped)[i] == pattern_byte(i, 32);
  report("mapped_host_data", ok);
  CODE(cudaFreeHost(host));
  CODE(cudaFreeHost(mapped));
  void *pitched = nullptr;
  size_t pitch = 0;
  CODE(cudaMallocPitch(&pitched, &pitch, 1000, 10));
  printf("pitch for 1000 bytes wide: %zu\n", pitch);
  std::vector<uint8_t> rows(1000 * 10), back(1000 * 10);
  for (size_t i = 0; i < rows.size(); i++) rows[i] = pattern_byte(i, 33);
  CODE(cudaMemcpy2D(pitched, pitch, rows.data(), 1000, 1000, 10, cudaMemcpyHostToDevice));
  CODE(cudaMemcpy2D(back.data(), 1000, pitched, pitch, 1000, 10, cudaMemcpyDeviceToHost));
  report("pitch_data", rows == back);
  CODE(cudaFree(pitched));
  void *async_block = nullptr;
  CODE(cudaMallocAsync(&async_block, n, s));
  fill_pattern<<<grid_for(n), 256, 0, s>>>((uint8_t *)async_block, n, 34);
  report("malloc_async_data", device_mismatches(async_block, n, 34, s) == 0);
  CODE(cudaFreeAsync(async_block, s));
  CODE(cudaStreamSynchronize(s));
  CK(cudaStreamDestroy(s));
}

static void section_mem_get_info() {
  printf("== cudaMemGetInfo\n");
  size_t free0 = 0, total = 0, free1 = 0, free2 = 0;
  CODE(cudaMemGetInfo(&free0, &total));
  report("meminfo_sane", free0 > 0 && free0 <= total);
  void *p = nullptr;
  CODE(cudaMalloc(&p, (size_t)1 << 30));
  CODE(cudaMemGetInfo(&free1, &total));
  report("meminfo_drops_after_1GiB_alloc", free1 + (900u << 20) < free0);
  CODE(cudaFree(p));
  CODE(cudaMemGetInfo(&free2, &total));
  double diff_mib = ((double)free0 - (double)free2) / (1 << 20);
  char detail[96];
  snprintf(detail, sizeof detail, "(start-after %.1f MiB)", diff_mib);
  printf("NODIFF meminfo free start %zu MiB, after 1 GiB alloc %zu MiB, after free %zu MiB\n",
         free0 >> 20, free1 >> 20, free2 >> 20);
  report("meminfo_back_after_free_within_8MiB", diff_mib < 8.0 && diff_mib > -8.0, detail);
}

static void section_fork() {
  printf("== fork\n");
  void *p = nullptr;
  CODE(cudaMalloc(&p, 1 << 20));
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    void *c = nullptr;
    cudaError_t e = cudaMalloc(&c, 1 << 20);  // a fork child of a CUDA parent cannot use CUDA
    _exit(e == cudaSuccess ? 100 : (int)e);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  printf("fork child exit: %d\n", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  report("parent_after_fork", roundtrip(3u << 20, 77, s));
  CODE(cudaFree(p));
  CK(cudaStreamDestroy(s));
}

// Frees at exit: an atexit handler registered after CUDA init may still free; a static
// destructor runs after cudart's teardown (native: cudaErrorCudartUnloading).
struct FreeInStaticDestructor {
  void *p = nullptr;
  ~FreeInStaticDestructor() {
    if (p) {
      cudaError_t e = cudaFree(p);
      printf("static destructor cudaFree -> %d %s\n", (int)e, cudaGetErrorName(e));
      fflush(stdout);
    }
  }
};
static FreeInStaticDestructor g_static_free;
static void *g_atexit_block = nullptr;
static void free_at_exit() {
  cudaError_t e = cudaFree(g_atexit_block);
  printf("atexit cudaFree -> %d %s\n", (int)e, cudaGetErrorName(e));
  fflush(stdout);
}

int main() {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  printf("NODIFF preloaded: %s\n", preloaded() ? "yes" : "no");
  section_roundtrips();
  section_errors();
  section_races();
  section_capture();
  section_pass_through();
  section_mem_get_info();
  section_fork();
  print_pool_stats("end");
  printf("== exit without freeing\n");
  std::vector<void *> leaked(16);
  for (void *&p : leaked) CODE(cudaMalloc(&p, 1 << 20));
  CODE(cudaMalloc(&g_static_free.p, 1 << 20));
  CODE(cudaMalloc(&g_atexit_block, 1 << 20));
  atexit(free_at_exit);
  printf("main returns\n");
  return 0;
}
