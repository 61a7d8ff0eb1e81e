/* Statistics after a known sequence, as a struct and as JSON; peaks; emptying the cache. */
#include "check.h"

#include <ctype.h>
#include <stddef.h>
#include <stdint.h>

/* ---- a minimal JSON validator (objects, numbers, strings; what the stats use and more) */
static const char *skip_ws(const char *p) {
    while (*p == ' ' || *p == '\n' || *p == '\t' || *p == '\r') p++;
    return p;
}
static const char *parse_value(const char *p, int depth);
static const char *parse_string(const char *p) {
    if (*p != '"') return NULL;
    for (p++; *p && *p != '"'; p++)
        if (*p == '\\' && !*++p) return NULL;
    return *p == '"' ? p + 1 : NULL;
}
static const char *parse_number(const char *p) {
    const char *start = p;
    if (*p == '-') p++;
    while (isdigit((unsigned char)*p)) p++;
    return p > start ? p : NULL;
}
static const char *parse_object(const char *p, int depth) {
    if (*p != '{' || depth > 16) return NULL;
    p = skip_ws(p + 1);
    if (*p == '}') return p + 1;
    for (;;) {
        p = parse_string(skip_ws(p));
        if (!p) return NULL;
        p = skip_ws(p);
        if (*p != ':') return NULL;
        p = parse_value(skip_ws(p + 1), depth + 1);
        if (!p) return NULL;
        p = skip_ws(p);
        if (*p == '}') return p + 1;
        if (*p != ',') return NULL;
        p++;
    }
}
static const char *parse_value(const char *p, int depth) {
    if (*p == '{') return parse_object(p, depth);
    if (*p == '"') return parse_string(p);
    return parse_number(p);
}
static int json_valid(const char *text) {
    const char *end = parse_object(skip_ws(text), 0);
    return end && *skip_ws(end) == '\0';
}

static void expect_contains(const char *json, const char *needle) {
    if (!strstr(json, needle)) {
        fprintf(stderr, "stats JSON lacks %s:\n%s\n", needle, json);
        exit(1);
    }
}

