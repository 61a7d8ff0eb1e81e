/* Checks dlsym semantics under the preload library (see libnext.c). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <sys/types.h>
#include <unistd.h>

void *libnext_next_getpid(void);

int main(void)
{
    void *libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
    void *libnext = dlopen("libnext.so", RTLD_NOW | RTLD_NOLOAD);
    if (!libc || !libnext) {
        fprintf(stderr, "dlopen: %s\n", dlerror());
        return 3;
    }
    void *libc_getpid = dlsym(libc, "getpid");
    printf("rtld_next_from_library_is_libc=%d\n", libnext_next_getpid() == libc_getpid);
    printf("wrapped_getpid_works=%d\n", getpid() > 0);
    int (*info)(size_t *, size_t *) = (int (*)(size_t *, size_t *))dlsym(libnext, "cuMemGetInfo_v2");
    printf("handle_own_definition=%d\n", info ? info(NULL, NULL) : -1);
    printf("unknown_name_is_null=%d\n", dlsym(libc, "cuNoSuchFunction") == NULL);
    printf("prefix_name_is_null=%d\n", dlsym(libc, "cudnnCreate") == NULL);
    return 0;
}
