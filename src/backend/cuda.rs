//! CUDA backend (placeholder until the driver backend lands from its branch).
use super::BackendError;

pub struct CudaBackend;

impl CudaBackend {
    pub fn new() -> Result<CudaBackend, BackendError> {
        Err(BackendError::Unavailable)
    }
}
