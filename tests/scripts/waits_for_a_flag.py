"""Rank 1 waits for a flag that nothing sets, outside any collective; rank 0 waits for it in
barrier(). No rank fails and no hang is reported (run with hang_timeout=None): only the
timeout ends it, and the summary says where each rank was."""
import time

import torch.distributed as dist

dist.init_process_group("gloo")
print("started", flush=True)
done = False
if dist.get_rank() == 1:
    while not done:  # waits here
        time.sleep(0.05)
dist.barrier()  # rank 0 waits here
