"""Checks only the grader runs (never in a learner's copy of the lab): the same fix,
measured in a case the public checks do not show: other tensor sizes at 4 ranks, a world
size they do not use, some sizes smaller than it, most not divisible by it."""

from checks import _bytes_sent, _not_like_all_reduce, _rows, _run, _traffic

from labutils.grading import check

SIZES = [2, 3, 5, 64, 3001]
NPROC = 4


@check(f"Other sizes ({', '.join(map(str, SIZES))}), at {NPROC} ranks: the sum of dist.all_reduce, "
       "in place, sending 2(n-1)/n of the tensor", points=2, visibility="after_published")
def other_sizes(c):
    label = f"{NPROC} ranks, sizes {SIZES}"
    if not _run(c, 3).ok:  # the public checks' run: a deadlock costs seconds
        c.expect(False, label, measured="not tried, since it did not finish at 3 ranks "
                 "with the public sizes", expected="the run finishes")
        return
    run = _run(c, NPROC, SIZES)
    if not c.completed(run, label):
        return
    rows = _rows(run)
    wrong = [f"rank {r['rank']}, size {r['size']}: {why}" for r in rows if (why := _not_like_all_reduce(r))]
    c.expect(not wrong and len(rows) == NPROC * len(SIZES), f"{label}: results",
             measured="; ".join(wrong[:4]) or f"{len(rows)} results, all equal to dist.all_reduce",
             expected="the sum over all ranks, in the input tensor, within 1e-4")
    _bytes_sent(c, _traffic(run, SIZES), NPROC, max(SIZES),
                f"{NPROC} ranks, {max(SIZES)} elements: bytes sent")
