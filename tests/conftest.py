"""Test-wide setup. TRITON_INTERPRET must be set before anything imports triton (TRITON_ON_CPU.md)."""

import os
import sys

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("triton was imported before tests/conftest.py could set TRITON_INTERPRET=1")
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import torch  # noqa: E402

# Two threads on a two-core machine with a busy neighbour run up to 50x slower than one.
torch.set_num_threads(1)
