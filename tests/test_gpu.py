"""The course on real GPUs: NCCL, nn.DataParallel and a lesson notebook on CUDA.

Every test here is marked ``gpu`` and skipped, with the reason, on a machine without
CUDA (a CPU build of torch, or no GPU visible). Run them on a GPU machine with

    make test-gpu          # pytest -m gpu tests/test_gpu.py

Two GPUs are needed for DataParallel, the collectives, the hang report and lesson 11 (NCCL puts
one rank on each GPU); init() on NCCL and the notebook run on one.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
from helpers import autocast_problem, this_python_kernel

from labutils import launch

REPO = Path(__file__).resolve().parent.parent
LESSONS = REPO / "lessons"
LESSON01 = LESSONS / "01_dp_vs_ddp"
LESSON02 = LESSONS / "02_collectives"


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


GPUS = _gpu_count()
NCCL = dist.is_available() and dist.is_nccl_available()


def _skip_reason(n: int, *, nccl: bool) -> str:
    need = f"needs CUDA and >= {n} GPU{'s' if n > 1 else ''}" + (" and NCCL" if nccl else "")
    if torch.version.cuda is None:
        return f"{need}; this machine has 0 (torch {torch.__version__} is a CPU build)"
    if GPUS < n:
        return f"{need}; this machine has {GPUS}"
    return f"{need}; this torch has no NCCL"


def needs_gpus(n: int, *, nccl: bool = False):
    """Mark a test `gpu`, and skip it unless CUDA sees n GPUs (and NCCL is there, if asked)."""
    ok = GPUS >= n and (NCCL or not nccl)
    skip = pytest.mark.skipif(not ok, reason=_skip_reason(n, nccl=nccl))
    return lambda test: pytest.mark.gpu(skip(test))


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _assert_ranks_gone(result, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while any(_alive(r.pid) for r in result.ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [r.rank for r in result.ranks if _alive(r.pid)]
    assert not left, f"ranks still alive after the run: {left}"


# ------------------------------------------------------------------ init() on NCCL

INIT_SCRIPT = """
import os

import torch
import torch.distributed as dist

from labutils.dist import init, report

rank, world_size, device = init()
t = torch.tensor([float(rank + 1)], device=device)
dist.all_reduce(t)
bound = getattr(dist.group.WORLD, "bound_device_id", None)
report(backend=dist.get_backend(), device=str(device), local_rank=int(os.environ["LOCAL_RANK"]),
       current=torch.cuda.current_device(), bound=None if bound is None else str(bound),
       tensor_device=str(t.device), total=t.item())
dist.destroy_process_group()
"""


@needs_gpus(1, nccl=True)
def test_init_on_nccl_binds_each_rank_to_its_gpu(runs_dir, write_script):
    nproc = min(GPUS, 2)
    script = write_script("init_nccl.py", INIT_SCRIPT)
    result = launch(script, nproc, backend="nccl", display="none", hang_timeout=60, timeout=180)
    assert result.ok, result.summary()
    rows = sorted((r for r in result.records if "backend" in r), key=lambda r: r["rank"])
    assert [r["rank"] for r in rows] == list(range(nproc))
    for r in rows:
        local = r["local_rank"]
        assert r["backend"] == "nccl"
        assert r["device"] == f"cuda:{local}" and r["current"] == local
        assert r["tensor_device"] == f"cuda:{local}"
        # init() passes device_id: the process group is bound to this rank's GPU.
        assert r["bound"] == f"cuda:{local}"
        assert r["total"] == nproc * (nproc + 1) / 2


def test_init_passes_device_id_for_nccl(monkeypatch):
    """Runs everywhere (no gpu mark): with NCCL, init() binds the group to cuda:LOCAL_RANK.

    torch's group calls are replaced by recorders, so the arguments init() passes
    are checked without a GPU; the test above checks the same on real GPUs.
    """
    from labutils import dist as labdist

    calls = {}
    monkeypatch.setenv("LOCAL_RANK", "3")
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, {"RANK": "5", "WORLD_SIZE": "8"}.get(name, "x"))
    monkeypatch.setattr(labdist, "pick_backend", lambda backend: "nccl")
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("set_device", d))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls.setdefault("init", kw))
    monkeypatch.setattr(dist, "get_rank", lambda: 5)
    monkeypatch.setattr(dist, "get_world_size", lambda: 8)
    assert labdist.init("nccl") == (5, 8, torch.device("cuda", 3))
    assert calls["set_device"] == torch.device("cuda", 3)
    assert calls["init"]["backend"] == "nccl"
    assert calls["init"]["device_id"] == torch.device("cuda", 3)


# ------------------------------------------------------------------ lesson 01: nn.DataParallel

@pytest.fixture
def lesson01(monkeypatch):
    """lesson 01's model and data_parallel modules, imported fresh from its folder."""
    import importlib

    monkeypatch.syspath_prepend(str(LESSON01))
    for name in ("model", "data_parallel"):
        if name in sys.modules:
            monkeypatch.delitem(sys.modules, name)
    return importlib.import_module("model"), importlib.import_module("data_parallel")


