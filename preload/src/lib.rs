//! LD_PRELOAD interposer (being written).
