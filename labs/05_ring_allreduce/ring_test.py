"""Test ring.ring_all_reduce against dist.all_reduce and count what it sends.

    torchrun --nproc-per-node 3 ring_test.py --sizes 1,7,1000,4099
    labutils launch -n 3 ring_test.py

It tests the ring.py of the current folder (or the one --ring names).

For each size, every rank reports report(size=..., max_error=..., in_place=...,
bytes_sent=..., collectives=[...]): the largest difference from dist.all_reduce,
whether the input tensor itself holds the sum, the bytes this rank sent inside
ring_all_reduce, and any library collective it called.
"""

import argparse
import importlib.util
from contextlib import contextmanager

import torch
import torch.distributed as dist

from labutils.dist import init, print0, report

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--sizes", default="1,7,1000,4099", help="tensor sizes, comma-separated")
parser.add_argument("--ring", default="ring.py", help="the file that defines ring_all_reduce")
args = parser.parse_args()

SENDS = ("send", "isend")
COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
               "gather", "scatter", "batch_isend_irecv")


@contextmanager
def counting():
    """Count bytes sent and collectives called while the block runs."""
    seen = {"bytes": 0, "collectives": []}
    originals = {name: getattr(dist, name) for name in SENDS + COLLECTIVES}

    def wrap(name, fn):
        def counted(*a, **kw):
            if name in SENDS:
                tensor = a[0] if a else kw["tensor"]
                seen["bytes"] += tensor.numel() * tensor.element_size()
            else:
                seen["collectives"].append(name)
            return fn(*a, **kw)
        return counted

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield seen
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


rank, world_size, device = init()
spec = importlib.util.spec_from_file_location("ring", args.ring)
ring = importlib.util.module_from_spec(spec)
with counting():  # catches `from torch.distributed import isend` inside ring.py too
    spec.loader.exec_module(ring)
ring_all_reduce = ring.ring_all_reduce

for size in [int(s) for s in args.sizes.split(",")]:
    g = torch.Generator().manual_seed(100 * size + rank)
    data = torch.randn(size, generator=g)
    expected = data.clone()
    dist.all_reduce(expected)
    mine = data.clone()
    with counting() as seen:
        returned = ring_all_reduce(mine)
    error = (mine - expected).abs().max().item()
    report(size=size, max_error=error, in_place=returned is mine, bytes_sent=seen["bytes"],
           collectives=seen["collectives"])
    print0(f"size {size}: max error {error:.2e}, rank 0 sent {seen['bytes']} bytes "
           f"({seen['bytes'] / (4 * size):.2f} x the tensor)")
