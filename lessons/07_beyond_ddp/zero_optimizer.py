"""Optimizer-state sharding: DDP with Adam against DDP with ZeroRedundancyOptimizer(Adam).

Run it on 2 ranks, from the lessons folder:

    torchrun --standalone --nproc-per-node 2 07_beyond_ddp/zero_optimizer.py

or from the notebook: launch("07_beyond_ddp/zero_optimizer.py", nproc=2).

Three runs of the same STEPS training steps from the same weights and data: plain
Adam; ZeroRedundancyOptimizer wrapping Adam (each rank owns whole parameters, about
1/n of the bytes, keeps Adam's state for those only, updates them and broadcasts the
result); the same with parameters_as_bucket_view=True (one broadcast per rank instead
of one per parameter). Each rank reports its optimizer state bytes, the parameters it
owns, the collectives of the last step (DDP's bucket all-reduces from a BucketRecorder,
ZeRO's broadcasts from a CollectiveLog), and the losses; at the
end, whether each run's final weights equal plain Adam's (assert_close, and bitwise).
"""

import sys
from pathlib import Path

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).parent))  # models.py and probes.py sit next to this file
from models import TinyTransformer, lm_loss, token_batch  # noqa: E402
from probes import CollectiveLog, optimizer_state_tensors, storage_bytes  # noqa: E402

from labutils.course.ddp_probes import BucketRecorder  # noqa: E402
from labutils.dist import init, report  # noqa: E402

STEPS, LR = 8, 1e-2
rank, world_size, device = init()
RUNS = {
    "DDP + Adam": None,
    "DDP + ZeroRedundancyOptimizer(Adam)": {"parameters_as_bucket_view": False},
    "the same, parameters_as_bucket_view=True": {"parameters_as_bucket_view": True},
}
final: dict[str, list[torch.Tensor]] = {}
for name, zero_options in RUNS.items():
    torch.manual_seed(0)
    model = TinyTransformer().to(device)
    ddp = DDP(model)
    buckets = BucketRecorder(ddp)
    if zero_options is None:
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)
        state, owned = optimizer.state, list(model.parameters())
    else:
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=LR,
                                            **zero_options)
        state = optimizer.optim.state  # the local Adam: only this rank's parameters
        owned = [p for group in optimizer.optim.param_groups for p in group["params"]]
    losses = []
    with CollectiveLog(["broadcast"]) as log:
        for step in range(STEPS):
            x, y = (t.to(device) for t in token_batch(rank, step))
            buckets.clear()
            log.calls.clear()
            log.phase = "step"
            loss = lm_loss(ddp(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
    final[name] = [p.detach().clone() for p in model.parameters()]
    report(part="run", run=name, losses=losses,
           optimizer_state=storage_bytes(optimizer_state_tensors(state)),
           parameters=storage_bytes(model.parameters()),
           owned_tensors=len(owned), owned_bytes=sum(p.numel() * p.element_size() for p in owned),
           all_reduce_bytes=[c.nbytes for c in buckets.calls],
           broadcasts=[c.to_json() for c in log.calls])

reference = final["DDP + Adam"]
for name, params in final.items():
    try:
        for a, b in zip(params, reference):
            torch.testing.assert_close(a, b)
        equal = "equal (assert_close)"
    except AssertionError:
        equal = "DIFFERENT"
    report(part="check", run=name, equal_to_adam=equal,
           bitwise=all(torch.equal(a, b) for a, b in zip(params, reference)),
           max_abs_diff=max((a - b).abs().max().item() for a, b in zip(params, reference)))
torch.distributed.destroy_process_group()
