"""The learner's view: launch() in JupyterLab, in a real (headless) browser.

The tests start a JupyterLab server on a free localhost port and drive Debian's
chromium with Playwright: open a notebook, run a cell, watch one pane per rank
fill while the run goes, press Stop, read the failure and hang summaries.
Each scenario saves a screenshot under test-artifacts/e2e/.

Needs /usr/bin/chromium (scripts/system-packages.txt; `make test` installs it)
and the playwright package (requirements.lock); a missing one fails the tests
with a message saying how to install it.

    .venv/bin/python -m pytest tests/e2e -x -q
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import nbformat
import pytest
from labdriver import (
    NotebookPage,
    RunView,
    network_of,
    open_browser,
    own_network,
    start_lab,
    stop_lab,
    wait_for,
)

from labutils.cluster import netns
from labutils.runtime.procs import pid_alive

# In the parallel pass: the server, its kernels and the browser run in a network
# namespace of their own (labdriver.own_network), where no virtual cluster's links come
# or go beside them.
pytestmark = [pytest.mark.slow]

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
ARTIFACTS = REPO / "test-artifacts" / "e2e"
LESSON_00 = REPO / "lessons" / "00_first_distributed_run.ipynb"
INDEX = REPO / "lessons" / "index.ipynb"
SCRIPT = HERE / "scripts" / "train_steps.py"

# The notebook the scenario tests run, one cell each; the script is train_steps.py.
CELLS = {
    "import": "from labutils import launch",
    "live": """\
live = launch("scripts/train_steps.py", nproc=2,
              args=["--steps", "30", "--sleep", "0.3"])""",
    "stop": """\
stopped = launch("scripts/train_steps.py", nproc=2, hang_timeout=None,
                 args=["--steps", "100000", "--sleep", "0.2"])""",
    "fail": """\
failed = launch("scripts/train_steps.py", nproc=2,
                args=["--fail-rank", "1", "--fail-step", "5", "--sleep", "0.1"])""",
    "hang": """\
hung = launch("scripts/train_steps.py", nproc=2, hang_timeout=3,
              args=["--stuck-rank", "1", "--stuck-step", "5", "--sleep", "0.1"])""",
    "debug": """\
debugged = launch("scripts/breakpoint_rank1.py", nproc=2, hang_timeout=3)""",
    "world": "%load_ext labutils\n%dist start -n 2",
    "world_loop": """\
