/*
 * Shared by the preload test programs (TEST DOUBLE clients of the fake libcuda): how a
 * program reaches the driver, chosen at build time, as real programs do:
 *   -DREACH_GPA     like a static CUDA runtime: dlopen("libcuda.so.1"),
 *                   dlsym(handle, "cuGetProcAddress_v2"), then one query per entry point;
 *   -DREACH_DLSYM   like XLA/TensorFlow stubs: dlsym(handle, "cuMemAlloc_v2") ...;
 *   -DREACH_LINKED  like a program linked with -lcuda: direct calls.
 *
 * Before including it, a program defines the types its entry points use and
 * DRIVER_FUNCS(X), one X(name, query_base, query_version, return_type, (parameters)) per
 * entry point. It gets `drv` (the table), `libcuda`, CHECK, need() and
 * load_driver_table(); with REACH_GPA also `gpa`, query() and print_owner().
 */
#ifndef CUPOOL_PRELOAD_TEST_REACH_H
#define CUPOOL_PRELOAD_TEST_REACH_H

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define REACH_FIELD(name, base, version, ret, params) ret(*name) params;
struct driver {
    DRIVER_FUNCS(REACH_FIELD)
};
#undef REACH_FIELD

static struct driver drv;
static void *libcuda;

#define CHECK(call)                                                                        \
    do {                                                                                   \
        CUresult rc_ = (call);                                                             \
        if (rc_ != 0) {                                                                    \
            fprintf(stderr, "%s:%d: %s -> %d\n", __FILE__, __LINE__, #call, rc_);          \
            exit(3);                                                                       \
        }                                                                                  \
    } while (0)

static void *need(void *p, const char *what)
{
    if (!p) {
        fprintf(stderr, "cannot resolve %s: %s\n", what, dlerror());
        exit(3);
    }
    return p;
}

#if defined(REACH_LINKED)
#define REACH_DECLARE(name, base, version, ret, params) ret name params;
DRIVER_FUNCS(REACH_DECLARE)
#undef REACH_DECLARE

static void load_driver_table(void)
{
    libcuda = need(dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD), "libcuda.so.1");
#define REACH_ASSIGN(name, base, version, ret, params) drv.name = name;
    DRIVER_FUNCS(REACH_ASSIGN)
#undef REACH_ASSIGN
}
#elif defined(REACH_DLSYM)
static void load_driver_table(void)
{
    libcuda = need(dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL), "libcuda.so.1");
#define REACH_LOAD(name, base, version, ret, params)                                         \
    *(void **)&drv.name = need(dlsym(libcuda, #name), #name);
    DRIVER_FUNCS(REACH_LOAD)
#undef REACH_LOAD
}
#elif defined(REACH_GPA)
typedef CUresult (*gpa_v2_fn)(const char *, void **, int, unsigned long long, int *);
static gpa_v2_fn gpa;

static void *query(const char *base, int version, unsigned long long flags)
{
    void *fn = NULL;
    int status = -1;
    CUresult rc = gpa(base, &fn, version, flags, &status);
    if (rc != 0 || !fn || status != 0) {
        fprintf(stderr, "cuGetProcAddress_v2(%s, %d, %llu) -> %d status %d\n", base, version,
                flags, rc, status);
        exit(3);
    }
    return fn;
}

/* Which library and exported symbol a function pointer belongs to. */
static void print_owner(const char *label, void *fn)
{
    Dl_info info;
    if (!fn) {
        printf("%s=NULL\n", label);
        return;
    }
    if (!dladdr(fn, &info) || !info.dli_fname) {
        printf("%s=?\n", label);
        return;
    }
    const char *file = strrchr(info.dli_fname, '/');
    printf("%s=%s:%s\n", label, file ? file + 1 : info.dli_fname,
           info.dli_sname ? info.dli_sname : "?");
}

static void load_driver_table(void)
{
    libcuda = need(dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL), "libcuda.so.1");
    gpa = (gpa_v2_fn)need(dlsym(libcuda, "cuGetProcAddress_v2"), "cuGetProcAddress_v2");
#define REACH_QUERY(name, base, version, ret, params)                                        \
    *(void **)&drv.name = query(base, version, 0);
    DRIVER_FUNCS(REACH_QUERY)
#undef REACH_QUERY
}
#else
#error "define REACH_GPA, REACH_DLSYM or REACH_LINKED"
#endif

#endif
