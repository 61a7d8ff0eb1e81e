/* Wrong arguments return the right status, never crash, leak nothing (ASan/LSan), and
 * leave the pool working. */
#include "check.h"

#include <stdint.h>

static void *const SENTINEL = (void *)(uintptr_t)0xC0FFEE;

static void expect_pool_works(void) {
    void *p = NULL;
    EXPECT_OK(cupool_alloc(&p, 777));
    write_and_verify(p, 777, 9);
    EXPECT_OK(cupool_free(p));
    EXPECT_OK(cupool_alloc_async(&p, 777, STREAM(0x10)));
    write_and_verify(p, 777, 10);
    EXPECT_OK(cupool_free_async(p, STREAM(0x10)));
}

int main(void) {
    void *p = SENTINEL;

    /* Before the pool has started: frees of foreign pointers do not start it. */
    int on_stack = 0;
    EXPECT_STATUS(cupool_free(&on_stack), CUPOOL_ERROR_INVALID_POINTER);
    EXPECT_OK(cupool_free(NULL));
    EXPECT_OK(cupool_free_async(NULL, STREAM(0x10)));

    /* NULL out-pointers. */
    EXPECT_STATUS(cupool_alloc(NULL, 64), CUPOOL_ERROR_INVALID_VALUE);
    EXPECT_STATUS(cupool_alloc_async(NULL, 64, STREAM(0x10)), CUPOOL_ERROR_INVALID_VALUE);
    EXPECT_STATUS(cupool_get_memory_limit(0, NULL), CUPOOL_ERROR_INVALID_VALUE);
    EXPECT_STATUS(cupool_get_stats(0, NULL), CUPOOL_ERROR_INVALID_VALUE);

    /* Size 0 and sizes no device can hold: out-pointer untouched. */
    EXPECT_STATUS(cupool_alloc(&p, 0), CUPOOL_ERROR_INVALID_VALUE);
    EXPECT_STATUS(cupool_alloc_async(&p, 0, STREAM(0x10)), CUPOOL_ERROR_INVALID_VALUE);
    EXPECT(p == SENTINEL);
    /* A size no device can hold is out of memory, as cudaMalloc reports it. */
    const size_t huge[] = {SIZE_MAX, SIZE_MAX - 511, SIZE_MAX / 2, SIZE_MAX / 2 + 1, (size_t)1 << 62};
    for (size_t i = 0; i < sizeof huge / sizeof huge[0]; i++) {
        EXPECT_STATUS(cupool_alloc(&p, huge[i]), CUPOOL_ERROR_OUT_OF_MEMORY);
        EXPECT_STATUS(cupool_alloc_async(&p, huge[i], STREAM(0x10)), CUPOOL_ERROR_OUT_OF_MEMORY);
        EXPECT(p == SENTINEL);
    }
    expect_pool_works();

    /* Frees of pointers the pool never handed out. */
    void *heap = malloc(256);
    EXPECT(heap != NULL);
    EXPECT_STATUS(cupool_free(&on_stack), CUPOOL_ERROR_INVALID_POINTER);
    EXPECT_STATUS(cupool_free(heap), CUPOOL_ERROR_INVALID_POINTER);
    EXPECT_STATUS(cupool_free_async(heap, STREAM(0x10)), CUPOOL_ERROR_INVALID_POINTER);
    EXPECT_STATUS(cupool_free((void *)(uintptr_t)0x1000), CUPOOL_ERROR_INVALID_POINTER);
    EXPECT_STATUS(cupool_free((void *)UINTPTR_MAX), CUPOOL_ERROR_INVALID_POINTER);
    free(heap);

    /* Interior pointers are not blocks; the block stays live. */
    void *block = NULL;
    EXPECT_OK(cupool_alloc(&block, 4096));
    EXPECT_STATUS(cupool_free((char *)block + 16), CUPOOL_ERROR_INVALID_POINTER);
    EXPECT_STATUS(cupool_free((char *)block + 4095), CUPOOL_ERROR_INVALID_POINTER);
    EXPECT_STATUS(cupool_free_async((char *)block + 1, STREAM(0x10)), CUPOOL_ERROR_INVALID_POINTER);
    write_and_verify(block, 4096, 1);

    /* Double frees, through either call. */
    EXPECT_OK(cupool_free(block));
    EXPECT_STATUS(cupool_free(block), CUPOOL_ERROR_DOUBLE_FREE);
    EXPECT_STATUS(cupool_free_async(block, STREAM(0x10)), CUPOOL_ERROR_DOUBLE_FREE);
    void *async_block = NULL;
    EXPECT_OK(cupool_alloc_async(&async_block, 2048, STREAM(0x20)));
    EXPECT_OK(cupool_free_async(async_block, STREAM(0x20)));
    EXPECT_STATUS(cupool_free_async(async_block, STREAM(0x20)), CUPOOL_ERROR_DOUBLE_FREE);
    EXPECT_STATUS(cupool_free(async_block), CUPOOL_ERROR_DOUBLE_FREE);

    /* Freeing on another stream than the allocation's is allowed and counted. */
    cupool_stats before = read_stats();
    void *cross = NULL;
    EXPECT_OK(cupool_alloc_async(&cross, 5000, STREAM(0x30)));
    EXPECT_OK(cupool_free_async(cross, STREAM(0x40)));
    cupool_stats after = read_stats();
    EXPECT_EQ_U64(after.cross_stream_frees, before.cross_stream_frees + 1);

    /* Negative devices. */
    EXPECT_STATUS(cupool_reset_peak_stats(-2), CUPOOL_ERROR_INVALID_DEVICE);
    EXPECT_STATUS(cupool_empty_cache_device(-2, NULL), CUPOOL_ERROR_INVALID_DEVICE);
    EXPECT_STATUS(cupool_stats_json(-100, NULL, 0, NULL), CUPOOL_ERROR_INVALID_DEVICE);

    /* Only the successful calls were counted, and nothing is left allocated. */
    expect_pool_works();
    cupool_stats end = read_stats();
    EXPECT_EQ_U64(end.num_allocs, 2 + 2 + 3);
    EXPECT_EQ_U64(end.num_frees, end.num_allocs);
    EXPECT_EQ_U64(end.allocated_bytes.current, 0);
    size_t released = 0;
    EXPECT_OK(cupool_empty_cache(&released));
    EXPECT_EQ_U64(read_stats().reserved_bytes.current, 0);

    puts("PASS bad_input");
    return 0;
}