%%ranks
import time
kept = rank * 7
for i in range(100000):
    print("tick", i, flush=True)
    time.sleep(0.1)""",
    "world_after": "%%ranks\nkept",
    "world_stop": "%dist stop",
}
CELL = {name: i for i, name in enumerate(CELLS)}


def script_line(text: str) -> int:
    """The line number of the first line of train_steps.py containing text."""
    for number, line in enumerate(SCRIPT.read_text().splitlines(), 1):
        if text in line:
            return number
    raise AssertionError(f"{text!r} not in {SCRIPT}")


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def network():
    """The module's own network namespace: started before the server and the browser,
    left after both are gone."""
    with own_network() as net:
        yield net


@pytest.fixture(scope="module")
def lab(network, tmp_path_factory):
    """A JupyterLab server whose folder holds the course index, lesson 00, runs.ipynb and
    scripts/."""
    root = tmp_path_factory.mktemp("lab-root")
    shutil.copytree(HERE / "scripts", root / "scripts")
    shutil.copy(HERE.parent / "scripts" / "breakpoint_rank1.py", root / "scripts")
    assert LESSON_00.exists(), f"{LESSON_00} is missing: the browser tests open lesson 00"
    shutil.copy(LESSON_00, root)
    shutil.copy(INDEX, root)
    shutil.copytree(LESSON_00.with_suffix(""), root / LESSON_00.stem,
                    ignore=shutil.ignore_patterns("runs", "__pycache__", ".ipynb_checkpoints"))
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in CELLS.values()]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                       "language": "python"}
    nbformat.write(notebook, root / "runs.ipynb")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for old in ARTIFACTS.glob("*.png"):
        old.unlink()
    server = start_lab(root, tmp_path_factory.mktemp("lab-state"))
    yield server
    stop_lab(server)


@pytest.fixture(scope="module")
def browser(network):
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the playwright package is missing: install the pinned packages with "
                    "`.venv/bin/pip install -r requirements.lock` (make test does). The "
                    "browser is Debian's chromium; never run `playwright install`.",
                    pytrace=False)
    with sync_playwright() as playwright:
        chromium = open_browser(playwright)
        yield chromium
        chromium.close()


def _new_page(browser):
    from labdriver import VIEWPORT

    context = browser.new_context(viewport=VIEWPORT)
    context.set_default_timeout(60_000)
    return context, context.new_page()


@pytest.fixture(scope="module")
def runs(browser, lab):
    """runs.ipynb open in JupyterLab, its import cell run."""
    context, page = _new_page(browser)
    notebook = NotebookPage(page, lab, "runs.ipynb").open()
    notebook.run(CELL["import"])
    notebook.wait_finished(CELL["import"], timeout=120)
    yield notebook
    context.close()


@pytest.fixture
def scenario(runs, request):
    """The runs notebook, idle; a picture of the page if the test fails."""
    runs.wait_kernel_idle(timeout=120)
    failed_before = request.session.testsfailed
    yield runs
    if request.session.testsfailed > failed_before:
        _on_failure_screenshot(runs.page, request)


def _on_failure_screenshot(page, request) -> None:
    page.screenshot(path=str(ARTIFACTS / f"failed-{request.node.name}.png"))


# --------------------------------------------------------------------- tests
def _links() -> set[str]:
    """The interfaces of this thread's network namespace."""
    out = subprocess.run(["ip", "-j", "link", "show"], capture_output=True, text=True, check=True)
    return {link["ifname"] for link in json.loads(out.stdout)}


@pytest.mark.timeout(120)
def test_the_server_and_the_browser_see_no_other_tests_links(network, lab, browser):
    """Chromium cut a page's requests (ERR_NETWORK_CHANGED) when a virtual cluster made
    its links beside this file: the server, its kernels and Chromium now live in a network
    namespace of their own, where another test's virtual cluster is not seen."""
    if not network.private:
        pytest.skip("not root: no network namespace of its own (nor a virtual cluster beside)")
    import psutil

    outer = os.fstat(network.outer).st_ino
    chromium = [p for p in psutil.Process().children(recursive=True) if "chrom" in p.name()]
    assert chromium, "Chromium's processes, started by this test's Playwright"
    assert {network_of(p.pid) for p in [psutil.Process(lab.proc.pid), *chromium]} == {network_of()}
    assert network_of() != outer and _links() == {"lo"}
    # a virtual cluster made where the other tests make theirs: host 0's interface is
    # there, in the namespace this file started in, and not here
    switch, hosts, interfaces = netns.host_names(2)
    try:
        with network.outside():
            netns.build_hosts(switch=switch, namespaces=hosts, interfaces=interfaces)
            outside = _links()
        assert interfaces[0] in outside and interfaces[0] not in _links()
    finally:
        with network.outside():
            netns.delete_hosts(switch, hosts)
    assert _links() == {"lo"}


