"""What dcp_save.py and dcp_load.py share: the model, its training step, its state as
DCP sees it, and fingerprints of that state.

- build("DDP" | "FSDP2", mesh): MLP(1024, 6) (6.3 M parameters, 25 MB) and its Adam,
  as a DDP model or sharded with fully_shard, from the same weights.
- training_state(): {"model": ..., "optimizer": ...} from get_state_dict, keyed by
  parameter name whatever the wrapper (no "module." prefix, FSDP2 shards as DTensors).
- fingerprints(): a short sha256 of every tensor of the full state, on rank 0 ({} on
  the others): two states are bitwise equal when all their fingerprints are.
"""

from __future__ import annotations

import hashlib

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from models import MLP, mse, regression_batch

WIDTH, DEPTH = 1024, 6


def build(kind: str, mesh, device: torch.device):
    """(model, optimizer, trained): trained is what the training step calls."""
    torch.manual_seed(0)
    model = MLP(WIDTH, DEPTH).to(device)
    if kind == "DDP":
        trained = DDP(model)
    elif kind == "FSDP2":
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        trained = fully_shard(model, mesh=mesh)
    else:
        raise ValueError(f"kind: expected 'DDP' or 'FSDP2', got {kind!r}")
    return model, torch.optim.Adam(model.parameters(), lr=1e-3), trained


def train_step(trained, optimizer, *, rank: int, step: int, device: torch.device) -> float:
    x, y = (t.to(device) for t in regression_batch(rank, step, width=WIDTH))
    loss = mse(trained(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def training_state(model, optimizer) -> dict:
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def fingerprints(model, optimizer) -> dict[str, str]:
    """{tensor name: sha256[:12]} of the full state, gathered to rank 0 (a collective:
    every rank calls it; the others get {})."""
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 only, in CPU memory
    model_state, optimizer_state = get_state_dict(model, optimizer, options=full)
    tensors = {f"model/{k}": v for k, v in model_state.items()}
    for param, state in optimizer_state.get("state", {}).items():
        tensors.update({f"optimizer/{param}/{k}": v for k, v in state.items() if torch.is_tensor(v)})
    return {k: hashlib.sha256(v.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:12]
            for k, v in sorted(tensors.items())}
