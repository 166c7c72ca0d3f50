"""What torchrun tells each worker about itself.

Run it on 4 ranks, from this folder:

    torchrun --standalone --nproc-per-node 4 env_report.py

or from a notebook cell, where each rank's values arrive in result.records:

    from labutils import launch
    result = launch("00_first_distributed_run/env_report.py", nproc=4)

torchrun is one agent process that starts --nproc-per-node worker processes, all
running this same file. The only thing that makes one worker different from the
next is its environment: the variables read below.
"""

import os

import torch.distributed as dist

from labutils.dist import report

# The variables torchrun sets in every worker it starts.
TORCHRUN_VARS = (
    "RANK",                        # this worker's number in the whole job: 0 .. WORLD_SIZE-1
    "LOCAL_RANK",                  # its number on this machine (which GPU it should use)
    "WORLD_SIZE",                  # how many workers take part in the job
    "LOCAL_WORLD_SIZE",            # how many of them run on this machine
    "MASTER_ADDR",                 # the host of the store the workers meet at ...
    "MASTER_PORT",                 # ... and its port
    "TORCHELASTIC_RESTART_COUNT",  # how often the agent has restarted the workers so far
)
env = {name: os.environ[name] for name in TORCHRUN_VARS}
print(f"pid {os.getpid()}, started by pid {os.getppid()}: "
      + " ".join(f"{name}={value}" for name, value in env.items()))

# The default init method "env://" reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT,
# and returns once all WORLD_SIZE workers have joined. gloo works on every machine.
dist.init_process_group(backend="gloo")

report(**env, get_rank=dist.get_rank(), get_world_size=dist.get_world_size(),
       pid=os.getpid(), parent_pid=os.getppid())
# init_process_group can return on one worker while a slower one is still connecting to
# it: no worker leaves before every worker has joined, or that one loses its peer.
dist.barrier()
dist.destroy_process_group()
