/* Recording through the C API: cupool_trace_start / cupool_trace_stop, their argument
 * checks, and what the two files hold. Usage: trace DIR (a fresh directory). */
#include "check.h"

#include <stdint.h>

/* Reads the whole file (NUL-terminated); the caller frees it. */
static char *read_file(const char *path) {
    FILE *f = fopen(path, "rb");
    EXPECT(f != NULL);
    char *text = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (cap - len < 4096) {
            cap = cap ? 2 * cap : 8192;
            text = realloc(text, cap);
            EXPECT(text != NULL);
        }
        size_t n = fread(text + len, 1, cap - len - 1, f);
        len += n;
        if (n == 0) break;
    }
    fclose(f);
    text[len] = '\0';
    return text;
}

static size_t count(const char *text, const char *needle) {
    size_t n = 0;
    for (const char *p = strstr(text, needle); p != NULL; p = strstr(p + 1, needle)) n++;
    return n;
}

int main(int argc, char **argv) {
    EXPECT(argc == 2);
    char path[4096], driver[4096], missing[4096];
    snprintf(path, sizeof path, "%s/trace.csv", argv[1]);
    snprintf(driver, sizeof driver, "%s/trace.driver.csv", argv[1]);
    snprintf(missing, sizeof missing, "%s/no/such/dir/trace.csv", argv[1]);

    EXPECT_STATUS(cupool_trace_start(NULL), CUPOOL_ERROR_INVALID_VALUE);
    EXPECT_STATUS(cupool_trace_start(""), CUPOOL_ERROR_INVALID_VALUE);
    EXPECT_STATUS(cupool_trace_start("\xff\xfe.csv"), CUPOOL_ERROR_INVALID_VALUE);
    EXPECT_STATUS(cupool_trace_start(missing), CUPOOL_ERROR_IO);
    EXPECT_OK(cupool_trace_stop()); /* no trace running: nothing to do */

    /* Started before the pool's first use. */
    EXPECT_OK(cupool_trace_start(path));
    void *a = NULL, *b = NULL, *huge = NULL;
    EXPECT_OK(cupool_alloc_async(&a, 1000, STREAM(0x10)));
    EXPECT_OK(cupool_alloc(&b, 3000));
    EXPECT_OK(cupool_free_async(a, STREAM(0x10)));
    EXPECT_OK(cupool_free(b));
    EXPECT_STATUS(cupool_free(b), CUPOOL_ERROR_DOUBLE_FREE);
    EXPECT_STATUS(cupool_alloc(&huge, (size_t)1 << 40), CUPOOL_ERROR_OUT_OF_MEMORY);
    EXPECT_OK(cupool_trace_stop());
    EXPECT_OK(cupool_trace_stop());
    /* Stopped: not recorded. */
    EXPECT_OK(cupool_alloc(&b, 100));
    EXPECT_OK(cupool_free(b));

    char *text = read_file(path);
    const char *header =
        "Thread,Time,Action,Pointer,Size,Stream,Device,StreamId,Streamless,Rounded,Result,Nanos\n";
    EXPECT(strncmp(text, header, strlen(header)) == 0);
    EXPECT_EQ_U64(count(text, "\n"), 1 + 6);
    EXPECT_EQ_U64(count(text, ",allocate,"), 2);
    EXPECT_EQ_U64(count(text, ",free,"), 3);
    EXPECT_EQ_U64(count(text, ",allocate failure,"), 1);
    EXPECT_EQ_U64(count(text, ",double_free,"), 1);
    EXPECT_EQ_U64(count(text, ",out_of_memory,"), 1);
    EXPECT_EQ_U64(count(text, ",1000,0x10,"), 2); /* size and stream of `a` */
    free(text);

    text = read_file(driver);
    EXPECT(strncmp(text, "Thread,Time,Action,Pointer,Size,Device,Nanos\n", 45) == 0);
    EXPECT(count(text, ",segment_alloc,") >= 1);
    free(text);

    puts("PASS trace");
    return 0;
}
