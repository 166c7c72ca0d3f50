#!/usr/bin/env bash
# One device session for issue 28: lesson 05's shrinking run and lesson 10 on a
# many-core GPU machine, the gpu tests, and lessons with the GPU visible.
# Usage there: bash scripts/device_check.sh   (wheels in .whl/, results under $OUT)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{
echo "== machine"; nproc; python3 -c "import torch,sys;print(sys.version.split()[0], torch.__version__, torch.cuda.is_available(), torch.cuda.device_count())"
nvidia-smi -L 2>&1 | head -2; which ip py-spy 2>&1 | head -2
echo "== doctor"; timeout 60 python3 -m labutils.cli doctor 2>&1 | tail -15
echo "== shrink"; timeout 120 python3 scripts/shrink_probe.py 3 2>&1 | tail -45
echo "== gpu tests"; timeout 90 python3 -m pytest -o addopts="" -p no:cacheprovider -q -m gpu tests/test_gpu.py 2>&1 | tail -15
echo "== notebooks"; timeout 300 python3 scripts/run_notebooks.py lessons/10_current_stack.ipynb lessons/05_elastic_training.ipynb lessons/00_first_distributed_run.ipynb lessons/04_sampler_pitfalls.ipynb --out /tmp/nb --timeout 200 2>&1 | tail -40
} 2>&1 | tee "$OUT/log.txt"
tar czf "$OUT/runs.tgz" lessons/runs 2>/dev/null; tar czf "$OUT/nb.tgz" -C /tmp nb 2>/dev/null
ls -la "$OUT"
