"""Expert parallelism: a mixture-of-experts layer whose experts live on different ranks.

Run it on 2 or 4 ranks, from the lessons folder:

    torchrun --standalone --nproc-per-node 2 11_parallelism_in_several_dimensions/moe.py

or from the notebook: launch("11_parallelism_in_several_dimensions/moe.py", nproc=2).

The layer: a router (a Linear from the width to one score per expert) sends each token
to its best-scoring expert (top-1), an expert is a small feed-forward network, and the
token's output is the expert's output times the router's softmax probability for that
expert. There are 2 experts per rank; rank r holds experts 2r and 2r + 1.

Each rank has its own 256 tokens. One forward and backward, expert-parallel:

1. route: each rank scores its tokens and sorts them by expert;
2. counts: an all-to-all of how many tokens each rank sends to each expert, so that
   every rank knows how many it will receive (a tiny all-to-all);
3. dispatch: an all-to-all of the tokens themselves, each to the rank of its expert;
4. the experts run on the tokens they received, from every rank;
5. combine: the reverse all-to-all brings each output back to its token's rank, where
   it is put back in order and weighted by the router's probability.

The all-to-alls are torch.distributed.nn.functional.all_to_all_single, which autograd
runs backwards in backward. The check: every rank also builds the whole layer (all
experts, the same seed) and runs it on all ranks' tokens in one process; its outputs for
this rank's tokens, and every gradient (the router's, and of the experts this rank
holds), must equal the expert-parallel ones.

Run twice: with the router as initialised ("balanced": tokens spread over the experts)
and with a router whose scores favour expert 0 ("skewed"). Reported per run: tokens per
expert, the bytes this rank sent in each all-to-all, and the tokens an expert would drop
if each expert took at most capacity_factor x its fair share (1.25, a common setting).
"""

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from torch import nn

from labutils.dist import init, report

DIM, HIDDEN, TOKENS, EXPERTS_PER_RANK, CAPACITY_FACTOR = 64, 128, 256, 2, 1.25

rank, world_size, device = init()
experts_total = EXPERTS_PER_RANK * world_size
mine = range(rank * EXPERTS_PER_RANK, (rank + 1) * EXPERTS_PER_RANK)


def make_layer() -> tuple[nn.Linear, nn.ModuleList]:
    """The router and every expert, the same on every rank."""
    torch.manual_seed(0)
    router = nn.Linear(DIM, experts_total)
    with torch.no_grad():
        router.bias.zero_()
    experts = nn.ModuleList(nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM))
                            for _ in range(experts_total))
    return router.to(device), experts.to(device)


def tokens_of(r: int) -> torch.Tensor:
    return torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(100 + r)).to(device)


def route(router: nn.Linear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert of each token, the router's probability for it)."""
    probs = F.softmax(router(x), dim=-1)
    weight, expert = probs.max(dim=-1)
    return expert, weight


def moe_one_process(router, experts, x: torch.Tensor) -> torch.Tensor:
    expert, weight = route(router, x)
    out = torch.zeros_like(x)
    for e in range(experts_total):
        here = expert == e
        out[here] = experts[e](x[here])
    return out * weight.unsqueeze(-1)


def moe_expert_parallel(router, experts, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    expert, weight = route(router, x)
    order = torch.argsort(expert, stable=True)               # tokens grouped by expert
    per_expert = torch.bincount(expert, minlength=experts_total)
    # 2. counts: rank r learns how many tokens each rank sends to each of r's experts
    incoming = torch.empty_like(per_expert)
    dist.all_to_all_single(incoming, per_expert)              # chunk j (j's experts) to rank j
    send_splits = per_expert.view(world_size, EXPERTS_PER_RANK).sum(1).tolist()
    recv_splits = incoming.view(world_size, EXPERTS_PER_RANK).sum(1).tolist()
    # 3. dispatch
    received = dist_nn.all_to_all_single(x.new_empty(sum(recv_splits), DIM), x[order],
                                         recv_splits, send_splits)
    # 4. the local experts: from each source rank, its tokens for expert 2r, then 2r + 1
    counts = incoming.view(world_size, EXPERTS_PER_RANK).tolist()
    pieces, start = [], 0
    for source in range(world_size):
        for local, e in enumerate(mine):
            n = counts[source][local]
            pieces.append(experts[e](received[start:start + n]))
            start += n
    processed = torch.cat(pieces) if pieces else received
    # 5. combine: back to the tokens' ranks, back in order, weighted
    returned = dist_nn.all_to_all_single(x.new_empty(TOKENS, DIM), processed, send_splits, recv_splits)
    out = torch.empty_like(returned).index_copy(0, order, returned)
    traffic = {
        "tokens_per_expert": per_expert.tolist(),
        "sent_elsewhere": TOKENS - send_splits[rank],
        "dispatch_bytes": (TOKENS - send_splits[rank]) * DIM * x.element_size(),
        "combine_bytes": (sum(recv_splits) - recv_splits[rank]) * DIM * x.element_size(),
        "count_bytes": (world_size - 1) * EXPERTS_PER_RANK * per_expert.element_size(),
        "received": sum(recv_splits),
    }
    return out * weight.unsqueeze(-1), traffic


def skew(router: nn.Linear) -> None:
    """Make the router favour expert 0: a bias added to that expert's score."""
    with torch.no_grad():
        router.bias[0] = 1.0


for setting in ("balanced", "skewed"):
    router, experts = make_layer()
    ref_router, ref_experts = make_layer()
    if setting == "skewed":
        skew(router)
        skew(ref_router)
    x = tokens_of(rank)
    out, traffic = moe_expert_parallel(router, experts, x)
    out.pow(2).mean().backward()
    # the reference: all ranks' tokens through the whole layer, in this one process
    everyone = torch.cat([tokens_of(r) for r in range(world_size)])
    ref_out = moe_one_process(ref_router, ref_experts, everyone)
    ref_out.view(world_size, TOKENS, DIM).pow(2).mean(dim=(1, 2)).sum().backward()
    mine_ref = ref_out[rank * TOKENS:(rank + 1) * TOKENS]
    ok = True
    for got, want in [(out, mine_ref),
                      # the router's gradient: this rank's tokens only on this rank, so
                      # the ranks' gradients add up to the reference's
                      (dist_nn.all_reduce(router.weight.grad.clone()), ref_router.weight.grad),
                      (dist_nn.all_reduce(router.bias.grad.clone()), ref_router.bias.grad),
                      *[(p.grad, q.grad) for e in mine
                        for p, q in zip(experts[e].parameters(), ref_experts[e].parameters())]]:
        try:
            torch.testing.assert_close(got, want)
        except AssertionError:
            ok = False
    # every rank's view of the whole routing, for the tokens-per-expert table
    all_counts = [torch.zeros(experts_total, dtype=torch.long, device=device) for _ in range(world_size)]
    dist.all_gather(all_counts, torch.tensor(traffic["tokens_per_expert"], device=device))
    per_expert = torch.stack(all_counts).sum(0)
    capacity = int(CAPACITY_FACTOR * world_size * TOKENS / experts_total)
    report(part="moe", setting=setting, equal=ok, **traffic,
           expert_load=per_expert.tolist(), capacity=capacity,
           dropped=int((per_expert - capacity).clamp(min=0).sum()),
           token_bytes=DIM * x.element_size(), tokens=TOKENS, experts=experts_total)
