//! The one status type every C entry point returns.

/// Result of every `cupool_*` call. `CUPOOL_OK` is 0; every other value names one
/// failure, and `cupool_status_string` turns it into text.
#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum CupoolStatus {
    /// The call did what it was asked.
    CupoolOk = 0,
    /// An argument was wrong: a NULL out-pointer, a size of 0. (A size no device can hold is out of memory, as `cudaMalloc` reports it.)
    CupoolErrorInvalidValue = 1,
    /// The device (or the configured memory limit) has no room, even after the pool waited
    /// for pending frees and gave its idle cached memory back to the driver.
    CupoolErrorOutOfMemory = 2,
    /// The backend could not start: no `libcuda.so.1`, no device, or the driver failed to
    /// initialise. The message on stderr (`CUPOOL_LOG=info`) says which.
    CupoolErrorBackendUnavailable = 3,
    /// The pointer was not handed out by this pool (foreign, interior, or never allocated).
    CupoolErrorInvalidPointer = 4,
    /// The pointer was handed out by this pool but is already free.
    CupoolErrorDoubleFree = 5,
    /// The device ordinal does not exist.
    CupoolErrorInvalidDevice = 6,
    /// `cupool_config_set` was given a key the library does not know.
    CupoolErrorUnknownConfigKey = 7,
    /// `cupool_config_set` was given a value the key cannot take.
    CupoolErrorInvalidConfigValue = 8,
    /// The CUDA driver returned an error the pool cannot map to a more precise status.
    CupoolErrorCuda = 9,
    /// The operation needs a fence, a synchronisation or a release to the driver, which
    /// would invalidate a stream capture that is in progress.
    CupoolErrorStreamCapture = 10,
    /// The output buffer is too small; the size needed was written where the call allows.
    CupoolErrorBufferTooSmall = 11,
    /// A versioned struct had a `size` or `version` this library does not accept.
    CupoolErrorVersionMismatch = 12,
    /// A bug inside cupool was caught at the C boundary (a panic); nothing crossed it.
    CupoolErrorInternal = 13,
    /// A file could not be created or written (`cupool_trace_start`); the line on stderr
    /// says which and why.
    CupoolErrorIo = 14,
}

impl CupoolStatus {
    /// Text for every status; static, never NULL.
    pub const fn as_str(self) -> &'static str {
        match self {
            CupoolStatus::CupoolOk => "success",
            CupoolStatus::CupoolErrorInvalidValue => "invalid value",
            CupoolStatus::CupoolErrorOutOfMemory => "out of memory",
            CupoolStatus::CupoolErrorBackendUnavailable => {
                "backend unavailable (no CUDA driver or device)"
            }
            CupoolStatus::CupoolErrorInvalidPointer => "pointer not allocated by cupool",
            CupoolStatus::CupoolErrorDoubleFree => "pointer already freed",
            CupoolStatus::CupoolErrorInvalidDevice => "invalid device ordinal",
            CupoolStatus::CupoolErrorUnknownConfigKey => "unknown configuration key",
            CupoolStatus::CupoolErrorInvalidConfigValue => "invalid configuration value",
            CupoolStatus::CupoolErrorCuda => "CUDA driver error",
            CupoolStatus::CupoolErrorStreamCapture => {
                "not permitted while a stream capture is in progress"
            }
            CupoolStatus::CupoolErrorBufferTooSmall => "buffer too small",
            CupoolStatus::CupoolErrorVersionMismatch => "struct size or version not supported",
            CupoolStatus::CupoolErrorInternal => "internal error in cupool (please report)",
            CupoolStatus::CupoolErrorIo => "a file could not be created or written",
        }
    }
}

/// Rust-side result used by every layer below the C boundary.
pub type Result<T> = core::result::Result<T, CupoolStatus>;
