"""A parameter that takes no part in the loss: an error on every rank, or a hang.

Run it on 2 ranks, from the lessons folder:

    torchrun --standalone --nproc-per-node 2 03_bucketing_and_overlap/unused.py --skip every-rank
    torchrun --standalone --nproc-per-node 2 03_bucketing_and_overlap/unused.py --skip rank0-last-step

or from the notebook: launch("03_bucketing_and_overlap/unused.py", nproc=2, args=[...]).

BranchNet's branch layer is used only when use_branch is True, as an auxiliary head
used only for some batches would be. DDP's defaults (find_unused_parameters=False)
expect every parameter to get a gradient in every backward.

- every-rank: no rank uses the branch. The reducer waits for the branch's gradients,
  which never come; the next forward raises "Expected to have finished reduction in
  the prior iteration ...": an error at the second iteration, on every rank.
- rank0-last-step: rank 0 skips the branch in its last step only, then every rank
  meets at a barrier before rank 0 would save a checkpoint. Rank 1 waits inside
  backward for rank 0's part of the branch's all-reduce; rank 0 waits in the barrier.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).parent))  # models.py sits next to this file
from models import BranchNet, batch  # noqa: E402

from labutils.course.ddp_probes import rank_output_dir  # noqa: E402
from labutils.dist import init  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--skip", choices=["every-rank", "rank0-last-step"], required=True)
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

rank, world_size, device = init()
ddp = DDP(BranchNet().to(device))
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)

for step in range(args.steps):
    if args.skip == "every-rank":
        use_branch = False
    else:
        use_branch = not (rank == 0 and step == args.steps - 1)
    x, _ = batch(rank, step, size="small", n=8)
    loss = ddp(x[:, :64].to(device), use_branch=use_branch).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step} done (branch {'used' if use_branch else 'skipped'})", flush=True)

dist.barrier()  # everyone here before rank 0 saves the checkpoint
if rank == 0:
    torch.save(ddp.module.state_dict(), rank_output_dir() / "checkpoint.pt")
dist.destroy_process_group()
