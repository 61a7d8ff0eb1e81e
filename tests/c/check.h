/* Assertion helpers shared by the C API tests. Each test program exits 0 and prints
 * "PASS <name>" as its last line only when every check held. */
#ifndef CUPOOL_TEST_CHECK_H
#define CUPOOL_TEST_CHECK_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cupool.h"

#define EXPECT_STATUS(call, expected)                                                         \
    do {                                                                                      \
        cupool_status got_ = (call);                                                          \
        cupool_status want_ = (expected);                                                     \
        if (got_ != want_) {                                                                  \
            fprintf(stderr, "%s:%d: %s returned %d (%s), expected %d (%s)\n", __FILE__,      \
                    __LINE__, #call, (int)got_, cupool_status_string(got_), (int)want_,       \
                    cupool_status_string(want_));                                             \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

#define EXPECT_OK(call) EXPECT_STATUS(call, CUPOOL_OK)

#define EXPECT(cond)                                                                          \
    do {                                                                                      \
        if (!(cond)) {                                                                        \
            fprintf(stderr, "%s:%d: expected %s\n", __FILE__, __LINE__, #cond);               \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

#define EXPECT_EQ_U64(actual, expected)                                                       \
    do {                                                                                      \
        unsigned long long a_ = (unsigned long long)(actual);                                 \
        unsigned long long e_ = (unsigned long long)(expected);                               \
        if (a_ != e_) {                                                                       \
            fprintf(stderr, "%s:%d: %s is %llu, expected %llu\n", __FILE__, __LINE__,         \
                    #actual, a_, e_);                                                         \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

/* Statistics summed over all devices. */
static inline cupool_stats read_stats(void) {
    cupool_stats s;
    memset(&s, 0, sizeof s);
    s.size = sizeof s;
    s.version = CUPOOL_STATS_VERSION;
    EXPECT_OK(cupool_get_stats(-1, &s));
    EXPECT_EQ_U64(s.size, sizeof s);
    EXPECT_EQ_U64(s.version, CUPOOL_STATS_VERSION);
    return s;
}

/* Fills `len` bytes with a pattern derived from `seed`, then checks they read back. */
static inline void write_and_verify(void *ptr, size_t len, unsigned seed) {
    unsigned char *bytes = ptr;
    for (size_t i = 0; i < len; i++) bytes[i] = (unsigned char)(i * 31u + seed);
    for (size_t i = 0; i < len; i++) EXPECT(bytes[i] == (unsigned char)(i * 31u + seed));
}

#define STREAM(n) ((struct CUstream_st *)(uintptr_t)(n))

#endif
