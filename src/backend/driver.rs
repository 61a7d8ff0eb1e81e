//! driver backend (being written).
