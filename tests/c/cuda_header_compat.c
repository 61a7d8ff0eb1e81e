/* A CUDA program includes cuda.h and cupool.h together and passes its CUstream without a
 * cast. cuda.h is not installed here, so its stream declarations are repeated verbatim. */
typedef struct CUstream_st *CUstream;     /* as in cuda.h */
typedef struct CUstream_st *cudaStream_t; /* as in driver_types.h */

#include "check.h"
#include "cupool.h" /* included twice on purpose: the include guard must hold */

#include <stdint.h>

int main(void) {
    CUstream driver_stream = (CUstream)(uintptr_t)0x100;
    cudaStream_t runtime_stream = (cudaStream_t)(uintptr_t)0x200;
    void *a = NULL, *b = NULL;
    EXPECT_OK(cupool_alloc_async(&a, 256, driver_stream));
    EXPECT_OK(cupool_alloc_async(&b, 256, runtime_stream));
    EXPECT_OK(cupool_free_async(a, driver_stream));
    EXPECT_OK(cupool_free_async(b, runtime_stream));
    puts("PASS cuda_header_compat");
    return 0;
}