@needs_gpus(2)
def test_lesson01_data_parallel_takes_the_real_branch(lesson01):
    model_mod, dp_mod = lesson01
    way = dp_mod.data_parallel(n_devices=2, per_device_batch=32, config=model_mod.FEW_BIG_OPS)
    [run] = dp_mod.time_in_turn([way], dp_mod.global_batches(model_mod.FEW_BIG_OPS, 64, 3, warmup=1), warmup=1)
    assert run["kind"] == "nn.DataParallel on 2 GPUs"
    assert run["samples_per_s"] > 0 and run["step_s"] > 0
    peaks = {m["device"]: m["peak allocated"] for m in run["memory"]}
    assert sorted(peaks) == [0, 1]
    # The replica and its chunk of the batch lived on GPU 1 too; GPU 0 holds more
    # (the model, its gradients, the optimizer state, the gathered outputs).
    assert peaks[1] > 0 and peaks[0] > peaks[1]


@needs_gpus(2)
def test_lesson01_real_data_parallel_equals_one_process(lesson01):
    """The step the lesson describes, on 2 GPUs, against one device and the whole batch."""
    from torch import nn

    model_mod, _ = lesson01
    reference = model_mod.make_model(**model_mod.PROOF).to("cuda:0")
    replicated = model_mod.make_model(**model_mod.PROOF).to("cuda:0")
    dp = nn.DataParallel(replicated, device_ids=[0, 1])
    ref_opt, dp_opt = model_mod.make_optimizer(reference), model_mod.make_optimizer(replicated)
    for step in range(2):
        x, y = (t.to("cuda:0") for t in model_mod.make_batch(step, 16, **model_mod.PROOF))
        for model, opt in ((reference, ref_opt), (dp, dp_opt)):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    # Parameters live on GPU 0 only; DataParallel copied them to GPU 1 for each forward.
    assert {p.device for p in replicated.parameters()} == {torch.device("cuda", 0)}
    torch.testing.assert_close(model_mod.flat_params(replicated), model_mod.flat_params(reference),
                               rtol=1e-4, atol=1e-5)
    assert list(dp.state_dict())[0].startswith("module.")


# ------------------------------------------------------------------ lesson 02: collectives on NCCL

def _by_rank_and_op(result) -> dict:
    return {(r["rank"], r["op"]): (r.get("before"), r.get("after"))
            for r in result.records if "op" in r and r["op"] != "barrier"}


@needs_gpus(2, nccl=True)
def test_lesson02_primitives_on_nccl_match_gloo(runs_dir):
    nproc = min(GPUS, 4)
    script = LESSON02 / "primitives.py"
    gloo = launch(script, nproc, backend="gloo", display="none", hang_timeout=60, timeout=300)
    assert gloo.ok, gloo.summary()
    nccl = launch(script, nproc, backend="nccl", display="none", hang_timeout=60, timeout=300)
    assert nccl.ok, nccl.summary()
    want, got = _by_rank_and_op(gloo), _by_rank_and_op(nccl)
    assert len(want) >= 15 * nproc  # every primitive reported on every rank
    assert sorted(got) == sorted(want)
    different = {k: (want[k], got[k]) for k in want if want[k] != got[k]}
    assert not different, f"NCCL differs from gloo: {different}"
    # The barrier on NCCL also lets no rank leave before the last one arrived.
    barrier = [r for r in nccl.records if r.get("op") == "barrier"]
    assert len(barrier) == nproc
    last_arrival = max(r["arrived_s"] for r in barrier)
    assert all(r["left_s"] >= last_arrival - 0.02 for r in barrier), barrier


