"""Wrong fixes of lab 05 that a learner in a hurry would submit; each must fail the lab.

Kept for instructors and the tests (`labutils wrongfixes labs/05_ring_allreduce`);
never in a learner's copy.
"""

from labutils.grading.wrongfix import WrongFix

BODY = '''    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 1:
        return tensor
'''

# the solution's reduce-scatter and all-gather
RING = '''    chunks = tensor.view(-1).tensor_split(world)  # views: writing a chunk writes the tensor

    for step in range(world - 1):  # reduce-scatter
        send, recv = chunks[(rank - step) % world], chunks[(rank - step - 1) % world]
        incoming = torch.empty_like(recv)
        _exchange(send, incoming, right, left)
        recv += incoming

    for step in range(world - 1):  # all-gather
        send, recv = chunks[(rank - step + 1) % world], chunks[(rank - step) % world]
        _exchange(send, recv, right, left)
    return tensor
'''

CHUNKS = "    chunks = tensor.view(-1).tensor_split(world)  # views: writing a chunk writes the tensor\n"
TAIL = "        _exchange(send, recv, right, left)\n    return tensor\n"
# the solution's ring, run on a copy of the tensor (for show): its sums are thrown away
SHOW_RING = (RING.replace(CHUNKS, "    shown = tensor.clone()  # the ring, for show, on a copy\n"
                                  "    chunks = shown.view(-1).tensor_split(world)\n")
             .replace("    return tensor\n", ""))


def _passed_whole(condition: str, comment: str) -> str:
    """Lines that pass a tensor meeting `condition` around the ring whole, n-1 times (the
    naive ring), before the chunked ring."""
    return (f"    if {condition}:  # {comment}\n"
            "        passing = tensor.clone()\n"
            "        for _ in range(world - 1):\n"
            "            incoming = torch.empty_like(passing)\n"
            "            _exchange(passing, incoming, right, left)\n"
            "            tensor += incoming\n"
            "            passing = incoming\n"
            "        return tensor\n")


