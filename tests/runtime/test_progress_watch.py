"""The worker's progress watcher (runtime/worker.py): it reads where the main thread is
from a faulthandler dump, not by walking the thread's frame objects, and says a thread
moved when its stack changed or it computed; a thread blocked at one line says nothing.
Run here against threads of the test's own process, the watcher given their idents."""

from __future__ import annotations

import faulthandler
import threading
import time

from labutils.runtime import worker
from labutils.runtime.frames import DUMP_FRAME, dump_thread


def _blocked(ready: threading.Event, release: threading.Event) -> None:
    ready.set()
    release.wait()


def test_the_dump_gives_each_threads_own_stack(tmp_path):
    ready, release = threading.Event(), threading.Event()
    other = threading.Thread(target=_blocked, args=(ready, release))
    other.start()
    ready.wait()
    try:
        with open(tmp_path / "dump.txt", "w+") as out:
            faulthandler.dump_traceback(out, all_threads=True)
            out.seek(0)
            text = out.read()
    finally:
        release.set()
        other.join()
    mine, theirs = dump_thread(text, threading.get_ident()), dump_thread(text, other.ident)
    assert [m["func"] for m in DUMP_FRAME.finditer(theirs)][:3] == ["wait", "wait", "_blocked"]
    assert "test_the_dump_gives_each_threads_own_stack" in mine and "_blocked" not in mine
    assert dump_thread(text, 12345) is None


class _Events:
    def __init__(self) -> None:
        self.times: list[float] = []

    def write(self, event: dict) -> None:
        assert event["kind"] == "progress"
        self.times.append(time.monotonic())


def _watch(target, seconds: float) -> list[float]:
    """Progress events the watcher wrote while `target` ran in a thread of its own."""
    stop = threading.Event()
    thread = threading.Thread(target=target, args=(stop,), daemon=True)
    thread.start()
    events = _Events()
    watcher = threading.Thread(target=worker._watch_progress, args=(events, thread.ident), daemon=True)
    watcher.start()
    time.sleep(seconds)
    stop.set()
    thread.join()
    watcher.join(timeout=10)  # it ends at its next look, the thread gone
    assert not watcher.is_alive()
    return events.times


def _deeper(stop: threading.Event, depth: int = 0) -> None:
    """Sleeps, no computing, one frame deeper every 0.1 s: each look finds another stack."""
    if not stop.wait(0.1) and depth < 60:
        _deeper(stop, depth + 1)


def test_a_thread_whose_stack_changes_makes_progress_without_computing():
    interval = worker.PROGRESS_INTERVAL_S
    # one event per look (the first included), whatever the load: 6 looks in 3 s
    assert len(_watch(_deeper, 6 * interval + interval / 2)) >= 5


def test_a_thread_blocked_at_one_line_makes_none_after_the_first_look():
    interval = worker.PROGRESS_INTERVAL_S
    assert len(_watch(lambda stop: stop.wait(), 6 * interval + interval / 2)) == 1
