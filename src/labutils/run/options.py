"""Every launch option in one table, and what is built from it.

Each row of OPTIONS is one keyword argument of launch() with its default and the
command-line flags that set it. From the table come:

- add_launch_arguments(parser): the flags of `labutils launch`, and with magic=True
  those %%torchrun offers;
- launch_kwargs(ns): launch()'s keyword arguments from what such a parser parsed;
- node_words(**values): the inverse, the `labutils launch` words for launch() values,
  for the commands that run one node of a job elsewhere (a virtual host, a pod, a
  SLURM node);
- command_line_error(exc): launch()'s one-line error in the words of the flags.

A new option is one row here and one parameter of launch(); tests/run/test_options.py
checks that the table's names and defaults are launch()'s own.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from labutils.errors import InputError, LaunchConfigError, in_flag_words
from labutils.run.spec import BACKENDS

REQUIRED = inspect.Parameter.empty  # the default of an argument launch() requires (script)

# The CLI's argument groups: title and description, in the order `--help` shows them.
GROUPS = {
    "node": ("one node of a job across machines",
             "run the same command on every machine with its own --node-rank; with a log "
             "folder the machines share, each node shows every rank"),
    "scheduler": ("through a scheduler",
                  "submit the run as a batch job of --nnodes nodes x -n ranks and follow it "
                  "here; stop, Ctrl-C, timeout and hang cancel it"),
    "fault": ("fault injection",
              "kill something at a step the script reports with "
              "labutils.dist.report(step=...); needs --max-restarts >= 1"),
}


@dataclass(frozen=True)
class Flag:
    """One command-line flag: what argparse's add_argument is given."""

    names: tuple[str, ...]  # ("-n", "--nproc"), or ("script",) for a positional
    help: str
    type: Callable[[str], object] = str
    default: object = None  # parsed value when absent (one-flag options: the option's default)
    choices: tuple | None = None
    metavar: str | None = None
    exclusive: bool = False  # one of its option's mutually exclusive flags
    action: str | None = None  # argparse's action, e.g. "store_true" (then no type)

    @property
    def dest(self) -> str:
        """The namespace attribute argparse stores it in."""
        return self.names[-1].lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class Option:
    """One keyword argument of launch(), and the flags that set it."""

    name: str  # launch()'s keyword
    default: object  # launch()'s default
    flags: tuple[Flag, ...] = ()  # none: launch() only, or (args) the words after --
    group: str | None = None  # the CLI's argument group (GROUPS); None: the main list
    magic: bool = False  # %%torchrun offers it
    # Composite options: the value from the parsed flags, and the flags for a value.
    # None: the one flag's value, and [flag, value].
    read: Callable[[argparse.Namespace], object] | None = None
    words: Callable[[Any], list] | None = None


def _word(value):
    """A value as a command-line word; any other object (a placeholder a node's shell
    expands, e.g. sbatch's ShellRef) comes back as it is, for its caller to write."""
    return str(value) if isinstance(value, (str, int, float, os.PathLike)) else value


def _hang_timeout_words(value) -> list:
    return ["--hang-timeout", "0" if value is None else _word(value)]


def _nnodes(ns: argparse.Namespace):
    text = str(ns.nnodes)
    return int(text) if text.isdigit() else text


def _rdzv_conf(ns: argparse.Namespace) -> dict | None:
    text = ns.rdzv_conf
    if not text:
        return None
    pairs = [item.partition("=") for item in text.split(",") if item]
    if any(not k or not sep for k, sep, _ in pairs):
        raise LaunchConfigError("--rdzv-conf", expected="KEY=VALUE pairs separated by commas",
                                given=text, fix="pass e.g. --rdzv-conf last_call_timeout=5")
    return {k: v for k, _, v in pairs}


def _rdzv_conf_words(conf: dict) -> list:
    return ["--rdzv-conf", ",".join(f"{k}={v}" for k, v in conf.items())] if conf else []


