"""The hang report: where each rank waits, and which rank is the straggler.

When no rank has made progress for hang_timeout, the launcher asks each live rank for
its Python stack (faulthandler on SIGUSR1, which works while the rank is blocked inside
gloo or NCCL). analyse_hang() finds the line of the learner's script each rank waits
on and the collective it waits in, and names the straggler: the rank whose position
differs from the others'. A crash's faulthandler dump (run/crash.py) is read with the
same parser.
"""

from __future__ import annotations

import linecache
import os
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from labutils.runtime.frames import DUMP_THREAD, Frame, dump_frames, learners_frame, script_depth
from labutils.runtime.runfiles import is_cell_path, relative_path, short_path

# The module whose outermost frame is the torch.distributed call a script made.
COLLECTIVE_FILES = ("distributed_c10d.py",)
# DDP's own collectives that run in C++ below a Python frame of DDP's: the name a hang
# report gives them, and (file, functions) whose frame shows a rank waits in one.
DDP_COLLECTIVES = {
    "forward": ("nn/parallel/distributed.py", ("_pre_forward", "_sync_buffers", "_sync_module_buffers",
                                               "_default_broadcast_coalesced")),
    "DistributedDataParallel": ("distributed/utils.py", ("_verify_param_shape_across_processes",
                                                          "_sync_module_states", "_sync_params_and_buffers")),
}


def where_text(path: str | None) -> str:
    """A file as a failure or hang report names it: relative to the current folder; a
    notebook cell's file (runfiles.cell_path) by its name, cell-3.py."""
    if not path:
        return "?"
    return os.path.basename(path) if is_cell_path(path) else relative_path(path)


def parse_faulthandler(text: str, main_tid: int | None) -> list[Frame]:
    """The main thread's frames (innermost first) from a faulthandler dump.

    Falls back to the first thread in the dump when main_tid is unknown or absent.
    """
    threads: dict[int, list[Frame]] = {}
    order: list[int] = []
    current: list[Frame] | None = None
    for line in text.splitlines():
        m = DUMP_THREAD.match(line)
        if m:
            tid = int(m["ident"], 16)
            current = threads.setdefault(tid, [])
            if tid in order:  # a later dump of the same thread: keep only the newest
                current.clear()
            else:
                order.append(tid)
            continue
        frame = dump_frames(line)
        if frame and current is not None:
            current.append(frame[0])
    if main_tid is not None and main_tid in threads:
        return threads[main_tid]
    return threads[order[0]] if order else []


def user_frame(frames: list[Frame], script: str | None) -> Frame | None:
    """The learner's line of a stack (frames innermost first; frames.learners_frame),
    else its innermost frame."""
    mine = learners_frame([fr.file for fr in reversed(frames)], script)
    return frames[len(frames) - 1 - mine] if mine is not None else frames[0] if frames else None


def collective_of(frames: list[Frame], at: Frame | None) -> str:
    """The torch.distributed call the rank is inside (closest to the learner's line).

    A rank stuck in backward() waits for DDP's gradient all-reduce (the reducer runs
    it from autograd hooks, out of sight of Python), so backward counts as one; so does
    DDP's forward when the rank waits in its pre-forward step (from the second
    iteration on, the reducer's bucket rebuild broadcasts the new bucket order; with
    buffers, their broadcast), and DDP's constructor in its checks and broadcast of
    the parameters across ranks: those collectives run in C++ too.
    """
    inner = frames[: frames.index(at)] if at is not None and at in frames else frames
    names = [fr.func for fr in inner if fr.file.endswith(COLLECTIVE_FILES)]
    if names:
        return names[-1]
    if any(fr.func == "backward" and "torch" in fr.file for fr in inner):
        return "backward"
    for fr in inner:
        for name, (file, funcs) in DDP_COLLECTIVES.items():
            if fr.file.endswith(file) and fr.func in funcs:
                return name
    return ""


@dataclass
class Hang:
    """A hang report. Unpacks as (stacks, waiting, stragglers)."""

    stacks: dict[int, str]
    waiting: dict[int, str]
    stragglers: list[int]
    calls: dict[int, str] = field(default_factory=dict)      # rank -> collective it waits in
    sources: dict[int, str] = field(default_factory=dict)    # rank -> source of its line
    exited: dict[int, int | None] = field(default_factory=dict)  # ranks already gone
    silent_s: float = 0.0
    explanation: str = ""
    # rank -> how its script ended ("raised ValueError: ... at train.py:9"), for ranks
    # whose script ended while their process runs on (a thread that is not a daemon)
    lingering: dict[int, str] = field(default_factory=dict)

    def __iter__(self):
        return iter((self.stacks, self.waiting, self.stragglers))

    def to_json(self) -> dict:
        return {
            "stacks": {str(r): s for r, s in self.stacks.items()},
            "waiting": {str(r): w for r, w in self.waiting.items()},
            "stragglers": self.stragglers,
            "calls": {str(r): c for r, c in self.calls.items()},
            "exited": {str(r): c for r, c in self.exited.items()},
            "silent_s": round(self.silent_s, 2),
            "explanation": self.explanation,
            "lingering": {str(r): how for r, how in self.lingering.items()},
        }


