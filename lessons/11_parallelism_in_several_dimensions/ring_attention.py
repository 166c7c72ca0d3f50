"""Context parallelism: causal attention over a sequence split across ranks, by a ring.

Run it on 2 or 4 ranks, from the lessons folder:

    torchrun --standalone --nproc-per-node 4 11_parallelism_in_several_dimensions/ring_attention.py

or from the notebook: launch("11_parallelism_in_several_dimensions/ring_attention.py", nproc=4).

One sequence of 1024 positions (4 heads of 32 features, the same q, k and v on every
rank) is split along the positions, and each rank keeps the queries, keys and values of
its part. Attention needs every key for every query, so the ranks pass their keys and
values around a ring: at each of n steps a rank attends its queries to the block of
keys and values it holds, then sends that block to the next rank and receives one from
the previous (isend/irecv, posted together). The blocks' results are merged with the
online softmax: a running maximum and sum per query, so that the merged result is
exactly softmax over all keys.

Causal attention (a query sees only the keys at or before its position) makes the work
uneven: with the positions split in n consecutive parts, rank 0 attends only to its
own block and the last rank to all n. Two layouts:

- contiguous: rank r holds part r of n;
- zigzag: the positions are cut in 2n parts and rank r holds parts r and 2n-1-r, one
  early and one late, so that every rank has the same number of (query, key) pairs to
  compute.

Each rank's queries and each block travel in parts (1 in the contiguous layout, 2 in
the zigzag one), and a (query part, key part) pair whose keys all come after its
queries is skipped. Reported per layout: the rank's output against full causal
attention computed in one process (assert_close); the attention scores it computed
and the (query, key) pairs causal attention needs for its queries; the bytes it sent.
The ring passes every block on, whether or not this rank had a use for it: the next
rank may need it.
"""

import math

import torch
import torch.distributed as dist

from labutils.dist import init, report

SEQ, HEADS, HEAD_DIM = 1024, 4, 32

rank, world_size, device = init()
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(HEADS, SEQ, HEAD_DIM, generator=g).to(device) for _ in range(3))


def full_causal(q, k, v) -> torch.Tensor:
    """Causal attention in one process: the reference."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def parts_of(r: int, layout: str) -> list[int]:
    """Which of the sequence's parts rank r holds (positions split in n or 2n parts)."""
    return [r] if layout == "contiguous" else [r, 2 * world_size - 1 - r]


def positions(r: int, layout: str) -> torch.Tensor:
    cuts = world_size if layout == "contiguous" else 2 * world_size
    size = SEQ // cuts
    return torch.cat([torch.arange(p * size, (p + 1) * size) for p in parts_of(r, layout)]).to(device)


def ring_attention(layout: str) -> tuple[torch.Tensor, int, int]:
    """This rank's output for its positions; the attention scores it computed (entries
    of the (query, key) blocks it did not skip); the bytes it sent."""
    mine = positions(rank, layout)
    q_mine = q[:, mine]
    chunk = SEQ // (world_size if layout == "contiguous" else 2 * world_size)
    chunks = [slice(start, start + chunk) for start in range(0, len(mine), chunk)]
    block = torch.stack([k[:, mine], v[:, mine]])  # what travels: keys and values
    block_pos = mine
    out = torch.zeros_like(q_mine)
    running_max = torch.full((HEADS, len(mine), 1), -math.inf, device=device)
    running_sum = torch.zeros((HEADS, len(mine), 1), device=device)
    computed, sent = 0, 0
    for step in range(world_size):
        for qs in chunks:          # each part of this rank's queries ...
            for ks in chunks:      # ... against each part of the block it holds now
                qp, kp = mine[qs], block_pos[ks]
                if qp.max() < kp.min():
                    continue       # every key after every query: masked out, skipped
                visible = qp.view(-1, 1) >= kp.view(1, -1)  # causal: key at or before query
                scores = q_mine[:, qs] @ block[0][:, ks].transpose(-1, -2) / math.sqrt(HEAD_DIM)
                scores = scores.masked_fill(~visible, -math.inf)
                computed += scores.numel()
                new_max = torch.maximum(running_max[:, qs], scores.amax(dim=-1, keepdim=True))
                scale_old = torch.exp(running_max[:, qs] - new_max)  # rescale what was summed
                weights = torch.exp(scores - new_max)
                running_sum[:, qs] = running_sum[:, qs] * scale_old + weights.sum(dim=-1, keepdim=True)
                out[:, qs] = out[:, qs] * scale_old + weights @ block[1][:, ks]
                running_max[:, qs] = new_max
        if step < world_size - 1:  # pass the block on: to rank + 1, from rank - 1
            incoming, incoming_pos = torch.empty_like(block), torch.empty_like(block_pos)
            to, frm = (rank + 1) % world_size, (rank - 1) % world_size
            requests = [dist.isend(block, to), dist.isend(block_pos, to),
                        dist.irecv(incoming, frm), dist.irecv(incoming_pos, frm)]
            for request in requests:
                request.wait()
            sent += block.numel() * block.element_size()
            block, block_pos = incoming, incoming_pos
    return out / running_sum, computed, sent


reference = full_causal(q, k, v)
for layout in ("contiguous", "zigzag"):
    out, computed, sent = ring_attention(layout)
    mine = positions(rank, layout)
    try:
        torch.testing.assert_close(out, reference[:, mine])
        equal = True
    except AssertionError:
        equal = False
    # the work: (query, key) pairs a causal mask leaves, for this rank's queries
    needed = int(sum(p + 1 for p in mine.tolist())) * HEADS
    report(part="ring", layout=layout, equal=equal, computed=computed, needed=needed, sent_bytes=sent,
           positions=len(mine), kv_bytes=2 * HEADS * SEQ * HEAD_DIM * q.element_size())

# torch's own context parallelism (torch.distributed.tensor.experimental.context_parallel)
# swaps scaled_dot_product_attention for a ring over the mesh; here, on the CPU's kernel
try:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh(device.type, (world_size,))
    qq, kk, vv = (t.unsqueeze(0).clone() for t in (q, k, v))
    with context_parallel(mesh, buffers=[qq, kk, vv], buffer_seq_dims=[2, 2, 2]):
        torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
    torch_cp = "ran"
except Exception as exc:  # noqa: BLE001 - what it says is the result
    torch_cp = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
report(part="torch_cp", result=torch_cp)