def _fault(ns: argparse.Namespace) -> dict | None:
    """The fault= argument of launch() from --kill-rank/--kill-agent and --kill-at-step."""
    who = ("rank", ns.kill_rank) if ns.kill_rank is not None else \
        ("agent", ns.kill_agent) if ns.kill_agent is not None else None
    if who is None and ns.kill_at_step is None:
        return None
    if who is None or ns.kill_at_step is None:
        raise LaunchConfigError(
            "fault", expected="--kill-rank R (or --kill-agent A) together with --kill-at-step S",
            given=f"--kill-at-step {ns.kill_at_step}" if who is None else f"--kill-{who[0]} {who[1]}",
            fix="pass both, e.g. --kill-rank 1 --kill-at-step 5 --max-restarts 1")
    text = ns.kill_at_step
    try:
        lo, _, hi = text.partition(":")
        step = (int(lo), int(hi)) if hi else int(lo)
    except ValueError:
        raise LaunchConfigError("--kill-at-step", expected="a step S or a range LO:HI", given=text,
                                fix="pass e.g. --kill-at-step 5 or --kill-at-step 3:8") from None
    fault = {who[0]: who[1], "step": step}
    if isinstance(step, tuple):
        fault["seed"] = ns.fault_seed
    return fault


def _fault_words(fault) -> list:
    keys = set(fault) if isinstance(fault, dict) else set()
    if len(keys & {"rank", "agent"}) != 1 or "step" not in keys \
            or keys - {"rank", "agent", "step", "seed"}:
        raise LaunchConfigError(
            "fault", expected="one {'rank': R, 'step': S} or {'agent': A, 'step': S} fault "
            "(the command line takes no list of faults and no phase)", given=fault,
            fix="pass one fault, e.g. fault={'rank': 1, 'step': 5}")
    who = "rank" if "rank" in keys else "agent"
    step = fault["step"]
    words = [f"--kill-{who}", _word(fault[who]), "--kill-at-step",
             f"{step[0]}:{step[1]}" if isinstance(step, (tuple, list)) else _word(step)]
    if fault.get("seed", 0) != 0:
        words += ["--fault-seed", _word(fault["seed"])]
    return words


_SLURM_FLAGS = {"partition": "--partition", "time_limit": "--time-limit"}


def _slurm(ns: argparse.Namespace) -> dict | None:
    slurm = {key: getattr(ns, key) for key in _SLURM_FLAGS if getattr(ns, key) is not None}
    if ns.scheduler is None and slurm:
        raise LaunchConfigError("--partition/--time-limit", expected="--scheduler slurm with them",
                                given=slurm, fix="add --scheduler slurm")
    return slurm or None


def _slurm_words(slurm) -> list:
    if not isinstance(slurm, dict) or set(slurm) - set(_SLURM_FLAGS):
        raise LaunchConfigError(
            "slurm", expected=f"a dict with keys among {', '.join(_SLURM_FLAGS)} (the command "
            "line's --partition and --time-limit)", given=slurm,
            fix='pass e.g. slurm={"partition": "debug", "time_limit": "00:10:00"}')
    return [word for key, value in slurm.items() for word in (_SLURM_FLAGS[key], _word(value))]


