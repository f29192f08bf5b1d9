import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
# One intra-op thread per test process: tests run in parallel (pytest -n), and OpenMP threads spinning
# against another busy process make tiny matmuls ~100x slower.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def tmp_ckpt(tmp_path):
    return tmp_path / "ckpt"
