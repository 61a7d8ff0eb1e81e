"""Every test runs on cupool's host backend (host memory, simulated streams): no GPU is
needed. The backend is read when the pool starts, so it is set before cupool is loaded;
subprocesses the tests start inherit it."""

import os
import pathlib

os.environ["CUPOOL_CONF"] = "backend:host"

REPO = pathlib.Path(__file__).resolve().parents[2]
