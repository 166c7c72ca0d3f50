#!/usr/bin/env bash
# One device session for issue 28 (a one-GPU machine with its own torch, no network):
# `make test-gpu`, then the lessons with the GPU visible, in two groups at once (the
# machine has 16 cores): lessons 10 and 06 (their GPU cells) after the GPU tests, and
# the lessons on virtual clusters. Each notebook has its own time limit, so one that
# hangs does not cost the others; executed notebooks and logs go to $OUT.
# Usage there: bash scripts/device_check.sh   (wheels in .whl/)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
{
echo "== machine"; nproc; id -u; python3 -c "import torch,sys;print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.device_count(), torch.cuda.get_device_name(0))"
for c in ip tc py-spy g++ make; do printf '%s: %s\n' "$c" "$(command -v $c || echo missing)"; done
} > "$OUT/machine.txt" 2>&1
notebooks() {  # group name, then notebooks, each under its own limit
  local group=$1; shift
  for nb in "$@"; do
    timeout "${NB_LIMIT:-300}" python3 scripts/run_notebooks.py "lessons/$nb" --out "$OUT/nb-$group" --timeout 240 \
      >> "$OUT/$group.txt" 2>&1 || echo "$nb: exit $?" >> "$OUT/$group.txt"
    cp "$OUT/nb-$group/summary.json" "$OUT/nb-$group/summary-${nb%.ipynb}.json" 2>/dev/null
  done
}
( SECONDS=0; timeout 240 make test-gpu PYTEST_ARGS="-v -s -k 'not lesson00'" > "$OUT/test-gpu.txt" 2>&1
  echo "exit $? after $SECONDS s" >> "$OUT/test-gpu.txt"
  notebooks gpu 10_current_stack.ipynb 06_production_patterns.ipynb ) &
notebooks cluster 01_dp_vs_ddp.ipynb 02_collectives.ipynb 03_bucketing_and_overlap.ipynb \
  09_debugging_at_scale.ipynb 07_beyond_ddp.ipynb 08_async_data_parallel.ipynb &
wait
cat "$OUT/machine.txt" "$OUT/test-gpu.txt" | tail -60; cat "$OUT"/gpu.txt "$OUT"/cluster.txt
