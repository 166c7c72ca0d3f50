"""All-reduce written from scratch with point-to-point messages, three ways.

Every function sums ``tensor`` over the ranks of ``group`` in place, exactly like
``dist.all_reduce(tensor)``, and adds the bytes it sent and received to ``traffic``
so the cost of each algorithm can be measured rather than claimed.

- ring_all_reduce: the bandwidth-optimal ring. Split the data into n chunks.
  Reduce-scatter (n-1 steps): pass one chunk to the right neighbour, add the chunk
  arriving from the left; afterwards rank r holds the full sum of chunk r+1.
  All-gather (n-1 steps): pass the finished chunks around the ring.
  Each rank sends 2(n-1) chunks of size 1/n: 2(n-1)/n of the data.
- pipelined_ring_all_reduce: the same ring, with every chunk cut into segments and
  several segments in flight at once, so that adding one segment overlaps the
  transfer of the next, and with each receive posted before its data is due, so
  that a sender never waits to hear that its neighbour is ready. Same bytes.
- naive_ring_all_reduce: pass the whole tensor around the ring n-1 times; each
  rank sends (n-1) times the data.
- reduce_broadcast_all_reduce: every rank sends its tensor to the root, the root
  sums and sends the result back; the root sends and receives (n-1) times the
  data, the others only once, so the root is the bottleneck.
- blocking_ring_all_reduce: the ring with blocking send() then recv(). Every rank
  sends first and nobody receives, so it deadlocks (gloo's send waits for the
  matching recv), even for a tensor of a few bytes.

Each step posts the send and the receive together (isend + irecv, through
dist.batch_isend_irecv) and waits for both, so no rank blocks on a send its
neighbour cannot accept yet. (Ordering blocking sends and receives
by rank parity also works: an exercise in the notebook.)
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict

import torch
import torch.distributed as dist

__all__ = [
    "ALGORITHMS", "ring_all_reduce", "pipelined_ring_all_reduce", "naive_ring_all_reduce",
    "reduce_broadcast_all_reduce", "blocking_ring_all_reduce", "ring_chunks",
]


def _ring_position(group) -> tuple[int, int, int, int]:
    """(my position, ring size, global rank of the right neighbour, of the left one)."""
    n = dist.get_world_size(group)
    me = dist.get_rank(group)

    def global_rank(pos: int) -> int:
        return pos if group is None else dist.get_global_rank(group, pos)

    return me, n, global_rank((me + 1) % n), global_rank((me - 1) % n)


def ring_chunks(flat: torch.Tensor, n: int) -> list[torch.Tensor]:
    """n views of ``flat`` whose sizes differ by at most one element (some may be empty)."""
    return list(torch.tensor_split(flat, n))


def _exchange(send_buf: torch.Tensor, recv_buf: torch.Tensor, right: int, left: int,
              group, traffic: Counter | None) -> None:
    """Send to the right neighbour and receive from the left one at the same time."""
    ops = []
    if send_buf.numel():  # both ends know the chunk sizes, so both skip empty chunks
        ops.append(dist.P2POp(dist.isend, send_buf, right, group))
    if recv_buf.numel():
        ops.append(dist.P2POp(dist.irecv, recv_buf, left, group))
    # Post both, then wait for both. batch_isend_irecv is isend + irecv on gloo; on NCCL it
    # also groups them, which a ring of 2 (left == right) needs to avoid a deadlock.
    for request in dist.batch_isend_irecv(ops) if ops else []:
        request.wait()
    if traffic is not None:
        traffic["sent"] += send_buf.numel() * send_buf.element_size()
        traffic["received"] += recv_buf.numel() * recv_buf.element_size()


def ring_all_reduce(tensor: torch.Tensor, group=None, *, traffic: Counter | None = None) -> torch.Tensor:
    """Sum ``tensor`` over the group in place with reduce-scatter then all-gather.

    Args:
        tensor: a contiguous tensor, the same shape on every rank.
        group: the process group (None: every rank).
        traffic: a Counter that receives "sent" and "received" byte counts.
    """
    me, n, right, left = _ring_position(group)
    if n == 1:
        return tensor
    flat = tensor.view(-1)
    chunks = ring_chunks(flat, n)
    inbox = torch.empty_like(chunks[0])  # chunk 0 is the largest
    # Reduce-scatter: in step s, send chunk (me - s) and add the incoming chunk (me - s - 1).
    for step in range(n - 1):
        send_c, recv_c = chunks[(me - step) % n], chunks[(me - step - 1) % n]
        incoming = inbox[: recv_c.numel()]
        _exchange(send_c, incoming, right, left, group, traffic)
        recv_c += incoming
    # Now chunk (me + 1) holds the sum from every rank. All-gather: pass finished chunks on.
    for step in range(n - 1):
        send_c, recv_c = chunks[(me + 1 - step) % n], chunks[(me - step) % n]
        _exchange(send_c, recv_c, right, left, group, traffic)
    return tensor


def pipelined_ring_all_reduce(tensor: torch.Tensor, group=None, *, segment_bytes: int = 2**20,
                              traffic: Counter | None = None) -> torch.Tensor:
    """ring_all_reduce with every chunk cut into S segments, several of them in flight.

    Transfer k = step·S + segment sends what transfer k-S brought in, so it starts once
    that one has arrived and been added, while up to S transfers are on the wire. On CPU
    (gloo, which sends once the receiver has announced the receive) every receive is
    also posted one step before its data is due.

    Args:
        tensor: a contiguous tensor, the same shape on every rank.
        group: the process group (None: every rank).
        segment_bytes: the largest segment; a chunk of C bytes is cut into
            ceil(C / segment_bytes) segments (the same number on every rank).
        traffic: a Counter that receives "sent" and "received" byte counts.
    """
    me, n, right, left = _ring_position(group)
    if n == 1:
        return tensor
    chunks = ring_chunks(tensor.view(-1), n)
    s = max(1, math.ceil(chunks[0].numel() * tensor.element_size() / segment_bytes))
    segments = [ring_chunks(chunk, s) for chunk in chunks]
    # The steps of ring_all_reduce, (chunk sent, chunk received, add it?), one transfer
    # per segment: plan[k] = (segment sent, segment received, add it?).
    steps = [((me - t) % n, (me - t - 1) % n, True) for t in range(n - 1)]       # reduce-scatter
    steps += [((me + 1 - t) % n, (me - t) % n, False) for t in range(n - 1)]     # all-gather
    plan = [(segments[out][j], segments[into][j], add) for out, into, add in steps for j in range(s)]
    inbox = [ring_chunks(torch.empty_like(chunks[0]), s) for _ in range(2)]  # two steps' worth
    ahead = s if tensor.device.type == "cpu" else 0  # NCCL runs a stream's transfers in order
    pending = defaultdict(list)  # transfer -> its send and receive requests
    landed = {}  # transfer -> where its segment arrives

    def start(send_k: int | None, recv_k: int | None) -> None:
        ops, owners = [], []
        if send_k is not None and plan[send_k][0].numel():
            ops.append(dist.P2POp(dist.isend, plan[send_k][0], right, group))
            owners.append(send_k)
        if recv_k is not None and plan[recv_k][1].numel():
            _, into, add = plan[recv_k]
            # Reduce-scatter segments land in the inbox to be added; all-gather ones in place
            # (they can only arrive after this rank's own copy was sent on).
            landed[recv_k] = inbox[recv_k // s % 2][recv_k % s][: into.numel()] if add else into
            ops.append(dist.P2POp(dist.irecv, landed[recv_k], left, group))
            owners.append(recv_k)
        for k, request in zip(owners, dist.batch_isend_irecv(ops) if ops else []):
            pending[k].append(request)
        if traffic is not None:
            traffic["sent"] += 0 if send_k is None else plan[send_k][0].numel() * tensor.element_size()
            traffic["received"] += 0 if recv_k is None else plan[recv_k][1].numel() * tensor.element_size()

    def finish(k: int) -> None:
        for request in pending.pop(k, []):
            request.wait()
        _, into, add = plan[k]
        if add and k in landed:
            into += landed.pop(k)  # meanwhile the next segments are on the wire

    for k in range(ahead):
        start(None, k)  # the first step's receives, before any send
    for k in range(len(plan)):
        if k >= s:
            finish(k - s)  # the segment sent next (and its inbox slot) is ready
        start(k, k + ahead if k + ahead < len(plan) else None)
    for k in range(max(0, len(plan) - s), len(plan)):
        finish(k)
    return tensor


def naive_ring_all_reduce(tensor: torch.Tensor, group=None, *,
                          traffic: Counter | None = None) -> torch.Tensor:
    """Sum ``tensor`` in place by passing whole tensors around the ring n-1 times.

    Args:
        tensor: a contiguous tensor, the same shape on every rank.
        group: the process group (None: every rank).
        traffic: a Counter that receives "sent" and "received" byte counts.
    """
    me, n, right, left = _ring_position(group)
    passing = tensor.clone()  # what this rank forwards next: first its own data
    inbox = torch.empty_like(tensor)
    for _ in range(n - 1):
        _exchange(passing, inbox, right, left, group, traffic)
        tensor += inbox
        passing, inbox = inbox, passing  # forward what just arrived
    return tensor


def reduce_broadcast_all_reduce(tensor: torch.Tensor, group=None, *, root: int = 0,
                                traffic: Counter | None = None) -> torch.Tensor:
    """Sum ``tensor`` in place: everyone sends to the root, the root sends the sum back.

    Args:
        tensor: a contiguous tensor, the same shape on every rank.
        group: the process group (None: every rank).
        root: the group position that collects and redistributes.
        traffic: a Counter that receives "sent" and "received" byte counts.
    """
    me, n, _, _ = _ring_position(group)

    def global_rank(pos: int) -> int:
        return pos if group is None else dist.get_global_rank(group, pos)

    nbytes = tensor.numel() * tensor.element_size()
    if me == root:
        inboxes = [torch.empty_like(tensor) for _ in range(n - 1)]
        others = [p for p in range(n) if p != root]
        for req in [dist.irecv(buf, src=global_rank(p), group=group) for buf, p in zip(inboxes, others)]:
            req.wait()
        for buf in inboxes:
            tensor += buf
        for req in [dist.isend(tensor, dst=global_rank(p), group=group) for p in others]:
            req.wait()
        sent = received = (n - 1) * nbytes
    else:
        dist.send(tensor, dst=global_rank(root), group=group)
        dist.recv(tensor, src=global_rank(root), group=group)
        sent = received = nbytes
    if traffic is not None:
        traffic["sent"] += sent
        traffic["received"] += received
    return tensor


def blocking_ring_all_reduce(tensor: torch.Tensor, group=None, *,
                             traffic: Counter | None = None) -> torch.Tensor:
    """The ring with blocking send() then recv(): every rank waits in send(). Deadlocks.

    Args:
        tensor: a contiguous tensor, the same shape on every rank.
        group: the process group (None: every rank).
        traffic: a Counter that receives "sent" and "received" byte counts.
    """
    me, n, right, left = _ring_position(group)
    chunks = ring_chunks(tensor.view(-1), n)
    inbox = torch.empty_like(chunks[0])
    for step in range(n - 1):
        send_c, recv_c = chunks[(me - step) % n], chunks[(me - step - 1) % n]
        dist.send(send_c, dst=right, group=group)   # every rank is here, nobody receives
        dist.recv(inbox[: recv_c.numel()], src=left, group=group)
        recv_c += inbox[: recv_c.numel()]
    for step in range(n - 1):
        send_c, recv_c = chunks[(me + 1 - step) % n], chunks[(me - step) % n]
        dist.send(send_c, dst=right, group=group)
        dist.recv(recv_c, src=left, group=group)
    return tensor


ALGORITHMS = {
    "ring": ring_all_reduce,
    "pipelined ring": pipelined_ring_all_reduce,
    "naive ring": naive_ring_all_reduce,
    "reduce+broadcast": reduce_broadcast_all_reduce,
}
