/* The cupool C API as the GPU suite uses it: the generated header (the suite passes
 * -I include), plus the status values of the C contract under short names of the suite's
 * own. They are fixed numbers, not the header's names, because the numbers are the ABI
 * that C callers compiled against; header_check.cu asserts that the header agrees. */
#ifndef CUPOOL_GPU_API_H
#define CUPOOL_GPU_API_H

#include <cupool.h>

enum {
  CUP_OK = 0,
  CUP_INVALID_VALUE = 1,
  CUP_OUT_OF_MEMORY = 2,
  CUP_BACKEND_UNAVAILABLE = 3,
  CUP_INVALID_POINTER = 4,
  CUP_DOUBLE_FREE = 5,
};
#define CUP_STATS_VERSION 1u

#endif
