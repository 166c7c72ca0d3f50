"""launch(): run a script on N ranks with torchrun and own the run's whole lifetime.

The calling thread runs one loop: read new lines and events from the run folder,
hand them to the display, and watch for the end (the agent exits), a stop
request, the timeout, or a hang (no rank made progress for hang_timeout
seconds). Whatever ends the run, _shutdown() leaves no process behind: the agent
and every worker get SIGTERM, then SIGKILL, and the agent and workers also die
by themselves if this process dies (see _agent.py and worker.py).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path

from labutils import runfiles
from labutils._proc import descendants, free_port, pid_alive, stop_processes
from labutils.config import LaunchSpec, make_spec, new_run_dir, torchrun_command
from labutils.diagnosis import analyse_hang, find_failure
from labutils.display import Display, make_display
from labutils.result import RankResult, RunResult
from labutils.streams import EventTail, RankOutput

POLL_S = 0.05
TICK_S = 0.2
STACK_WAIT_S = 3.0
_AGENT_FAILURE_RE = re.compile(
    r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)"
)

_last_result: RunResult | None = None


def last_result() -> RunResult | None:
    """The result of the most recent launch() in this process (also after an interrupt)."""
    return _last_result


class _Rank:
    """What the launcher knows about one rank while the run goes."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.rank = rank
        self.output = RankOutput(run_dir, rank)
        self.events = EventTail(run_dir, rank)
        self.state = "starting"
        self.pid: int | None = None
        self.main_tid: int | None = None
        self.attempt = -1
        self.exit_code: int | None = None
        self.exceptions: dict[int, dict] = {}  # attempt -> exception event


