#!/bin/sh
# Build the learner's CPU image (or, with FLAVOR=cuda, the CUDA one) on a machine with no
# Docker engine and no image registry, with podman, buildah and runc from Debian
# packages, then try it. `make image` runs this; `make image-cuda` with FLAVOR=cuda.
#
# 1. Debian packages podman, buildah, runc, debootstrap: installed with apt-get if missing.
# 2. The base image ($BASE): Debian bookworm with its Python 3.11 and pip, made with
#    debootstrap and `podman import` (kept: built once per machine).
# 3. The learner copy (scripts/learner_copy.py, in $WORK/learner), the build context.
# 4. `podman build` of docker/Dockerfile.$FLAVOR from it, as $IMAGE. pip gets this
#    machine's CA bundle. cpu: a folder of wheels if $WHEELS holds torch's CPU wheel (then
#    torch comes from it, the rest from PyPI; otherwise from PyPI's and PyTorch's
#    indexes). cuda: torch from $CUDA_TORCH_INDEX (default PyPI, whose torch 2.13.0 is
#    the CUDA 13.0 build, the same variant as PyTorch's cu130 index; gigabytes of NVIDIA
#    libraries come with it). Without a GPU the CUDA build runs on the CPU (gloo), so the
#    tries below run the same way; `labutils doctor` inside says which build it is.
# 5. The tries, each inside a container of the image:
#    - the image holds no hidden check, no wrong-fix catalogue, no solution, no
#      "starter_fails" (searched as root, so no folder is unreadable to the search);
#    - lesson 00 runs under nbval (`pytest lessons/00_first_distributed_run.ipynb`), as the
#      image's user (uid 1000), as a learner would;
#    - lab 01 graded: the instructor's lab folder and the course's solution mounted read
#      only, graded by `labutils grade` inside, as root and as the image's user; the
#      solution must pass both times.
# Prints each step's time; exits non-zero at the first failure. Run as root.
set -eu

REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=${WORK:-$REPO/build}
FLAVOR=${FLAVOR:-cpu}
case "$FLAVOR" in
    cpu|cuda) ;;
    *) echo "build-local.sh: FLAVOR must be cpu or cuda (docker/Dockerfile.FLAVOR), not '$FLAVOR'" >&2
       exit 2 ;;
esac
IMAGE=${IMAGE:-localhost/dist-course:$FLAVOR}
CUDA_TORCH_INDEX=${CUDA_TORCH_INDEX:-https://pypi.org/simple}
BASE=${BASE:-localhost/course-base:bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
WHEELS=${WHEELS:-/opt/wheels}
CA=${CA:-/etc/ssl/certs/ca-certificates.crt}
PY=${PY:-$REPO/.venv/bin/python}
LAB=01_data_sharding

step() { now=$(date +%s); echo "[image] $* (at ${now}s)"; }
took() { echo "[image]   done in $(( $(date +%s) - now )) s"; }

if [ "$(id -u)" != 0 ]; then
    echo "build-local.sh: run as root (podman with runc and debootstrap need it here); sudo make image" >&2
    exit 2
fi

step "tools: podman, buildah, runc, debootstrap"
missing=""
for tool in podman buildah runc debootstrap; do
    command -v "$tool" >/dev/null 2>&1 || missing="$missing $tool"
done
if [ -n "$missing" ]; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        podman buildah runc debootstrap uidmap ca-certificates >/dev/null
fi
took

# This machine's containers: runc, cgroupfs (cgroups v1 hosts too), no default ulimits
# (the kernel here refuses podman's), events in a file (no systemd journal).
mkdir -p "$WORK"
CONTAINERS_CONF="$WORK/containers.conf"
cat > "$CONTAINERS_CONF" <<'EOF'
[containers]
default_ulimits = []
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
export CONTAINERS_CONF
run() { podman run --rm --network host "$@"; }

if ! podman image exists "$BASE"; then
    step "base image $BASE: debootstrap bookworm from $MIRROR"
    rootfs="$WORK/rootfs"
    rm -rf "$rootfs"
    debootstrap --variant=minbase \
        --include=python3,python3-pip,python3-venv,python-is-python3,ca-certificates \
        bookworm "$rootfs" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
        || { tail -20 "$WORK/debootstrap.log" >&2; exit 1; }
    # pip installs into the system Python, as in the python:3.11-slim images
    rm -f "$rootfs"/usr/lib/python3*/EXTERNALLY-MANAGED
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
    rm -rf "$rootfs"
    took
fi

step "learner copy in $WORK/learner"
rm -rf "$WORK/learner"
"$PY" "$REPO/scripts/learner_copy.py" "$WORK/learner"
took

step "podman build $IMAGE"
set -- --build-arg "BASE=$BASE"
if [ -f "$CA" ]; then
    set -- "$@" --volume "$CA:/etc/build-ca.crt:ro" --build-arg PIP_CERT=/etc/build-ca.crt
fi
if [ "$FLAVOR" = cuda ]; then
    set -- "$@" --build-arg "TORCH_INDEX_URL=$CUDA_TORCH_INDEX"
elif ls "$WHEELS"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
    set -- "$@" --volume "$WHEELS:/wheels:ro" --build-arg PIP_FIND_LINKS=/wheels \
        --build-arg TORCH_INDEX_URL=https://pypi.org/simple
fi
podman build --network host --layers -f "$WORK/learner/docker/Dockerfile.$FLAVOR" -t "$IMAGE" "$@" \
    "$WORK/learner"
took
podman image inspect "$IMAGE" --format '[image]   {{.Size}} bytes'
step "torch inside"
run "$IMAGE" python -c "import torch; print('[image]   torch', torch.__version__, 'CUDA', torch.version.cuda, 'GPUs', torch.cuda.device_count())"

step "no instructor material in the image"
run --user 0 "$IMAGE" sh -c '
    found=$(find / -xdev \( -name hidden_checks.py -o -name wrong_fixes.py -o -name solutions \) -print)
    [ -z "$found" ] || { echo "found: $found"; exit 1; }
    ! grep -l starter_fails labs/*/lab.json'
took

step "lesson 00 under nbval, inside"
run "$IMAGE" python -m pytest -q -p no:cacheprovider lessons/00_first_distributed_run.ipynb
took

# Graded twice: as root, as Gradescope runs an autograder (the grader then runs the
# learner's code as an unprivileged user of its own, in namespaces), and as the image's
# user, as a learner grading their own copy (namespaces where the container allows them).
for who in 0 1000; do
    step "lab $LAB: the solution graded inside, as uid $who"
    run --user "$who" --volume "$REPO/labs/$LAB:/grading/lab:ro" \
        --volume "$REPO/solutions/$LAB:/grading/submission:ro" \
        "$IMAGE" sh -c 'labutils grade /grading/lab /grading/submission --out /tmp/grades \
            && cat /tmp/grades/grades.csv && tail -n 1 /tmp/grades/grades.csv | grep -q ",yes,completed,"'
    took
done
echo "[image] $IMAGE built and tried"
