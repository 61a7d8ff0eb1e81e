//! Replay. OWNER: replay/CLI helper. Skeleton only.