class Launch:
    """One run: start the agent, follow it, end it, build the RunResult."""

    def __init__(self, spec: LaunchSpec, run_dir: Path, display: Display) -> None:
        self.spec = spec
        self.run_dir = run_dir
        self.display = display
        self.ranks = [_Rank(run_dir, r) for r in range(spec.world_size)]
        self.records: list[dict] = []
        self.attempts: list[dict] = []
        self.attempt = 0
        self.reason = "ok"
        self.hang = None
        self.proc: subprocess.Popen | None = None
        self.command: list[str] = []

    # ---------------------------------------------------------------- lifetime
    def run(self) -> RunResult:
        global _last_result
        spec = self.spec
        self.command = torchrun_command(spec, port=free_port(), run_id=uuid.uuid4().hex[:12])
        (self.run_dir / "command.txt").write_text("\n".join(self.command) + "\n")
        env = os.environ.copy()
        env.update(spec.env)
        env[runfiles.ENV_RUN_DIR] = str(self.run_dir)
        env[runfiles.ENV_PARENT_PID] = str(os.getpid())
        env["LABUTILS_BACKEND"] = spec.backend
        # Re-initialising gloo through the agent's shared store after a restart fails
        # intermittently; a store per round does not (CURRICULUM.md, lesson 05).
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        if spec.fault:
            env[runfiles.ENV_FAULT] = f"{spec.fault['rank']}:{spec.fault['step']}"
        if spec.nproc > 1:
            env.setdefault("OMP_NUM_THREADS", "1")  # what torchrun would set, minus its warning
        self.t0 = time.monotonic()
        self.last_activity = self.t0
        interrupted = False
        self.display.start(world_size=spec.world_size, log_dir=str(self.run_dir),
                           script=str(spec.script))
        with open(self.run_dir / "agent.log", "wb") as agent_log:
            try:
                self.proc = subprocess.Popen(
                    self.command, stdin=subprocess.DEVNULL, stdout=agent_log,
                    stderr=subprocess.STDOUT, env=env, start_new_session=True,
                )
                self._follow()
            except KeyboardInterrupt:
                interrupted = True
                self.reason = "interrupted"
            finally:
                while True:  # a second Ctrl-C must not leave processes behind
                    try:
                        self._shutdown()
                        break
                    except KeyboardInterrupt:
                        interrupted = True
                        self.reason = "interrupted"
        result = self._result()
        _last_result = result
        result.write_json(self.run_dir / "summary.json")
        self.display.finish(result)
        if interrupted:
            raise KeyboardInterrupt(f"run interrupted; every rank was stopped. {result.headline()}")
        return result

    def _follow(self) -> None:
        spec, last_tick = self.spec, 0.0
        while True:
            self._poll()
            now = time.monotonic()
            if self.proc.poll() is not None:
                self._poll(final=True)
                self.reason = "ok" if self.proc.returncode == 0 else "failed"
                return
            if self.display.stop_requested.is_set():
                self.display.note("stop requested: stopping every rank")
                self.reason = "stopped"
                return
            if spec.timeout is not None and now - self.t0 >= spec.timeout:
                self.display.note(f"timeout of {spec.timeout:g} s reached: stopping every rank")
                self.reason = "timeout"
                return
            silent = now - self.last_activity
            if spec.hang_timeout is not None and silent >= spec.hang_timeout and self._hung():
                self._diagnose_hang(silent)
                self.reason = "hang"
                return
            if now - last_tick >= TICK_S:
                self.display.tick()
                last_tick = now
            time.sleep(POLL_S)

    def _hung(self) -> bool:
        """Every rank has started in this attempt and at least one is still alive."""
        started = all(r.attempt == self.attempt and r.pid for r in self.ranks)
        return started and any(self._alive(r) for r in self.ranks)

    @staticmethod
    def _alive(r: _Rank) -> bool:
        return bool(r.pid) and r.exit_code is None and pid_alive(r.pid)

    def _shutdown(self) -> None:
        pids = [r.pid for r in self.ranks if r.pid and pid_alive(r.pid)]
        if self.proc is not None:
            if self.proc.poll() is None:
                pids = [self.proc.pid, *descendants(self.proc.pid), *pids]
            if pids:
                stop_processes(pids)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._poll(final=True)
        for r in self.ranks:
            r.output.close()
            r.events.close()

    # ------------------------------------------------------------- following
    def _poll(self, *, final: bool = False) -> None:
        for r in self.ranks:
            events = r.events.poll(final=final)
            for event in events:
                self._on_event(r, event)
            new = r.output.poll(final=final)
            for stream, lines in new.items():
                self.display.lines(r.rank, stream, lines)
            if events or new:
                self.last_activity = time.monotonic()

    def _set_state(self, r: _Rank, state: str) -> None:
        if r.state != state:
            r.state = state
            self.display.state(r.rank, state)

    def _on_event(self, r: _Rank, ev: dict) -> None:
        kind = ev.get("kind")
        if kind == "start":
            restart = int(ev.get("restart", 0))
            if restart > self.attempt:
                self._close_attempt()
                self.attempt = restart
                self.display.note(f"restart {restart}: torchrun started every rank again")
            r.attempt, r.pid, r.main_tid, r.exit_code = restart, ev.get("pid"), ev.get("main_tid"), None
            self._set_state(r, "running")
        elif kind == "record":
            self.records.append({"rank": r.rank, **ev.get("values", {})})
            self.display.record(r.rank, ev.get("values", {}))
        elif kind == "exception":
            r.exceptions[int(ev.get("restart", 0))] = ev
            self._set_state(r, "failed")
        elif kind == "exit":
            r.exit_code = int(ev.get("code", 0))
            self._set_state(r, "done" if r.exit_code == 0 else "failed")

    def _failure_of(self, attempt: int, exit_codes: dict[int, int | None],
                    finished: set[int] = frozenset()):
        exceptions = {r.rank: r.exceptions[attempt] for r in self.ranks if attempt in r.exceptions}
        failed = [r.rank for r in self.ranks
                  if r.rank in exceptions or (exit_codes.get(r.rank) not in (0, None))]
        tails = {r.rank: "\n".join(line for stream, line in list(r.output.combined)[-20:]
                                    if stream == "stderr") for r in self.ranks}
        return find_failure(exceptions, exit_codes, failed, finished=finished,
                            stderr_tails=tails)

    def _close_attempt(self) -> None:
        """Record why the attempt that is being replaced ended."""
        codes = {}
        for r in self.ranks:
            codes[r.rank] = r.exit_code
            if r.exit_code is None and r.pid and not pid_alive(r.pid):
                codes[r.rank] = -signal.SIGKILL if r.attempt == self.attempt else None
        failure = self._failure_of(self.attempt, codes)
        entry = _attempt_entry(self.attempt, failure, codes)
        if self.spec.fault and self.attempt == 0:
            entry["injected"] = dict(self.spec.fault)
        self.attempts.append(entry)

    def _diagnose_hang(self, silent: float) -> None:
        alive = [r for r in self.ranks if self._alive(r)]
        self.display.note(f"no rank made progress for {silent:.0f} s: reading every rank's stack")
        offsets = {r.rank: runfiles.stacks_path(self.run_dir, r.rank).stat().st_size
                   if runfiles.stacks_path(self.run_dir, r.rank).exists() else 0 for r in alive}
        for r in alive:
            try:
                os.kill(r.pid, signal.SIGUSR1)
            except OSError:
                pass
        dumps = _wait_for_dumps(self.run_dir, offsets)
        exited = {r.rank: r.exit_code for r in self.ranks if r.exit_code is not None}
        self.hang = analyse_hang(dumps, {r.rank: r.main_tid for r in alive}, str(self.spec.script),
                                 exited=exited, silent_s=silent)
        for r in alive:
            self._set_state(r, "hung")

    # ---------------------------------------------------------------- result
    def _result(self) -> RunResult:
        agent_text = (self.run_dir / "agent.log").read_text(errors="replace")
        # torchrun's own list of failed ranks is the final word on exit codes: a rank
        # can finish its script (exit event 0) and still die while Python shuts down.
        agent_codes = {int(r): int(c) for r, c in _AGENT_FAILURE_RE.findall(agent_text)}
        finished = set()
        for r in self.ranks:
            if r.rank in agent_codes and agent_codes[r.rank] != r.exit_code:
                if r.exit_code == 0:
                    finished.add(r.rank)
                    self._set_state(r, "killed" if agent_codes[r.rank] == -signal.SIGTERM
                                    else "failed")
                r.exit_code = agent_codes[r.rank]
        failure = None
        if self.reason == "failed":
            codes = {r.rank: r.exit_code for r in self.ranks}
            failure = self._failure_of(self.attempt, codes, finished)
            if failure is None:
                failure = _agent_failure(agent_text)
        for r in self.ranks:
            if r.state in ("starting", "running"):
                if self.reason == "failed" and failure and r.rank == failure.rank:
                    self._set_state(r, "failed")
                elif self.reason == "ok" and r.exit_code == 0:
                    self._set_state(r, "done")
                else:
                    self._set_state(r, "killed")
        codes = {r.rank: r.exit_code for r in self.ranks}
        self.attempts.append(_attempt_entry(self.attempt, failure, codes, final=self.reason))
        victims = set(failure.victims) if failure else set()
        ranks = [
            RankResult(
                rank=r.rank, state=r.state, exit_code=r.exit_code, pid=r.pid,
                log_dir=self.run_dir, stdout_lines=r.output.counts["stdout"],
                stderr_lines=r.output.counts["stderr"], tail=list(r.output.combined)[-50:],
                victim=r.rank in victims,
            )
            for r in self.ranks
        ]
        return RunResult(
            ok=self.reason == "ok", world_size=self.spec.world_size,
            duration_s=time.monotonic() - self.t0, log_dir=self.run_dir, ranks=ranks,
            records=self.records, failure=failure, hang=self.hang, attempts=self.attempts,
            reason=self.reason, script=str(self.spec.script), command=self.command,
            agent_exit_code=self.proc.returncode if self.proc else None,
        )