# launch()'s keywords, in the order `labutils launch --help` lists their flags.
OPTIONS: tuple[Option, ...] = (
    Option("script", REQUIRED, (Flag(("script",), "the training script (.py)"),)),
    Option("nproc", 2, (Flag(("-n", "--nproc"), "ranks per agent; with one agent, on this "
                             "machine (default 2)", int),), magic=True),
    Option("args", ()),  # the words after --
    Option("hang_timeout", 30.0,
           (Flag(("--hang-timeout",), "seconds without progress before a hang is reported "
                 "(0: never; default 30)", float),),
           magic=True, read=lambda ns: ns.hang_timeout or None, words=_hang_timeout_words),
    Option("timeout", None, (Flag(("--timeout",), "wall-clock limit in seconds (default: none)",
                                  float),),
           magic=True),
    Option("max_restarts", 0, (Flag(("--max-restarts",), "torchrun restarts after a failure",
                                    int),), magic=True),
    Option("nnodes", 1, (Flag(("--nnodes",), "torchrun --nnodes, N or MIN:MAX; the nodes are "
                              "agents on this machine joining one c10d rendezvous (default 1)"),),
           read=_nnodes),
    Option("local_agents", None, (Flag(("--local-agents",), "agents started on this machine, "
                                       "each with -n ranks (default: MAX)", int),)),
    Option("rdzv_conf", None, (Flag(("--rdzv-conf",), "rendezvous settings KEY=VALUE,... e.g. "
                                    "last_call_timeout=5"),),
           read=_rdzv_conf, words=_rdzv_conf_words),
    Option("node_rank", None, (Flag(("--node-rank",), "this machine's node rank, 0..N-1 "
                                    "(static rendezvous)", int),), group="node"),
    Option("rdzv_endpoint", None, (Flag(("--rdzv-endpoint",), "where the nodes meet: node 0's "
                                        "address and a free port", metavar="HOST:PORT"),),
           group="node"),
    Option("rdzv_id", None, (Flag(("--rdzv-id",), "the job's name, the same on every node "
                                  "(names the run folder)", metavar="ID"),), group="node"),
    Option("scheduler", None, (Flag(("--scheduler",), "slurm: sbatch, then follow the job (the "
                                    "run folder must be shared)", choices=("slurm",)),),
           group="scheduler"),
    Option("slurm", None, (
        Flag(("--partition",), "SLURM partition (default: the cluster's)"),
        Flag(("--time-limit",), "SLURM time limit (default 00:30:00)", metavar="HH:MM:SS"),
    ), group="scheduler", read=_slurm, words=_slurm_words),
    Option("fault", None, (
        Flag(("--kill-rank",), "SIGKILL this rank inside its report(step=STEP) in the first "
             "attempt", int, exclusive=True),
        Flag(("--kill-agent",), "SIGKILL this agent and its ranks when one of them reports STEP "
             "(a node leaves; needs --nnodes MIN:MAX with several agents)", int, exclusive=True),
        Flag(("--kill-at-step",), "the step, or LO:HI for a step drawn with --fault-seed",
             metavar="STEP"),
        Flag(("--fault-seed",), "seed for a LO:HI step (default 0)", int, default=0),
    ), group="fault", read=_fault, words=_fault_words),
    Option("backend", "auto", (Flag(("--backend",), "nccl with a GPU per rank, else gloo "
                                    "(default auto)", choices=BACKENDS),), magic=True),
    Option("log_dir", None, (Flag(("--log-dir",), "where run folders go (default ./runs)"),),
           magic=True),
    Option("warm", True, (Flag(("--cold",), "start cold: a new interpreter for the agent and "
                               "every rank, not forks of this caller's warm server",
                               action="store_true", default=False),),
           magic=True, read=lambda ns: not ns.cold, words=lambda warm: [] if warm else ["--cold"]),
    Option("display", "auto"),  # the CLI always shows text; %%torchrun has its own --display
    Option("env", None),
)
BY_NAME = {option.name: option for option in OPTIONS}


def add_launch_arguments(parser: argparse.ArgumentParser, *, magic: bool = False) -> None:
    """Add the launch options' flags to parser, in the groups `labutils launch --help` shows.

    Args:
        parser: the `labutils launch` parser, or %%torchrun's.
        magic: only the options %%torchrun offers (no script: the cell is the script).
    """
    chosen = [o for o in OPTIONS if o.flags and (o.magic or not magic)]
    groups = {name: parser.add_argument_group(*GROUPS[name])
              for name in GROUPS if any(o.group == name for o in chosen)}
    for option in chosen:
        where = groups[option.group] if option.group else parser
        exclusive: argparse._MutuallyExclusiveGroup | None = None
        for flag in option.flags:
            if flag.exclusive and exclusive is None:
                exclusive = where.add_mutually_exclusive_group()
            default = option.default if len(option.flags) == 1 else flag.default
            settings: dict[str, Any]
            settings = {"help": flag.help, "type": flag.type, "default": default,
                        "choices": flag.choices, "metavar": flag.metavar, "action": flag.action}
            if flag.action:
                settings.update(type=None, default=flag.default)
            # an exclusive flag's group was made above
            target = cast(argparse._MutuallyExclusiveGroup, exclusive) if flag.exclusive else where
            target.add_argument(
                *flag.names, **{k: v for k, v in settings.items() if v not in (None, REQUIRED)})


