/* Linked with libcupool.so: reports whether CUDA calls are interposed in this process. */
#include <stdio.h>

#include "cupool.h"

int main(void)
{
    printf("interposition_active=%d\n", cupool_interposition_active());
    return 0;
}