def _attempt_entry(attempt: int, failure, codes: dict, final: str | None = None) -> dict:
    entry = {
        "attempt": attempt,
        "failed_rank": failure.rank if failure else None,
        "why": f"{failure.exc_type}: {failure.message}" if failure else None,
        "exit_codes": {str(k): v for k, v in codes.items()},
    }
    if final is not None:
        entry["outcome"] = final
    else:
        entry["outcome"] = "restarted"
    return entry


def _agent_failure(agent_text: str):
    """A failure of torchrun itself (before any rank ran), from the agent's log."""
    from labutils.diagnosis import Failure

    lines = [ln for ln in agent_text.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^\w*(Error|Exception)\b", ln)]
    message = errors[-1] if errors else (lines[-1] if lines else "torchrun exited with an error")
    return Failure(rank=-1, exc_type="torchrun", message=message, file=None, line=None,
                   traceback="\n".join(lines[-30:]))


def _wait_for_dumps(run_dir: Path, offsets: dict[int, int]) -> dict[int, str]:
    """Each rank's new stack text, once every file has grown and stopped growing."""
    deadline = time.monotonic() + STACK_WAIT_S
    sizes: dict[int, int] = {}
    while time.monotonic() < deadline:
        now = {r: runfiles.stacks_path(run_dir, r).stat().st_size
               if runfiles.stacks_path(run_dir, r).exists() else 0 for r in offsets}
        grown = all(now[r] > offsets[r] for r in offsets)
        if grown and now == sizes:
            break
        sizes = now
        time.sleep(0.1)
    dumps = {}
    for r, off in offsets.items():
        path = runfiles.stacks_path(run_dir, r)
        with open(path, "rb") if path.exists() else open(os.devnull, "rb") as f:
            f.seek(off)
            dumps[r] = f.read().decode(errors="replace")
    return dumps


def launch(
    script: str | os.PathLike,
    nproc: int = 2,
    *,
    args=(),
    backend: str = "auto",
    hang_timeout: float | None = 30.0,
    timeout: float | None = None,
    max_restarts: int = 0,
    log_dir: str | os.PathLike | None = None,
    display: str | Display = "auto",
    env: dict[str, str] | None = None,
    fault: dict | None = None,
) -> RunResult:
    """Run ``script`` on ``nproc`` ranks with torchrun and return what happened.

    Each rank's output streams into the cell as it arrives (live panes in
    JupyterLab, ``[rank N] line`` text elsewhere) and is kept complete in the run
    folder. Bad input raises LaunchConfigError before any process starts.

    Args:
        script: the training script, run unchanged in every rank.
        nproc: number of ranks (processes) on this machine.
        args: command-line arguments for the script, a list of strings.
        backend: "auto" (nccl with a GPU per rank, else gloo), "gloo" or "nccl";
            scripts read it through labutils.dist.init().
        hang_timeout: seconds without progress from any rank before the run is
            declared hung, every stack is read and the run is stopped; None: never.
        timeout: wall-clock limit for the whole run in seconds; None: no limit.
        max_restarts: how often torchrun restarts all ranks after a failure.
        log_dir: folder for run folders (default $LABUTILS_RUNS_DIR or ./runs).
        display: "auto", "widgets", "text", "terminal", "none" or a Display.
        env: extra environment variables for the ranks.
        fault: fault injection, {"rank": R, "step": S} or {"rank": R, "step": (lo, hi),
            "seed": k}: rank R is SIGKILLed when it calls report(step=S) in the first
            attempt; needs max_restarts >= 1. The restart history is in result.attempts.

    Returns:
        RunResult. A Ctrl-C or Jupyter interrupt stops every rank, prints the
        summary and re-raises KeyboardInterrupt; last_result() still has the result.
    """
    spec = make_spec(script, nproc, args=args, backend=backend, hang_timeout=hang_timeout,
                     timeout=timeout, max_restarts=max_restarts, env=env, fault=fault)
    if not isinstance(display, Display):
        display = make_display(display)
    run_dir = new_run_dir(spec.script, log_dir)
    return Launch(spec, run_dir, display).run()