@pytest.mark.timeout(300)
def test_course_index_renders_and_its_links_open_the_lessons(browser, lab, request):
    context, page = _new_page(browser)
    try:
        index = NotebookPage(page, lab, INDEX.name).open()
        cell = index.panel.locator(".jp-Cell", has_text="what you learn").first
        lessons = cell.locator(".jp-RenderedMarkdown table")
        rows = lessons.locator("tbody tr")
        assert rows.count() >= 7, "lessons 00 to 06"
        assert rows.first.inner_text().startswith("00 · Your first distributed run")
        assert lessons.locator("a").first.inner_text() == "00 · Your first distributed run"
        cell.screenshot(path=str(ARTIFACTS / "00-course-index.png"))

        lessons.locator("a").first.click()  # JupyterLab opens the linked notebook in a tab
        tab = page.locator(".lm-TabBar-tab.lm-mod-current", has_text=LESSON_00.name)
        tab.wait_for(timeout=60_000)
        page.locator(".jp-NotebookPanel:visible .jp-RenderedMarkdown h1",
                     has_text="Lesson 00").wait_for(timeout=60_000)
    except BaseException:
        _on_failure_screenshot(page, request)
        raise
    finally:
        context.close()


@pytest.mark.timeout(300)
def test_lesson_00_launch_cell_shows_one_pane_per_rank(browser, lab, request):
    source = nbformat.read(lab.root / LESSON_00.name, as_version=4)
    launch_cell = next(i for i, c in enumerate(source.cells)
                       if c.cell_type == "code" and re.search(r"=\s*launch\(", c.source))
    nproc = int(re.search(r"nproc=(\d+)", source.cells[launch_cell].source).group(1))
    context, page = _new_page(browser)
    try:
        lesson = NotebookPage(page, lab, LESSON_00.name).open()
        for i in range(launch_cell):  # what comes before it: imports, paths
            if source.cells[i].cell_type == "code":
                lesson.run(i)
                lesson.wait_finished(i, timeout=120)
        lesson.run(launch_cell)
        view = RunView(lesson.cell(launch_cell))
        wait_for(lambda: view.count() == nproc, timeout=60, what=f"{nproc} rank panes")

        def own_lines() -> bool:  # each pane holds its own rank's line (env_report.py)
            return all(f"RANK={r} LOCAL_RANK={r}" in view.body(r) for r in range(nproc))

        wait_for(lambda: own_lines() or not lesson.busy(launch_cell), timeout=240,
                 what="every pane to show its rank's line")
        # A warm run of this cell takes about half a second, often less than the page
        # needs to show it: whether the panes fill while the cell runs is checked with a
        # longer run (test_panes_fill_while_the_run_goes_and_show_progress).
        lesson.screenshot(launch_cell, ARTIFACTS / "01-lesson00-mid-run.png")
        lesson.wait_finished(launch_cell, timeout=240)

        assert view.states() == ["done"] * nproc
        assert own_lines()
        for rank in range(nproc):
            others = [r for r in range(nproc) if r != rank]
            assert not any(f"RANK={r} " in view.body(rank) for r in others)
        assert f"run finished: {nproc} rank(s)" in view.summary.inner_text()
        lesson.screenshot(launch_cell, ARTIFACTS / "01-lesson00-finished.png")
    except BaseException:
        _on_failure_screenshot(page, request)
        raise
    finally:
        context.close()


@pytest.mark.timeout(300)
def test_panes_fill_while_the_run_goes_and_show_progress(scenario):
    cell = CELL["live"]
    scenario.run(cell)
    view = RunView(scenario.cell(cell))
    wait_for(lambda: view.count() == 2, timeout=60, what="2 rank panes")

    def counts_while_busy(at_least: list[int]):
        """Line counts of both panes once each is >= at_least, read while the cell runs."""
        counts = [len(view.lines(r)) for r in range(2)]
        if all(c >= n for c, n in zip(counts, at_least)):
            assert scenario.busy(cell), f"the cell ended before the panes had {at_least} lines"
            return counts
        return None

    first = wait_for(lambda: counts_while_busy([4, 4]), timeout=180,
                     what="4 lines in each pane while the cell runs")
    assert view.states() == ["running", "running"]
    progress = [view.progress(r) for r in range(2)]
    assert all(p and 0 < p[0] < 30 and p[1] == 30 for p in progress), progress
    scenario.screenshot(cell, ARTIFACTS / "02-live-panes-mid-run.png")
    later = wait_for(lambda: counts_while_busy([first[0] + 5, first[1] + 5]), timeout=60,
                     what=f"the panes to grow past {first} lines while the cell runs")
    assert scenario.busy(cell)
    assert later[0] > first[0] and later[1] > first[1]
    assert 0 < view.bar_width(0) < 1

    scenario.wait_finished(cell, timeout=120)
    assert view.states() == ["done", "done"]
    for rank in range(2):
        lines = view.lines(rank)
        assert all(line.startswith(f"rank {rank} ") for line in lines), lines
        assert lines[-1].startswith(f"rank {rank} step 29 loss"), "the pane shows the last lines"
        assert view.progress(rank) == (30, 30)
        assert view.bar_width(rank) == pytest.approx(1.0, abs=0.01)
    assert "run finished: 2 rank(s)" in view.summary.inner_text()
    scenario.screenshot(cell, ARTIFACTS / "03-live-panes-finished.png")


