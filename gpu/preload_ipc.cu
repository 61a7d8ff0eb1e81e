// IPC through cudaIpcGetMemHandle across two processes, with and without the preload.
// The parent allocates, writes a pattern, exports a handle and starts a fresh copy of this
// program (fork + exec) that opens the handle and compares the bytes. The outcome must be
// correct bytes or a clean error, never wrong bytes (a sub-allocated block exported as its
// segment's handle would map at the wrong offset).
// Usage: preload_ipc            (parent)
//        preload_ipc child HEX SIZE SEED
// With the C API instead (libcupool.so preloaded, nothing interposed; blocks from
// cupool_alloc, handles from cupool_ipc_get_handle):
//        LD_PRELOAD=libcupool.so [IPC_PRELOAD_LIB=libcupool_preload.so] preload_ipc api
// prints PASS/FAIL lines: a child on the C API (cupool_ipc_open_handle) must see the bytes,
// a child under the preload (cudaIpcOpenMemHandle hooked) too when IPC_PRELOAD_LIB names
// it, a child without cupool must see them or fail cleanly.
#include <dlfcn.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "common.cuh"

static std::string to_hex(const void *p, size_t n) {
  std::string s;
  char b[3];
  for (size_t i = 0; i < n; i++) {
    snprintf(b, sizeof b, "%02x", ((const uint8_t *)p)[i]);
    s += b;
  }
  return s;
}

static bool from_hex(const char *hex, void *out, size_t n) {
  if (strlen(hex) != 2 * n) return false;
  for (size_t i = 0; i < n; i++) {
    unsigned v;
    if (sscanf(hex + 2 * i, "%2x", &v) != 1) return false;
    ((uint8_t *)out)[i] = (uint8_t)v;
  }
  return true;
}

// The C API's calls, found in the preloaded libcupool.so (no link: the same binary runs
// without cupool).
struct Api {
  int (*alloc)(void **, size_t);
  int (*free)(void *);
  int (*get)(cudaIpcMemHandle_t *, const void *);
  int (*open)(void **, const cudaIpcMemHandle_t *, unsigned);
  int (*close)(void *);
};

static bool load_api(Api *a) {
  a->alloc = (int (*)(void **, size_t))dlsym(RTLD_DEFAULT, "cupool_alloc");
  a->free = (int (*)(void *))dlsym(RTLD_DEFAULT, "cupool_free");
  a->get = (int (*)(cudaIpcMemHandle_t *, const void *))dlsym(RTLD_DEFAULT, "cupool_ipc_get_handle");
  a->open = (int (*)(void **, const cudaIpcMemHandle_t *, unsigned))dlsym(RTLD_DEFAULT, "cupool_ipc_open_handle");
  a->close = (int (*)(void *))dlsym(RTLD_DEFAULT, "cupool_ipc_close_handle");
  return a->alloc && a->free && a->get && a->open && a->close;
}

// Child: exit 0 = bytes correct, 10 = open failed cleanly, 20 = WRONG BYTES, 30 = other.
static int child(const char *hex, size_t n, uint32_t seed) {
  cudaIpcMemHandle_t h;
  if (!from_hex(hex, &h, sizeof h)) return 30;
  // IPC_CHILD_DEVICE=1: the importer works on another GPU than the exporter (two GPUs).
  if (const char *dev = getenv("IPC_CHILD_DEVICE")) {
    if (cudaSetDevice(atoi(dev)) != cudaSuccess) return 30;
  }
  void *p = nullptr;
  Api api;
  bool through_api = getenv("IPC_CHILD_API") != nullptr && load_api(&api);
  if (through_api) {
    if (cudaFree(0) != cudaSuccess) return 30;  // a current context, as the runtime makes
    int st = api.open(&p, &h, cudaIpcMemLazyEnablePeerAccess);
    if (st != 0) {
      fprintf(stderr, "child: cupool_ipc_open_handle -> %d\n", st);
      return 10;
    }
  } else {
    cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
      fprintf(stderr, "child: cudaIpcOpenMemHandle -> %s\n", cudaGetErrorName(e));
      return 10;
    }
  }
  std::vector<uint8_t> back(n);
  if (cudaMemcpy(back.data(), p, n, cudaMemcpyDeviceToHost) != cudaSuccess) return 30;
  size_t bad = 0;
  for (size_t i = 0; i < n; i++) bad += back[i] != pattern_byte(i, seed);
  if (through_api) {
    if (api.close(p) != 0) return 30;
  } else {
    cudaIpcCloseMemHandle(p);
  }
  return bad ? 20 : 0;
}

