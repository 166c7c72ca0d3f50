"""The one table of launch options: launch()'s signature, the CLI and the node commands
agree with it (no torchrun runs: pure tables of good and bad inputs)."""

from __future__ import annotations

import inspect
import re

import pytest

import labutils
from labutils.errors import LaunchConfigError, whole_number
from labutils.notebook import magics
from labutils.cli import build_parser, main
from labutils.run.options import OPTIONS, command_line_error, launch_kwargs, node_words, split_script_args


def parse(words: list[str]) -> dict:
    """launch()'s keyword arguments from `labutils launch` words, as the CLI reads them."""
    argv, script_args = split_script_args(words)
    ns = build_parser().parse_args(argv)
    ns.script_args = script_args
    return launch_kwargs(ns)


CLI_DEFAULTS = {o.name: o.default for o in OPTIONS if o.flags} | {"args": []}


def test_the_table_is_launch_signature():
    params = inspect.signature(labutils.launch).parameters
    assert {o.name for o in OPTIONS} == set(params)
    assert {o.name: o.default for o in OPTIONS} == {n: p.default for n, p in params.items()}


def test_the_magic_offers_the_options_marked_for_it():
    opts = magics.parse_line("")
    offered = {o.name for o in OPTIONS if o.magic}
    assert offered == {"nproc", "hang_timeout", "timeout", "max_restarts", "backend", "log_dir",
                       "warm"}
    assert {"out", "display", "args", "cold"} | offered - {"warm"} == set(vars(opts))
    assert {k: v for k, v in launch_kwargs(opts).items() if k in offered} == \
        {o.name: o.default for o in OPTIONS if o.magic}
    assert launch_kwargs(magics.parse_line("--cold"))["warm"] is False


@pytest.mark.parametrize("kwargs", [
    {"script": "train.py"},
    {"script": "train.py", "nproc": 4, "args": ["--epochs", "2", "--name", "a b", "-x"]},
    {"script": "/abs/t.py", "backend": "gloo", "hang_timeout": None, "timeout": 12.5,
     "max_restarts": 2, "log_dir": "/shared/runs"},
    {"script": "t.py", "hang_timeout": 7.5, "max_restarts": 1, "fault": {"rank": 1, "step": 5}},
    {"script": "t.py", "max_restarts": 1, "fault": {"rank": 0, "step": (3, 8), "seed": 4}},
    {"script": "t.py", "max_restarts": 1, "fault": {"rank": 0, "step": (3, 8), "seed": 0}},
    {"script": "t.py", "nnodes": "1:2", "local_agents": 2, "max_restarts": 1,
     "fault": {"agent": 1, "step": 2}, "rdzv_conf": {"last_call_timeout": "5", "join_timeout": "30"}},
    {"script": "t.py", "nnodes": 2, "node_rank": 1, "rdzv_endpoint": "node0:29500",
     "rdzv_id": "job-1"},
    {"script": "t.py", "nnodes": 2, "scheduler": "slurm",
     "slurm": {"partition": "debug", "time_limit": "00:10:00"}},
    {"script": "t.py", "scheduler": "slurm"},
])
def test_node_words_parse_back_to_the_same_launch_arguments(kwargs):
    assert parse(node_words(**kwargs)) == {**CLI_DEFAULTS, **kwargs}


def test_node_words_name_only_what_differs_from_the_default():
    assert node_words(script="t.py") == ["launch", "t.py"]
    defaults = {o.name: o.default for o in OPTIONS if o.name != "script"}
    assert node_words(script="t.py", **defaults) == ["launch", "t.py"]
    assert node_words(script="t.py", nproc=4, hang_timeout=None, args=["--steps", "3"]) == \
        ["launch", "-n", "4", "--hang-timeout", "0", "t.py", "--", "--steps", "3"]


def test_placeholders_are_written_as_they_are():
    marker = object()  # e.g. sbatch's ShellRef, which the batch script writes in quotes
    words = node_words(script="t.py", node_rank="$(RANK)", nnodes=marker,
                       rdzv_endpoint="$(MASTER_ADDR):$(MASTER_PORT)", rdzv_id="j")
    assert words[words.index("--node-rank") + 1] == "$(RANK)"
    assert words[words.index("--nnodes") + 1] is marker


