"""DeviceMesh and DTensor: where the pieces of a tensor live, and what moving them costs.

Run it on 4 ranks (a 2 x 2 mesh), from the lessons folder:

    torchrun --standalone --nproc-per-node 4 10_current_stack/placements.py

or from the notebook: launch("10_current_stack/placements.py", nproc=4).

One global tensor X (1024 x 1024 float32, 4 MiB, the same numbers on every rank) is
laid out on the mesh with several placements, one per mesh dimension:

    Replicate()   the ranks along that mesh dimension hold the same data
    Shard(d)      the ranks along that mesh dimension split tensor dimension d
    Partial()     the ranks along that mesh dimension hold tensors of the full shape,
                  and the value is their sum

Reported: which rows and columns each rank holds under each layout, and under a split
that does not come out even (X's first 1023 rows over 2 ranks); then, for each
redistribution in CASES, the collectives it issued (CollectiveCounter, i.e.
CommDebugMode with sizes) and whether the result is the right global tensor; last, what
CommDebugMode counts around a barrier and a send/recv, which it does not see.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from labutils.course.comm_count import CollectiveCounter
from labutils.dist import init, report

rank, world_size, device = init()
if world_size != 4:
    raise SystemExit(f"placements.py needs 4 ranks for its 2 x 2 mesh, not {world_size}")
mesh = init_device_mesh(device.type, (2, 2))  # ranks [[0, 1], [2, 3]]; dim 0 pairs 0-2 and 1-3
coords = mesh.get_coordinate()                # this rank's place: rank 3 is at [1, 1]
N = 1024
X = torch.arange(N * N, dtype=torch.float32, device=device).reshape(N, N)  # X[i, j] = N * i + j


def span(values: torch.Tensor) -> str:
    """Which rows and columns of X a local tensor holds (read from its values)."""
    rows, cols = values[:, 0] // N, values[0, :] % N
    return f"rows {int(rows[0])}-{int(rows[-1])}, cols {int(cols[0])}-{int(cols[-1])}"


# 1. Layouts: what each rank holds.
for placements in [(Replicate(), Replicate()), (Shard(0), Replicate()), (Replicate(), Shard(0)),
                   (Shard(0), Shard(1))]:
    d = distribute_tensor(X, mesh, placements)
    report(part="layout", placements=str(placements), coords=coords,
           local_shape=list(d.to_local().shape), holds=span(d.to_local()))

# A size that does not divide: 1023 rows over the 2 ranks of mesh dim 0, split as torch.chunk
# splits them (512 and 511).
d = distribute_tensor(X[:N - 1], mesh, (Shard(0), Replicate()))
report(part="uneven", placements=str(d.placements), rows=N - 1, coords=coords,
       local_shape=list(d.to_local().shape), holds=span(d.to_local()))

# 2. Partial: the natural way to get one. A @ B with A split by columns and B by rows:
# each rank multiplies its own pieces, and the product is the SUM of the ranks' results.
A = torch.randn(8, 16, generator=torch.Generator().manual_seed(0)).to(device)
B = torch.randn(16, 8, generator=torch.Generator().manual_seed(1)).to(device)
a = distribute_tensor(A, mesh, (Replicate(), Shard(1)))
b = distribute_tensor(B, mesh, (Replicate(), Shard(0)))
with CollectiveCounter(mesh) as comm:
    product = a @ b
with CollectiveCounter(mesh) as comm_full:
    full = product.full_tensor()  # Partial -> Replicate: the sum is taken here
report(part="matmul", a=str(a.placements), b=str(b.placements), product=str(product.placements),
       product_calls=comm.calls, local_shape=list(product.to_local().shape),
       full_calls=comm_full.calls, equal=bool(torch.allclose(full, A @ B)))


def partial_x() -> DTensor:
    """X as a Partial over mesh dim 1: the rank at column c holds (c + 1) * X / 3, so the
    two pieces sum to X."""
    return DTensor.from_local((coords[1] + 1) * X / 3, mesh, (Replicate(), Partial()))


# 3. Redistributions and the collectives each costs.
CASES = [
    ((Replicate(), Shard(0)), (Replicate(), Replicate())),
    ((Shard(0), Shard(1)), (Replicate(), Replicate())),
    ((Replicate(), Partial()), (Replicate(), Replicate())),
    ((Replicate(), Partial()), (Replicate(), Shard(0))),
    # an all-to-all on GPUs; on a CPU mesh DTensor falls back to an all-gather and a slice
    ((Replicate(), Shard(0)), (Replicate(), Shard(1))),
    ((Replicate(), Replicate()), (Shard(0), Shard(1))),
]
for source, target in CASES:
    start = partial_x() if isinstance(source[1], Partial) else distribute_tensor(X, mesh, source)
    with CollectiveCounter(mesh) as comm:
        moved = start.redistribute(mesh, target)
    correct = torch.allclose(moved.full_tensor(), X)  # every rank calls full_tensor: a collective
    report(part="redistribute", source=str(source), target=str(target), calls=comm.calls,
           counts={op.__name__: n for op, n in comm.get_comm_counts().items()},
           local_shape=list(moved.to_local().shape), correct=bool(correct))

# 4. What CommDebugMode does not count: a barrier, and a send/recv between ranks 0 and 1
# (and 2 and 3). It counts the collectives in its list; these are not in it.
with CommDebugMode() as unseen:
    dist.barrier()
    message = torch.zeros(4, device=device)
    if rank % 2 == 0:
        dist.send(message, rank + 1)
    else:
        dist.recv(message, rank - 1)
report(part="uncounted", total=unseen.get_total_counts(),
       counts={str(op): n for op, n in unseen.get_comm_counts().items()})
