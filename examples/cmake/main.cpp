// cupool from C++: device buffers owned by std::unique_ptr, freed in stream order.
//
// Runs on the GPU when libcuda.so.1 is there and on cupool's host backend otherwise, like
// examples/streams.c. Built by examples/cmake/CMakeLists.txt against an installed cupool.
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cupool.h"

namespace {

// Frees a block on the stream it was used on, when its owner goes out of scope.
struct StreamFree {
    CUstream_st *stream;
    void operator()(void *ptr) const {
        cupool_status status = cupool_free_async(ptr, stream);
        if (status != CUPOOL_OK)
            std::fprintf(stderr, "cupool_free_async: %s\n", cupool_status_string(status));
    }
};
using DeviceBuffer = std::unique_ptr<void, StreamFree>;

DeviceBuffer allocate(std::size_t bytes, CUstream_st *stream) {
    void *ptr = nullptr;
    cupool_status status = cupool_alloc_async(&ptr, bytes, stream);
    if (status != CUPOOL_OK) {
        std::fprintf(stderr, "cupool_alloc_async(%zu): %s\n", bytes, cupool_status_string(status));
        return DeviceBuffer(nullptr, StreamFree{stream});
    }
    return DeviceBuffer(ptr, StreamFree{stream});
}

std::string stats_json() {
    std::size_t needed = 0;
    if (cupool_stats_json(-1, nullptr, 0, &needed) != CUPOOL_ERROR_BUFFER_TOO_SMALL) return "{}";
    std::string json(needed, '\0');
    if (cupool_stats_json(-1, json.data(), json.size(), &needed) != CUPOOL_OK) return "{}";
    json.resize(std::strlen(json.c_str()));
    return json;
}

}  // namespace

int main() {
    // The backend is fixed at first use: pick the host backend before it when there is no
    // driver (a GPU program would create its streams with cuStreamCreate instead).
    char backend[16] = "";
    cupool_config_get("backend", backend, sizeof backend, nullptr);
    bool on_gpu = std::strcmp(backend, "cuda") == 0;
    if (on_gpu) {
        void *libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        if (libcuda) {
            dlclose(libcuda);
        } else {
            on_gpu = false;
            cupool_config_set("backend", "host");
        }
    }
    std::printf("cupool %s from C++ on the %s backend\n", cupool_version(),
                on_gpu ? "cuda" : "host");

    // The legacy default stream (NULL) works on both backends.
    CUstream_st *stream = nullptr;
    std::uint64_t blocks = 0;
    for (int round = 0; round < 100; round++) {
        std::vector<DeviceBuffer> buffers;
        for (std::size_t bytes = 256; bytes <= (std::size_t{4} << 20); bytes *= 4) {
            buffers.push_back(allocate(bytes, stream));
            if (!buffers.back()) return 1;
            blocks++;
        }
    }  // each round's buffers are freed here, and reused by the next round

    cupool_stats stats;
    std::memset(&stats, 0, sizeof stats);
    stats.size = sizeof stats;
    stats.version = CUPOOL_STATS_VERSION;
    if (cupool_get_stats(-1, &stats) != CUPOOL_OK) return 1;
    std::printf("%llu blocks: %llu cache hits, %llu driver allocations\n",
                static_cast<unsigned long long>(blocks),
                static_cast<unsigned long long>(stats.cache_hits),
                static_cast<unsigned long long>(stats.device_allocs));
    std::printf("stats %s\n", stats_json().c_str());
    bool ok = stats.num_allocs == blocks && stats.num_frees == blocks && stats.cache_hits > 0;
    std::printf("%s\n", ok ? "OK" : "FAILED: the counters do not match the blocks");
    return ok ? 0 : 1;
}
