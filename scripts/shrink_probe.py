"""Lesson 05's shrinking run (two agents, agent 1 killed at step 21), run N times with the
machine's own cores: prints each run's attempts and how many records of each kind it
left, to find why a fast many-core machine can leave no `index` records."""

import collections
import os
import sys

os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lessons"))
from labutils import launch  # noqa: E402
from labutils.course import lesson  # noqa: E402

lesson.use("05_elastic_training")
import lesson05 as L  # noqa: E402

for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 2):
    r = launch("05_elastic_training/train_resumable.py", nproc=1, nnodes="1:2", local_agents=2,
               max_restarts=1, fault={"agent": 1, "step": 21},
               args=[L.fresh_checkpoint_dir(f"shrink{i}")], display="none")
    kinds = collections.Counter(tuple(sorted(k for k in rec if k not in ("rank", "t", "restart")))
                                for rec in r.records)
    print(f"== run {i}: {r.headline()}  start={r.to_json().get('start')}")
    print(L.attempts_table(r))
    print("records:", dict(kinds))
    print("resumed_at:", L.resumed_at(r))
    try:
        print("coverage:", L.epoch_coverage(r, samples=512, global_batch=32))
    except Exception as exc:  # noqa: BLE001
        print("coverage failed:", type(exc).__name__, exc)
    print("log_dir:", r.log_dir, flush=True)