def launch_kwargs(ns: argparse.Namespace) -> dict:
    """launch()'s keyword arguments from a namespace add_launch_arguments' flags filled in.

    Only the options whose flags the parser had; args from ns.script_args when it is
    there (the CLI puts the words after -- in it). Bad combinations of flags raise
    LaunchConfigError, one line.

    Args:
        ns: the parsed command line.
    """
    kwargs = {o.name: o.read(ns) if o.read else getattr(ns, o.flags[0].dest)
              for o in OPTIONS if o.flags and hasattr(ns, o.flags[0].dest)}
    if hasattr(ns, "script_args"):
        kwargs["args"] = list(ns.script_args)
    return kwargs


def node_words(**values) -> list:
    """The `labutils launch` words for launch() keyword values: "launch", the flags of
    each value that differs from launch()'s default, the script, then -- and args.

    The inverse of launch_kwargs: parsing the words gives the values back. A value
    given as text for a number (e.g. node_rank="$(RANK)") or as another object (e.g.
    sbatch's ShellRef) is a placeholder the node fills in: written as it is.

    Args:
        values: launch()'s keyword arguments; script is required.
    """
    unknown = sorted(set(values) - set(BY_NAME))
    if unknown or "script" not in values:
        raise LaunchConfigError("node_words", expected="launch()'s keyword arguments, script among "
                                "them", given=unknown or sorted(values),
                                fix='pass e.g. node_words(script="train.py", nproc=2)')
    words = ["launch"]
    for option in OPTIONS:
        value = values.get(option.name, option.default)
        if option.name in ("script", "args") or value == option.default:
            continue
        if not option.flags:
            raise LaunchConfigError(option.name, expected="the default: `labutils launch` has "
                                    "no flag for it", given=value,
                                    fix=f"leave {option.name} out of a node's command")
        words += option.words(value) if option.words else [option.flags[0].names[0], _word(value)]
    args = [_word(a) for a in values.get("args", ())]
    return [*words, _word(values["script"]), *(["--", *args] if args else [])]


def split_script_args(words: list[str]) -> tuple[list[str], list[str]]:
    """(options, script arguments): everything after the first -- belongs to the script.

    Args:
        words: a command line without the program's name.
    """
    if "--" not in words:
        return list(words), []
    cut = words.index("--")
    return list(words[:cut]), list(words[cut + 1:])


def _flag_names(option: Option) -> str:
    """The flags that set an option, as one word: "-n/--nproc", "--kill-rank/--kill-agent"."""
    if len(option.flags) == 1:
        return "/".join(option.flags[0].names)
    return "/".join(flag.names[-1] for flag in option.flags if flag.exclusive) or option.flags[0].names[-1]


# argparse's messages (Python 3.10 to 3.13), read by parser_error_line.
_ARGUMENT = re.compile(r"argument (?P<names>.+?): (?P<what>.*)$", re.S)
_INVALID = re.compile(r"invalid (?P<type>\w+) value: (?P<got>.*)$", re.S)
_CHOICE = re.compile(r"invalid choice: (?P<got>'.*?'|\S+)(?: \(choose from .*\))?$", re.S)
_REQUIRED = re.compile(r"the following arguments are required: (?P<names>.*)$", re.S)
_KINDS = {"int": "a whole number", "float": "a number"}


