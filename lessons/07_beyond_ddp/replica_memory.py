"""What one DDP replica holds in memory, measured tensor by tensor.

Run it on 2 ranks, from the lessons folder:

    torchrun --standalone --nproc-per-node 2 07_beyond_ddp/replica_memory.py

or from the notebook: launch("07_beyond_ddp/replica_memory.py", nproc=2).

The TinyTransformer is wrapped in DDP (default options) and trained for two steps with
Adam; after the second backward and optimizer step (DDP's buckets rebuilt, Adam's
state created) every rank reports the bytes of the distinct storages of: the
parameters, their .grad tensors, DDP's bucket buffers (seen by a BucketRecorder
hook), Adam's state, and the activations autograd saved during the forward pass
(SavedActivations), per part of the model. Then it measures the activations alone
for batch sizes 4, 8 and 16. Fingerprints of parameters, gradients and Adam's state
show which of these are the same on every rank.
"""

import sys
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).parent))  # models.py and probes.py sit next to this file
from models import TinyTransformer, lm_loss, token_batch  # noqa: E402
from probes import SavedActivations, fingerprint, optimizer_state_tensors, storage_bytes  # noqa: E402

from labutils.course.ddp_probes import BucketRecorder  # noqa: E402
from labutils.dist import init, report  # noqa: E402

BATCH = 8
rank, world_size, device = init()
torch.manual_seed(0)  # the same initial weights on every rank
model = TinyTransformer().to(device)
ddp = DDP(model)
buckets = BucketRecorder(ddp)  # DDP's own all-reduce, plus a record of each bucket buffer
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
meter = SavedActivations(model)

for step in range(2):
    optimizer.zero_grad(set_to_none=True)
    x, y = (t.to(device) for t in token_batch(rank, step, batch_size=BATCH))
    with meter:
        loss = lm_loss(ddp(x), y)
    loss.backward()
    optimizer.step()

params = list(model.parameters())
last = [c for c in buckets.calls if c.iteration == buckets.iteration - 1]
report(
    part="replica", batch_size=BATCH, seq_len=model.cfg.seq_len, width=model.cfg.width,
    parameter_count=sum(p.numel() for p in params), parameter_tensors=len(params),
    parameters=storage_bytes(params),
    gradients=storage_bytes(p.grad for p in params),
    ddp_buckets=sum({c.storage: c.nbytes for c in last}.values()), bucket_count=len(last),
    optimizer_state=storage_bytes(optimizer_state_tensors(optimizer.state)),
    activations=meter.total, activations_by_part=meter.by_part,
    block0_saved=meter.shapes["blocks.0"],
    fingerprints={"parameters": fingerprint(params), "gradients": fingerprint(p.grad for p in params),
                  "optimizer state": fingerprint(optimizer_state_tensors(optimizer.state)),
                  "activations (input batch)": fingerprint([x])},
)

# Activations grow with the tokens in flight; parameters and optimizer state do not.
for batch_size in (4, 8, 16):
    x, y = (t.to(device) for t in token_batch(rank, 99, batch_size=batch_size))
    with meter:
        loss = lm_loss(model(x), y)  # the plain module: no DDP bookkeeping for a measurement
    report(part="activations", batch_size=batch_size, tokens=x.numel(), activations=meter.total)
    del loss
torch.distributed.destroy_process_group()
