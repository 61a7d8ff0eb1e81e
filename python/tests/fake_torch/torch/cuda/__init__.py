"""Fake torch.cuda: lazy initialisation, device indices, and memory's functions."""

_initialized = False


def is_initialized():
    return _initialized


def init():
    global _initialized
    if not _initialized:
        _initialized = True
        memory._init_allocator(2)


def current_device():
    init()
    return 0


def _get_device_index(device, optional=False):
    if device is None:
        return current_device()
    if isinstance(device, str):
        return int(device.split(":")[1]) if ":" in device else current_device()
    return int(device)


from . import graphs, memory  # noqa: E402
from .graphs import CUDAGraph  # noqa: E402,F401
from .memory import *  # noqa: E402,F401,F403
