#!/usr/bin/env bash
# Stop the cluster start-local-slurm.sh started in DIR: cancel every job, wait for the
# queue to empty, shut the daemons down, and make sure none of its processes is left.
#
#   scripts/slurm/stop-local-slurm.sh [DIR]      DIR: $LABUTILS_SLURM_DIR or /var/tmp/labutils-slurm
#
# Stopping a cluster that is not running does nothing. Exits 1 with one line on stderr
# when a process of the cluster would not die.
set -uo pipefail

dir="${1:-${LABUTILS_SLURM_DIR:-/var/tmp/labutils-slurm}}"
conf="$dir/etc/slurm.conf"
export SLURM_CONF="$conf"

die() { echo "stop-local-slurm: $*" >&2; exit 1; }
alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# Processes of this cluster: the daemons and slurmstepd carry LABUTILS_SLURM_CLUSTER=DIR
# (set by the start script), and the jobs' processes descend from them. Zombies are skipped.
cluster_pids() {
    local marked
    marked="$(grep -lzxF "LABUTILS_SLURM_CLUSTER=$dir" /proc/[0-9]*/environ 2>/dev/null \
        | cut -d/ -f3 | tr '\n' ' ')"
    [ -n "$marked" ] || return 0
    ps -eo pid=,ppid=,stat= | awk -v marked="$marked" '
        { parent[$1] = $2; state[$1] = $3 }
        END {
            n = split(marked, m, " "); for (i = 1; i <= n; i++) keep[m[i]] = 1
            do { grew = 0; for (p in parent) if (!(p in keep) && (parent[p] in keep)) { keep[p] = 1; grew = 1 } } while (grew)
            for (p in keep) if ((p in state) && state[p] !~ /^Z/) print p
        }'
}

if [ -f "$conf" ] && alive "$dir/run/slurmctld.pid"; then
    # Cancel every job and wait (KillWait is 5 s) until none is pending, running or completing.
    jobs="$(timeout 10 squeue -h -o '%i' 2>/dev/null || true)"
    [ -n "$jobs" ] && timeout 10 scancel $jobs 2>/dev/null
    for _ in $(seq 1 40); do
        [ -z "$(timeout 10 squeue -h -o '%i' 2>/dev/null)" ] && break
        sleep 0.5
    done
    # Tells slurmctld and every slurmd to exit.
    timeout 10 scontrol shutdown >/dev/null 2>&1
fi
# munged last: the daemons need it to say goodbye to each other.
for _ in $(seq 1 40); do
    alive "$dir/run/slurmctld.pid" || break
    sleep 0.25
done
for pidfile in "$dir"/run/slurmd-*.pid "$dir"/run/slurmctld.pid "$dir"/run/munged.pid; do
    alive "$pidfile" && kill -TERM "$(cat "$pidfile")" 2>/dev/null
done

# Two-stage stop for whatever is still there: TERM, up to 5 s, then KILL.
left="$(cluster_pids)"
for _ in $(seq 1 20); do
    [ -z "$left" ] && break
    kill -TERM $left 2>/dev/null
    sleep 0.25
    left="$(cluster_pids)"
done
[ -n "$left" ] && kill -KILL $left 2>/dev/null && sleep 0.5
left="$(cluster_pids)"
[ -z "$left" ] || die "processes of the cluster in $dir would not die: $left"
rm -f "$dir"/run/*.pid
echo "stop-local-slurm: stopped (no job, no daemon left)"