/* Every field of `s` appears in `json` with the same value. */
static void expect_json_matches(const char *json, const cupool_stats *s) {
    char needle[160];
#define LEVEL(f)                                                                              \
    snprintf(needle, sizeof needle, "\"" #f "\":{\"current\":%llu,\"peak\":%llu}",            \
             (unsigned long long)s->f.current, (unsigned long long)s->f.peak);                \
    expect_contains(json, needle);
#define COUNT(f)                                                                              \
    snprintf(needle, sizeof needle, "\"" #f "\":%llu", (unsigned long long)s->f);             \
    expect_contains(json, needle);
    LEVEL(allocated_bytes) LEVEL(reserved_bytes) LEVEL(requested_bytes) LEVEL(cached_bytes)
    COUNT(num_allocs) COUNT(num_frees) COUNT(cache_hits) COUNT(cache_misses)
    COUNT(device_allocs) COUNT(device_frees) COUNT(alloc_retries) COUNT(num_ooms)
    COUNT(fences_recorded) COUNT(cross_stream_frees)
    COUNT(inactive_split_bytes) COUNT(pending_fence_bytes) LEVEL(mapped_bytes)
    COUNT(segments) COUNT(granules)
#undef LEVEL
#undef COUNT
}

static char *stats_json(int device) {
    size_t needed = 0;
    EXPECT_STATUS(cupool_stats_json(device, NULL, 0, &needed), CUPOOL_ERROR_BUFFER_TOO_SMALL);
    EXPECT(needed > 2);
    char *buf = malloc(needed);
    EXPECT(buf != NULL);
    size_t written = 0;
    EXPECT_OK(cupool_stats_json(device, buf, needed, &written));
    EXPECT_EQ_U64(written, needed);
    EXPECT_EQ_U64(strlen(buf) + 1, needed);
    return buf;
}

static void check_invariants(const cupool_stats *s) {
    EXPECT_EQ_U64(s->cache_hits + s->cache_misses, s->num_allocs);
    EXPECT(s->allocated_bytes.current >= s->requested_bytes.current);
    EXPECT(s->reserved_bytes.current >= s->allocated_bytes.current);
    EXPECT_EQ_U64(s->cached_bytes.current, s->reserved_bytes.current - s->allocated_bytes.current);
    EXPECT(s->allocated_bytes.peak >= s->allocated_bytes.current);
    EXPECT(s->reserved_bytes.peak >= s->reserved_bytes.current);
    EXPECT(s->requested_bytes.peak >= s->requested_bytes.current);
}

int main(void) {
    struct CUstream_st *s1 = STREAM(0x10), *s2 = STREAM(0x20);

    cupool_stats s = read_stats();
    EXPECT_EQ_U64(s.num_allocs, 0);
    EXPECT_EQ_U64(s.reserved_bytes.current, 0);

    /* 1. First allocation: a miss that brings a segment from the backend. */
    void *a = NULL, *b = NULL, *c = NULL, *d = NULL;
    EXPECT_OK(cupool_alloc_async(&a, 1000, s1));
    s = read_stats();
    EXPECT_EQ_U64(s.num_allocs, 1);
    EXPECT_EQ_U64(s.cache_misses, 1);
    EXPECT_EQ_U64(s.cache_hits, 0);
    EXPECT_EQ_U64(s.device_allocs, 1);
    EXPECT_EQ_U64(s.requested_bytes.current, 1000);
    EXPECT(s.allocated_bytes.current >= 1000);
    EXPECT(s.reserved_bytes.current >= s.allocated_bytes.current);
    check_invariants(&s);
    const uint64_t size_a = s.allocated_bytes.current;
    /* Version 2: one small segment, the rest of it free but not releasable; no VMM. */
    EXPECT_EQ_U64(s.segments, 1);
    EXPECT_EQ_U64(s.inactive_split_bytes, s.reserved_bytes.current - size_a);
    EXPECT_EQ_U64(s.pending_fence_bytes, 0);
    EXPECT_EQ_U64(s.mapped_bytes.current, 0);
    EXPECT_EQ_U64(s.mapped_bytes.peak, 0);
    EXPECT_EQ_U64(s.granules, 0);

    /* 2. A second small block fits in the same segment: a hit, no driver call. */
    EXPECT_OK(cupool_alloc_async(&b, 3000, s1));
    s = read_stats();
    EXPECT_EQ_U64(s.num_allocs, 2);
    EXPECT_EQ_U64(s.cache_hits, 1);
    EXPECT_EQ_U64(s.device_allocs, 1);
    EXPECT_EQ_U64(s.requested_bytes.current, 4000);
    EXPECT(s.allocated_bytes.current >= size_a + 3000);
    const uint64_t size_ab = s.allocated_bytes.current;
    check_invariants(&s);

    /* 3. Free a on its stream, then the same size on that stream again: a hit. */
    EXPECT_OK(cupool_free_async(a, s1));
    s = read_stats();
    EXPECT_EQ_U64(s.num_frees, 1);
    EXPECT_EQ_U64(s.requested_bytes.current, 3000);
    EXPECT_EQ_U64(s.allocated_bytes.current, size_ab - size_a);
    EXPECT_EQ_U64(s.allocated_bytes.peak, size_ab);
    EXPECT_EQ_U64(s.requested_bytes.peak, 4000);
    EXPECT_OK(cupool_alloc_async(&c, 1000, s1));
    s = read_stats();
    EXPECT_EQ_U64(s.cache_hits, 2);
    EXPECT_EQ_U64(s.cache_misses, 1);
    EXPECT_EQ_U64(s.allocated_bytes.current, size_ab);

    /* 4. Streamless alloc/free and a cross-stream free. */
    EXPECT_OK(cupool_alloc(&d, 5u << 20));
    EXPECT_OK(cupool_free_async(b, s2)); /* b was allocated on s1 */
    s = read_stats();
    EXPECT_EQ_U64(s.cross_stream_frees, 1);
    EXPECT(s.pending_fence_bytes >= 3072); /* b waits for a fence (no miss polled since) */
    EXPECT_EQ_U64(s.num_allocs, 4);
    EXPECT_EQ_U64(s.num_frees, 2);
    EXPECT_EQ_U64(s.requested_bytes.current, 1000 + (5u << 20));
    check_invariants(&s);

    /* JSON: valid, every field present with the struct's value; per-device view too. */
    char *json = stats_json(-1);
    EXPECT(json_valid(json));
    expect_json_matches(json, &s);
    free(json);
    json = stats_json(0);
    EXPECT(json_valid(json));
    free(json);

    /* BUFFER_TOO_SMALL: nothing written, needed size reported; NULL buffer with a length. */
    size_t needed = 0;
    EXPECT_STATUS(cupool_stats_json(-1, NULL, 0, &needed), CUPOOL_ERROR_BUFFER_TOO_SMALL);
    char small[16];
    memset(small, 'x', sizeof small);
    size_t needed2 = 0;
    EXPECT_STATUS(cupool_stats_json(-1, small, sizeof small, &needed2), CUPOOL_ERROR_BUFFER_TOO_SMALL);
    EXPECT_EQ_U64(needed2, needed);
    for (size_t i = 0; i < sizeof small; i++) EXPECT(small[i] == 'x');
    EXPECT_STATUS(cupool_stats_json(-1, small, needed - 1 < sizeof small ? needed - 1 : sizeof small, NULL),
                  CUPOOL_ERROR_BUFFER_TOO_SMALL);
    EXPECT_STATUS(cupool_stats_json(-1, NULL, 10, &needed), CUPOOL_ERROR_INVALID_VALUE);
    EXPECT_STATUS(cupool_stats_json(-2, NULL, 0, &needed), CUPOOL_ERROR_INVALID_DEVICE);

    /* A struct from an older, shorter header: only `size` bytes are written. */
    _Alignas(cupool_stats) unsigned char raw[sizeof(cupool_stats) + 64];
    memset(raw, 0xAB, sizeof raw);
    cupool_stats *partial = (cupool_stats *)(void *)raw;
    partial->size = 24; /* the header and allocated_bytes */
    partial->version = CUPOOL_STATS_VERSION;
    EXPECT_OK(cupool_get_stats(-1, partial));
    EXPECT_EQ_U64(partial->size, 24);
    EXPECT_EQ_U64(partial->allocated_bytes.current, s.allocated_bytes.current);
    for (size_t i = 24; i < sizeof raw; i++) EXPECT(raw[i] == 0xAB);
    /* A struct as version 1 of the header declared it (it ended at cross_stream_frees):
       filled up to there, nothing written past it. */
    const size_t v1_size = offsetof(cupool_stats, inactive_split_bytes);
    EXPECT_EQ_U64(v1_size, 8 + 4 * sizeof(cupool_stat) + 10 * sizeof(uint64_t));
    memset(raw, 0xAB, sizeof raw);
    partial->size = (uint32_t)v1_size;
    partial->version = 1;
    EXPECT_OK(cupool_get_stats(-1, partial));
    EXPECT_EQ_U64(partial->size, v1_size);
    EXPECT_EQ_U64(partial->version, 1);
    EXPECT_EQ_U64(partial->num_allocs, 4);
    EXPECT_EQ_U64(partial->cross_stream_frees, 1);
    for (size_t i = v1_size; i < sizeof raw; i++) EXPECT(raw[i] == 0xAB);
    /* A larger buffer: the library writes its own size and says so. */
    memset(raw, 0xAB, sizeof raw);
    partial->size = sizeof raw;
    partial->version = CUPOOL_STATS_VERSION;
    EXPECT_OK(cupool_get_stats(-1, partial));
    EXPECT_EQ_U64(partial->size, sizeof(cupool_stats));
    EXPECT_EQ_U64(partial->num_allocs, 4);
    for (size_t i = sizeof(cupool_stats); i < sizeof raw; i++) EXPECT(raw[i] == 0xAB);
    /* Header refusals leave the struct untouched. */
    cupool_stats bad;
    memset(&bad, 0x5A, sizeof bad);
    bad.size = 4;
    bad.version = CUPOOL_STATS_VERSION;
    EXPECT_STATUS(cupool_get_stats(-1, &bad), CUPOOL_ERROR_VERSION_MISMATCH);
    EXPECT_EQ_U64(bad.size, 4);
    bad.size = sizeof bad;
    bad.version = 0;
    EXPECT_STATUS(cupool_get_stats(-1, &bad), CUPOOL_ERROR_VERSION_MISMATCH);
    bad.version = CUPOOL_STATS_VERSION + 1;
    EXPECT_STATUS(cupool_get_stats(-1, &bad), CUPOOL_ERROR_VERSION_MISMATCH);
    EXPECT_EQ_U64(bad.num_allocs, 0x5A5A5A5A5A5A5A5Aull);
    bad.version = CUPOOL_STATS_VERSION;
    EXPECT_STATUS(cupool_get_stats(-5, &bad), CUPOOL_ERROR_INVALID_DEVICE);
    EXPECT_STATUS(cupool_get_stats(-1, NULL), CUPOOL_ERROR_INVALID_VALUE);

    /* Free everything; peaks stay until reset, then equal the current values. */
    EXPECT_OK(cupool_free_async(c, s1));
    EXPECT_OK(cupool_free(d));
    s = read_stats();
    EXPECT_EQ_U64(s.allocated_bytes.current, 0);
    EXPECT_EQ_U64(s.requested_bytes.current, 0);
    EXPECT(s.allocated_bytes.peak >= size_ab + (5u << 20));
    EXPECT_EQ_U64(s.num_frees, s.num_allocs);
    check_invariants(&s);
    EXPECT_OK(cupool_reset_peak_stats(-1));
    s = read_stats();
    EXPECT_EQ_U64(s.allocated_bytes.peak, 0);
    EXPECT_EQ_U64(s.requested_bytes.peak, 0);
    EXPECT_EQ_U64(s.reserved_bytes.peak, s.reserved_bytes.current);
    EXPECT_OK(cupool_reset_peak_stats(0));
    EXPECT_STATUS(cupool_reset_peak_stats(-3), CUPOOL_ERROR_INVALID_DEVICE);

    /* Emptying the cache gives every reserved byte back once nothing is in use. */
    const uint64_t reserved = s.reserved_bytes.current;
    EXPECT(reserved > 0);
    size_t released = 0;
    EXPECT_OK(cupool_empty_cache(&released));
    EXPECT_EQ_U64(released, reserved);
    s = read_stats();
    EXPECT_EQ_U64(s.reserved_bytes.current, 0);
    EXPECT_EQ_U64(s.cached_bytes.current, 0);
    EXPECT_EQ_U64(s.device_frees, s.device_allocs);
    EXPECT_OK(cupool_empty_cache(NULL));
    EXPECT_OK(cupool_empty_cache_device(0, &released));
    EXPECT_EQ_U64(released, 0);
    EXPECT_STATUS(cupool_empty_cache_device(-2, &released), CUPOOL_ERROR_INVALID_DEVICE);

    /* The pool works again after being emptied. */
    void *e = NULL;
    EXPECT_OK(cupool_alloc(&e, 1234));
    write_and_verify(e, 1234, 3);
    s = read_stats();
    EXPECT_EQ_U64(s.device_allocs, s.device_frees + 1);
    EXPECT_OK(cupool_free(e));

    puts("PASS stats");
    return 0;
}
