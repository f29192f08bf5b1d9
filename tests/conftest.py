import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
# One intra-op thread per test process: tests run in parallel (pytest -n), and OpenMP threads spinning
# against another busy process make tiny matmuls ~100x slower.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Without a GPU our Triton kernels run under Triton's interpreter, so the tests check them against the torch
# reference on the CPU (read when a kernel is defined, so before any moetune module is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _release_held_ports():
    """Ports handed out by helpers.free_port stay bound until the test that asked for them ends."""
    yield
    from helpers import release_ports

    release_ports()


@pytest.fixture
def tmp_ckpt(tmp_path):
    return tmp_path / "ckpt"
