/* Two copies of cupool in one process reach one pool.
 *
 * argv[1] is a second copy of the library (libcupool.so under another file name, as
 * libcupool_preload.so carries its own copy); argv[2] says how it is loaded:
 *   local:  this program links libcupool.so; the copy is dlopen'd RTLD_LOCAL and must
 *           forward to the program's copy, which comes first in the global scope;
 *   global: this program links libcupool.a (its symbols not exported); the copy is
 *           dlopen'd RTLD_GLOBAL before the first call, as a preloaded library would be,
 *           and the program's own copy must forward to it. */
#define _POSIX_C_SOURCE 200809L
#include "check.h"

#include <dlfcn.h>
#include <stdint.h>

typedef cupool_status (*alloc_fn)(void **, size_t);
typedef cupool_status (*free_fn)(void *);
typedef cupool_status (*get_stats_fn)(int, cupool_stats *);
typedef cupool_status (*config_set_fn)(const char *, const char *);

static void *symbol(void *lib, const char *name) {
    void *f = dlsym(lib, name);
    if (!f) {
        fprintf(stderr, "second copy lacks %s\n", name);
        exit(1);
    }
    return f;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: one_pool SECOND_COPY local|global\n");
        return 2;
    }
    int global = strcmp(argv[2], "global") == 0;
    void *lib = dlopen(argv[1], RTLD_NOW | (global ? RTLD_GLOBAL : RTLD_LOCAL));
    if (!lib) {
        fprintf(stderr, "dlopen %s: %s\n", argv[1], dlerror());
        return 1;
    }
    alloc_fn other_alloc;
    free_fn other_free;
    get_stats_fn other_get_stats;
    config_set_fn other_config_set;
    *(void **)&other_alloc = symbol(lib, "cupool_alloc");
    *(void **)&other_free = symbol(lib, "cupool_free");
    *(void **)&other_get_stats = symbol(lib, "cupool_get_stats");
    *(void **)&other_config_set = symbol(lib, "cupool_config_set");
    EXPECT(*(void **)&other_alloc != (void *)(uintptr_t)&cupool_alloc); /* really two copies */

    /* A block from one copy is known to the other: freed there, counted by both. */
    void *a = NULL, *b = NULL;
    EXPECT_OK(other_alloc(&a, 4096));
    write_and_verify(a, 4096, 1);
    EXPECT_OK(cupool_alloc(&b, 8192));
    write_and_verify(b, 8192, 2);
    cupool_stats mine = read_stats();
    cupool_stats theirs;
    memset(&theirs, 0, sizeof theirs);
    theirs.size = sizeof theirs;
    theirs.version = CUPOOL_STATS_VERSION;
    EXPECT_OK(other_get_stats(-1, &theirs));
    EXPECT_EQ_U64(mine.num_allocs, 2);
    EXPECT_EQ_U64(theirs.num_allocs, 2);
    EXPECT_EQ_U64(theirs.allocated_bytes.current, mine.allocated_bytes.current);

    EXPECT_OK(cupool_free(a));
    EXPECT_OK(other_free(b));
    EXPECT_STATUS(other_free(a), CUPOOL_ERROR_DOUBLE_FREE);
    EXPECT_STATUS(cupool_free(b), CUPOOL_ERROR_DOUBLE_FREE);

    /* One configuration too. */
    EXPECT_OK(other_config_set("fence_batch", "7"));
    char value[16];
    EXPECT_OK(cupool_config_get("fence_batch", value, sizeof value, NULL));
    EXPECT(strcmp(value, "7") == 0);

    mine = read_stats();
    EXPECT_EQ_U64(mine.num_frees, 2);
    EXPECT_EQ_U64(mine.allocated_bytes.current, 0);
    dlclose(lib);
    puts("PASS one_pool");
    return 0;
}
