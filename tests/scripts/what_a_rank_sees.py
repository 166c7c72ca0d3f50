"""Reports what a rank sees of its own process, for comparing a warm start with a cold
one (tests/run/test_warm.py): each value must be the same whichever way the rank started."""
import gc
import locale
import logging
import multiprocessing
import os
import random
import signal
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from labutils.dist import report

MARK = "labutils_test_mark"


def square(x):  # defined in the script: must pickle for DataLoader workers and a spawn pool
    return x * x


def collate(batch):
    return [square(int(x)) for x in batch]


if __name__ == "__main__":
    dist.init_process_group("gloo")
    draw = float(torch.rand(1))  # before anything below uses torch's generator
    leaked = getattr(torch, MARK, None)  # a previous run's change, had it reached us
    setattr(torch, MARK, os.getpid())
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    workers = list(DataLoader(list(range(6)), batch_size=3, num_workers=2, collate_fn=collate))
    spawned = None
    filters = len(warnings.filters)  # before the script imports anything of its own
    umask = os.umask(0)
    os.umask(umask)
    import torch._dynamo  # what DDP's constructor imports
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    debug_dir, inductor_cache = torch._dynamo.config.debug_dir_root, cache_dir()
    if "--spawn" in sys.argv:  # fresh interpreters that import this script: slow, asked for
        with multiprocessing.get_context("spawn").Pool(2) as pool:
            spawned = pool.map(square, [1, 2, 3])
    report(
        argv=sys.argv[1:], argv0=os.path.basename(sys.argv[0]), file=os.path.basename(__file__),
        name=__name__, cwd=os.getcwd(), path0=sys.path[0],
        env_given=os.environ.get("WHAT_A_RANK_SEES"), threads=torch.get_num_threads(),
        omp=os.environ.get("OMP_NUM_THREADS"), hash_seed=hash("labutils"),
        debug_level=str(dist.get_debug_level()),
        mp_name=multiprocessing.current_process().name,
        mp_parent=multiprocessing.parent_process() is not None,
        sigterm=str(signal.getsignal(signal.SIGTERM)), sigint=str(signal.getsignal(signal.SIGINT)),
        blocked=sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        stdout_write_through=sys.stdout.write_through, stdin=sys.stdin.read(),
        leaked=leaked, dtype_before=str(before), workers=workers, spawned=spawned,
        world=dist.get_world_size(), log_handlers=len(logging.getLogger().handlers),
        log_level=logging.getLogger().level, warning_filters=filters, rand=random.random(),
        torch_seed=torch.initial_seed(), torch_draw=draw,
        tmpdir=tempfile.gettempdir(), umask=umask, flags=list(sys.flags),
        encodings=[sys.stdout.encoding, sys.getfilesystemencoding(), locale.getpreferredencoding(False)],
        collector=[gc.isenabled(), list(gc.get_threshold())],
        path=sys.path, env=sorted(os.environ), debug_dir=debug_dir, inductor_cache=inductor_cache,
    )
    dist.destroy_process_group()
