//! cuda backend (being written).