@pytest.mark.timeout(300)
def test_stop_button_ends_every_rank_while_the_cell_is_busy(scenario, lab):
    cell = CELL["stop"]
    scenario.run(cell)
    view = RunView(scenario.cell(cell))
    wait_for(lambda: view.count() == 2 and all(len(view.lines(r)) >= 3 for r in range(2)),
             timeout=180, what="both ranks printing")
    assert view.states() == ["running", "running"]
    processes = lab.run_processes()  # the torchrun agent and both ranks
    rank_pids = lab.rank_pids(lab.newest_run("train_steps"))
    assert len(processes) >= 3 and set(rank_pids.values()) <= set(processes), \
        (processes, rank_pids)
    assert all(pid_alive(pid) for pid in processes)

    view.stop.click()
    # The run never ends by itself (100,000 steps): the cell finishing is the click's doing.
    scenario.wait_finished(cell, timeout=60)
    assert view.states() == ["killed", "killed"]
    assert "run STOPPED" in view.summary.inner_text()
    assert "stop requested: stopping every rank" in view.notes.inner_text()
    assert view.stop.is_disabled()
    wait_for(lambda: not any(pid_alive(pid) for pid in processes), timeout=10,
             what=f"the agent and ranks {processes} to be gone")
    assert lab.run_processes() == []
    scenario.screenshot(cell, ARTIFACTS / "04-stopped.png")


@pytest.mark.timeout(300)
def test_a_failing_run_shows_the_root_cause(scenario):
    cell = CELL["fail"]
    scenario.run(cell)
    view = RunView(scenario.cell(cell))
    wait_for(lambda: view.count() == 2, timeout=60, what="2 rank panes")
    scenario.wait_finished(cell, timeout=180)

    assert view.state(1) == "failed"
    assert "root cause" in view.head(1) and "victim of rank 1" in view.head(0)
    assert "ValueError: bad batch on rank 1 at step 5" in view.body(1)  # its stderr, in its pane
    summary = view.summary.inner_text()
    assert "run FAILED: 2 rank(s)" in summary
    assert "root cause: rank 1 raised ValueError: bad batch on rank 1 at step 5" in summary
    raise_line = script_line('raise ValueError(f"bad batch')
    assert re.search(rf"at \S*train_steps\.py:{raise_line}\b", summary), summary
    assert "rank 0 stopped because rank 1 failed" in summary
    assert re.search(r"^0\s+\w+.*victim", summary, re.M), summary  # rank 0's row in the table
    scenario.screenshot(cell, ARTIFACTS / "05-failure-root-cause.png")


