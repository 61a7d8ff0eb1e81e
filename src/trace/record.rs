//! Recording. OWNER: recording helper. Skeleton only.