static const char *outcome(int code) {
  switch (code) {
    case 0: return "correct bytes";
    case 10: return "clean open error";
    case 20: return "WRONG BYTES";
    default: return "child failed";
  }
}

static bool preloaded() {
  typedef int (*active_fn)(void);
  active_fn active = (active_fn)dlsym(RTLD_DEFAULT, "cupool_interposition_active");
  return active != nullptr && active() == 1;
}

// Whether the preload's pool runs with vmm:on.
static bool vmm_on() {
  typedef int (*get_fn)(const char *, char *, size_t, size_t *);
  get_fn get = (get_fn)dlsym(RTLD_DEFAULT, "cupool_config_get");
  char v[16] = "";
  size_t n = 0;
  return get != nullptr && get("vmm", v, sizeof v, &n) == 0 && strcmp(v, "on") == 0;
}

// Starts a child that opens `h` and checks n bytes of pattern `seed`; returns its code.
// `preload`: the child's LD_PRELOAD ("" for none: an importer not under cupool; nullptr:
// this process's); `through_api`: the child opens with cupool_ipc_open_handle.
static int open_in_child(const cudaIpcMemHandle_t &h, size_t n, uint32_t seed,
                         const char *preload, bool through_api) {
  std::string hex = to_hex(&h, sizeof h), size = std::to_string(n), sd = std::to_string(seed);
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    if (preload != nullptr && *preload == 0) unsetenv("LD_PRELOAD");
    else if (preload != nullptr) setenv("LD_PRELOAD", preload, 1);
    if (through_api) setenv("IPC_CHILD_API", "1", 1);
    else unsetenv("IPC_CHILD_API");
    char self[4096];
    ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    if (len <= 0) _exit(30);
    self[len] = 0;
    execl(self, self, "child", hex.c_str(), size.c_str(), sd.c_str(), (char *)nullptr);
    _exit(30);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 30;
}

// Exports `p` (n bytes of pattern `seed`) to a child process; returns the child's code.
// `plain_child`: the child runs without LD_PRELOAD (an importer that is not under cupool).
static int export_to_child(void *p, size_t n, uint32_t seed, bool *export_ok,
                           bool plain_child = false) {
  cudaIpcMemHandle_t h;
  cudaError_t e = cudaIpcGetMemHandle(&h, p);
  *export_ok = e == cudaSuccess;
  if (e != cudaSuccess) {
    fprintf(stderr, "parent: cudaIpcGetMemHandle -> %s\n", cudaGetErrorName(e));
    (void)cudaGetLastError();  // a program that handles the refusal clears the sticky error
    return 10;
  }
  return open_in_child(h, n, seed, plain_child ? "" : nullptr, false);
}

// Small blocks allocated first, so that later small blocks may sit inside a pool segment.
static std::vector<void *> g_filler;

// The context, a non-blocking stream for the pattern kernels, and the filler blocks from
// `alloc` (cudaMalloc, or the C API's cupool_alloc).
static cudaStream_t start(int (*alloc)(void **, size_t)) {
  CK(cudaFree(0));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (int i = 0; i < 8; i++) {
    void *f;
    if (alloc(&f, 4096) != 0) exit(1);
    g_filler.push_back(f);
  }
  return s;
}

