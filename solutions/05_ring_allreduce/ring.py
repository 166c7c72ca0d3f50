"""A ring all-reduce written from scratch on point-to-point messages.

ring_all_reduce(tensor) does what dist.all_reduce(tensor) does: it replaces the
tensor, in place, by its sum over every rank, using only point-to-point messages
between ring neighbours. The tensor is cut into n chunks (n = world size):

1. reduce-scatter, n-1 steps: each rank sends one chunk to its right neighbour and
   adds the chunk arriving from its left; afterwards rank r holds the complete sum
   of chunk (r + 1) % n;
2. all-gather, n-1 steps: the complete chunks travel once around the ring.

Each rank sends 2(n-1) chunks: 2(n-1)/n of the tensor when the chunks are equal, and
on average over the ranks at any size (uneven chunks differ by one element). Sends and
receives are posted together (isend/irecv) and then waited on: with a blocking
send first, every rank would wait in send for a neighbour that is itself waiting
in send, and the ring would deadlock.

Test it on 3 ranks (ring_test.py compares it with dist.all_reduce):

    torchrun --nproc-per-node 3 ring_test.py
    labutils launch -n 3 ring_test.py
"""

import torch
import torch.distributed as dist


def _exchange(send: torch.Tensor, recv: torch.Tensor, right: int, left: int) -> None:
    """Send to the right and receive from the left at the same time; skip empty chunks."""
    requests = []
    if send.numel():
        requests.append(dist.isend(send, dst=right))
    if recv.numel():
        requests.append(dist.irecv(recv, src=left))
    for request in requests:
        request.wait()


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over every rank, in place, and return it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 1:
        return tensor
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = tensor.view(-1).tensor_split(world)  # views: writing a chunk writes the tensor

    for step in range(world - 1):  # reduce-scatter
        send, recv = chunks[(rank - step) % world], chunks[(rank - step - 1) % world]
        incoming = torch.empty_like(recv)
        _exchange(send, incoming, right, left)
        recv += incoming

    for step in range(world - 1):  # all-gather
        send, recv = chunks[(rank - step + 1) % world], chunks[(rank - step) % world]
        _exchange(send, recv, right, left)
    return tensor
