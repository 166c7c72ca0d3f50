"""Checks for lab 05: a ring all-reduce from scratch.

Run them yourself from this folder (the grader runs the same ones):

    python checks.py

The runs launch this lab's ring_test.py on your ring.py, under the grader's probe
(measure=["traffic"]), which logs every operation each rank asks of its process group
and the bytes of its tensors, whichever torch.distributed function asked for it.
"""

from labutils.grading import check
from labutils.grading.probe import POINT_TO_POINT

SIZES = [1, 4, 7, 1000, 4099]  # 4 at 3 ranks: torch.chunk gives 2 chunks, not 3
ITEMSIZE = {"float32": 4, "float64": 8}  # ring_test.py's --dtype: bytes per element


def _run(c, nproc, sizes=SIZES, dtype="float32"):
    """ring_test.py, the lab's own, on the learner's ring.py, with the traffic probe."""
    return c.run(c.lab_file("ring_test.py"), nproc, measure=["traffic"],
                 args=["--sizes", ",".join(map(str, sizes)), "--ring", c.learner_file("ring.py"),
                       "--dtype", dtype])


def _rows(run):
    """ring_test.py's results, the last per rank and size (its report follows the ring)."""
    return list({(r["rank"], r["size"]): r for r in run.rows("size", "max_error")}.values())


def _traffic(run, sizes, dtype="float32") -> dict[int, dict[int, list]]:
    """rank -> size -> the process-group operations ring_all_reduce made, [name, bytes,
    peer] (the peer of a send or a receive, else None).

    The probe logs a rank's operations in order; ring_test.py calls dist.all_reduce on
    each size's reference before the ring, so each size's share starts after the first
    allreduce of its bytes (the sizes differ: a ring that calls the library on its own
    tensor is not taken for the next size's reference)."""
    cut: dict[int, dict[int, list]] = {}
    for rank, record in run.probe("traffic").items():
        ops, starts, at = record["operations"], [], 0
        for size in sizes:
            while at < len(ops) and ops[at][:2] != ["allreduce", ITEMSIZE[dtype] * size]:
                at += 1
            starts.append(at)
            at += 1
        ends = starts[1:] + [len(ops)]
        cut[rank] = {size: ops[start + 1:end] for size, start, end in zip(sizes, starts, ends)}
    return cut


def _not_like_all_reduce(row: dict) -> str:
    """What one rank's result of one size did unlike dist.all_reduce, which leaves the sum
    in the input tensor ("" if nothing; what it returned is another check's)."""
    if row["max_error"] <= 1e-4:
        return ""
    if row.get("returned") == "a new tensor holding the sum":
        return "returned the sum in a new tensor; the input was not summed in place"
    if row.get("same_memory") is False:
        return ("the input tensor was given new memory holding the sum (tensor.data = or "
                "set_()); its own memory, which every view of it shares, was not summed in place")
    return f"max error {row['max_error']:.3g} in the input"


def _sums_in_place(c, run, nproc: int, sizes, label: str) -> None:
    """One part: every rank's input tensor of every size holds the sum of dist.all_reduce."""
    rows = _rows(run)
    wrong = [f"rank {row['rank']}, size {row['size']}: {why}" for row in rows
             if (why := _not_like_all_reduce(row))]
    c.expect(not wrong and len(rows) == nproc * len(sizes), label,
             measured="; ".join(wrong[:4]) or f"{len(rows)} results, all equal to dist.all_reduce",
             expected="the sum over all ranks, in the input tensor, within 1e-4")


# Required: the sum is what an all-reduce is for. A ring cut into 3 chunks, or taking 2
# steps, whatever the world size (the docstring's 3 ranks) sums right at 3 ranks only, and
# the other checks' points leave it above the pass mark.
@check("ring_all_reduce sums in place like dist.all_reduce, at 2 and 3 ranks", points=5,
       required=True)
def correct(c):
    for nproc in (2, 3):
        run = _run(c, nproc)
        if c.completed(run, f"{nproc} ranks"):
            _sums_in_place(c, run, nproc, SIZES, f"{nproc} ranks, sizes {SIZES}")


# A small part of its own: a ring that sums in place and returns None, as dist.all_reduce
# does, is right where it matters; ring.py's docstring asks for the tensor back.
@check("ring_all_reduce returns the tensor it summed, as its docstring says", points=1)
def returns_the_input(c):
    for nproc in (2, 3):
        run = _run(c, nproc)
        if not c.completed(run, f"{nproc} ranks"):
            continue
        rows = _rows(run)
        other = sorted({row.get("returned", "?") for row in rows if not row["in_place"]})
        c.expect(bool(rows) and not other, f"{nproc} ranks, sizes {SIZES}",
                 measured=f"returned {', '.join(other)}, not the input tensor" if other
                 else "the input tensor, every time",
                 expected="the input tensor itself (`return tensor`), so that "
                          "`total = ring_all_reduce(t)` works too; dist.all_reduce returns None, "
                          "ring_all_reduce's docstring asks for the tensor")


