//! The caching pool (being written).
