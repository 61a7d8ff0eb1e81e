/* Streamless alloc+free pairs (cupool_alloc / cupool_free: the path of every cudaMalloc /
 * cudaFree under the preload) from 1 thread, then from one thread per core, on cupool's
 * host backend, against glibc malloc/free on the same loop. Prints pairs per second and the
 * scaling (N threads' throughput over one thread's) for each.
 *
 *   cc -O2 -pthread streamless_scaling.c -Iinclude -Ltarget/release -lcupool -o /tmp/ss
 *   CUPOOL_CONF=backend:host LD_LIBRARY_PATH=target/release /tmp/ss [PAIRS] [ROUNDS]
 *
 * Each thread cycles through 8 sizes from 512 B to 256 KiB (a block of each size live at
 * a time, freed one iteration later), so the loop is not one block bouncing. Medians of
 * ROUNDS rounds. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cupool.h"

static long pairs = 200000;
static int use_malloc;

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void *worker(void *arg) {
  (void)arg;
  static const size_t sizes[8] = {512, 1024, 4096, 8192, 16384, 65536, 131072, 262144};
  void *live[8] = {0};
  for (long i = 0; i < pairs; i++) {
    int k = (int)(i & 7);
    if (live[k]) {
      if (use_malloc) free(live[k]);
      else if (cupool_free(live[k]) != CUPOOL_OK) { fprintf(stderr, "free failed\n"); exit(1); }
    }
    if (use_malloc) live[k] = malloc(sizes[k]);
    else if (cupool_alloc(&live[k], sizes[k]) != CUPOOL_OK) { fprintf(stderr, "alloc failed\n"); exit(1); }
    if (use_malloc) memset(live[k], 1, 8);
  }
  for (int k = 0; k < 8; k++) {
    if (!live[k]) continue;
    if (use_malloc) free(live[k]);
    else cupool_free(live[k]);
  }
  return NULL;
}

/* Pairs per second with `threads` threads. */
static double run(int threads) {
  pthread_t t[256];
  double start = now_s();
  for (int i = 0; i < threads; i++) pthread_create(&t[i], NULL, worker, NULL);
  for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
  return (double)pairs * threads / (now_s() - start);
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  if (argc > 1) pairs = atol(argv[1]);
  int rounds = argc > 2 ? atoi(argv[2]) : 5;
  int cores = (int)sysconf(_SC_NPROCESSORS_ONLN);
  if (cores > 256) cores = 256;
  for (use_malloc = 0; use_malloc < 2; use_malloc++) {
    double one[64], many[64];
    for (int r = 0; r < rounds && r < 64; r++) {
      one[r] = run(1);
      many[r] = run(cores);
    }
    qsort(one, rounds, sizeof one[0], cmp);
    qsort(many, rounds, sizeof many[0], cmp);
    double a = one[rounds / 2], b = many[rounds / 2];
    printf("%-8s 1 thread %.2f M pairs/s, %d threads %.2f M pairs/s: %.2fx (%.2f x cores)\n",
           use_malloc ? "malloc" : "cupool", a / 1e6, cores, b / 1e6, b / a, b / a / cores);
  }
  cupool_stats s;
  memset(&s, 0, sizeof s);
  s.size = sizeof s;
  s.version = CUPOOL_STATS_VERSION;
  if (cupool_get_stats(-1, &s) == CUPOOL_OK)
    printf("cupool: fences %llu, cache hits %llu, misses %llu\n",
           (unsigned long long)s.fences_recorded, (unsigned long long)s.cache_hits,
           (unsigned long long)s.cache_misses);
  return 0;
}
