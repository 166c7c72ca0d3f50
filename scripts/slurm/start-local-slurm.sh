#!/usr/bin/env bash
# Start a real single-host SLURM cluster (munged, slurmctld, two slurmd "nodes") for the
# tests and for trying `labutils slurm` by hand. Needs root and the Debian packages
# slurm-wlm and munge (scripts/system-packages.txt).
#
#   scripts/slurm/start-local-slurm.sh [DIR]      DIR: $LABUTILS_SLURM_DIR or /var/tmp/labutils-slurm
#   export SLURM_CONF=DIR/etc/slurm.conf            so sbatch, squeue, scontrol find it
#   scripts/slurm/stop-local-slurm.sh [DIR]
#
# Everything lives under DIR: etc/ (slurm.conf), munge/ (key, socket), ctld/ (controller
# state), spool/<node>/, log/, run/ (pid files). Nothing is written to /etc or /var/log.
# Settings from the environment:
#   LABUTILS_SLURM_PORT   slurmctld's port (default 6817); node i's slurmd uses PORT+1+i
#   LABUTILS_SLURM_NODES  how many slurmd nodes on this host (default 2)
# Starting again while the cluster answers does nothing. Exits 1 with one line on stderr
# when something cannot start.
set -euo pipefail

dir="${1:-${LABUTILS_SLURM_DIR:-/var/tmp/labutils-slurm}}"
port="${LABUTILS_SLURM_PORT:-6817}"
nnodes="${LABUTILS_SLURM_NODES:-2}"
conf="$dir/etc/slurm.conf"
socket="$dir/munge/munge.socket"

die() { echo "start-local-slurm: $*" >&2; exit 1; }
# The last error-looking line of a daemon's log, to say why it did not start.
why() { [ -f "$1" ] && grep -iE 'error|fatal' "$1" | tail -n 1 | cut -c1-300 || true; }
alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
# A daemon that died: its pid file names a dead process, or it wrote none within 5 s.
gone() { if [ -f "$1" ]; then ! alive "$1"; else [ $SECONDS -ge $((started + 5)) ]; fi; }

[ "$(id -u)" -eq 0 ] || die "must run as root (slurmd starts jobs as their owner); got uid $(id -u)"
for tool in munged munge slurmctld slurmd sinfo scontrol; do
    command -v "$tool" >/dev/null || die "$tool not found; install the Debian packages slurm-wlm and munge"
done
case "$nnodes" in 1|2) ;; *) die "LABUTILS_SLURM_NODES must be 1 or 2, got '$nnodes'" ;; esac
[[ "$port" =~ ^[0-9]+$ ]] || die "LABUTILS_SLURM_PORT must be a port number, got '$port'"

export SLURM_CONF="$conf"
# Every daemon (and the slurmstepd it forks) carries this, so stop-local-slurm.sh can find
# anything of this cluster's that outlived a pid file.
export LABUTILS_SLURM_CLUSTER="$dir"

# Nodes that can take jobs: idle, or busy with jobs (allocated, mixed, completing).
nodes_up() {
    local states
    states="$(timeout 10 sinfo -h -N -o '%t' 2>/dev/null)" || return 1
    [ "$(grep -cE '^(idle|alloc|mix|comp)$' <<<"$states")" -eq "$nnodes" ]
}

if [ -f "$conf" ] && alive "$dir/run/slurmctld.pid" && nodes_up; then
    echo "start-local-slurm: already running; export SLURM_CONF=$conf"
    exit 0
fi

mkdir -p "$dir"/{etc,munge,ctld,log,run}
chmod 700 "$dir/munge"   # munged refuses a key or socket folder others can write to

# --- munge: the shared secret that authenticates every SLURM message -----------------
if [ ! -s "$dir/munge/munge.key" ]; then
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
    chmod 400 "$dir/munge/munge.key"
fi
if ! alive "$dir/run/munged.pid"; then
    # --force: munged runs as root here (one host, no munge user needed for the test)
    munged --force --socket="$socket" --key-file="$dir/munge/munge.key" \
        --pid-file="$dir/run/munged.pid" --log-file="$dir/log/munged.log" \
        --seed-file="$dir/munge/munged.seed" 2>>"$dir/log/munged.log" \
        || die "munged did not start: $(why "$dir/log/munged.log")"
