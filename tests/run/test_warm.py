"""Warm start (labutils.run.warm, labutils.runtime.server): what only a warm run has.

A warm rank must see what a cold one sees (its script as __main__, argv, cwd, sys.path,
environment, thread count, signal handlers, functions that pickle for DataLoader
workers and a spawn pool), nothing one run does may reach the next, each caller has
its own server, a killed server is replaced, and runs where warm does not apply say
why they started cold. The launcher's other tests run both ways (conftest.py).
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import SCRIPTS

from labutils import launch
from labutils.run.launcher import prepare
from labutils.errors import LaunchConfigError
from labutils.run import warm
from labutils.run.spec import LaunchSpec
from labutils.runtime.procs import pid_alive

SEES = SCRIPTS / "what_a_rank_sees.py"
# Values that differ between any two processes, however they started: a random draw,
# and str hashes when PYTHONHASHSEED is not set (a warm server's forks share its seed;
# docs/architecture.md says so).
PER_PROCESS = {"rand", "torch_seed", "torch_draw", "rank", "t", "hash_seed"}


@pytest.fixture(autouse=True)
def warm_allowed(monkeypatch):
    """These tests are about warm runs, also in a session started with LABUTILS_START=cold."""
    monkeypatch.delenv("LABUTILS_START", raising=False)


def _sees(result, ignore=PER_PROCESS) -> dict[int, dict]:
    assert result.ok, result.headline()
    return {r["rank"]: {k: v for k, v in r.items() if k not in ignore} for r in result.records}


def test_a_warm_rank_sees_what_a_cold_rank_sees(runs_dir, tmp_path, monkeypatch):
    # The server is started in another folder, without the run's TMPDIR: what the rank
    # reads from its folder and environment must be the run's, not the server's.
    # A relative PYTHONPATH entry is made absolute against the rank's folder, not the server's.
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, ["lib", os.environ.get("PYTHONPATH")])))
    # The launcher's OMP_NUM_THREADS=1 for 2 ranks, which a caller's own would replace;
    # torch reads MKL_NUM_THREADS before it: a user's would overrule it (the doctor names it)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    warm.server_for({**os.environ, "OMP_NUM_THREADS": "1"})
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tmp").mkdir()
    # where torch's compile cache goes when the caller has not set it (a caller that
    # built a DDP model has: importing torch._dynamo writes torch's default into it)
    monkeypatch.delenv(warm.INDUCTOR_CACHE, raising=False)
    kwargs = dict(args=["--spawn", "--lr", "0.1"], display="none",
                  env={"WHAT_A_RANK_SEES": "given", "TMPDIR": str(tmp_path / "tmp")})
    cold = launch(SEES, 2, warm=False, **kwargs)
    hot = launch(SEES, 2, **kwargs)
    assert (cold.start, hot.start) == ("cold", "warm") and cold.start_reason == "warm=False"
    assert _sees(hot) == _sees(cold)
    seen = _sees(hot)[1]
    assert seen["argv"] == ["--spawn", "--lr", "0.1"] and seen["argv0"] == seen["file"] == SEES.name
    assert seen["name"] == "__main__" and seen["cwd"] == str(tmp_path)
    assert seen["path0"] == str(SCRIPTS) and seen["env_given"] == "given"
    assert str(tmp_path / "lib") in seen["path"] and str(tmp_path / "elsewhere" / "lib") not in seen["path"]
    assert seen["threads"] == 1 and seen["omp"] == "1"  # as torchrun sets it for 2 ranks
    assert seen["mp_name"] == "MainProcess" and not seen["mp_parent"]
    assert seen["sigterm"] == str(signal.SIG_DFL) and seen["blocked"] == []
    assert seen["workers"] == [[0, 1, 4], [9, 16, 25]] and seen["spawned"] == [1, 4, 9]
    assert seen["stdin"] == "" and seen["stdout_write_through"]
    assert seen["collector"] == [True, list(gc.get_threshold())]  # the server imports without it
    # read from the run's environment and its folder, not fixed when the server started
    assert seen["tmpdir"] == str(tmp_path / "tmp")
    assert seen["inductor_cache"].startswith(str(tmp_path / "tmp"))
    assert seen["debug_dir"] == str(tmp_path / "torch_compile_debug")
    # Seeded per process, as an interpreter and torch seed them: every rank and run differs.
    records = [r for res in (hot, launch(SEES, 2, display="none")) for r in res.records]
    for key in ("rand", "torch_seed", "torch_draw"):
        assert len({r[key] for r in records}) == 4, key


def test_nothing_one_run_does_reaches_the_next(runs_dir):
    first = _sees(launch(SEES, 2, display="none"))
    second = _sees(launch(SEES, 2, display="none"))
    for seen in (first, second):  # each run set a torch attribute and the default dtype
        assert all(s["leaked"] is None and s["dtype_before"] == "torch.float32"
                   for s in seen.values())


def test_variables_read_at_import_get_a_server_of_their_own(runs_dir):
    env = {"PYTHONHASHSEED": "123", "TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
    hot = launch(SEES, 1, display="none", env=env)
    cold = launch(SEES, 1, display="none", env=env, warm=False)
    same = PER_PROCESS - {"hash_seed"}  # the hash seed is set: equal in every process
    assert hot.start == "warm" and _sees(hot, same) == _sees(cold, same)
    fresh = subprocess.run([sys.executable, "-c", "print(hash('labutils'))"], text=True,
                           capture_output=True, env={**os.environ, **env}).stdout
    seen = _sees(hot, same)[0]
    assert seen["hash_seed"] == int(fresh) and seen["debug_level"].endswith("DETAIL")
    # one rank: the launcher sets no OMP_NUM_THREADS; the rank sees the caller's, if any
    assert seen["omp"] == os.environ.get("OMP_NUM_THREADS")
    assert seen["threads"] == _sees(cold)[0]["threads"]
    assert any(s.import_env.get("PYTHONHASHSEED") == "123" for s in warm.servers())


def test_a_warm_ranks_exit_imports_nothing(runs_dir, tmp_path):
    """torch._dynamo's atexit handler formats a table of compile times at every exit, a
    rank's too, with the tabulate package: the server has imported it, so a warm rank
    does not import it as it ends (about 70 ms of a rank's exit)."""
    script = tmp_path / "exit_table.py"
    script.write_text(
        "import sys\n"
        "from torch._dynamo.utils import compile_times\n"
        "before = set(sys.modules)\n"
        "compile_times(repr='str', aggregate=True)  # what the handler does\n"
        "print('imported at exit:', sorted(set(sys.modules) - before))\n")
    result = launch(script, 1, display="none")
    assert result.ok and result.start == "warm", result.headline()
    assert "imported at exit: []" in result.ranks[0].stdout, result.ranks[0].stdout


def test_a_caller_that_built_a_ddp_model_keeps_its_server(runs_dir, monkeypatch):
    """Importing torch._dynamo (DDP's constructor does) writes torch's default
    TORCHINDUCTOR_CACHE_DIR into the caller's environment: the same server still serves
    (a grader's check process started a second one at every grading). Another value
    is the caller's own choice, and gets a server of its own."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    monkeypatch.delenv(warm.INDUCTOR_CACHE, raising=False)
    first = launch(SEES, 2, display="none")
    cache_dir()  # what importing torch._dynamo does to this process's environment
    assert os.environ[warm.INDUCTOR_CACHE] == default_cache_dir() == warm.inductor_default_cache_dir()
    before = {s.pid for s in warm.servers()}
    again = launch(SEES, 2, display="none")
    assert first.start == again.start == "warm" and again.warm_server is None
    assert {s.pid for s in warm.servers()} == before
    env = {**os.environ, warm.INDUCTOR_CACHE: str(runs_dir / "inductor")}
    assert warm.import_env(env)[warm.INDUCTOR_CACHE] == str(runs_dir / "inductor")


def test_a_killed_server_is_replaced(runs_dir):
    first = launch(SEES, 2, display="none")
    # the launcher's OMP_NUM_THREADS=1 for several ranks, unless the caller set one
    # (and the rest of what it imports with: other servers of this worker may share the
    # variable, e.g. under an OMP_NUM_THREADS the user set)
    key = warm.import_env({**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    [server] = [s for s in warm.servers() if s.import_env == key]
    os.kill(server.pid, signal.SIGKILL)
    server.proc.wait(timeout=10)
    again = launch(SEES, 2, display="none")
    assert first.ok and again.ok and again.start == "warm"
    assert "gone" in again.warm_server and again.start_reason is None
    assert server not in warm.servers() and not pid_alive(server.pid)


def test_a_call_a_signal_cut_short_leaves_every_later_call_its_own_answer(monkeypatch):
    """A signal handler that raises (Ctrl-C, the CLI's SIGTERM) can cut a call to the
    server anywhere: before its answer is read, or after it is read and before it is
    returned. The next calls must get their own answers at once. (Found by the
    lifetime stress: one CLI in 20 warm runs sat 30 s on SIGTERM, waiting for an answer
    it had already read; with answers counted instead of matched by id, 40 of 100 cuts
    in this loop left the next call waiting.) The cuts come from a timer (SIGALRM,
    pytest-timeout's alarm put back after)."""
    monkeypatch.setattr(warm, "CALL_TIMEOUT_S", 10.0)   # a stall fails the test in 10 s
    server, _ = warm.server_for({**os.environ, "OMP_NUM_THREADS": "1"})
    ops = [({"op": "poll", "pid": 1 << 22}, lambda r: r == {"code": None}),
           ({"op": "hello"}, lambda r: r["pid"] == server.pid and set(r) == {"pid", "threads"})]

    def call(k: int) -> None:
        request, right = ops[k % 2]
        answer = server.call(request)
        assert right(answer), (request, answer)

    def cut(signum, frame):
        raise KeyboardInterrupt("cut")

    rng, cuts = random.Random(0), 0
    alarm = signal.getitimer(signal.ITIMER_REAL)
    previous = signal.signal(signal.SIGALRM, cut)
    try:
        for trial in range(300):
            try:  # the timer is set inside: a cut can come before setitimer has returned
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(2e-5, 1e-3))
                for k in itertools.count():
                    call(k)
            except KeyboardInterrupt:
                cuts += 1
            signal.setitimer(signal.ITIMER_REAL, 0)
            for k in range(2):   # the next calls, each its own answer
                call(trial + k)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if alarm[0] > 0:
            signal.setitimer(signal.ITIMER_REAL, *alarm)
    assert cuts == 300 and server.alive()


def test_a_changed_installation_retires_the_server(runs_dir, monkeypatch):
    launch(SEES, 2, display="none")
    before = {s.pid for s in warm.servers()}
    stamp = warm.install_stamp()
    monkeypatch.setattr(warm, "install_stamp", lambda: stamp + 1)
    result = launch(SEES, 2, display="none")
    assert result.start == "warm" and "changed on disk" in result.warm_server
    assert result.start_reason is None
    assert not before & {s.pid for s in warm.servers()}


def test_the_install_stamp_sees_an_edited_module():
    import labutils.run.warm as module

    path = Path(module.__file__)
    st = path.stat()
    before = warm.install_stamp()
    try:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        assert warm.install_stamp() != before
    finally:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert warm.install_stamp() == before


CALLER = """
import json, sys
from labutils import launch
from labutils.run.launcher import prepare
from labutils.run import warm
r = launch({script!r}, 2, display="none")
print(json.dumps({{"ok": r.ok, "start": r.start, "servers": [s.pid for s in warm.servers()]}}))
sys.stdout.flush()
sys.stdin.read()  # stay alive until the test closes stdin
"""


def test_two_callers_have_separate_servers_that_die_with_them(runs_dir):
    callers = [subprocess.Popen([sys.executable, "-c", CALLER.format(script=str(SEES))],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
               for _ in range(2)]
    try:
        seen = [json.loads(c.stdout.readline()) for c in callers]
        assert all(s["ok"] and s["start"] == "warm" and len(s["servers"]) == 1 for s in seen)
        servers = [s["servers"][0] for s in seen]
        assert servers[0] != servers[1]
        for caller, server in zip(callers, servers):
            assert _parent(server) == caller.pid
        callers[0].kill()  # a kernel killed with -9: its server goes with it
        callers[0].wait()
        deadline = time.monotonic() + 5
        while pid_alive(servers[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(servers[0]) and pid_alive(servers[1])
    finally:
        for caller in callers:
            caller.kill()
            caller.wait()


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _spec(**changes) -> LaunchSpec:
    return LaunchSpec(script=SEES, nproc=2, **changes)


def test_runs_where_warm_does_not_apply_say_why(monkeypatch):
    assert warm.decide_start(_spec()) == warm.Start("warm")
    assert warm.decide_start(_spec(warm=False)) == warm.Start("cold", "warm=False")
    # a node of a job across machines starts warm, from a server of its own launcher
    assert warm.decide_start(_spec(rdzv_endpoint="10.0.0.1:29400")) == warm.Start("warm")
    assert "GPU" in warm.decide_start(_spec(backend="nccl")).reason
    monkeypatch.setenv("LABUTILS_START", "cold")
    assert str(warm.decide_start(_spec())) == "cold (LABUTILS_START=cold)"


def test_runs_start_cold_where_the_ranks_see_a_gpu_and_warm_where_it_is_hidden(
        monkeypatch, tmp_path):
    """A machine with an NVIDIA GPU (its driver's /proc folder lists one): "auto" would
    pick nccl there, and a gloo rank may still use CUDA, which a rank forked from
    torchrun's agent cannot (the agent asked torch.cuda.is_available(): lab 11's DCP save
    failed so on torch 2.11), so the run starts cold; with CUDA_VISIBLE_DEVICES empty or
    -1, in the run's variables or the caller's, the ranks see no GPU and run as on CPU,
    warm."""
    gpus = tmp_path / "gpus"
    (gpus / "0000:01:00.0").mkdir(parents=True)
    monkeypatch.setattr(warm, "NVIDIA_GPUS", gpus)
    monkeypatch.setattr(warm, "AMD_GPUS", tmp_path / "no-kfd")
    monkeypatch.setattr(warm, "torch_gpu_builds", lambda: {"cuda"})
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert "GPU" in warm.decide_start(_spec()).reason
    assert "GPU" in warm.decide_start(_spec(env={"CUDA_VISIBLE_DEVICES": "0"})).reason
    assert "GPU" in warm.decide_start(_spec(backend="gloo")).reason
    for hidden in ("", "-1"):
        assert warm.decide_start(_spec(env={"CUDA_VISIBLE_DEVICES": hidden})) == warm.Start("warm")
        assert warm.decide_start(_spec(backend="gloo", env={"CUDA_VISIBLE_DEVICES": hidden})) \
            == warm.Start("warm")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert warm.decide_start(_spec()) == warm.Start("warm")
    assert "GPU" in warm.decide_start(_spec(env={"CUDA_VISIBLE_DEVICES": "0,1"})).reason
    assert "GPU" in warm.decide_start(_spec(backend="nccl")).reason
    monkeypatch.setattr(warm, "NVIDIA_GPUS", tmp_path / "no-driver")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert warm.decide_start(_spec()) == warm.Start("warm")


def test_a_gpu_the_installed_torch_cannot_use_leaves_runs_warm(monkeypatch, tmp_path):
    """A CPU build of torch (the lock's, from a CPU wheel index) on a machine with an
    NVIDIA GPU: no rank can start CUDA, so nothing poisons a fork and runs start warm.
    An AMD GPU (/dev/kfd) with a ROCm build starts cold like an NVIDIA one with CUDA's,
    and HIP's and ROCr's own variables hide it too. The build is read from torch's
    version.py without importing torch, and agrees with torch.version."""
    import torch

    assert warm.torch_gpu_builds() == {k for k in ("cuda", "hip") if getattr(torch.version, k)}
    gpus = tmp_path / "gpus"
    (gpus / "0000:01:00.0").mkdir(parents=True)
    kfd = tmp_path / "kfd"
    monkeypatch.setattr(warm, "NVIDIA_GPUS", gpus)
    monkeypatch.setattr(warm, "AMD_GPUS", tmp_path / "no-kfd")
    for name in warm.HIDING["hip"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(warm, "torch_gpu_builds", lambda: set())
    assert warm.decide_start(_spec()) == warm.Start("warm")
    monkeypatch.setattr(warm, "torch_gpu_builds", lambda: {"hip"})
    assert warm.decide_start(_spec()) == warm.Start("warm")       # NVIDIA's GPU, ROCm's torch
    kfd.touch()
    monkeypatch.setattr(warm, "AMD_GPUS", kfd)
    assert "GPU" in warm.decide_start(_spec(backend="gloo")).reason
    for name in warm.HIDING["hip"]:
        assert warm.decide_start(_spec(env={name: ""})) == warm.Start("warm"), name
    monkeypatch.setattr(warm, "torch_gpu_builds", lambda: {"cuda"})
    assert "GPU" in warm.decide_start(_spec()).reason             # the NVIDIA GPU again
    assert warm.decide_start(_spec(env={"HIP_VISIBLE_DEVICES": ""})).reason  # hides AMD's only


def test_a_run_no_server_can_serve_starts_cold_with_the_servers_last_words(monkeypatch, runs_dir):
    """The one decision (decide_start) also covers a server that cannot start: the run
    goes on cold, its reason is the server's, and prepare()'s plan said warm."""
    def refuse(env):
        raise warm.WarmUnavailable("the warm server exited before it was ready: no room")

    monkeypatch.setattr(warm, "server_for", refuse)
    assert warm.decide_start(_spec(), dict(os.environ)) == warm.Start(
        "cold", "the warm server exited before it was ready: no room")
    assert prepare(SEES, 2).request.start == "warm"
    result = launch(SEES, 2, display="none")
    assert result.ok and result.start == "cold" and "no room" in result.start_reason
    assert result.warm_server is None


def test_warm_takes_only_a_bool():
    with pytest.raises(LaunchConfigError, match="warm"):
        launch(SEES, 2, warm="yes")


def test_the_server_is_single_threaded_and_answers_bad_requests(runs_dir):
    launch(SEES, 2, display="none")
    server = warm.servers()[0]
    assert len(os.listdir(f"/proc/{server.pid}/task")) == 1
    with pytest.raises(warm.WarmUnavailable, match="unknown request"):
        server.call({"op": "nothing"})
    assert server.call({"op": "poll", "pid": 1}) == {"code": None}


def test_a_call_cut_short_by_ctrl_c_does_not_hand_its_answer_to_the_next(runs_dir, monkeypatch):
    """Ctrl-C between a request and its answer (a kernel interrupted while its run is
    polled): the next call, a new run's start, must read its own answer."""
    launch(SEES, 2, display="none")
    server = warm.servers()[0]
    read = server._readline

    def interrupted(timeout):
        monkeypatch.setattr(server, "_readline", read)
        raise KeyboardInterrupt

    monkeypatch.setattr(server, "_readline", interrupted)
    with pytest.raises(KeyboardInterrupt):
        server.call({"op": "poll", "pid": 1})
    with pytest.raises(warm.WarmUnavailable, match="unknown request"):
        server.call({"op": "nothing"})  # not the poll's {"code": None}
    result = launch(SEES, 2, display="none")
    assert result.ok and result.start == "warm" and warm.servers()[0] is server


def test_a_prestarted_server_serves_the_first_run(runs_dir):
    for server in warm.servers():  # the session's servers, to see prestart() at work
        warm._servers.remove(server)
        server.close()
    warm.prestart()
    (server,) = warm.servers()
    result = launch(SEES, 2, display="none")
    assert result.ok and result.start == "warm" and result.start_reason is None
    assert warm.servers() == [server] and server.pid is not None