# ------------------------------------------------------------------ a hang on NCCL

HANG_SCRIPT = """
import time

import torch
import torch.distributed as dist

from labutils.dist import init, report

rank, world_size, device = init()
t = torch.ones(1, device=device)
dist.all_reduce(t)                      # both ranks: the group works
torch.cuda.synchronize()
report(silent_from=time.time())
if rank == 0:
    dist.all_reduce(t)                  # only rank 0 calls it; NCCL returns once it is queued
    dist.barrier()                      # rank 0 blocks here, behind that all_reduce
    torch.cuda.synchronize()
else:
    time.sleep(600)                     # rank 1 never comes: the straggler
"""


@needs_gpus(2, nccl=True)
def test_hang_on_nccl_names_the_straggler_and_leaves_no_process(runs_dir, write_script):
    script = write_script("hang_nccl.py", HANG_SCRIPT)
    lines = HANG_SCRIPT.splitlines()  # the file has these lines, a blank one first

    def line(marker: str) -> int:
        return next(i + 1 for i, text in enumerate(lines) if marker in text)

    sleep_line = line("time.sleep(600)")
    # rank 0's own lines: its all_reduce, the barrier, the synchronize after it
    rank0_lines = {line("only rank 0 calls it"), line("dist.barrier()"), line("dist.barrier()") + 1}
    t0 = time.monotonic()
    result = launch(script, 2, backend="nccl", display="none", hang_timeout=5, timeout=240)
    assert result.reason == "hang" and not result.ok, result.summary()
    assert time.monotonic() - t0 < 120
    hang = result.hang
    assert sorted(hang.waiting) == [0, 1], hang.waiting
    assert hang.waiting[1].endswith(f"hang_nccl.py:{sleep_line}"), hang.waiting
    # Where rank 0 sits depends on when NCCL blocks the CPU; it is one of its own lines.
    at0 = hang.waiting[0]
    assert "hang_nccl.py:" in at0 and int(at0.rsplit(":", 1)[1]) in rank0_lines, hang.waiting
    assert hang.stragglers == [1], (hang.stragglers, hang.explanation, hang.stacks)
    _assert_ranks_gone(result)


# ------------------------------------------------------------------ a lesson notebook on CUDA

@needs_gpus(1)
def test_lesson00_notebook_runs_with_the_gpus_visible(runs_dir, tmp_path):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(LESSONS / "00_first_distributed_run.ipynb", as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(
        "import torch\nprint('gpus seen by the kernel:', torch.cuda.device_count())"))
    km = this_python_kernel(tmp_path, "course")
    client = NotebookClient(nb, km=km, timeout=600, resources={"metadata": {"path": str(LESSONS)}})
    try:
        client.execute(env={**os.environ})  # raises CellExecutionError on the first failing cell
    finally:
        if km.has_kernel:  # a kernel manager passed in is not shut down by nbclient
            km.shutdown_kernel(now=True)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
    last = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    assert f"gpus seen by the kernel: {GPUS}" in last


# ------------------------------------------------------------------ one-GPU parts of lessons 06 and 10

@needs_gpus(1)
def test_lesson06_cuda_autocast_puts_softmax_sum_and_layer_norm_in_float32():
    """Lesson 06's claim about CUDA's autocast lists, measured next to CPU's."""
    from labutils.course import lesson

    lesson06 = lesson.load(LESSONS / "06_production_patterns", "lesson06")
    linear, x, ops = autocast_problem()
    cpu = lesson06.autocast_dtypes("cpu", linear, x, ops)
    cuda = lesson06.autocast_dtypes("cuda", linear, x, ops)
    print(lesson06.autocast_comparison(linear, x, ops))  # kept in the log: the whole table
    assert cpu["Linear (a matmul)"] == cuda["Linear (a matmul)"] == "bfloat16"
    for op in ("softmax", "log_softmax", "sum", "layer_norm"):
        assert (cpu[op], cuda[op]) == ("bfloat16", "float32"), op
    for op in ("cross_entropy", "mse_loss"):
        assert cpu[op] == cuda[op] == "float32", op