WRONG_FIXES = [
    WrongFix(
        "calls the library's all-reduce through torch.distributed.distributed_c10d",
        why="no deadlock and the right sum, but no ring: only bytes counted at the process "
            "group see the collective (a wrapper of the dist.* names misses this path)",
        edits={"ring.py": [(BODY, '''    from torch.distributed import distributed_c10d

    distributed_c10d.all_reduce(tensor)  # the ring can wait
    return tensor
''')]}),
    WrongFix(
        "a ring whose neighbours are right only at 2 ranks",
        why="at 2 ranks the other rank is both neighbours; at 3 the ring is broken",
        edits={"ring.py": [("right, left = (rank + 1) % world, (rank - 1) % world",
                            "right = left = 1 - rank  # the other rank")]}),
    WrongFix(
        "sums a copy and returns it: the input tensor is left as it was",
        why="dist.all_reduce works in place; callers that ignore the return value get nothing",
        edits={"ring.py": [(BODY, BODY + "    tensor = tensor.clone()  # leave the input alone\n")]}),
    WrongFix(
        "a naive ring: every rank passes its whole tensor around, n-1 times",
        why="the right sum with point-to-point messages only, but each rank sends n-1 "
            "tensors instead of 2(n-1)/n: the same at 2 ranks, twice the optimum's bytes at 4",
        edits={"ring.py": [(RING, '''    passing = tensor.clone()
    for _ in range(world - 1):  # hand what came from the left on to the right
        incoming = torch.empty_like(passing)
        _exchange(passing, incoming, right, left)
        tensor += incoming
        passing = incoming
    return tensor
''')]}),
    WrongFix(
        "a direct exchange: each chunk goes straight to the rank that sums it, then back",
        why="the right sums and 2(n-1)/n of the tensor in sends, but every rank talks to "
            "every other (a reduce-scatter and an all-gather as all-to-all), not around a "
            "ring of neighbours",
        edits={"ring.py": [(RING, '''    chunks = tensor.view(-1).tensor_split(world)
    mine = chunks[rank]
    incoming = [torch.empty_like(mine) for _ in range(world)]
    requests = []
    for other in range(world):  # every rank sends me my chunk, I send each theirs
        if other == rank:
            continue
        if chunks[other].numel():
            requests.append(dist.isend(chunks[other], dst=other))
        if mine.numel():
            requests.append(dist.irecv(incoming[other], src=other))
    for request in requests:
        request.wait()
    for other in range(world):
        if other != rank:
            mine += incoming[other]
    requests = []
    for other in range(world):  # then my summed chunk to every rank
        if other == rank:
            continue
        if mine.numel():
            requests.append(dist.isend(mine, dst=other))
        if chunks[other].numel():
            requests.append(dist.irecv(chunks[other], src=other))
    for request in requests:
        request.wait()
    return tensor
''')]}),
    WrongFix(
        "tensors with fewer elements than ranks handed to dist.all_reduce",
        why="the edge case of empty chunks goes to the library collective the lab replaces",
        edits={"ring.py": [(BODY, BODY + '''    if tensor.numel() < world:  # too small to cut into a chunk per rank
        dist.all_reduce(tensor)
        return tensor
''')]}),
    WrongFix(
        "torch.chunk for the chunks, tensors smaller than the world passed whole around the ring",
        why="torch.chunk gives fewer than n chunks for some sizes of at least n elements (4 at "
            "3 ranks, 5 or 9 at 4): the ring then indexes a chunk that is not there",
        edits={"ring.py": [("    chunks = tensor.view(-1).tensor_split(world)  # views: writing a chunk writes the tensor\n",
                            _passed_whole("tensor.numel() < world", "too small for a chunk per rank: pass it around whole")
                            + "    chunks = tensor.view(-1).chunk(world)  # views: writing a chunk writes the tensor\n")]}),
    WrongFix(
        "the buffer for the incoming chunk made with torch.zeros(n): float32 on the CPU",
        why="right for every float32 CPU tensor, but the buffer is not like the tensor: a "
            "float64 chunk does not fit it (and on a GPU, NCCL cannot receive into CPU memory); "
            "torch.empty_like(recv) is",
        edits={"ring.py": [("        incoming = torch.empty_like(recv)\n",
                            "        incoming = torch.zeros(recv.numel())\n")]}),
    WrongFix(
        "sums in float64 whatever the dtype, in a copy cast back into the tensor",
        why="right sums, and 2(n-1)/n of a float64 tensor, but a float32 tensor travels as "
            "float64: twice the bytes the ring should send "
            "(found by an audit, 2026-11-30: it scored 0.625)",
        edits={"ring.py": [(CHUNKS, "    flat = tensor.view(-1).to(torch.float64)  # sum in double: no rounding on the way\n"
                                    "    chunks = flat.tensor_split(world)\n"),
                           (TAIL, "        _exchange(send, recv, right, left)\n"
                                  "    tensor.copy_(flat.view_as(tensor))\n    return tensor\n")]}),
    WrongFix(
        "the naive ring for tensors under 256 elements, the chunked ring from there",
        why="right sums, point-to-point between neighbours, and 2(n-1)/n of the largest "
            "tensor, but each small tensor travels whole, n-1 times: 14 elements of a "
            "7-element tensor at 3 ranks, not 9 or 10 "
            "(found by an audit, 2026-11-30: it scored 1.000 when only the largest size's "
            "bytes were counted)",
        edits={"ring.py": [(CHUNKS, _passed_whole("tensor.numel() < 256", "small: not worth cutting into chunks")
                           + CHUNKS)]}),
    WrongFix(
        "sums a flat copy, then gives the input its memory: tensor.data = copy",
        why="the input tensor object holds the sum and is returned, but its own memory, which "
            "every view of it shares (a gradient bucket's view, a slice), still holds the "
            "rank's values: not in place as dist.all_reduce is "
            "(found by an audit, 2026-11-30: it scored 1.000; set_() does the same)",
        edits={"ring.py": [(CHUNKS, "    flat = tensor.detach().clone().view(-1)\n"
                                    "    chunks = flat.tensor_split(world)\n"),
                           (TAIL, "        _exchange(send, recv, right, left)\n"
                                  "    tensor.data = flat.view_as(tensor)  # the sum, in the input\n"
                                  "    return tensor\n")]}),
    WrongFix(
        "the ring run on a copy for show, the answer from the functional in-place all_reduce_",
        why="right sums and ring traffic, but the sums come from a library collective "
            "(torch.ops._c10d_functional.all_reduce_, all_reduce_inplace's op), which the "
            "traffic probe did not log (found by an audit, 2026-11-30, eleventh audit: it "
            "scored 1.000)",
        edits={"ring.py": [(RING, SHOW_RING
                            + "    torch.ops._c10d_functional.all_reduce_(tensor, 'sum', dist.group.WORLD.group_name)\n"
                            + "    torch.ops._c10d_functional.wait_tensor(tensor)\n    return tensor\n")]}),
    WrongFix(
        "three chunks, as at the docstring's 3 ranks, whatever the world size",
        why="right at 3 ranks only: at 2 ranks the third chunk is never summed, at 4 one chunk "
            "is never sent; wrong sums were worth 2.5 points of 16 and no required check "
            "(found by an audit, 2026-11-30, eleventh audit: it scored 0.719)",
        edits={"ring.py": [("tensor.view(-1).tensor_split(world)  # views",
                            "tensor.view(-1).tensor_split(3)  # views")]}),
    WrongFix(
        "torch.chunk for the chunks, the naive ring where it gives fewer chunks than ranks",
        why="right sums, but a tensor that torch.chunk cuts into fewer than n chunks (4 "
            "elements at 3 ranks, 5 or 9 at 4) travels whole, n-1 times: too many bytes at 4 "
            "ranks only, where the hidden check's 2 points were all it cost "
            "(found by an audit, 2026-11-30, eleventh audit: it scored 0.938)",
        edits={"ring.py": [(CHUNKS, CHUNKS.replace("tensor_split(world)", "chunk(world)")
                            + _passed_whole("len(chunks) < world",
                                            "chunk() gave fewer chunks: pass it around whole"))]}),
    WrongFix(
        "the ring run on a copy for show, the answer from the gloo backend's own allreduce",
        why="right sums and ring traffic, but the sums come from the library's all-reduce, "
            "called on the backend under the process group (group._get_backend(device)), "
            "which the traffic probe did not log (found by an audit, 2026-11-30, eleventh "
            "audit: it scored 1.000)",
        edits={"ring.py": [(RING, SHOW_RING
                            + "    backend = dist.group.WORLD._get_backend(tensor.device)\n"
                            + "    backend.allreduce([tensor]).wait()\n    return tensor\n")]}),
]
