//! The `cupool` command (skeleton; replaced by the replay/run implementation).
fn main() {
    eprintln!("cupool: not built yet");
    std::process::exit(2);
}
