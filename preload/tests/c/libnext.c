/*
 * A library that wraps getpid() the classic way, with dlsym(RTLD_NEXT, ...), and defines a
 * driver-named function of its own. Used to check that the preload's dlsym hook keeps
 * RTLD_NEXT relative to the caller and answers a handle's own definitions unchanged.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <sys/types.h>
#include <unistd.h>

/* What RTLD_NEXT finds for getpid when asked from this library. */
void *libnext_next_getpid(void)
{
    return dlsym(RTLD_NEXT, "getpid");
}

/* Same name as a driver entry point the preload hooks; not the driver's. */
int cuMemGetInfo_v2(size_t *free_bytes, size_t *total)
{
    (void)free_bytes;
    (void)total;
    return 77;
}

pid_t getpid(void)
{
    pid_t (*next)(void) = (pid_t(*)(void))libnext_next_getpid();
    if (!next || next == getpid)
        return -1;
    return next();
}
