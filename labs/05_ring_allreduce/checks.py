"""Checks for lab 05: a ring all-reduce from scratch.

Run them yourself from this folder (the grader runs the same ones):

    python checks.py
"""

from labutils.grading import check

SIZES = [1, 7, 1000, 4099]
ARGS = ["--sizes", ",".join(map(str, SIZES))]


def _run(c, nproc):
    return c.run("ring_test.py", nproc, args=[*ARGS, "--ring", c.learner_file("ring.py")])


def _rows(run):
    return run.rows("size", "max_error")


@check("ring_all_reduce sums in place like dist.all_reduce, at 2 and 3 ranks", points=4)
def correct(c):
    for nproc in (2, 3):
        run = _run(c, nproc)
        if not c.completed(run, f"{nproc} ranks"):
            continue
        wrong = []
        for row in _rows(run):
            if not row["max_error"] <= 1e-4:
                wrong.append(f"rank {row['rank']}, size {row['size']}: max error {row['max_error']:.3g}")
            elif not row["in_place"]:
                wrong.append(f"rank {row['rank']}, size {row['size']}: returned a new tensor, "
                             "the input was not summed in place")
        tested = len(_rows(run))
        c.expect(not wrong and tested == nproc * len(SIZES), f"{nproc} ranks, sizes {SIZES}",
                 measured="; ".join(wrong[:4]) or f"{tested} results, all equal to dist.all_reduce",
                 expected="the sum over all ranks, in the input tensor, within 1e-4")


@check("Each rank sends 2(n-1)/n of the tensor (reduce-scatter, then all-gather)", points=3)
def bandwidth_optimal(c):
    nproc, size = 3, max(SIZES)
    run = _run(c, nproc)
    if not c.completed(run, f"{nproc} ranks"):
        return
    _bytes_sent(c, _rows(run), nproc, size, f"{nproc} ranks, {size} elements")


def _bytes_sent(c, rows, nproc: int, size: int, label: str) -> None:
    """One part: each rank sent at most 2(n-1)/n of the tensor of ``size`` elements."""
    sent = {row["rank"]: row["bytes_sent"] / (4 * size) for row in rows if row["size"] == size}
    optimal = 2 * (nproc - 1) / nproc
    slack = 2 * (nproc - 1) / size  # uneven chunks: one element more per message at most
    c.expect(len(sent) == nproc and all(s <= optimal + slack + 1e-9 for s in sent.values()),
             label, measured="sent per rank, in tensors: "
                             + ", ".join(f"rank {r}: {s:.3f}" for r, s in sorted(sent.items())),
             expected=f"{optimal:.3f} (2(n-1)/n); the naive ring sends {nproc - 1}.000")


@check("ring_all_reduce uses only point-to-point operations", points=1)
def point_to_point_only(c):
    for nproc in (2, 3):
        run = _run(c, nproc)
        if not c.completed(run, f"{nproc} ranks"):
            continue
        used = sorted({name for row in _rows(run) for name in row["collectives"]})
        c.expect(not used, f"{nproc} ranks", measured=f"collectives called: {used or 'none'}",
                 expected="none: only send/recv/isend/irecv")


if __name__ == "__main__":
    from labutils.grading import run_checks

    run_checks()
