/* The pinned host memory API from C (host backend): blocks are writable, page aligned and
 * reused; the stats struct is written up to the caller's size; bad input is refused and
 * changes nothing; every chunk goes back on cupool_host_empty_cache. */
#include "check.h"

#include <stdint.h>

static cupool_host_stats host_stats(void) {
    cupool_host_stats s;
    memset(&s, 0, sizeof s);
    s.size = sizeof s;
    s.version = CUPOOL_HOST_STATS_VERSION;
    EXPECT_OK(cupool_host_get_stats(&s));
    EXPECT_EQ_U64(s.size, sizeof s);
    return s;
}

int main(void) {
    static const size_t sizes[] = {1, 4096, 5000, 1u << 20, (1u << 20) + 1, 5u << 20};
    enum { NSIZES = sizeof sizes / sizeof sizes[0] };
    void *blocks[NSIZES];
    for (size_t i = 0; i < NSIZES; i++) {
        blocks[i] = NULL;
        EXPECT_OK(cupool_host_alloc(&blocks[i], sizes[i]));
        EXPECT(((uintptr_t)blocks[i] % 4096) == 0);
        write_and_verify(blocks[i], sizes[i], (unsigned)i);
    }
    cupool_host_stats s = host_stats();
    EXPECT_EQ_U64(s.num_allocs, NSIZES);
    EXPECT(s.reserved_bytes.current >= s.allocated_bytes.current);
    EXPECT(s.allocated_bytes.current >= s.requested_bytes.current);
    EXPECT_EQ_U64(s.chunks.current, s.driver_allocs);
    for (size_t i = 0; i < NSIZES; i++) EXPECT_OK(cupool_host_free(blocks[i]));

    /* Cached pairs, streamless and on a stream: no new chunk. */
    unsigned long long chunks = host_stats().driver_allocs;
    for (int round = 0; round < 200; round++) {
        void *p = NULL;
        size_t n = sizes[round % NSIZES];
        EXPECT_OK(cupool_host_alloc(&p, n));
        write_and_verify(p, n < 4096 ? n : 4096, (unsigned)round);
        EXPECT_OK(cupool_host_free(p));
        EXPECT_OK(cupool_host_alloc_async(&p, n, STREAM(0x40)));
        EXPECT_OK(cupool_host_free_async(p, STREAM(0x40)));
    }
    s = host_stats();
    EXPECT_EQ_U64(s.driver_allocs, chunks);
    EXPECT(s.cache_hits >= 400);

    /* Bad input: clear statuses, nothing changed. */
    void *p = (void *)0x1;
    EXPECT_STATUS(cupool_host_alloc(NULL, 8), CUPOOL_ERROR_INVALID_VALUE);
    EXPECT_STATUS(cupool_host_alloc(&p, 0), CUPOOL_ERROR_INVALID_VALUE);
    EXPECT(p == (void *)0x1);
    EXPECT_STATUS(cupool_host_alloc(&p, SIZE_MAX), CUPOOL_ERROR_OUT_OF_MEMORY);
    EXPECT_OK(cupool_host_free(NULL));
    int on_stack = 0;
    EXPECT_STATUS(cupool_host_free(&on_stack), CUPOOL_ERROR_INVALID_POINTER);
    EXPECT_OK(cupool_host_alloc(&p, 10000));
    EXPECT_STATUS(cupool_host_free((char *)p + 4096), CUPOOL_ERROR_INVALID_POINTER);
    EXPECT_STATUS(cupool_free(p), CUPOOL_ERROR_INVALID_POINTER); /* not a device block */
    EXPECT_OK(cupool_host_free(p));
    EXPECT_STATUS(cupool_host_free(p), CUPOOL_ERROR_DOUBLE_FREE);
    EXPECT_STATUS(cupool_host_get_stats(NULL), CUPOOL_ERROR_INVALID_VALUE);
    cupool_host_stats bad;
    memset(&bad, 0, sizeof bad);
    bad.size = sizeof bad;
    bad.version = CUPOOL_HOST_STATS_VERSION + 1;
    EXPECT_STATUS(cupool_host_get_stats(&bad), CUPOOL_ERROR_VERSION_MISMATCH);

    /* An older caller's shorter struct: only its bytes are written. */
    unsigned char short_stats[24 + 8];
    memset(short_stats, 0xee, sizeof short_stats);
    uint32_t header[2] = {24, 1};
    memcpy(short_stats, header, sizeof header);
    EXPECT_OK(cupool_host_get_stats((cupool_host_stats *)(void *)short_stats));
    for (size_t i = 24; i < sizeof short_stats; i++) EXPECT(short_stats[i] == 0xee);

    /* JSON: ask for the size, then fetch. */
    size_t needed = 0;
    EXPECT_STATUS(cupool_host_stats_json(NULL, 0, &needed), CUPOOL_ERROR_BUFFER_TOO_SMALL);
    char *json = malloc(needed);
    EXPECT(json != NULL);
    EXPECT_OK(cupool_host_stats_json(json, needed, NULL));
    EXPECT(strstr(json, "\"driver_allocs\":") != NULL);
    free(json);

    /* Everything back to the driver. */
    size_t released = 0;
    EXPECT_OK(cupool_host_empty_cache(&released));
    s = host_stats();
    EXPECT_EQ_U64(released, s.reserved_bytes.peak);
    EXPECT_EQ_U64(s.reserved_bytes.current, 0);
    EXPECT_EQ_U64(s.driver_frees, s.driver_allocs);
    EXPECT_EQ_U64(s.num_frees, s.num_allocs);
    EXPECT_OK(cupool_host_reset_peak_stats());
    EXPECT_EQ_U64(host_stats().reserved_bytes.peak, 0);
    EXPECT_OK(cupool_host_empty_cache(NULL));
    printf("PASS pinned\n");
    return 0;
}
