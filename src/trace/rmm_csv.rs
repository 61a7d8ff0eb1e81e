//! RMM's log CSV. OWNER: formats helper. Skeleton only.
