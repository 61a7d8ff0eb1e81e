// IPC through cudaIpcGetMemHandle across two processes, with and without the preload.
// The parent allocates, writes a pattern, exports a handle and starts a fresh copy of this
// program (fork + exec) that opens the handle and compares the bytes. The outcome must be
// correct bytes or a clean error, never wrong bytes (a sub-allocated block exported as its
// segment's handle would map at the wrong offset).
// Usage: preload_ipc            (parent)
//        preload_ipc child HEX SIZE SEED
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

// Child: exit 0 = bytes correct, 10 = open failed cleanly, 20 = WRONG BYTES, 30 = other.
static int child(const char *hex, size_t n, uint32_t seed) {
  cudaIpcMemHandle_t h;
  if (!from_hex(hex, &h, sizeof h)) return 30;
  // IPC_CHILD_DEVICE=1: the importer works on another GPU than the exporter (two GPUs).
  if (const char *dev = getenv("IPC_CHILD_DEVICE")) {
    if (cudaSetDevice(atoi(dev)) != cudaSuccess) return 30;
  }
  void *p = nullptr;
  cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
  if (e != cudaSuccess) {
    fprintf(stderr, "child: cudaIpcOpenMemHandle -> %s\n", cudaGetErrorName(e));
    return 10;
  }
  std::vector<uint8_t> back(n);
  if (cudaMemcpy(back.data(), p, n, cudaMemcpyDeviceToHost) != cudaSuccess) return 30;
  size_t bad = 0;
  for (size_t i = 0; i < n; i++) bad += back[i] != pattern_byte(i, seed);
  cudaIpcCloseMemHandle(p);
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
  std::string hex = to_hex(&h, sizeof h), size = std::to_string(n), sd = std::to_string(seed);
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    if (plain_child) unsetenv("LD_PRELOAD");
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

int main(int argc, char **argv) {
  if (argc == 5 && strcmp(argv[1], "child") == 0)
    return child(argv[2], strtoull(argv[3], nullptr, 10), (uint32_t)strtoul(argv[4], nullptr, 10));
  setvbuf(stdout, nullptr, _IOLBF, 0);
  CK(cudaFree(0));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // Some small blocks first, so that later small blocks may sit inside a pool segment.
  std::vector<void *> filler;
  for (int i = 0; i < 8; i++) {
    void *f;
    CK(cudaMalloc(&f, 4096));
    filler.push_back(f);
  }
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
  for (void *f : filler) CK(cudaFree(f));
  CK(cudaStreamDestroy(s));
  return wrong ? 1 : 0;
}
