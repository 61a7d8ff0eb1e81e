//! The C boundary (being written).
