"""Test ring.ring_all_reduce against dist.all_reduce and count what it sends.

    torchrun --nproc-per-node 3 ring_test.py --sizes 1,4,7,1000,4099
    labutils launch -n 3 ring_test.py -- --dtype float64

It tests the ring.py of the current folder (or the one --ring names), on tensors of
--dtype (float32 unless told).

For each size, every rank reports report(size=..., max_error=..., in_place=..., returned=...,
bytes_sent=..., collectives=[...], same_memory=...): the largest difference from
dist.all_reduce, whether the input tensor itself holds the sum (in its own memory:
same_memory says whether the ring kept it), the bytes this rank sent inside
ring_all_reduce, and any library collective it called (both counted at the process
group, labutils.grading.probe.count_traffic: the names of the ProcessGroup's methods,
allreduce for dist.all_reduce).
"""

import argparse
import importlib.util

import torch
import torch.distributed as dist

from labutils.dist import init, print0, report
from labutils.grading.probe import POINT_TO_POINT, count_traffic

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--sizes", default="1,4,7,1000,4099", help="tensor sizes, comma-separated")
parser.add_argument("--ring", default="ring.py", help="the file that defines ring_all_reduce")
parser.add_argument("--dtype", default="float32", choices=["float32", "float64"],
                    help="the tensors' element type")
args = parser.parse_args()

rank, world_size, device = init()
spec = importlib.util.spec_from_file_location("ring", args.ring)
ring = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ring)
ring_all_reduce = ring.ring_all_reduce
# Every operation this rank asks of its process group, [name, bytes], counted at the
# ProcessGroup itself: whichever torch.distributed function ring.py calls, it is seen.
traffic = count_traffic()

for size in [int(s) for s in args.sizes.split(",")]:
    g = torch.Generator().manual_seed(100 * size + rank)
    data = torch.randn(size, generator=g, dtype=getattr(torch, args.dtype))
    expected = data.clone()
    dist.all_reduce(expected)
    mine = data.clone()
    memory = mine.view_as(mine)  # the input's memory, as a view: an in-place sum shows in it
    before = len(traffic)
    returned = ring_all_reduce(mine)
    sent = sum(n for name, n, _ in traffic[before:] if name == "send")
    collectives = [name for name, _, _ in traffic[before:] if name not in POINT_TO_POINT]
    # the error of the input tensor, or of its own memory where the ring gave it other
    # memory (tensor.data = ..., set_()): views of the input would not see that sum
    error = max((mine - expected).abs().max().item(), (memory - expected).abs().max().item())
    same_memory = mine.data_ptr() == memory.data_ptr()
    if returned is mine:
        what = "the input"
    elif isinstance(returned, torch.Tensor) and returned.shape == expected.shape:
        summed = (returned - expected).abs().max().item() <= 1e-4
        what = "a new tensor holding the sum" if summed else "a new tensor"
    else:
        what = repr(returned)[:40]  # None, a Work, ...
    report(size=size, max_error=error, in_place=returned is mine, returned=what, bytes_sent=sent,
           collectives=collectives, same_memory=same_memory)
    print0(f"size {size}: max error {error:.2e}, rank 0 sent {sent} bytes "
           f"({sent / (data.element_size() * size):.2f} x the tensor)")
