"""labutils.course.timing: busbw factors, bandwidths, timing calls, the alpha-beta fit."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest

from labutils.errors import InputError
from labutils.course.timing import (
    AlphaBeta, algbw, busbw, busbw_factor, fit_alpha_beta, format_bytes, format_rate,
    format_seconds, machine_cpu_so_far, median, sleeps_so_far, time_calls, waited_for_a_core,
)


@pytest.mark.parametrize(
    ("collective", "n", "factor"),
    [
        ("all_reduce", 1, 0.0),
        ("all_reduce", 2, 1.0),
        ("all_reduce", 4, 1.5),
        ("all_reduce", 8, 1.75),
        ("reduce_scatter", 4, 0.75),
        ("all_gather", 2, 0.5),
        ("all_to_all", 4, 0.75),
        ("broadcast", 4, 1.0),
        ("reduce", 16, 1.0),
    ],
)
def test_busbw_factor(collective, n, factor):
    assert busbw_factor(collective, n) == pytest.approx(factor)


@pytest.mark.parametrize(
    ("collective", "n", "fragment"),
    [
        ("allreduce", 4, "collective: expected all_reduce | reduce_scatter"),
        ("", 4, "collective"),
        ("all_reduce", 0, "world_size: expected a whole number >= 1, got 0"),
        ("all_reduce", 2.0, "got 2.0"),
        ("all_reduce", True, "world_size"),
        ("all_reduce", "4", "got '4'"),
    ],
)
def test_busbw_factor_rejects(collective, n, fragment):
    with pytest.raises(InputError, match=fragment):
        busbw_factor(collective, n)


def test_algbw_and_busbw():
    assert algbw(1e9, 2.0) == pytest.approx(5e8)
    # nccl-tests: all_reduce of 1 GB in 1 s on 4 ranks -> algbw 1 GB/s, busbw 1.5 GB/s
    assert busbw(1e9, 1.0, collective="all_reduce", world_size=4) == pytest.approx(1.5e9)
    assert busbw(1e9, 1.0, collective="broadcast", world_size=4) == pytest.approx(1e9)


@pytest.mark.parametrize(
    ("nbytes", "seconds", "fragment"),
    [
        (0, 1.0, "nbytes: expected a finite number > 0"),
        (-8, 1.0, "nbytes"),
        (8, 0.0, "seconds: expected a finite number > 0"),
        (8, math.inf, "seconds"),
        (8, math.nan, "seconds"),
        ("8", 1.0, "nbytes"),
        (8, None, "seconds"),
    ],
)
def test_algbw_rejects(nbytes, seconds, fragment):
    with pytest.raises(InputError, match=fragment):
        algbw(nbytes, seconds)


def test_time_calls_counts_warmup_and_sync():
    calls, syncs = [], []
    ticks = iter(range(100))
    times = time_calls(lambda: calls.append(1), iters=3, warmup=2,
                       sync=lambda: syncs.append(1), clock=lambda: float(next(ticks)))
    assert len(calls) == 5 and len(syncs) == 5
    assert times == [1.0, 1.0, 1.0]  # each timed call reads the clock twice


def test_time_calls_measures_real_time():
    import time

    times = time_calls(lambda: time.sleep(0.01), iters=2, warmup=0)
    assert len(times) == 2 and all(0.009 < t < 0.5 for t in times)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"fn": None, "iters": 1}, "fn: expected a callable"),
        ({"fn": print, "iters": 0}, "iters: expected a whole number >= 1, got 0"),
        ({"fn": print, "iters": 2.5}, "iters"),
        ({"fn": print, "iters": 1, "warmup": -1}, "warmup: expected a whole number >= 0"),
    ],
)
def test_time_calls_rejects(kwargs, fragment):
    fn = kwargs.pop("fn")
    with pytest.raises(InputError, match=fragment):
        time_calls(fn, **kwargs)


def test_median():
    assert median([3.0, 1.0, 100.0]) == 3.0
    assert median([1.0, 2.0]) == 1.5
    with pytest.raises(InputError, match="at least one value"):
        median([])


@pytest.mark.parametrize(
    ("alpha", "beta"),
    [(1e-4, 1e9), (5e-5, 2.5e8), (2e-3, 5e10), (0.0, 1e9)],
)
def test_fit_recovers_exact_model(alpha, beta):
    sizes = [2.0**k for k in range(3, 26, 2)]
    times = [alpha + s / beta for s in sizes]
    fit = fit_alpha_beta(sizes, times)
    assert fit.alpha_s == pytest.approx(alpha, rel=1e-6, abs=1e-12)
    assert fit.beta_Bps == pytest.approx(beta, rel=1e-6)


def test_fit_with_noise_stays_close():
    import random

    rng = random.Random(0)
    sizes = [2.0**k for k in range(3, 26)]
    times = [(1e-4 + s / 1e9) * rng.uniform(0.9, 1.1) for s in sizes]
    fit = fit_alpha_beta(sizes, times)
    assert fit.alpha_s == pytest.approx(1e-4, rel=0.2)
    assert fit.beta_Bps == pytest.approx(1e9, rel=0.2)


def test_fit_clamps_negative_alpha():
    # times that would need a negative intercept: alpha is clamped to 0
    sizes, times = [1e3, 1e6, 1e7], [1e-9, 1e-3, 1e-2]
    fit = fit_alpha_beta(sizes, times)
    assert fit.alpha_s == 0.0 and fit.beta_Bps > 0


@pytest.mark.parametrize(
    ("sizes", "times", "fragment"),
    [
        ([8, 16], [1e-3], "one time per size"),
        ([8, 8], [1e-3, 2e-3], "at least two different sizes"),
        ([8], [1e-3], "at least two different sizes"),
        ([0, 16], [1e-3, 1e-3], "nbytes: expected a finite number > 0"),
        ([8, 16], [1e-3, -1.0], "seconds: expected a finite number > 0"),
        ([8, 16], [1e-3, math.nan], "seconds"),
        ("8,16", [1e-3, 2e-3], "two sequences of numbers"),
        ([8, 1e6], [1e-3, 1e-6], "times that grow with the size"),
    ],
)
def test_fit_rejects(sizes, times, fragment):
    with pytest.raises(InputError, match=fragment):
        fit_alpha_beta(sizes, times)


def test_alpha_beta_model():
    model = AlphaBeta(alpha_s=1e-4, beta_Bps=1e9)
    assert model.predict(0) == 1e-4
    assert model.predict(1e9) == pytest.approx(1.0001)
    assert model.half_bandwidth_bytes == pytest.approx(1e5)
    assert str(model) == "alpha = 100 µs, beta = 1 GB/s, n½ = 97.7 KiB"


@pytest.mark.parametrize(
    ("value", "text"),
    [(8, "8 B"), (1023, "1023 B"), (1024, "1 KiB"), (1536, "1.5 KiB"), (2**25, "32 MiB"),
     (2**30, "1 GiB"), (2**42, "4096 GiB")],
)
def test_format_bytes(value, text):
    assert format_bytes(value) == text


@pytest.mark.parametrize(
    ("value", "text"),
    [(1.5e9, "1.5 GB/s"), (2.345e10, "23.4 GB/s"), (4e6, "0.004 GB/s"), (5e5, "0.5 MB/s")],
)
def test_format_rate(value, text):
    assert format_rate(value) == text


@pytest.mark.parametrize(
    ("value", "text"),
    [(2.5e-6, "2.5 µs"), (1.234e-3, "1.23 ms"), (0.5, "500 ms"), (3.0, "3 s")],
)
def test_format_seconds(value, text):
    assert format_seconds(value) == text


@pytest.mark.serial
def test_waited_for_a_core_counts_the_time_another_process_holds_the_core():
    """This thread and a spinning process on one CPU: about half the time this thread
    is ready and waits; alone, it hardly waits."""
    if waited_for_a_core() is None:
        pytest.skip("this kernel has no /proc/thread-self/schedstat")
    cpu = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(spinner.pid, {cpu})
        os.sched_setaffinity(0, {cpu})  # this thread only
        time.sleep(0.2)  # the spinner is running
        waited, t0 = waited_for_a_core(), time.perf_counter()
        while time.perf_counter() - t0 < 0.6:
            pass
        shared = (waited_for_a_core() - waited) / (time.perf_counter() - t0)
    finally:
        spinner.kill()
        spinner.wait()
        os.sched_setaffinity(0, before)
    assert 0.2 < shared < 0.95  # other work on this CPU can only add to the wait


def test_machine_cpu_so_far_counts_another_process():
    """A child that burns 0.5 s of CPU shows in the machine's count, beyond this process's
    own: the tick samples that land on it count as user time, or as steal where the host
    of a virtual machine took the core."""
    if machine_cpu_so_far() is None:
        pytest.skip("this kernel has no /proc/stat")
    before, own = machine_cpu_so_far(), sum(os.times()[:2])
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass"
    subprocess.run([sys.executable, "-c", burn], check=True)
    others = machine_cpu_so_far() - before - (sum(os.times()[:2]) - own)
    assert others >= 0.3, others  # other work on the machine can only add to it


def test_sleeps_so_far_counts_a_sleep_and_not_a_spin():
    if sleeps_so_far() is None:
        pytest.skip("this kernel does not count a thread's voluntary switches")
    before = sleeps_so_far()
    for _ in range(3):
        time.sleep(0.001)
    slept = sleeps_so_far()
    assert slept - before >= 3
    sum(range(100_000))  # a spin: other work can take the core away, but that is involuntary
    assert sleeps_so_far() <= slept + 1  # (one page read from disk would be a real sleep)