fi
munge -n -S "$socket" | unmunge -S "$socket" >/dev/null 2>&1 \
    || die "munge does not answer on $socket: $(why "$dir/log/munged.log")"

# --- slurm.conf -------------------------------------------------------------------------
host="$(hostname -s)"
# nproc honours OMP_NUM_THREADS and OMP_THREAD_LIMIT (coreutils): set for the ranks, they
# would declare more CPUs than slurmd finds, and slurmctld sets every node INVAL.
cpus="$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)"
nodes=""
for i in $(seq 1 "$nnodes"); do
    # Every node is this host (NodeAddr 127.0.0.1); each slurmd listens on its own port.
    nodes+="NodeName=node$i NodeHostname=$host NodeAddr=127.0.0.1 Port=$((port + i)) CPUs=$cpus State=UNKNOWN"$'\n'
done
cat > "$conf" <<EOF
# Written by scripts/slurm/start-local-slurm.sh: a one-host test cluster.
ClusterName=labutils
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# Clients and daemons find this cluster's munged here, not at /run/munge.
AuthInfo=socket=$socket
StateSaveLocation=$dir/ctld
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
# No cgroups in containers: jobs' processes are tracked through /proc's parent links
# (torchrun puts ranks in sessions of their own, so process groups would lose them).
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
# No slurmdbd: finished jobs, their state and ExitCode, stay visible to
# 'scontrol show job' for MinJobAge seconds; jobcomp/filetxt keeps a line per job too.
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/log/jobcomp.txt
MinJobAge=3600
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
SwitchType=switch/none
# scancel: SIGTERM, then SIGKILL after KillWait seconds (default 30).
KillWait=5
ReturnToService=2
SlurmdTimeout=60
InactiveLimit=0
$nodes
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF

# --- daemons ----------------------------------------------------------------------------
started=$SECONDS
if ! alive "$dir/run/slurmctld.pid"; then
    rm -f "$dir/run/slurmctld.pid"   # a stale one would read as "died" below
    # -i: ignore unreadable state left by a killed earlier run
    slurmctld -i -f "$conf" 2>>"$dir/log/slurmctld.log" \
        || die "slurmctld did not start: $(why "$dir/log/slurmctld.log")"
fi
for i in $(seq 1 "$nnodes"); do
    node="node$i"
    mkdir -p "$dir/spool/$node"
    if ! alive "$dir/run/slurmd-$node.pid"; then
        rm -f "$dir/run/slurmd-$node.pid"
        # -N: which NodeName this slurmd is (several on one host)
        slurmd -f "$conf" -N "$node" 2>>"$dir/log/slurmd-$node.log" \
            || die "slurmd $node did not start: $(why "$dir/log/slurmd-$node.log")"
    fi
done

# --- wait until every node answers ---------------------------------------------------------
deadline=$((SECONDS + 30))
while ! nodes_up; do
    # a daemon that exited says why in its log: report it at once, not after the 30 s
    gone "$dir/run/slurmctld.pid" && die "slurmctld exited: $(why "$dir/log/slurmctld.log")"
    for i in $(seq 1 "$nnodes"); do
        gone "$dir/run/slurmd-node$i.pid" \
            && die "slurmd node$i exited: $(why "$dir/log/slurmd-node$i.log")"
    done
    states="$(timeout 10 sinfo -h -N -o '%t' 2>/dev/null | sort -u | tr '\n' ' ' || true)"
    case "$states" in
        *down*|*drain*)  # a node that was down in saved state: it answers now, take it back
            scontrol update NodeName="node[1-$nnodes]" State=RESUME >/dev/null 2>&1 || true ;;
    esac
    [ $SECONDS -lt $deadline ] \
        || die "nodes not up after 30 s (sinfo: ${states:-no answer}); see $dir/log/"
    sleep 0.5
done
echo "start-local-slurm: $nnodes node(s) up; export SLURM_CONF=$conf"
