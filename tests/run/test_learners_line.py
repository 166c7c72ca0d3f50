"""The line a summary names is the learner's: the innermost line of their own files on
the rank's stack, also when the script the launcher ran is a harness that calls their
module (a lab's ring_test.py calling ring.py), warm and cold alike."""

from __future__ import annotations

import textwrap

import pytest

from labutils import launch

pytestmark = pytest.mark.usefixtures("start")

HARNESS = """\
import torch.distributed as dist
import mine

dist.init_process_group("gloo")
mine.step(dist.get_rank())  # the harness's call
dist.destroy_process_group()
"""

MINE = {
    "raises": """\
        import torch.distributed as dist


        def step(rank):
            if rank == 1:
                raise ValueError("bad shard")  # rank 1 fails here
            dist.barrier()
        """,
    "hangs": """\
        import torch
        import torch.distributed as dist


        def step(rank):
            if rank == 1:
                dist.all_reduce(torch.ones(1))  # rank 1 waits here
            dist.barrier()
        """,
}


@pytest.mark.parametrize("ending", sorted(MINE))
def test_the_summary_names_the_line_in_the_learners_module(runs_dir, tmp_path, ending):
    (tmp_path / "mine.py").write_text(textwrap.dedent(MINE[ending]))
    (tmp_path / "harness.py").write_text(HARNESS)
    line = next(i for i, text in enumerate((tmp_path / "mine.py").read_text().splitlines(), 1)
                if "# rank 1" in text)
    result = launch(tmp_path / "harness.py", 2, display="none", hang_timeout=3, timeout=120)
    if ending == "raises":
        failure = result.failure
        assert failure is not None and failure.rank == 1, result.summary()
        assert (failure.file, failure.line) == (str(tmp_path / "mine.py"), line), result.summary()
        assert f"at mine.py:{line}" in result.summary().replace(str(tmp_path) + "/", "")
    else:
        assert result.hang is not None, result.summary()
        assert result.hang.waiting[1].endswith(f"mine.py:{line}"), result.summary()
        assert result.hang.calls[1] == "all_reduce", result.summary()
