import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture
def tmp_ckpt(tmp_path):
    return tmp_path / "ckpt"
