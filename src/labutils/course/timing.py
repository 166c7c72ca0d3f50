"""Measuring communication like nccl-tests: time per call, algbw, busbw, alpha-beta.

Used inside ranks (timing a collective) and in notebooks (turning the reported
times into bandwidths and a latency/bandwidth model)::

    from labutils.course.timing import time_calls, busbw, fit_alpha_beta
    seconds = time_calls(lambda: dist.all_reduce(x), iters=10, sync=dist.barrier)
    busbw(x.numel() * x.element_size(), median(seconds), collective="all_reduce", world_size=4)
    fit_alpha_beta(sizes, times)   # t = alpha + bytes / beta

Bandwidths are in bytes per second; format_rate() prints them in GB/s (1e9 bytes),
as nccl-tests does. Sizes print in binary units (KiB, MiB).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from labutils.errors import InputError, whole_number

__all__ = [
    "BUSBW_FACTORS", "busbw_factor", "algbw", "busbw", "time_calls", "median", "sleeps_so_far", "waited_for_a_core",
    "AlphaBeta", "fit_alpha_beta", "format_bytes", "format_rate", "format_seconds",
]

# busbw = algbw * factor(n): the factor turns "bytes of the array per second" into the
# bandwidth each link must carry, so numbers compare across collectives and world
# sizes (nccl-tests, doc/PERFORMANCE.md). Bytes are the size of the whole array.
BUSBW_FACTORS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


def _whole(name: str, value, minimum: int, fix: str) -> int:
    if not whole_number(value) or value < minimum:
        raise InputError(name, expected=f"a whole number >= {minimum}", given=value, fix=fix)
    return value


def _positive(name: str, value, fix: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise InputError(name, expected="a finite number > 0", given=value, fix=fix)
    return float(value)


def busbw_factor(collective: str, world_size: int) -> float:
    """The nccl-tests factor from algbw to busbw for a collective on world_size ranks.

    Args:
        collective: one of BUSBW_FACTORS ("all_reduce", "reduce_scatter", ...).
        world_size: number of ranks taking part, >= 1.
    """
    if collective not in BUSBW_FACTORS:
        raise InputError("collective", expected=" | ".join(BUSBW_FACTORS), given=collective,
                         fix='pass the collective by its torch name, e.g. "all_reduce"')
    n = _whole("world_size", world_size, 1, "pass the number of ranks, e.g. world_size=4")
    return BUSBW_FACTORS[collective](n)


def algbw(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth in bytes/s: the array's size over the time of one call.

    Args:
        nbytes: size of the whole array in bytes (> 0).
        seconds: time of one call (> 0).
    """
    size = _positive("nbytes", nbytes, "pass the array size in bytes, e.g. x.numel() * x.element_size()")
    t = _positive("seconds", seconds, "pass the measured time of one call in seconds")
    return size / t


def busbw(nbytes: float, seconds: float, *, collective: str, world_size: int) -> float:
    """Bus bandwidth in bytes/s: algbw times busbw_factor(collective, world_size).

    Args:
        nbytes: size of the whole array in bytes (> 0).
        seconds: time of one call (> 0).
        collective: the collective measured, e.g. "all_reduce".
        world_size: number of ranks taking part.
    """
    return algbw(nbytes, seconds) * busbw_factor(collective, world_size)