def parser_error_line(parser: argparse.ArgumentParser, message: str, *, help_says: str,
                      words: list[str] | None = None) -> str:
    """argparse's error for a command line as one line: what was expected, what came,
    and how to go on (the flag's help, the nearest choice, the usage). No usage block.

    Args:
        parser: the parser (or subcommand's parser) that refused the line.
        message: what argparse passed to its error().
        help_says: where the options are listed, e.g. "--help" or "%%torchrun?".
        words: the command line, when known: a positional argument missing because an
            option took it as its value (`--json train.py`) is then named.
    """
    import difflib

    message = " ".join(message.split())
    required = _REQUIRED.match(message)
    if required:
        needed = [f"{a.option_strings[-1]} {_shown(a)}" for a in parser._actions
                  if a.option_strings and a.required]
        positionals = [_shown(a) for a in parser._actions
                       if not a.option_strings and a.help != argparse.SUPPRESS]
        usage = " ".join([parser.prog, *needed, "[options]", *positionals])
        return (f"expected {required['names']}, got none{_taken(parser, words)}; usage: {usage}; "
                f"{_where(parser, help_says)} lists the options")
    argument = _ARGUMENT.match(message)
    action = None if argument is None else next(
        (a for a in parser._actions if argument["names"] in ("/".join(a.option_strings), a.metavar, a.dest)),
        None)
    if argument is None or action is None:
        return f"{message}; {_where(parser, help_says)} lists the options"
    names, what = argument["names"], argument["what"]
    said = f"{help_says} says: {action.help}" if action.help else \
        f"{_where(parser, help_says)} lists the options"
    invalid, choice = _INVALID.match(what), _CHOICE.match(what)
    if invalid:
        return f"{names}: expected {_KINDS.get(invalid['type'], 'a valid value')}, got {invalid['got']}; {said}"
    if choice:
        among = [str(c) for c in action.choices or ()]
        near = difflib.get_close_matches(choice["got"].strip("'"), among, n=1, cutoff=0.6)
        fix = f"did you mean {near[0]}?" if near else said
        return f"{names}: expected one of {', '.join(among)}, got {choice['got']}; {fix}"
    if what.startswith("expected") and "argument" in what:  # "expected one argument"
        return f"{names}: expected a value after it, got none; e.g. {action.option_strings[-1]} " \
               f"{_shown(action)}; {said}"
    return f"{names}: {what}; {said}"


def _taken(parser: argparse.ArgumentParser, words: list[str] | None) -> str:
    """" (--json took 'train.py' as its value)" when an option of the parser that takes a
    value was given a .py file; "" otherwise."""
    takes = {name for a in parser._actions if a.nargs != 0 for name in a.option_strings}
    for before, word in zip(words or [], (words or [])[1:]):
        if before in takes and word.endswith(".py"):
            return f" ({before} took {word!r} as its value)"
    return ""


def _where(parser: argparse.ArgumentParser, help_says: str) -> str:
    """Where the options are listed: "labutils grade --help", "%%torchrun?"."""
    return f"{parser.prog} {help_says}" if help_says.startswith("-") else help_says


def _shown(action: argparse.Action) -> str:
    """An argument as a usage line shows it: its metavar, else its name in capitals for
    an option, as it is for a positional; "..." after one that takes several."""
    name = str(action.metavar) if action.metavar else \
        action.dest.upper() if action.option_strings else action.dest
    return f"{name} ..." if action.nargs in ("+", "*", argparse.REMAINDER) else name


def command_line_error(exc: InputError) -> str:
    """launch()'s one-line error in the words of `labutils launch`'s and %%torchrun's
    flags (errors.in_flag_words): `-n/--nproc 2`, not `nproc=2`.

    Args:
        exc: what launch() raised for a value the parsed flags gave it.
    """
    chosen = [o for o in OPTIONS if o.flags and o.name != "script"]
    return in_flag_words(
        exc, {o.name: _flag_names(o) for o in chosen},
        helps={o.name: o.flags[0].help for o in chosen if len(o.flags) == 1},
        bare=("nproc", "nnodes"),
        parts={"rank": "--kill-rank", "agent": "--kill-agent", "step": "--kill-at-step"},
        default=f"see {GROUPS['fault'][0]} in labutils launch --help")