// The C API's IPC: blocks of every kind exported with cupool_ipc_get_handle.
static int api_main() {
  Api api;
  if (!load_api(&api)) {
    printf("FAIL ipc_api_found: run with LD_PRELOAD=libcupool.so\n");
    return 1;
  }
  const char *preload_lib = getenv("IPC_PRELOAD_LIB");
  if (preload_lib != nullptr && *preload_lib == 0) preload_lib = nullptr;
  cudaStream_t s = start(api.alloc);
  struct Case { const char *name; size_t n; } cases[] = {
      {"64MiB", 64u << 20}, {"3MiB", 3u << 20}, {"1MiB", 1u << 20}, {"4KiB", 4096}};
  int failed = 0;
  for (unsigned c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    void *p;
    if (api.alloc(&p, cases[c].n) != 0) return 1;
    uint32_t seed = 700 + c;
    fill_pattern<<<grid_for(cases[c].n), 256, 0, s>>>((uint8_t *)p, cases[c].n, seed);
    CK(cudaGetLastError());
    CK(cudaStreamSynchronize(s));
    cudaIpcMemHandle_t h;
    int st = api.get(&h, p);
    if (st != 0) {
      printf("FAIL ipc_api_export_%s: cupool_ipc_get_handle -> %d\n", cases[c].name, st);
      failed++;
      continue;
    }
    int code = open_in_child(h, cases[c].n, seed, nullptr, true);
    printf("%s ipc_api_%s_opened_by_the_api: %s\n", code == 0 ? "PASS" : "FAIL", cases[c].name, outcome(code));
    failed += code != 0;
    if (preload_lib != nullptr) {
      code = open_in_child(h, cases[c].n, seed, preload_lib, false);
      printf("%s ipc_api_%s_opened_under_the_preload: %s\n", code == 0 ? "PASS" : "FAIL", cases[c].name, outcome(code));
      failed += code != 0;
    }
    code = open_in_child(h, cases[c].n, seed, "", false);
    bool clean = code == 0 || code == 10;
    printf("%s ipc_api_%s_importer_without_cupool: %s\n", clean ? "PASS" : "FAIL", cases[c].name, outcome(code));
    failed += !clean;
    bool parent_ok = device_mismatches(p, cases[c].n, seed, s) == 0;
    printf("%s ipc_api_%s_parent_data\n", parent_ok ? "PASS" : "FAIL", cases[c].name);
    failed += !parent_ok;
    if (api.free(p) != 0) return 1;
  }
  for (void *f : g_filler) api.free(f);
  CK(cudaStreamDestroy(s));
  return failed ? 1 : 0;
}

int main(int argc, char **argv) {
  if (argc == 5 && strcmp(argv[1], "child") == 0)
    return child(argv[2], strtoull(argv[3], nullptr, 10), (uint32_t)strtoul(argv[4], nullptr, 10));
  if (argc == 2 && strcmp(argv[1], "api") == 0) {
    setvbuf(stdout, nullptr, _IOLBF, 0);
    return api_main();
  }
  setvbuf(stdout, nullptr, _IOLBF, 0);
  cudaStream_t s = start([](void **p, size_t n) { return (int)cudaMalloc(p, n); });
  struct Case { const char *name; size_t n; } cases[] = {
      {"ipc_64MiB", 64u << 20}, {"ipc_1MiB", 1u << 20}, {"ipc_4KiB", 4096}, {"ipc_4KiB_second", 4096}};
  int wrong = 0;
  for (unsigned c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    void *p;
    CK(cudaMalloc(&p, cases[c].n));
    uint32_t seed = 500 + c;
    fill_pattern<<<grid_for(cases[c].n), 256, 0, s>>>((uint8_t *)p, cases[c].n, seed);
    CK(cudaGetLastError());
    CK(cudaStreamSynchronize(s));
    bool export_ok = false;
    int code = export_to_child(p, cases[c].n, seed, &export_ok);
    printf("NODIFF %s: export %s, child: %s\n", cases[c].name, export_ok ? "ok" : "refused", outcome(code));
    bool ok = code == 0 || code == 10;
    wrong += !ok;
    printf("CHECK %s %s\n", cases[c].name, ok ? "ok" : "BAD");
    if (preloaded()) {
      // Under cupool both sides: every block opens with its own bytes (Note [ipc registry]),
      // VMM-backed ones (vmm:on, above 1 MiB) too (Note [ipc of arena blocks]).
      printf("PCHECK %s_opened_under_cupool%s %s\n", cases[c].name, vmm_on() ? "_vmm" : "",
             code == 0 ? "ok" : "BAD");
      // An importer without cupool: the driver's handle (a block with a segment of its
      // own) opens; a sub-allocated block's handle is refused; never wrong bytes.
      bool plain_export = false;
      int plain = export_to_child(p, cases[c].n, seed, &plain_export, true);
      printf("NODIFF %s: importer without cupool: %s\n", cases[c].name, outcome(plain));
      printf("PCHECK %s_importer_without_cupool %s\n", cases[c].name,
             plain == 0 || plain == 10 ? "ok" : "BAD");
    }
    // The parent's own view is unchanged.
    printf("CHECK %s_parent_data %s\n", cases[c].name,
           device_mismatches(p, cases[c].n, seed, s) == 0 ? "ok" : "BAD");
    CK(cudaFree(p));
  }
  for (void *f : g_filler) CK(cudaFree(f));
  CK(cudaStreamDestroy(s));
  return wrong ? 1 : 0;
}
