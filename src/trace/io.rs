//! Opening and creating trace files: zstd (`.zst`, or zstd magic), gzip (gzip magic, as
//! `_dump_snapshot` may write), or plain; and reading a whole trace whatever its format.
//! OWNER: formats helper. Skeleton only.
