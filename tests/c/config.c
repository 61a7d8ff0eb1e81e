/* Configuration at run time, status texts, version, interposition query. */
#include "check.h"

static void expect_config(const char *key, const char *expected) {
    char buf[64];
    size_t needed = 0;
    EXPECT_OK(cupool_config_get(key, buf, sizeof buf, &needed));
    if (strcmp(buf, expected) != 0) {
        fprintf(stderr, "config %s is '%s', expected '%s'\n", key, buf, expected);
        exit(1);
    }
    EXPECT_EQ_U64(needed, strlen(expected) + 1);
}

int main(void) {
    /* The test driver sets CUPOOL_CONF=backend:host. */
    expect_config("backend", "host");
    expect_config("fence_batch", "64");
    expect_config("thread_cache", "true");

    /* Good values, in every accepted spelling. */
    EXPECT_OK(cupool_config_set("fence_batch", "16"));
    expect_config("fence_batch", "16");
    EXPECT_OK(cupool_config_set("thread_cache", "off"));
    expect_config("thread_cache", "false");
    EXPECT_OK(cupool_config_set("thread_cache_bytes", "2M"));
    expect_config("thread_cache_bytes", "2097152");
    EXPECT_OK(cupool_config_set(" verbose ", "no"));

    /* Unknown key, bad value: refused, old value kept. */
    EXPECT_STATUS(cupool_config_set("no_such_option", "1"), CUPOOL_ERROR_UNKNOWN_CONFIG_KEY);
    EXPECT_STATUS(cupool_config_set("fence_batch", "many"), CUPOOL_ERROR_INVALID_CONFIG_VALUE);
    EXPECT_STATUS(cupool_config_set("fence_batch", "-1"), CUPOOL_ERROR_INVALID_CONFIG_VALUE);
    EXPECT_STATUS(cupool_config_set("thread_cache_bytes", "12Q"), CUPOOL_ERROR_INVALID_CONFIG_VALUE);
    EXPECT_STATUS(cupool_config_set("backend", "tpu"), CUPOOL_ERROR_INVALID_CONFIG_VALUE);
    expect_config("fence_batch", "16");
    expect_config("backend", "host");
    EXPECT_STATUS(cupool_config_set("fence_batch", "\xff\xfe"), CUPOOL_ERROR_INVALID_CONFIG_VALUE);
    EXPECT_STATUS(cupool_config_set("\xff\xfe", "1"), CUPOOL_ERROR_UNKNOWN_CONFIG_KEY);

    /* NULL arguments. */
    EXPECT_STATUS(cupool_config_set(NULL, "1"), CUPOOL_ERROR_INVALID_VALUE);
    EXPECT_STATUS(cupool_config_set("fence_batch", NULL), CUPOOL_ERROR_INVALID_VALUE);
    EXPECT_STATUS(cupool_config_get(NULL, NULL, 0, NULL), CUPOOL_ERROR_INVALID_VALUE);
    char buf[8];
    EXPECT_STATUS(cupool_config_get("fence_batch", NULL, sizeof buf, NULL), CUPOOL_ERROR_INVALID_VALUE);
    EXPECT_STATUS(cupool_config_get("no_such_option", buf, sizeof buf, NULL),
                  CUPOOL_ERROR_UNKNOWN_CONFIG_KEY);

    /* config_get buffer sizes: exactly enough works, one less does not and writes nothing. */
    size_t needed = 0;
    EXPECT_STATUS(cupool_config_get("backend", NULL, 0, &needed), CUPOOL_ERROR_BUFFER_TOO_SMALL);
    EXPECT_EQ_U64(needed, 5); /* "host" + NUL */
    memset(buf, 'x', sizeof buf);
    EXPECT_STATUS(cupool_config_get("backend", buf, 4, &needed), CUPOOL_ERROR_BUFFER_TOO_SMALL);
    for (size_t i = 0; i < sizeof buf; i++) EXPECT(buf[i] == 'x');
    EXPECT_OK(cupool_config_get("backend", buf, 5, NULL));
    EXPECT(strcmp(buf, "host") == 0);

    /* The pool picks up the settings; `backend` is frozen once it has started. */
    void *p = NULL;
    EXPECT_OK(cupool_alloc(&p, 100));
    EXPECT_STATUS(cupool_config_set("backend", "cuda"), CUPOOL_ERROR_INVALID_CONFIG_VALUE);
    EXPECT_OK(cupool_config_set("backend", "host")); /* unchanged value: fine */
    expect_config("backend", "host");
    EXPECT_OK(cupool_config_set("fence_batch", "8")); /* runtime options still change */
    expect_config("fence_batch", "8");
    EXPECT_OK(cupool_free(p));

    /* Every status has its own text; unknown values get a text too, never NULL. */
    const cupool_status all[] = {
        CUPOOL_OK, CUPOOL_ERROR_INVALID_VALUE, CUPOOL_ERROR_OUT_OF_MEMORY,
        CUPOOL_ERROR_BACKEND_UNAVAILABLE, CUPOOL_ERROR_INVALID_POINTER, CUPOOL_ERROR_DOUBLE_FREE,
        CUPOOL_ERROR_INVALID_DEVICE, CUPOOL_ERROR_UNKNOWN_CONFIG_KEY,
        CUPOOL_ERROR_INVALID_CONFIG_VALUE, CUPOOL_ERROR_CUDA, CUPOOL_ERROR_STREAM_CAPTURE,
        CUPOOL_ERROR_BUFFER_TOO_SMALL, CUPOOL_ERROR_VERSION_MISMATCH, CUPOOL_ERROR_INTERNAL,
        CUPOOL_ERROR_IO,
    };
    enum { N = sizeof all / sizeof all[0] };
    const char *unknown = cupool_status_string((cupool_status)1000);
    EXPECT(unknown != NULL && strlen(unknown) > 0);
    EXPECT(strcmp(cupool_status_string((cupool_status)-1), unknown) == 0);
    EXPECT(strcmp(cupool_status_string((cupool_status)N), unknown) == 0);
    for (int i = 0; i < N; i++) {
        EXPECT((int)all[i] == i);
        const char *text = cupool_status_string(all[i]);
        EXPECT(text != NULL && strlen(text) > 0);
        EXPECT(strcmp(text, unknown) != 0);
        for (int j = 0; j < i; j++) EXPECT(strcmp(text, cupool_status_string(all[j])) != 0);
        printf("status %d: %s\n", i, text);
    }
    EXPECT(strcmp(cupool_status_string(CUPOOL_OK), "success") == 0);

    const char *version = cupool_version();
    EXPECT(version != NULL);
    printf("version %s\n", version);
    EXPECT(cupool_interposition_active() == 0);

    puts("PASS config");
    return 0;
}
