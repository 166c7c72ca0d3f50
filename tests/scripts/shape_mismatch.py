"""Two ranks pass tensors of different sizes to one all_reduce: gloo aborts the rank that
receives more than it expects (a C++ exception, SIGABRT, no Python traceback)."""
import torch
import torch.distributed as dist

from labutils.dist import init

rank, world_size, device = init()
x = torch.ones(1 if rank == 0 else 8)  # the bug: the ranks disagree on the size
dist.all_reduce(x)
dist.destroy_process_group()
