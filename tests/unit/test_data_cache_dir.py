"""A data cache directory that cannot be used is a one-line ConfigError naming the setting and the path, not a
FileExistsError / PermissionError traceback."""

import errno
import os

import pytest

import moetune.data.cache as cache_module
from moetune.config import load_config
from moetune.data import data_options
from moetune.errors import ConfigError


def options_for(**over):
    args = []
    for k, v in over.items():
        args += [f"--{k}", str(v)]
    return data_options(load_config(None, args).data)


def test_a_file_named_as_the_cache_dir(tmp_path):
    path = tmp_path / "cache"
    path.write_text("not a directory")
    with pytest.raises(ConfigError, match=rf"^data.cache_dir: {path} is a file, not a directory"):
        options_for(**{"data.cache_dir": path})


def test_a_cache_dir_under_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match=rf"^data.cache_dir: {tmp_path / 'f' / 'cache'} cannot be used"):
        options_for(**{"data.cache_dir": tmp_path / "f" / "cache"})


def test_an_unwritable_cache_dir_names_the_environment_variable(tmp_path, monkeypatch):
    # as a user without the permission sees it (these tests may run as root, whom permissions do not stop)
    def denied(path, *a, **k):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)

    monkeypatch.setenv("MOETUNE_CACHE_DIR", str(tmp_path / "shared"))
    monkeypatch.setattr(cache_module.os, "makedirs", denied)
    with pytest.raises(ConfigError, match=rf"^MOETUNE_CACHE_DIR: {tmp_path / 'shared'} cannot be used as the data "
                                          r"cache \(Permission denied\)"):
        options_for()


def test_a_usable_cache_dir_is_created(tmp_path):
    assert options_for(**{"data.cache_dir": tmp_path / "new"})["cache_dir"] == str(tmp_path / "new")
    assert os.listdir(tmp_path / "new") == []  # the write test leaves nothing