@pytest.mark.parametrize(("values", "message"), [
    ({"fault": [{"rank": 0, "step": 1}]}, "fault: expected one {'rank': R, 'step': S}"),
    ({"fault": {"rank": 0, "step": 1, "phase": "save"}}, "no phase"),
    ({"slurm": {"gpus_per_node": 2}}, "slurm: expected a dict with keys among partition, time_limit"),
    ({"env": {"A": "1"}}, "env: expected the default: `labutils launch` has no flag for it"),
    ({"display": "text"}, "display: expected the default"),
    ({"nprocs": 2}, "node_words: expected launch()'s keyword arguments"),
])
def test_values_the_command_line_cannot_say_are_one_line_errors(values, message):
    with pytest.raises(LaunchConfigError) as info:
        node_words(**{"script": "t.py", **values})
    assert message in str(info.value) and "\n" not in str(info.value)


def test_node_words_need_the_script():
    with pytest.raises(LaunchConfigError, match="script among them"):
        node_words(nproc=2)


@pytest.mark.parametrize(("argv", "message"), [
    (["--kill-rank", "1"], "fault: expected --kill-rank R (or --kill-agent A) together with "
     "--kill-at-step S, got '--kill-rank 1'"),
    (["--kill-at-step", "5"], "got '--kill-at-step 5'"),
    (["--kill-agent", "1", "--kill-at-step", "x"], "--kill-at-step: expected a step S or a range LO:HI"),
    (["--rdzv-conf", "oops"], "--rdzv-conf: expected KEY=VALUE pairs separated by commas"),
    (["--partition", "debug"], "--partition/--time-limit: expected --scheduler slurm with them"),
])
def test_bad_combinations_of_flags_are_one_line_errors(argv, message, capsys):
    with pytest.raises(LaunchConfigError) as info:
        parse(["launch", *argv, "t.py"])
    assert message in str(info.value) and "\n" not in str(info.value)
    assert main(["launch", *argv, "t.py"]) == 2  # before anything starts
    assert capsys.readouterr().err.splitlines() == [f"labutils launch: {command_line_error(info.value)}"]


