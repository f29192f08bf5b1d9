"""Test-only: Python runs this at start-up when its folder is first on PYTHONPATH. With MOETUNE_TEST_GRAPHS_ON_CPU=1
train.cuda_graphs passes its check on the CPU, so that a CPU run exercises what the trainer does differently under
CUDA graphs (the graphs themselves need a GPU; without train.compile nothing is captured). Production code has no
hook."""

import os

if os.environ.get("MOETUNE_TEST_GRAPHS_ON_CPU") == "1":
    from moetune.train import setup

    setup.check_cuda_graphs = lambda *args: None
