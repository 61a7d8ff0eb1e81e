/* Linked with libcupool.so: reports whether CUDA calls are interposed in this process.
 * With an argument N: then makes N streamless 1 MiB alloc+free pairs through the C API
 * only (no CUDA call of its own, so no hook runs), each free fenced. */
#include <stdio.h>
#include <stdlib.h>

#include "cupool.h"

int main(int argc, char **argv)
{
    printf("interposition_active=%d\n", cupool_interposition_active());
    long pairs = argc > 1 ? atol(argv[1]) : 0;
    int failures = 0;
    for (long i = 0; i < pairs; i++) {
        void *p = NULL;
        if (cupool_alloc(&p, 1 << 20) != CUPOOL_OK || cupool_free(p) != CUPOOL_OK) failures++;
    }
    printf("pair_failures=%d\n", failures);
    return 0;
}
