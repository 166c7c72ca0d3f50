"""The warm server's pure parts (labutils.runtime.server); tests/run/test_warm.py runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from labutils.runtime.server import pythonpath_moved


def _started_in(folder, pythonpath: str) -> list[str]:
    """sys.path of an interpreter started in folder with PYTHONPATH set (-c: no script)."""
    env = {**os.environ, "PYTHONPATH": pythonpath}
    out = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path))"],
                         cwd=folder, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def test_a_moved_path_is_the_path_an_interpreter_started_there_has(tmp_path):
    was, now = tmp_path / "was", tmp_path / "now"
    was.mkdir(), now.mkdir()
    for pythonpath in ("lib", "lib:../up:/abs/x", ":lib::", f"{now}/lib:lib", f"{was}/lib:lib",
                       "/abs/only", ""):
        moved = pythonpath_moved(_started_in(was, pythonpath), pythonpath, str(was), str(now))
        assert moved == _started_in(now, pythonpath), pythonpath


def test_nothing_moves_in_the_same_folder_or_without_relative_entries():
    path = ["", "/w/lib", "/usr/lib/python3.11"]
    assert pythonpath_moved(path, "lib", "/w", "/w") is path
    assert pythonpath_moved(path, "/w/lib", "/w", "/v") is path
    assert pythonpath_moved(path, "", "/w", "/v") is path
