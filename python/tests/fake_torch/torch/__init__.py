from . import cuda  # noqa: F401

# Tests of the start-up hook (test_autoenable.py) need a PyTorch whose import already
# started CUDA, as a program's own start-up code might.
import os as _os  # noqa: E402

if _os.environ.get("FAKE_TORCH_CUDA_INITIALIZED_AT_IMPORT") == "1":
    cuda.init()
