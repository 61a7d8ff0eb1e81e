/* A per-device memory limit turns allocations past it into CUPOOL_ERROR_OUT_OF_MEMORY. */
#include "check.h"

#include <stdint.h>

int main(void) {
    size_t limit = 12345;
    EXPECT_OK(cupool_get_memory_limit(0, &limit));
    EXPECT_EQ_U64(limit, 0); /* none by default */

    const size_t cap = 8u << 20;
    EXPECT_OK(cupool_set_memory_limit(0, cap));
    EXPECT_OK(cupool_get_memory_limit(0, &limit));
    EXPECT_EQ_U64(limit, cap);

    void *small = NULL;
    EXPECT_OK(cupool_alloc(&small, 1u << 20));
    write_and_verify(small, 1u << 20, 1);

    void *big = (void *)(uintptr_t)0x1234; /* must stay untouched on failure */
    EXPECT_STATUS(cupool_alloc(&big, 64u << 20), CUPOOL_ERROR_OUT_OF_MEMORY);
    EXPECT(big == (void *)(uintptr_t)0x1234);
    cupool_stats s = read_stats();
    EXPECT_EQ_U64(s.num_ooms, 1);
    EXPECT(s.reserved_bytes.current <= cap);
    EXPECT_STATUS(cupool_alloc_async(&big, 64u << 20, STREAM(0x10)), CUPOOL_ERROR_OUT_OF_MEMORY);
    s = read_stats();
    EXPECT_EQ_U64(s.num_ooms, 2);
    EXPECT_EQ_U64(s.num_allocs, 1);
    EXPECT(big == (void *)(uintptr_t)0x1234);

    /* Under the limit still works, and the failed calls left the pool usable. */
    void *fits = NULL;
    EXPECT_OK(cupool_alloc(&fits, 1u << 20));
    write_and_verify(fits, 1u << 20, 2);
    EXPECT_OK(cupool_free(fits));

    /* 0 removes the limit. */
    EXPECT_OK(cupool_set_memory_limit(0, 0));
    EXPECT_OK(cupool_get_memory_limit(0, &limit));
    EXPECT_EQ_U64(limit, 0);
    EXPECT_OK(cupool_alloc(&big, 64u << 20));
    write_and_verify(big, 4096, 3);
    EXPECT_OK(cupool_free(big));
    EXPECT_OK(cupool_free(small));

    /* Bad arguments. */
    EXPECT_STATUS(cupool_set_memory_limit(-1, cap), CUPOOL_ERROR_INVALID_DEVICE);
    EXPECT_STATUS(cupool_set_memory_limit(-7, cap), CUPOOL_ERROR_INVALID_DEVICE);
    EXPECT_STATUS(cupool_get_memory_limit(-1, &limit), CUPOOL_ERROR_INVALID_DEVICE);
    EXPECT_STATUS(cupool_get_memory_limit(0, NULL), CUPOOL_ERROR_INVALID_VALUE);
    EXPECT_STATUS(cupool_set_memory_limit(1 << 20, cap), CUPOOL_ERROR_INVALID_DEVICE);

    /* A reserve: taken now, kept through empty_cache, refused past the limit. */
    size_t taken = 0;
    EXPECT_OK(cupool_empty_cache(NULL));
    EXPECT_OK(cupool_reserve(0, 32u << 20, &taken));
    EXPECT_EQ_U64(taken, 32u << 20);
    EXPECT_OK(cupool_empty_cache(NULL));
    EXPECT_EQ_U64(read_stats().reserved_bytes.current, 32u << 20);
    EXPECT_OK(cupool_set_memory_limit(0, cap));
    taken = 77;
    EXPECT_STATUS(cupool_reserve(0, 64u << 20, &taken), CUPOOL_ERROR_OUT_OF_MEMORY);
    EXPECT_EQ_U64(taken, 77); /* untouched on failure */
    EXPECT_OK(cupool_set_memory_limit(0, 0));
    EXPECT_STATUS(cupool_reserve(-7, 1, NULL), CUPOOL_ERROR_INVALID_DEVICE);
    EXPECT_OK(cupool_reserve(-1, 0, NULL)); /* current device: the reserve ends */
    EXPECT_OK(cupool_empty_cache(NULL));
    EXPECT_EQ_U64(read_stats().reserved_bytes.current, 0);

    s = read_stats();
    EXPECT_EQ_U64(s.num_ooms, 2);
    EXPECT_EQ_U64(s.allocated_bytes.current, 0);
    puts("PASS limits");
    return 0;
}