def analyse_hang(
    dumps: Mapping[int, str | list[Frame]],
    main_tids: dict[int, int | None],
    script: str | None,
    *,
    exited: dict[int, int | None] | None = None,
    silent_s: float = 0.0,
    lingering: dict[int, str] | None = None,
) -> Hang:
    """Turn per-rank faulthandler dumps into waiting lines and stragglers. A rank's dump
    may also be its frames, innermost first (the traceback of the exception it raised as
    the run was stopped). lingering: rank -> how its script ended, for ranks whose
    script ended but whose process runs on."""
    stacks, waiting, calls, sources, frames_of = {}, {}, {}, {}, {}
    near: set[int] = set()
    for rank in sorted(dumps):
        dump = dumps[rank]
        frames = dump if isinstance(dump, list) else parse_faulthandler(dump, main_tids.get(rank))
        frames = frames[:script_depth([f.file for f in frames])]  # what runs the script
        frames_of[rank] = frames
        stacks[rank] = "\n".join(
            f'  File "{short_path(f.file)}", line {f.line} in {f.func}' for f in frames
        ) or (dump.strip() if isinstance(dump, str) else "") or "(no stack received)"
        at = user_frame(frames, script)
        waiting[rank] = f"{where_text(at.file)}:{at.line}" if at else "unknown"
        calls[rank] = collective_of(frames, at)
        sources[rank] = linecache.getline(at.file, at.line).strip() if at else ""
        if passing(frames, at):
            near.add(rank)
    stragglers, explanation = _stragglers(waiting, calls, near, exited or {}, lingering or {})
    return Hang(stacks, waiting, stragglers, calls, sources, dict(exited or {}), silent_s,
                explanation, dict(lingering or {}))


def _stragglers(waiting: dict[int, str], calls: dict[int, str], near: set[int], exited: dict,
                lingering: dict) -> tuple[list[int], str]:
    ranks = sorted(waiting)
    if not ranks:
        return [], "no rank was alive to inspect"
    in_collective = reached(waiting, calls, near)
    outside = [r for r in ranks if r not in in_collective]
    if in_collective and outside:
        return outside, (
            f"{rank_list(in_collective)} {verb_for(in_collective, 'waits', 'wait')} in a collective that "
            f"{rank_list(outside)} {verb_for(outside, 'has', 'have')} not reached"
        )
    counts = Counter(waiting[r] for r in ranks)
    if exited and len(counts) == 1 and set(exited) <= set(lingering):
        gone = sorted(exited)
        return [], (
            f"{rank_list(ranks)} {verb_for(ranks, 'waits', 'wait')} at {waiting[ranks[0]]} for "
            f"{rank_list(gone)}, whose script ended but whose process "
            f"{verb_for(gone, 'runs', 'run')} on: a thread that is not a daemon keeps it alive"
        )
    if exited and len(counts) == 1:
        return [], (
            f"{rank_list(ranks)} {verb_for(ranks, 'waits', 'wait')} at {waiting[ranks[0]]} for "
            f"{rank_list(sorted(exited))}, which already left the run (uneven inputs or an early exit)"
        )
    if len(counts) == 1:  # one rank alone (a cell on one rank of a world) is no "every rank"
        who = "every rank waits" if len(ranks) > 1 else f"{rank_list(ranks)} waits"
        if len(ranks) > 1 and all(calls.get(r) == "init_process_group" for r in ranks):
            return [], (f"{who} at {waiting[ranks[0]]} in init_process_group(), which returns once "
                        f"world_size ranks have joined, and {len(ranks)} are running: a world_size "
                        "or rank given by hand that differs from torchrun's?")
        return [], f"{who} at {waiting[ranks[0]]}"
    top = counts.most_common()
    if top[0][1] > top[1][1]:
        majority = top[0][0]
        odd = [r for r in ranks if waiting[r] != majority]
        same = [r for r in ranks if waiting[r] == majority]
        return odd, (
            f"{rank_list(same)} {verb_for(same, 'waits', 'wait')} at {majority}; "
            f"{rank_list(odd)} {verb_for(odd, 'is', 'are')} somewhere else"
        )
    if not any(calls.get(r) for r in ranks):  # nobody waits for a peer: no mismatch to speak of
        return [], ("no rank is in a collective: each is at a line of its own, computing or "
                    "waiting on something other than its peers (a slow step needs a longer hang_timeout)")
    return [], "the ranks wait at different lines: their collectives do not match"


def passing(frames: list[Frame], at: Frame | None) -> bool:
    """Whether a rank's stack shows it passing through its line: no call under way there,
    or only torch.distributed's Python around the call (c10d's logging wrapper, as the
    collective's error goes up through it). Inside a model's forward, it computes."""
    if at is None or at not in frames:
        return False
    below = frames.index(at) - 1
    return below < 0 or "torch/distributed/" in frames[below].file.replace("\\", "/")


def reached(waiting: dict[int, str], calls: dict[int, str], near: Collection[int]) -> list[int]:
    """The ranks in a collective, and those of `near` (passing through their line:
    passing()) at the very line where another rank waits in one: a stack read at that
    moment caught them going in, or coming out with the collective's error (a peer gone)
    as SIGTERM came. Neither is a rank that never reached the collective."""
    lines = {waiting[r] for r in waiting if calls.get(r)}
    return sorted(r for r in waiting if calls.get(r) or (r in near and waiting[r] in lines))


def rank_list(ranks: list[int]) -> str:
    """'rank 1' or 'ranks 0, 2, 3'."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def verb_for(ranks: list[int], one: str, many: str) -> str:
    return one if len(ranks) == 1 else many
