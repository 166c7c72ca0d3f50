"""An exception a DataLoader worker raised, as the rank sees it: torch re-raises it in the
rank with the worker's traceback as text, and the launcher names the worker's line.

The exceptions here are real: a DataLoader with one worker process over a Dataset that
raises, in this test's process.
"""

from __future__ import annotations

import tempfile

import pytest
import torch

from labutils.runtime.frames import caught_elsewhere
from labutils.runtime.worker import describe_exception

HERE = __file__


class Items(torch.utils.data.Dataset):
    def __init__(self, fail):
        self.fail = fail

    def __len__(self):
        return 4

    def __getitem__(self, i):
        if i == 1:
            self.fail(i)
        return torch.tensor([float(i)])


def _missing(i):
    raise KeyError(f"item {i} is missing")


def _chained(i):
    try:
        {}["weights"]
    except KeyError as exc:
        raise ValueError("no weights in the checkpoint") from exc


class TwoArgumentError(Exception):
    def __init__(self, path, reason):
        super().__init__(f"{path}: {reason}")


def _two_arguments(i):
    raise TwoArgumentError("shard-1.pt", "truncated")


def _bare(i):
    raise IndexError


@pytest.fixture(autouse=True)
def own_temporary_folder(monkeypatch):
    """A DataLoader worker that sent a tensor leaves its multiprocessing folder (pymp-*,
    with a socket in it) when it is stopped, with or without the launcher: here it is
    made in a folder of the test's, removed with it (a short path: a socket's is at most
    108 bytes)."""
    with tempfile.TemporaryDirectory(prefix="frames-") as folder:
        monkeypatch.setattr(tempfile, "tempdir", folder)
        yield


def _raised_by(fail) -> BaseException:
    with pytest.raises(BaseException) as info:
        list(torch.utils.data.DataLoader(Items(fail), num_workers=1))
    return info.value


def _line_of(text: str) -> int:
    return next(i for i, line in enumerate(open(HERE).read().splitlines(), 1) if text in line)


@pytest.mark.parametrize(("fail", "exc_type", "message", "line"), [
    (_missing, "KeyError", "'item 1 is missing' (in DataLoader worker process 0)",
     'raise KeyError(f"item {i} is missing")'),
    # of chained exceptions, the one raised last
    (_chained, "ValueError", "no weights in the checkpoint (in DataLoader worker process 0)",
     'raise ValueError("no weights in the checkpoint") from exc'),
    # torch cannot make one with a message: it raises a RuntimeError with the same text
    (_two_arguments, "TwoArgumentError",
     "shard-1.pt: truncated (in DataLoader worker process 0)",
     'raise TwoArgumentError("shard-1.pt", "truncated")'),
    (_bare, "IndexError", "in DataLoader worker process 0", "raise IndexError"),
])
def test_a_worker_exception_is_named_by_the_workers_line(fail, exc_type, message, line):
    exc = _raised_by(fail)
    if fail is _two_arguments:
        assert type(exc) is RuntimeError
    info = describe_exception(exc, HERE)
    assert (info["exc_type"], info["message"]) == (exc_type, message)
    assert (info["file"], info["line"], info["source"]) == (HERE, _line_of(line), line)
    assert "Original Traceback" in info["traceback"]  # the whole text stays for the pane


def test_a_worker_running_library_code_only_keeps_the_line_that_iterated_the_loader():
    """Tensors of two sizes in one batch: the worker's default_collate raises, in torch's
    code only; the line named is the rank's own, where it took the batch."""
    loader = torch.utils.data.DataLoader([torch.ones(2), torch.ones(3)], batch_size=2, num_workers=1)
    with pytest.raises(RuntimeError) as info:
        next(iter(loader))  # the loop of the rank
    caught = caught_elsewhere(str(info.value))
    assert caught is not None and caught.exc_type == "RuntimeError"
    assert "stack expects each tensor to be equal size" in caught.message
    described = describe_exception(info.value, HERE)
    assert described["line"] == _line_of("next(iter(loader))  # the loop of the rank")
    assert described["message"].endswith("(in DataLoader worker process 0)")


def test_other_messages_are_not_read_as_a_workers():
    assert caught_elsewhere("Caught KeyError in DataLoader worker process 0.") is None
    assert caught_elsewhere("the batch is empty") is None
    info = describe_exception(ValueError("Caught it.\nOriginal Traceback (most recent call last):"),
                              HERE)
    assert (info["exc_type"], info["message"]) == ("ValueError", "Caught it.\nOriginal Traceback "
                                                                 "(most recent call last):")
