/* With the default cuda backend and no libcuda.so.1, calls fail cleanly with
 * CUPOOL_ERROR_BACKEND_UNAVAILABLE: no crash, no out-parameter written. */
#include "check.h"

#include <dlfcn.h>
#include <stdint.h>

int main(void) {
    void *libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (libcuda) {
        dlclose(libcuda);
        puts("SKIP no_backend: libcuda.so.1 is present on this machine");
        return 0;
    }
    char backend[16];
    EXPECT_OK(cupool_config_get("backend", backend, sizeof backend, NULL));
    EXPECT(strcmp(backend, "cuda") == 0);

    void *const sentinel = (void *)(uintptr_t)0xBAD;
    void *p = sentinel;
    for (int attempt = 0; attempt < 3; attempt++) {
        EXPECT_STATUS(cupool_alloc(&p, 1024), CUPOOL_ERROR_BACKEND_UNAVAILABLE);
        EXPECT_STATUS(cupool_alloc_async(&p, 1024, STREAM(0x10)), CUPOOL_ERROR_BACKEND_UNAVAILABLE);
        EXPECT(p == sentinel);
    }
    cupool_stats s;
    memset(&s, 0, sizeof s);
    s.size = sizeof s;
    s.version = CUPOOL_STATS_VERSION;
    EXPECT_STATUS(cupool_get_stats(-1, &s), CUPOOL_ERROR_BACKEND_UNAVAILABLE);
    EXPECT_OK(cupool_free(NULL));
    int local = 0;
    EXPECT_STATUS(cupool_free(&local), CUPOOL_ERROR_INVALID_POINTER);
    /* Argument checks still come first. */
    EXPECT_STATUS(cupool_alloc(&p, 0), CUPOOL_ERROR_INVALID_VALUE);
    printf("alloc without a driver: %s\n", cupool_status_string(CUPOOL_ERROR_BACKEND_UNAVAILABLE));
    puts("PASS no_backend");
    return 0;
}
