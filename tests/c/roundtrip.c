/* Allocations hand out memory the program can use, streamless and stream-ordered. */
#include "check.h"

#include <stdint.h>

int main(void) {
    static const size_t sizes[] = {1, 8, 100, 512, 4096, 65536, (1u << 20) + 1, 3u << 20};
    enum { NSIZES = sizeof sizes / sizeof sizes[0] };
    void *blocks[NSIZES];

    /* Streamless: all live at once, distinct, writable; contents survive other writes. */
    for (size_t i = 0; i < NSIZES; i++) {
        blocks[i] = NULL;
        EXPECT_OK(cupool_alloc(&blocks[i], sizes[i]));
        EXPECT(blocks[i] != NULL);
        EXPECT(((uintptr_t)blocks[i] % 256) == 0);
        write_and_verify(blocks[i], sizes[i], (unsigned)i);
    }
    for (size_t i = 0; i < NSIZES; i++) {
        const unsigned char *bytes = blocks[i];
        for (size_t j = 0; j < sizes[i]; j++) EXPECT(bytes[j] == (unsigned char)(j * 31u + i));
        for (size_t k = i + 1; k < NSIZES; k++) EXPECT(blocks[i] != blocks[k]);
    }
    for (size_t i = 0; i < NSIZES; i++) EXPECT_OK(cupool_free(blocks[i]));

    /* Stream-ordered on several fake streams (the host backend simulates them), NULL being
     * the legacy default stream. */
    struct CUstream_st *streams[] = {NULL, STREAM(0x10), STREAM(0x20), STREAM(0x30)};
    enum { NSTREAMS = sizeof streams / sizeof streams[0], ROUNDS = 50 };
    for (int round = 0; round < ROUNDS; round++) {
        void *live[NSTREAMS][3];
        for (int s = 0; s < NSTREAMS; s++) {
            for (int k = 0; k < 3; k++) {
                size_t size = (size_t)(k + 1) * 1000u + (size_t)round;
                live[s][k] = NULL;
                EXPECT_OK(cupool_alloc_async(&live[s][k], size, streams[s]));
                write_and_verify(live[s][k], size, (unsigned)(round + s + k));
            }
        }
        for (int s = 0; s < NSTREAMS; s++)
            for (int k = 0; k < 3; k++) EXPECT_OK(cupool_free_async(live[s][k], streams[s]));
    }

    /* A block freed on a stream is reused by that stream without a driver call. */
    void *first = NULL, *again = NULL;
    EXPECT_OK(cupool_alloc_async(&first, 4096, STREAM(0x40)));
    EXPECT_OK(cupool_free_async(first, STREAM(0x40)));
    cupool_stats before = read_stats();
    EXPECT_OK(cupool_alloc_async(&again, 4096, STREAM(0x40)));
    cupool_stats after = read_stats();
    EXPECT_EQ_U64(after.cache_hits, before.cache_hits + 1);
    EXPECT_EQ_U64(after.device_allocs, before.device_allocs);
    write_and_verify(again, 4096, 7);
    EXPECT_OK(cupool_free_async(again, STREAM(0x40)));

    cupool_stats end = read_stats();
    EXPECT_EQ_U64(end.num_allocs, NSIZES + ROUNDS * NSTREAMS * 3 + 2);
    EXPECT_EQ_U64(end.num_frees, end.num_allocs);
    EXPECT_EQ_U64(end.allocated_bytes.current, 0);
    EXPECT_EQ_U64(end.requested_bytes.current, 0);

    puts("PASS roundtrip");
    return 0;
}
