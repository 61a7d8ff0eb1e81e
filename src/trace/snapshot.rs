//! PyTorch memory snapshots. OWNER: formats helper. Skeleton only.