@needs_gpus(1, nccl=True)
def test_lesson10_inductor_on_one_gpu_writes_triton_and_equals_eager_ddp(runs_dir):
    """Lesson 10's GPU cell: compile_ddp.py's part 2 on one rank with the GPU."""
    from labutils.course import lesson

    lesson10 = lesson.load(LESSONS / "10_current_stack", "lesson10")
    result = launch(LESSONS / "10_current_stack" / "compile_ddp.py", 1, args=["--inductor-only"],
                    display="none", hang_timeout=300, timeout=540)
    assert result.ok, result.summary()
    for line in (lesson10.equivalence_lines(result), lesson10.exactness_line(result),
                 lesson10.compile_time_table(result), lesson10.kernels_line(result)):
        print(line)
    same = next(r for r in result.records if r.get("part") == "equivalence")
    assert same["losses"] == same["weights"] == "equal (assert_close)", same
    kernels = next(r for r in result.records if r.get("part") == "kernels")
    assert kernels["device"] == "cuda" and kernels["triton"] > 0 and kernels["cpp"] == 0, kernels
    assert not [r for r in result.records if r.get("part") == "graphs"]  # part 1 skipped


@needs_gpus(1)
def test_lesson12_memory_snapshot_on_one_gpu_matches_the_formulas(runs_dir):
    """Lesson 12's GPU cell: the caching allocator's readings of one Adam step, and a
    snapshot written next to the rank's logs."""
    import pickle

    from labutils.course import lesson

    lesson12 = lesson.load(LESSONS / "12_where_memory_goes", "lesson12")
    result = launch(LESSONS / "12_where_memory_goes" / "snapshot.py", 1, display="none",
                    hang_timeout=120, timeout=300)
    assert result.ok, result.summary()
    print(lesson12.snapshot_table(result))
    claims = lesson12.snapshot_claims(result)
    print(claims)
    snap = next(r for r in result.records if r.get("part") == "snapshot")
    print("live blocks at the end (bytes, count):", snap["live_blocks"][:8])
    assert "False" not in claims
    with open(snap["path"], "rb") as f:
        data = pickle.load(f)
    assert data["segments"] and data["device_traces"]


# ------------------------------------------------------------------ lesson 11 on NCCL

LESSON11 = LESSONS / "11_parallelism_in_several_dimensions"


@needs_gpus(2, nccl=True)
def test_lesson11_splits_on_nccl_equal_one_process_and_count_the_same_collectives(runs_dir):
    """Tensor, sequence, expert and context parallelism and the pipeline schedules, one
    GPU per rank: the same equalities and collective counts as on CPU. (The saved-bytes
    arithmetic is left out: CUDA's attention kernels keep other tensors for backward.)"""
    from labutils.course import lesson

    L = lesson.load(LESSON11, "lesson11")
    runs = {name: launch(LESSON11 / f"{name}.py", 2, backend="nccl", display="none",
                         hang_timeout=120, timeout=300)
            for name in ("tp_block", "moe", "ring_attention", "pipeline")}
    for name, result in runs.items():
        assert result.ok, f"{name}: {result.summary()}"
    print(L.tp_equality_table(runs["tp_block"]), L.tp_collectives_table(runs["tp_block"]), sep="\n")
    assert L.tp_claims(runs["tp_block"]).count(": True") == 4, L.tp_claims(runs["tp_block"])
    assert all(r["equal"] for r in runs["tp_block"].records if r.get("part") == "way")
    for name, claims in (("moe", L.moe_claims), ("ring_attention", L.ring_claims),
                         ("pipeline", L.pipeline_claims)):
        said = claims(runs[name])
        print(said)
        assert ": False" not in said, f"{name}: {said}"


@needs_gpus(4, nccl=True)
def test_lesson11_fsdp_and_tp_on_a_2x2_mesh_of_gpus(runs_dir):
    from labutils.course import lesson

    L = lesson.load(LESSON11, "lesson11")
    result = launch(LESSON11 / "fsdp_tp.py", 4, backend="nccl", display="none", hang_timeout=120,
                    timeout=300)
    assert result.ok, result.summary()
    print(L.mesh_table(result))
    assert ": False" not in L.mesh_claims(result), L.mesh_claims(result)
