//! host backend (being written).
