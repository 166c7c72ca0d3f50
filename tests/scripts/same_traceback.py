"""Every rank prints the same traceback (its own port and pid in the message) and ends
well; the message quotes a path of torch's build machine, as gloo's errors do."""
import os
import traceback

rank = int(os.environ["RANK"])


def step():
    raise RuntimeError(f"[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
                       f"Connection closed by peer [127.0.0.1]:{40000 + rank}\n"
                       f"a second line of the message, from pid {os.getpid()}")


try:
    step()
except RuntimeError:
    traceback.print_exc()
print(f"rank {rank} carried on")
