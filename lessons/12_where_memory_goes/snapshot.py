"""On a GPU: the caching allocator's own account of one training step, and a snapshot of it.

    launch("12_where_memory_goes/snapshot.py", nproc=1)     # needs CUDA

The model of model.py takes one Adam step on the GPU while the allocator records its
history (torch.cuda.memory._record_memory_history). torch.cuda.memory_allocated() is
read at the moments of the step: the model on the GPU, with the batch, after the forward
pass, after backward, after the optimizer step; and the peak (max_memory_allocated).
Then the batch, the loss and cuBLAS's workspaces (the allocator counts them too) are
freed, and a last reading is the training state alone. The snapshot
(torch.cuda.memory._snapshot()) is written as a pickle next to the rank's logs: drag
it into https://pytorch.org/memory_viz to see every allocation on a timeline, with the
stack that made it. Reported: the readings, the peak, the parameter count, the
workspaces' blocks, the sizes of the blocks left at the end, and the snapshot's path
and number of recorded events.
"""

import pickle
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))  # model.py sits next to this file
from model import batch, make_mlp

from labutils.course.ddp_probes import rank_output_dir
from labutils.dist import report

ROWS = 64

if not torch.cuda.is_available():
    raise SystemExit("snapshot.py needs a CUDA GPU: torch.cuda.is_available() is False here")
device = torch.device("cuda", 0)
torch.cuda.memory._record_memory_history(max_entries=100_000)
readings = {}
model = make_mlp().to(device)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
torch.cuda.synchronize()
readings["model"] = torch.cuda.memory_allocated(device)
x, y = (t.to(device) for t in batch(0, rows=ROWS))
readings["inputs"] = torch.cuda.memory_allocated(device)
loss = F.mse_loss(model(x), y)
readings["after forward"] = torch.cuda.memory_allocated(device)
loss.backward()
readings["after backward"] = torch.cuda.memory_allocated(device)
optimizer.step()
torch.cuda.synchronize()
readings["after step"] = torch.cuda.memory_allocated(device)
snapshot = torch.cuda.memory._snapshot()
torch.cuda.memory._record_memory_history(enabled=None)
# What else the allocator counts: cuBLAS keeps workspaces for the threads that run matrix
# multiplications (the forward's, and autograd's own thread for the backward), and torch
# allocates them through the caching allocator, so memory_allocated counts them.
# Freed here, with the batch and the loss, what is left is the training state alone.
peak = torch.cuda.max_memory_allocated(device)
# the blocks live after the step that cuBLAS asked for, found by the C++ frames recorded
workspaces = [block["size"] for segment in snapshot["segments"] for block in segment["blocks"]
              if block["state"] == "active_allocated"
              and any("workspace" in frame.get("name", "").lower() for frame in block.get("frames", []))]
del loss, x, y
torch._C._cuda_clearCublasWorkspaces()
torch.cuda.synchronize()
readings["state alone"] = torch.cuda.memory_allocated(device)
live = torch.cuda.memory._snapshot()  # the blocks still allocated, by size: what the state is
sizes: dict[int, int] = {}
for segment in live["segments"]:
    for block in segment["blocks"]:
        if block["state"] == "active_allocated":
            sizes[block["size"]] = sizes.get(block["size"], 0) + 1
path = rank_output_dir() / "memory_snapshot.pickle"
path.write_bytes(pickle.dumps(snapshot))
events = sum(len(trace) for trace in snapshot.get("device_traces", []))
report(part="snapshot", readings=readings, peak=peak,
       numel=sum(p.numel() for p in model.parameters()), rows=ROWS, path=str(path), events=events,
       live_blocks=sorted(sizes.items(), reverse=True), workspaces=workspaces)
