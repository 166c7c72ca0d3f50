#!/usr/bin/env bash
# One device session for issue 28 (a one-GPU machine with its own torch, no network):
# `make test-gpu`, then lessons with the GPU visible, in groups that run at once (the
# machine has 16 cores). Each notebook has its own time limit, so one that hangs does not cost
# the others; executed notebooks and logs go to $OUT.
# Usage there: bash scripts/device_check.sh [gpu-tests] NOTEBOOKS-A [-- NOTEBOOKS-B ...]
#   (GPU_TESTS_ARGS: more pytest arguments for make test-gpu, e.g. -k 'not lesson00';
#    KEEP_GOING=1: run every cell of a notebook even after one raised)
#   (wheels in .whl/ and Debian's ip and tc in .whl/iproute2: bash scripts/device_wheels.sh, here)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 PATH=$PWD/.whl/iproute2/bin:/tmp/site/bin:$PATH
{
echo "== machine"; nproc; id -u; python3 -c "import torch,sys;print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.device_count(), torch.cuda.get_device_name(0))"
for c in ip tc py-spy g++ make; do printf '%s: %s\n' "$c" "$(command -v $c || echo missing)"; done
ip -V; ip netns add luprobe && ip -n luprobe link set lo up && echo "netns: ok"; ip netns del luprobe 2>/dev/null
} > "$OUT/machine.txt" 2>&1
notebooks() {  # group name, then notebooks, each under its own limit
  local group=$1; shift
  for nb in "$@"; do
    timeout "${NB_LIMIT:-300}" python3 scripts/run_notebooks.py "lessons/$nb" --out "$OUT/nb-$group" --timeout 240 ${KEEP_GOING:+--keep-going} \
      >> "$OUT/$group.txt" 2>&1 || echo "$nb: exit $?" >> "$OUT/$group.txt"
  done
  rm -f "$OUT/nb-$group/summary.json"
}
gpu_tests=0; [ "${1:-}" = gpu-tests ] && { gpu_tests=1; shift; }
groups=(); current=""
for arg in "$@"; do
  if [ "$arg" = -- ]; then groups+=("$current"); current=""; else current="$current $arg"; fi
done
groups+=("$current")
for i in "${!groups[@]}"; do
  name=$(printf "\\x$(printf %x $((97 + i)))")   # a, b, c, ...
  ( if [ $i = 0 ] && [ $gpu_tests = 1 ]; then SECONDS=0
      timeout 240 make test-gpu PYTEST_ARGS="-v -s ${GPU_TESTS_ARGS:-}" > "$OUT/test-gpu.txt" 2>&1
      echo "exit $? after $SECONDS s" >> "$OUT/test-gpu.txt"; fi
    # shellcheck disable=SC2086 - each group is a list of notebook names
    notebooks "$name" ${groups[$i]} ) &
done
wait
# the device tool brings back at most 8 files: the executed notebooks travel as one archive,
# with the logs of every rank that wrote to stderr in a run that failed
mkdir -p "$OUT/nb-logs"
for summary in lessons/runs/*/summary.json; do
  grep -q '"ok": false' "$summary" 2>/dev/null || continue
  run=$(dirname "$summary"); mkdir -p "$OUT/nb-logs/${run##*/}"
  find "$run" -name stderr.log -size +0 | while read -r f; do cp "$f" "$OUT/nb-logs/${run##*/}/$(basename "$(dirname "$f")").log"; done
done
(cd "$OUT" && tar czf notebooks.tgz nb-* 2>/dev/null && rm -rf nb-*)
cat "$OUT"/machine.txt "$OUT"/test-gpu.txt "$OUT"/[a-h].txt 2>/dev/null | grep -v IPKernelApp | tail -100
