"""Same initialisation on every rank, or not: what DDP's broadcast hides and what it cannot.

    torchrun --nproc-per-node 2 init_every_rank.py

The model has ordinary parameters and one random tensor that is neither a parameter
nor a buffer (a fixed random feature mask, drawn in __init__). DDP(model) broadcasts
rank 0's parameters and buffers to every rank, so parameters that started different
end up equal; the mask is not part of the module's state, so it stays what each rank
drew. The model is built twice: first without seeding (torch seeds every process
differently), then after torch.manual_seed(0) on every rank. Reported per rank and
case: fingerprints of parameters before and after DDP(model), of the mask, and of the
output on the same input.
"""

import hashlib

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from labutils.dist import init, report

rank, world_size, device = init()


def fingerprint(*tensors: torch.Tensor) -> str:
    return hashlib.sha256(b"".join(t.detach().cpu().numpy().tobytes() for t in tensors)).hexdigest()[:8]


class MaskedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 2)
        self.mask = (torch.rand(8) > 0.5).float()  # plain attribute: DDP never sees it


for case in ("unseeded", "seeded"):
    if case == "seeded":
        torch.manual_seed(0)  # before building the model, on every rank
    model = MaskedNet().to(device)
    before = fingerprint(*model.parameters())
    ddp = DDP(model)
    after = fingerprint(*model.parameters())
    out = model.fc(torch.ones(1, 8, device=device) * model.mask.to(device))
    report(case=case, params_before_ddp=before, params_after_ddp=after,
           mask=fingerprint(model.mask), output=fingerprint(out))
torch.distributed.destroy_process_group()
