"""runfiles.socket_folder: a folder whose Unix socket can be bound, however deep TMPDIR is."""

from __future__ import annotations

import os
import socket
import tempfile

from labutils.runtime.runfiles import SOCKET_PATH_MAX, socket_folder


def _binds(folder: str, name: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(os.path.join(folder, name))
    return True


def test_the_socket_folder_is_in_tmpdir_unless_the_path_would_be_too_long(tmp_path, monkeypatch):
    deep = tmp_path / ("deep" * 30)
    deep.mkdir()
    with tempfile.TemporaryDirectory(dir="/tmp") as short:  # tmp_path may be too deep itself
        monkeypatch.setattr(tempfile, "tempdir", short)
        folder = socket_folder("labutils-test-", "rank0.sock")
        assert os.path.dirname(folder) == short and _binds(folder, "rank0.sock")
        assert oct(os.stat(folder).st_mode & 0o777) == "0o700"
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    assert len(str(deep)) > SOCKET_PATH_MAX
    folder = socket_folder("labutils-test-", "rank0.sock")
    try:
        assert os.path.dirname(folder) == "/tmp" and _binds(folder, "rank0.sock")
        assert os.listdir(deep) == []  # the first try is not left behind
    finally:
        os.unlink(os.path.join(folder, "rank0.sock"))
        os.rmdir(folder)
