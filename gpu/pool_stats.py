"""The preloaded pool's statistics, read through the C API from inside a Python process."""
import ctypes
import sys


def pool_stats_to_stderr(label):
    """Prints the pool's stats as JSON on stderr (or "absent" when no cupool is loaded)."""
    try:
        fn = ctypes.CDLL(None).cupool_stats_json
    except AttributeError:
        print(f"CUPOOL_STATS {label} absent", file=sys.stderr)
        return
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]
    buf = ctypes.create_string_buffer(8192)
    needed = ctypes.c_size_t(0)
    status = fn(-1, buf, len(buf), ctypes.byref(needed))
    text = buf.value.decode() if status == 0 else f"error {status}"
    print(f"CUPOOL_STATS {label} {text}", file=sys.stderr)