@pytest.mark.parametrize(("argv", "said"), [
    (["-n", "0"], "-n/--nproc: expected a whole number of ranks >= 1, got 0; pass e.g. -n/--nproc 2 "
     "(one process per rank)"),
    (["--hang-timeout", "-1"], "--hang-timeout: expected a number >= 0.5, got -1.0; --help says: "
     "seconds without progress before a hang is reported (0: never; default 30)"),
    (["--max-restarts", "-1"], "--max-restarts: expected a whole number >= 0, got -1; pass "
     "--max-restarts 0 to fail on the first error"),
    (["--kill-rank", "1", "--kill-at-step", "3"], "--kill-rank/--kill-agent: expected --max-restarts >= 1"),
    (["--kill-rank", "5", "--kill-at-step", "3", "--max-restarts", "1"],
     "--kill-rank: expected a rank in 0..1, got 5; see fault injection in labutils launch --help"),
    (["--local-agents", "3"], "(--nnodes 1), got 3"),
])
def test_launch_errors_on_the_command_line_name_its_flags(argv, said, tmp_path, capsys):
    """launch() checks the values the flags gave it; the CLI says what is wrong in the
    words of the flags, not launch()'s keywords (`nproc=2`) or Python's `None`."""
    script = tmp_path / "t.py"
    script.write_text("print('never runs')\n")
    assert main(["launch", *argv, str(script)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("labutils launch: ") and said in err[0], err
    assert not re.search(r"\b(nproc|max_restarts|local_agents|nnodes|fault)\b=|None", err[0])


@pytest.mark.parametrize("argv", [["t.py", "--epochs", "3"], ["-n", "2", "t.py", "3", "-n", "2"]])
def test_script_arguments_without_the_separator_are_a_one_line_error(argv, capsys):
    """`torchrun train.py --epochs 3` takes the script's arguments as they come;
    `labutils launch` wants them after --, and says so before anything starts."""
    assert main(["launch", *argv]) == 2
    extra = "--epochs 3" if "--epochs" in argv else "3"
    assert capsys.readouterr().err.splitlines() == [
        f"labutils launch: unrecognized arguments: {extra}; the script's own arguments go after "
        f"--: labutils launch [options] t.py -- {extra}"]


@pytest.mark.parametrize(("argv", "said"), [
    (["--nprocs", "2", "t.py"], "unrecognized arguments: --nprocs t.py; --nprocs is no option of "
     "labutils launch; did you mean --nproc or --nnodes? labutils launch --help lists them"),
    (["--timout=5", "t.py"], "did you mean --timeout or --hang-timeout?"),
    (["-x", "t.py"], "-x is no option of labutils launch; labutils launch --help lists them"),
])
def test_an_unknown_option_is_one_line_with_the_nearest_ones(argv, said, capsys):
    assert main(["launch", *argv]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("labutils launch: ") and said in err[0], err
    assert "after --" not in err[0]


@pytest.mark.parametrize(("argv", "said"), [
    (["launch", "-n", "two", "t.py"], "labutils launch: -n/--nproc: expected a whole number, got "
     "'two'; --help says: ranks per agent; with one agent, on this machine (default 2)"),
    (["launch", "--timeout", "soon", "t.py"], "labutils launch: --timeout: expected a number, got 'soon'"),
    (["launch", "--backend", "mpi", "t.py"], "labutils launch: --backend: expected one of auto, gloo, "
     "nccl, got 'mpi'; --help says: nccl with a GPU per rank"),
    (["launch", "--backend", "ncl", "t.py"], "got 'ncl'; did you mean nccl?"),
    (["launch", "t.py", "--timeout"], "labutils launch: --timeout: expected a value after it, got "
     "none; e.g. --timeout TIMEOUT; --help says: wall-clock limit"),
    # an option that takes a value took the script
    (["launch", "-n", "2", "--json", "t.py"], "labutils launch: expected script, got none (--json "
     "took 't.py' as its value); usage: labutils launch [options] script; labutils launch --help "
     "lists the options"),
    (["launch", "--cold=yes", "t.py"], "labutils launch: --cold: ignored explicit argument 'yes'"),
    (["lanch", "t.py"], "labutils: command: expected one of launch, doctor, grade, debug, release, "
     "wrongfixes, autograder, export, k8s, slurm, got 'lanch'; did you mean launch?"),
    ([], "labutils: expected command, got none; usage: labutils [options] command"),
    (["grade", "labs/01"], "labutils grade: expected SUBMISSION, got none; usage: labutils grade "
     "[options] lab SUBMISSION ...; labutils grade --help lists the options"),
    (["export", "grades"], "usage: labutils export --roster ROSTER --assignment ASSIGNMENT [options] grades"),
    (["doctor", "--jsn"], "labutils doctor: unrecognized arguments: --jsn; --jsn is no option of "
     "labutils doctor; did you mean --json? labutils doctor --help lists them"),
])
def test_what_argparse_refuses_is_one_line_too(argv, said, capsys):
    """A value of the wrong type or outside the choices, a missing value or argument, a
    misspelt command: one line with what was expected and how to go on, no usage block."""
    try:
        code = main(argv)
    except SystemExit as done:  # argparse's own refusals end in the parser's error()
        code = done.code
    assert code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and said in err[0], err


def test_help_is_still_the_whole_usage(capsys):
    with pytest.raises(SystemExit) as done:
        main(["launch", "--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("usage: labutils launch [-h] [-n NPROC]")


def test_kill_rank_and_kill_agent_exclude_each_other(capsys):
    with pytest.raises(SystemExit):
        parse(["launch", "--kill-rank", "1", "--kill-agent", "1", "t.py"])
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize(("words", "expected"), [
    ([], ([], [])),
    (["-n", "2", "t.py"], (["-n", "2", "t.py"], [])),
    (["t.py", "--", "--lr", "0.1", "--", "x"], (["t.py"], ["--lr", "0.1", "--", "x"])),
])
def test_split_script_args(words, expected):
    assert split_script_args(words) == expected


@pytest.mark.parametrize(("value", "expected"), [
    (0, True), (7, True), (-3, True), (True, False), (False, False), (2.0, False), ("2", False),
    (None, False),
])
def test_whole_number(value, expected):
    assert whole_number(value) is expected
