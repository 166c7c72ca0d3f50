#!/usr/bin/env bash
# What the launcher and the grader say, checked on a GPU machine with its own torch (a
# version other than the pin) and the GPU visible to every rank: the endings table in all
# four shapes (2 and 4 ranks, the failing rank first and last), warm and cold; every lab's
# solution graded (full marks expected), then its catalogue of wrong fixes (each below its
# bound). The table and the labs run at once; results go to $OUT.
#   Usage there: bash scripts/device_trust.sh     (wheels first, here: bash scripts/device_wheels.sh)
#   LIMIT: seconds for each half (default 400); ENDINGS_WORKERS (6); LAB_JOBS: labs at once (4);
#   LABS: the labs to grade (default every lab); ENDINGS=0: no endings table;
#   WRONGFIXES=0: solutions only
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/labs"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 PATH=$PWD/.whl/iproute2/bin:/tmp/site/bin:$PATH OUT
python3 -c "import torch,sys;print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.device_count(), torch.cuda.get_device_name(0))" > "$OUT/machine.txt" 2>&1
nproc >> "$OUT/machine.txt"
LIMIT=${LIMIT:-400}
[ "${ENDINGS:-1}" = 0 ] || ( SECONDS=0
  timeout "$LIMIT" python3 -m pytest -o addopts="" -p no:cacheprovider -q -rfE -p xdist -n "${ENDINGS_WORKERS:-6}" \
    tests/run/test_endings.py --endings-all --junitxml "$OUT/endings.xml" > "$OUT/endings.txt" 2>&1
  echo "exit $? after $SECONDS s" >> "$OUT/endings.txt" ) &
labs_list() { if [ -n "${LABS:-}" ]; then printf '%s\n' $LABS; else find labs -name lab.json | xargs -n1 dirname | xargs -n1 basename | sort; fi; }
grade() {  # one lab's solution graded; one line in labs.txt
  local lab=$1 start=$SECONDS score
  python3 -m labutils grade "labs/$lab" "solutions/$lab/$lab.ipynb" --out "$OUT/labs/$lab" > "$OUT/labs/$lab-grade.txt" 2>&1
  score=$(tail -n +2 "$OUT/labs/$lab/grades.csv" 2>/dev/null | head -1)
  echo "$lab: solution [$score]; $((SECONDS - start)) s" >> "$OUT/labs.txt"
}
wrongfixes() {  # one lab's catalogue of wrong fixes; one line in labs.txt
  local lab=$1 start=$SECONDS
  python3 -m labutils wrongfixes "labs/$lab" > "$OUT/labs/$lab-wrongfixes.txt" 2>&1
  echo "$lab: wrongfixes exit $?; $((SECONDS - start)) s" >> "$OUT/labs.txt"
}
export -f grade wrongfixes
# every solution first (the shorter half), then the catalogues, under one limit
SECONDS=0
labs_list | timeout "$LIMIT" xargs -P "${LAB_JOBS:-4}" -I{} bash -c 'grade {}'
echo "solutions: exit $? after $SECONDS s" >> "$OUT/labs.txt"
[ "${WRONGFIXES:-1}" = 0 ] || { labs_list | timeout $((LIMIT > SECONDS ? LIMIT - SECONDS : 1)) xargs -P "${LAB_JOBS:-4}" -I{} bash -c 'wrongfixes {}'
  echo "wrongfixes: exit $? after $SECONDS s" >> "$OUT/labs.txt"; }
wait
(cd "$OUT" && tar czf labs.tgz labs && rm -rf labs)
cat "$OUT/machine.txt" "$OUT/labs.txt"; tail -40 "$OUT/endings.txt" 2>/dev/null
