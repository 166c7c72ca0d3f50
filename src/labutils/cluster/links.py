"""Link rates: reading "400mbit", writing "400 Mbit/s", and measuring a link for real
(TCP throughput one way, then the round trip of one byte).
"""

from __future__ import annotations

import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from labutils.errors import LaunchConfigError

_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?)(bit|bps)?\s*$", re.IGNORECASE)
_UNIT = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}


def parse_rate(link: str | int | float) -> int:
    """A link rate in bits per second from "400mbit", "1gbit", "200M" or a number.

    tc's units: "bit" is bits per second, "bps" bytes per second (so "50mbps" is
    400 Mbit/s). Raises LaunchConfigError for anything else.

    Args:
        link: the rate, as text in tc's units or as bits per second.
    """
    if isinstance(link, bool) or not isinstance(link, (str, int, float)):
        raise LaunchConfigError("link", expected='a rate such as "400mbit" or "1gbit"',
                                given=repr(link), fix='pass link="400mbit" (bits per second)')
    if isinstance(link, (int, float)):
        bits = float(link)
    else:
        m = _RATE.match(link)
        if not m:
            raise LaunchConfigError("link", expected='a rate such as "400mbit" or "1gbit"',
                                    given=repr(link),
                                    fix='a number with kbit, mbit or gbit, e.g. "200mbit"')
        bits = float(m.group(1)) * _UNIT[m.group(2).lower()]
        if (m.group(3) or "").lower() == "bps":
            bits *= 8
    if not 10**5 <= bits <= 10**11:
        raise LaunchConfigError("link", expected="a rate between 100kbit and 100gbit",
                                given=repr(link), fix='e.g. link="400mbit"')
    return int(bits)


def rate_text(bits_per_s: float) -> str:
    """400000000 -> "400 Mbit/s".

    Args:
        bits_per_s: the rate.
    """
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_s >= scale:
            value = bits_per_s / scale
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{bits_per_s:.0f} bit/s"


# ---------------------------------------------------------- measuring a link
# Runs on the sending host with a bare interpreter (no torch, no labutils): sends
# for SECONDS on one connection, then bounces one byte ROUNDS times on a second one.
_SENDER = """
import socket, sys, time
host, port, seconds, rounds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
bulk = socket.create_connection((host, port), timeout=30)
block = bytes(1 << 18)
end = time.monotonic() + seconds
while time.monotonic() < end:
    bulk.sendall(block)
bulk.shutdown(socket.SHUT_WR)
bulk.recv(1)  # the receiver has counted every byte
bulk.close()
ping = socket.create_connection((host, port), timeout=30)
ping.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
times = []
for _ in range(rounds):
    t = time.perf_counter()
    ping.sendall(b"x")
    ping.recv(1)
    times.append(time.perf_counter() - t)
print(" ".join(f"{t:.9f}" for t in times))
"""


# struct tcp_info (linux/tcp.h): tcpi_bytes_received, the payload bytes that have
# arrived on a connection (Linux 4.1 on), is the u64 at this offset.
_BYTES_RECEIVED = 128
SAMPLE_S = 0.01  # how often the receiver notes the bytes arrived so far
WINDOW_S = 0.25  # the rate is that of the best stretch this long


def arrived_bytes(conn: socket.socket) -> int | None:
    """The payload bytes that have arrived on conn so far, counted by the kernel as they
    come in (not as this process reads them); None where the kernel does not say."""
    try:
        info = conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    except (OSError, AttributeError):
        return None
    return int.from_bytes(info[_BYTES_RECEIVED:_BYTES_RECEIVED + 8], sys.byteorder) \
        if len(info) >= _BYTES_RECEIVED + 8 else None


def best_rate(samples: list[tuple[float, int]], window: float) -> float:
    """Bits per second over the best stretch of at least `window` seconds between two
    (time, bytes so far) samples; over the whole span when it is shorter; 0.0 for fewer
    than two samples.

    Args:
        samples: (seconds, bytes arrived so far), in time order.
        window: the shortest stretch that counts.
    """
    rates = []
    for i, (t0, b0) in enumerate(samples):
        later = next(((t1, b1) for t1, b1 in samples[i + 1:] if t1 - t0 >= window), None)
        if later is None:
            break
        rates.append((later[1] - b0) * 8 / (later[0] - t0))
    if not rates and len(samples) >= 2 and samples[-1][0] > samples[0][0]:
        (t0, b0), (t1, b1) = samples[0], samples[-1]
        rates.append((b1 - b0) * 8 / (t1 - t0))
    return max(rates, default=0.0)


def _receive(server: socket.socket, rounds: int, out: dict) -> None:
    """The receiving side of a measurement: note the bulk bytes as they arrive, then echo
    the pings. The rate is that of the best WINDOW_S seconds: the link's rate is what
    it carries while the sender keeps it busy, and a sender or receiver that waits for a
    core (a loaded machine, a busy notebook kernel) leaves it idle now and then. The
    kernel's count of arrived bytes times them, so a read that comes late (its bytes
    waited in the socket) does not look like a burst."""
    try:
        conn, _ = server.accept()
        with conn:
            conn.settimeout(30)
            buffer = bytearray(1 << 20)  # one buffer: a new 1 MiB per read costs a core
            samples: list[tuple[float, int]] = []
            read, due = 0, 0.0
            while True:
                got = conn.recv_into(buffer)
                if not got:
                    break
                read += got
                now = time.perf_counter()
                if now >= due:
                    arrived = arrived_bytes(conn)
                    samples.append((now, read if arrived is None else arrived))
                    due = now + SAMPLE_S
            out["bits_per_s"] = best_rate(samples, WINDOW_S)
            conn.sendall(b"k")
        conn, _ = server.accept()
        with conn:
            conn.settimeout(30)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(rounds):
                if conn.recv(1) == b"":
                    break
                conn.sendall(b"x")
    except OSError as exc:
        out["error"] = str(exc)


def measure_link(address: str, *, on_sender: Callable[[list[str]], list[str]],
                 seconds: float = 2.0, rounds: int = 50) -> dict:
    """Measure a link for real: TCP throughput from the sending host to address (a
    receiver in this process) for `seconds`, the rate of its best WINDOW_S, then
    the median round trip of one byte.
    Returns {"measured_bps", "rtt_ms"}; OSError when the measurement fails.

    Args:
        address: this process's address on the link, where the receiver listens.
        on_sender: turns a command into the command that runs it on the sending host.
        seconds: how long to send.
        rounds: how many one-byte round trips.
    """
    server = socket.create_server((address, 0))
    port = server.getsockname()[1]
    out: dict = {}
    receiver = threading.Thread(target=_receive, args=(server, rounds, out), daemon=True)
    receiver.start()
    try:
        done = subprocess.run(
            on_sender([sys.executable, "-S", "-c", _SENDER, address, str(port), str(seconds),
                       str(rounds)]),
            capture_output=True, text=True, timeout=seconds + 30)
    finally:
        receiver.join(timeout=10)
        server.close()
    if done.returncode != 0 or "error" in out:
        raise OSError(f"measuring the link failed: {out.get('error') or done.stderr.strip()}")
    rtts = [float(t) for t in done.stdout.split()]
    return {"measured_bps": out.get("bits_per_s", 0.0),
            "rtt_ms": statistics.median(rtts) * 1e3 if rtts else float("nan")}