def time_calls(fn: Callable[[], object], *, iters: int, warmup: int = 1,
               sync: Callable[[], object] | None = None,
               clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Seconds of each of ``iters`` calls of fn(), after ``warmup`` untimed calls.

    Args:
        fn: the call to time (no arguments).
        iters: timed calls, >= 1.
        warmup: untimed calls first (connections, caches, allocator), >= 0.
        sync: called before every call and not timed, e.g. dist.barrier so that
            all ranks start each call together; on GPUs pass a function that also
            calls torch.cuda.synchronize().
        clock: the clock to read (time.perf_counter).

    Returns:
        One duration per timed call, in seconds, as measured by this process.
        In a distributed run, take the slowest rank per call (all_reduce MAX).
    """
    if not callable(fn):
        raise InputError("fn", expected="a callable with no arguments", given=fn,
                         fix="wrap the call: time_calls(lambda: dist.all_reduce(x), iters=10)")
    _whole("iters", iters, 1, "pass the number of timed calls, e.g. iters=10")
    _whole("warmup", warmup, 0, "pass warmup=0 to time from the first call")
    for _ in range(warmup):
        if sync is not None:
            sync()
        fn()
    times = []
    for _ in range(iters):
        if sync is not None:
            sync()
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return times


def sleeps_so_far() -> int | None:
    """How many times the calling thread has so far given up its core by itself, going
    to sleep until something woke it (waiting for a lock such as Python's GIL, for
    I/O, for a timer), as Linux counts them: voluntary_ctxt_switches in
    /proc/thread-self/status. Other work that takes the core away does not count here
    (those switches are involuntary). None where the kernel does not say."""
    try:
        with open("/proc/thread-self/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def waited_for_a_core() -> float | None:
    """Seconds the calling thread has spent so far ready to run but waiting for a core
    that other work held, as Linux's scheduler counts them (the second field of
    /proc/thread-self/schedstat; up to date whenever the thread itself reads it, since
    each wait is added when the thread gets a core); None where the kernel does not say.
    Its growth over a timed interval, against the interval, is the share of it that
    other work on the machine took."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def machine_cpu_so_far() -> float | None:
    """CPU-seconds every core of the machine has spent so far running programs (user,
    nice and system time in /proc/stat's first line), plus the time the host of a
    virtual machine kept for other guests while this one had work (steal); interrupt
    handling is left out. Its growth over an interval, less what a run's own processes
    used (os.times()), is what other programs took meanwhile. None where the kernel
    does not say."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        user, nice, system, steal = (int(fields[i]) for i in (1, 2, 3, 8))
    except (OSError, ValueError, IndexError):
        return None
    return (user + nice + system + steal) / os.sysconf("SC_CLK_TCK")


def median(values: Sequence[float]) -> float:
    """The median of a non-empty sequence (robust to a few slow calls on a busy machine)."""
    if len(values) == 0:
        raise InputError("values", expected="at least one value", given=list(values),
                         fix="time at least one call")
    return float(statistics.median(values))


@dataclass(frozen=True)
class AlphaBeta:
    """The latency-bandwidth model t(bytes) = alpha + bytes / beta.

    alpha_s: fixed cost per call in seconds (latency); beta_Bps: bytes per second
    once a message is large.
    """

    alpha_s: float
    beta_Bps: float

    def predict(self, nbytes: float) -> float:
        """Predicted seconds for one call moving nbytes."""
        return self.alpha_s + nbytes / self.beta_Bps

    @property
    def half_bandwidth_bytes(self) -> float:
        """alpha * beta: the size where latency and transfer take equally long, so a
        call reaches half of beta (Hockney's n½). Below it, latency rules."""
        return self.alpha_s * self.beta_Bps

    def __str__(self) -> str:
        return (f"alpha = {format_seconds(self.alpha_s)}, beta = {format_rate(self.beta_Bps)}, "
                f"n½ = {format_bytes(self.half_bandwidth_bytes)}")


def fit_alpha_beta(nbytes: Sequence[float], seconds: Sequence[float]) -> AlphaBeta:
    """Fit t = alpha + bytes / beta to measured (size, time) points.

    Least squares on relative error, so the small sizes (which set alpha) weigh as
    much as the large ones (which set beta). alpha is kept >= 0.

    Args:
        nbytes: message sizes in bytes (> 0), at least two different ones.
        seconds: the measured time per call for each size (> 0).
    """
    if isinstance(nbytes, (str, bytes)) or isinstance(seconds, (str, bytes)):
        raise InputError("nbytes/seconds", expected="two sequences of numbers",
                         given=(nbytes, seconds), fix="pass lists of sizes and of times")
    xs = [_positive("nbytes", x, "sizes are bytes moved per call, > 0") for x in nbytes]
    ts = [_positive("seconds", t, "times are seconds per call, > 0") for t in seconds]
    if len(xs) != len(ts):
        raise InputError("seconds", expected=f"one time per size ({len(xs)})",
                         given=f"{len(ts)} times", fix="pass as many times as sizes")
    if len(set(xs)) < 2:
        raise InputError("nbytes", expected="at least two different sizes", given=xs,
                         fix="measure at several sizes, e.g. from 8 B to 32 MiB")
    # Minimise sum(((alpha + x c) - t) / t)^2 with c = 1 / beta: a 2x2 linear system.
    s11 = sum(1 / t**2 for t in ts)
    s12 = sum(x / t**2 for x, t in zip(xs, ts))
    s22 = sum(x * x / t**2 for x, t in zip(xs, ts))
    r1 = sum(1 / t for t in ts)
    r2 = sum(x / t for x, t in zip(xs, ts))
    det = s11 * s22 - s12 * s12
    alpha = (r1 * s22 - r2 * s12) / det
    c = (s11 * r2 - s12 * r1) / det
    if alpha < 0:  # latency cannot be negative: fit the bandwidth term alone
        alpha, c = 0.0, r2 / s22
    if c <= 0:
        raise InputError("seconds", expected="times that grow with the size",
                         given=ts, fix="measure up to larger sizes (MiB), where bandwidth dominates")
    return AlphaBeta(alpha_s=alpha, beta_Bps=1 / c)


def format_bytes(nbytes: float) -> str:
    """8 B, 1 KiB, 32 MiB: binary units, as sizes are powers of two."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_rate(bytes_per_s: float) -> str:
    """Bandwidth in GB/s (1e9 bytes per second, as nccl-tests prints it)."""
    gbps = bytes_per_s / 1e9
    return f"{gbps:.3g} GB/s" if gbps >= 0.001 else f"{bytes_per_s / 1e6:.3g} MB/s"


def format_seconds(seconds: float) -> str:
    """Seconds as µs, ms or s with three significant digits."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.3g} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds:.3g} s"