# Required: the float64 check (hidden, required) measures the bytes of float64 tensors only;
# a ring that sums in float64 whatever the dtype (a copy, cast back at the end) is right
# there and sends twice 2(n-1)/n of every float32 tensor, which loses only these points.
@check("Each rank sends 2(n-1)/n of the tensor (reduce-scatter, then all-gather)", points=5,
       required=True)
def bandwidth_optimal(c):
    nproc = 3
    run = _run(c, nproc)
    if not c.completed(run, f"{nproc} ranks"):
        return
    _bytes_sent(c, _traffic(run, SIZES), nproc, SIZES, f"{nproc} ranks, sizes {SIZES}")


def _bytes_sent(c, traffic, nproc: int, sizes, label: str, dtype="float32") -> None:
    """One part: for every size, each rank sent 2(n-1)/n of the tensor, counted at the
    process group: not more (the naive ring sends n-1), not less (the rest went through
    something else than sends: a library collective). Every size, not the largest only:
    a ring that passes small tensors around whole is the naive ring there."""
    optimal = 2 * (nproc - 1) / nproc
    off, shown = [], ""
    for size in sizes:
        sent = {rank: sum(n for name, n, _ in ops[size] if name == "send") / (ITEMSIZE[dtype] * size)
                for rank, ops in traffic.items()}
        slack = 2 * (nproc - 1) / size  # uneven chunks: one element more or less per message
        shown = f"size {size}: " + ", ".join(f"rank {r}: {s:.3f}" for r, s in sorted(sent.items()))
        if len(sent) != nproc or any(abs(s - optimal) > slack + 1e-9 for s in sent.values()):
            off.append(shown)
    c.expect(bool(sizes) and not off, label,
             measured="sent per rank, in tensors: " + "; ".join(off[:2] or [shown]),
             expected=f"{optimal:.3f} (2(n-1)/n) at every size, within one element per message; "
                      f"the naive ring sends {nproc - 1}.000, a library collective 0.000 in sends")


def _off_the_ring(traffic: dict[int, dict[int, list]], nproc: int) -> list[str]:
    """How ranks talked other than around a ring: each rank sends to one neighbour only and
    hears from the other only (either way round: (r + 1) % n, then (r - 1) % n). Who a rank
    hears from is who sent to it, by the other ranks' sends: a receive from any source
    (irecv without src) names no sender of its own."""
    sent_to = {rank: {peer for ops in by_size.values() for name, _, peer in ops
                      if name == "send" and peer is not None}
               for rank, by_size in traffic.items()}
    odd = []
    for rank, by_size in sorted(traffic.items()):
        named = {peer for ops in by_size.values() for name, _, peer in ops
                 if name in POINT_TO_POINT and name != "send" and peer is not None}
        heard = named | {other for other, peers in sent_to.items() if rank in peers}
        neighbours = {(rank + 1) % nproc, (rank - 1) % nproc}
        mine = sent_to[rank]
        if len(mine) > 1 or len(heard) > 1 or not (mine | heard) <= neighbours or mine & heard:
            odd.append(f"rank {rank} sent to {_ranks(mine)}, heard from {_ranks(heard)}")
    return odd


def _ranks(peers: set) -> str:
    return ", ".join(f"rank {p}" for p in sorted(peers)) or "none"


# Required: a ring all-reduce that hands some tensors to dist.all_reduce, or sends each
# chunk straight to the rank that sums it, gives the right sums and can send 2(n-1)/n of
# the tensor: it is not the ring the lab asks for.
@check("ring_all_reduce uses only point-to-point operations, between ring neighbours", points=1,
       required=True)
def point_to_point_only(c):
    for nproc in (2, 3):
        run = _run(c, nproc)
        if not c.completed(run, f"{nproc} ranks"):
            continue
        traffic = _traffic(run, SIZES)
        used = sorted({name for ops in traffic.values() for size in SIZES
                       for name, _, _ in ops[size] if name not in POINT_TO_POINT})
        c.expect(len(traffic) == nproc and not used, f"{nproc} ranks",
                 measured=f"process-group collectives called: {used or 'none'}"
                 if traffic else "no process-group operation was measured",
                 expected="none: only send/recv/isend/irecv")
        if nproc > 2:  # on 2 ranks the other rank is both neighbours
            odd = _off_the_ring(traffic, nproc)
            c.expect(bool(traffic) and not odd, f"{nproc} ranks: who talks to whom",
                     measured="; ".join(odd[:3]) or "each rank sends to one neighbour only and "
                                                    "receives from the other only",
                     expected="rank r sends only to (r + 1) % n and receives only from (r - 1) % n "
                              "(or the other way round)")


if __name__ == "__main__":
    from labutils.grading import run_checks

    run_checks()
