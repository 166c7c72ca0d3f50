"""Load the checkpoints of dcp_save.py on another number of ranks, into DDP or FSDP2.

Run it after dcp_save.py (4 ranks), here on 2, from the lessons folder:

    torchrun --standalone --nproc-per-node 2 10_current_stack/dcp_load.py --ckpt-dir CKPT

For each checkpoint (CKPT/ddp, saved from DDP; CKPT/fsdp, saved from FSDP2 on 4
ranks) and each wrapper (DDP, FSDP2 on these ranks): a fresh model and Adam, then

    state = training_state(model, optimizer)   # get_state_dict: tensors of the right shapes
    dcp.load(state, checkpoint_id=...)         # fills them from the files, in place
    set_state_dict(model, optimizer, ...)      # puts them into the model and optimizer

dcp.load reads, on every rank, the pieces of the files that rank's tensors need,
whatever the number of ranks that wrote them. Reported: fingerprints of the loaded
full state, and the shape of one parameter on this rank.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import set_state_dict
from torch.distributed.device_mesh import init_device_mesh

from ckpt_state import build, fingerprints, training_state
from labutils.dist import init, report

parser = argparse.ArgumentParser()
parser.add_argument("--ckpt-dir", default="checkpoints", help="where dcp_save.py put the checkpoints")
args = parser.parse_args()

rank, world_size, device = init()
torch.set_num_threads(1)
mesh = init_device_mesh(device.type, (world_size,))

for checkpoint in ["ddp", "fsdp"]:
    for wrapper in ["DDP", "FSDP2"]:
        model, optimizer, _ = build(wrapper, mesh, device)
        state = training_state(model, optimizer)
        dcp.load(state, checkpoint_id=os.path.join(args.ckpt_dir, checkpoint))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        loaded = fingerprints(model, optimizer)
        weight = model.layers[0].weight
        local = weight.to_local() if hasattr(weight, "to_local") else weight
        report(part="loaded", checkpoint=checkpoint, wrapper=wrapper, fingerprints=loaded if rank == 0 else None,
               local_shape=list(local.shape))
dist.destroy_process_group()