@pytest.mark.timeout(300)
def test_a_hanging_run_shows_the_hang_report_with_the_straggler(scenario):
    cell = CELL["hang"]
    scenario.run(cell)
    view = RunView(scenario.cell(cell))
    wait_for(lambda: view.count() == 2, timeout=60, what="2 rank panes")
    scenario.wait_finished(cell, timeout=180)

    assert view.states() == ["hung", "hung"]
    assert "straggler" in view.head(1) and "straggler" not in view.head(0)
    assert "no rank made progress for" in view.notes.inner_text()
    summary = view.summary.inner_text()
    assert "run HUNG: 2 rank(s)" in summary
    assert "hang: no rank made progress for" in summary
    sleep_line = script_line("time.sleep(600)")
    straggler = re.search(rf"rank 1 waits at \S*train_steps\.py:{sleep_line}\b.*", summary)
    assert straggler and "<- straggler" in straggler.group(0), summary
    waiting = re.search(r"rank 0 waits at \S*train_steps\.py:\d+.*", summary)
    assert waiting and "all_reduce" in waiting.group(0) and "straggler" not in waiting.group(0)
    assert view.progress(0) == (5, 40) and view.progress(1) == (5, 40), "bars stop at step 5"
    scenario.screenshot(cell, ARTIFACTS / "06-hang-report.png")


@pytest.mark.timeout(300)
def test_a_rank_at_a_breakpoint_takes_pdb_commands_in_its_pane(scenario):
    cell = CELL["debug"]
    scenario.run(cell)
    view = RunView(scenario.cell(cell))
    box = view.panes.nth(1).locator(".labutils-debug-input input")
    wait_for(lambda: box.count() == 1, timeout=120, what="a pdb text box in rank 1's pane")
    wait_for(lambda: view.state(1) == "debugging", timeout=10, what="rank 1 shown debugging")
    assert scenario.busy(cell)
    # the console is laid out at once, the notes on the display's next refresh
    wait_for(lambda: "type pdb commands in its pane" in view.notes.inner_text(), timeout=10,
             what="the note that says rank 1's pane takes pdb commands")

    def command(text: str, answer: str) -> None:
        box.fill(text)
        box.press("Enter")
        wait_for(lambda: answer in view.body(1), timeout=30, what=f"{answer!r} in rank 1's pane")

    command("p secret", "41")
    scenario.page.wait_for_timeout(4000)   # past hang_timeout: a debugged rank is no hang
    assert scenario.busy(cell) and view.state(1) == "debugging"
    command("secret = 99", "(Pdb rank 1) secret = 99")
    scenario.screenshot(cell, ARTIFACTS / "07-debugger-in-a-pane.png")
    command("c", "rank 1 continues")
    scenario.wait_finished(cell, timeout=60)
    assert view.states() == ["done", "done"]
    assert "rank 1: secret 99" in view.body(1)
    assert box.count() == 0, "the text box goes once the session ends"
    assert "run finished: 2 rank(s)" in view.summary.inner_text()


@pytest.mark.timeout(300)
def test_a_persistent_world_shows_panes_per_cell_and_keeps_its_variables_after_stop(scenario):
    scenario.run(CELL["world"])
    scenario.wait_finished(CELL["world"], timeout=120)
    cell = CELL["world_loop"]
    scenario.run(cell)
    view = RunView(scenario.cell(cell))
    wait_for(lambda: view.count() == 2 and all(len(view.lines(r)) >= 3 for r in range(2)),
             timeout=120, what="both ranks printing in the cell's panes")
    assert "tick 0" in view.body(0) and "tick 0" in view.body(1)
    view.stop.click()
    scenario.wait_finished(cell, timeout=60)
    assert "cell 1 STOPPED" in view.summary.inner_text()
    assert "the world kept every rank's variables" in view.notes.inner_text()
    scenario.screenshot(cell, ARTIFACTS / "08-world-stopped.png")
    after = CELL["world_after"]
    scenario.run(after)
    scenario.wait_finished(after, timeout=60)
    view = RunView(scenario.cell(after))
    assert view.states() == ["done", "done"]
    assert view.body(0).strip().endswith("0") and view.body(1).strip().endswith("7")
    scenario.run(CELL["world_stop"])  # the world's ranks end with this test
    scenario.wait_finished(CELL["world_stop"], timeout=60)
