/* What a process that never uses CUDA pays for inheriting LD_PRELOAD: /bin/true (or
 * PROGRAM) started pair by pair with no preload, an empty preloaded library, and
 * libcupool_preload.so, in turn, N times; prints the median wall time of each and the
 * differences. Every run must exit 0.
 *
 *   cc -O2 -o /tmp/preload_startup benches/c/preload_startup.c
 *   echo 'void f(void){}' > /tmp/e.c && cc -shared -fPIC -o /tmp/libempty.so /tmp/e.c
 *   /tmp/preload_startup 300 /tmp/libempty.so $PWD/target/release/libcupool_preload.so [PROGRAM]
 */
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int by_value(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s N EMPTY_LIB PRELOAD_LIB [PROGRAM]\n", argv[0]);
    return 64;
  }
  int n = atoi(argv[1]);
  if (n <= 0 || n > 100000) {
    fprintf(stderr, "N must be 1..100000\n");
    return 64;
  }
  const char *program = argc > 4 ? argv[4] : "/bin/true";
  const char *preload[3] = {NULL, argv[2], argv[3]};
  const char *names[3] = {"no preload", "empty preload", "cupool preload"};
  double *t[3];
  for (int k = 0; k < 3; k++) t[k] = malloc(sizeof(double) * (size_t)n);
  for (int i = 0; i < n; i++) {
    for (int k = 0; k < 3; k++) {
      char var[4096];
      if (preload[k]) snprintf(var, sizeof var, "LD_PRELOAD=%s", preload[k]);
      else snprintf(var, sizeof var, "NO_PRELOAD=1");
      char *envp[] = {var, NULL};
      char *args[] = {(char *)program, NULL};
      double t0 = now_s();
      pid_t pid;
      if (posix_spawn(&pid, program, NULL, NULL, args, envp) != 0) {
        perror("posix_spawn");
        return 1;
      }
      int status = 0;
      waitpid(pid, &status, 0);
      t[k][i] = now_s() - t0;
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "%s: run %d of %s failed (status %d)\n", names[k], i, program, status);
        return 1;
      }
    }
  }
  double med[3];
  for (int k = 0; k < 3; k++) {
    qsort(t[k], (size_t)n, sizeof(double), by_value);
    med[k] = t[k][n / 2];
    printf("%-15s median %.3f ms\n", names[k], med[k] * 1e3);
  }
  printf("cupool preload: +%.3f ms over no preload, +%.3f ms over an empty preload (%d runs each, all exit 0)\n",
         (med[2] - med[0]) * 1e3, (med[2] - med[1]) * 1e3, n);
  return 0;
}
