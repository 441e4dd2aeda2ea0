#!/usr/bin/env bash
# A single-node SLURM on this machine, for dlspark's SLURM tests (tests/test_slurm.py).
#
#   .ci/slurm-up.sh start    start munged, slurmctld and slurmd (whichever is not running);
#                            prints SLURM_CONF=... and STARTED=<what this call started>
#   .ci/slurm-up.sh stop     cancel the test cluster's jobs and stop the daemons this script started
#   .ci/slurm-up.sh status   exit 0 when the node answers and is usable
#
# It installs nothing. On Debian: apt-get install -y --no-install-recommends slurmctld slurmd
# slurm-client munge. Needs root (the daemons and munge's socket directory). Idempotent: a
# second start finds the daemons up and starts nothing; stop stops only what a start of this
# script started (its pid files under DLSPARK_SLURM_DIR), and munged only if it started it.
# The configuration lives in DLSPARK_SLURM_DIR (default /tmp/dlspark-slurm), never in
# /etc/slurm: clients find it through SLURM_CONF.
set -euo pipefail

DIR=${DLSPARK_SLURM_DIR:-/tmp/dlspark-slurm}
CONF=$DIR/slurm.conf
export SLURM_CONF=$CONF
HOST=$(hostname -s)
# Three one-core jobs must fit at once (adapt adds a third worker) beside a second cluster of
# two: config_overrides lets the node claim more CPUs than the machine has.
CPUS=${DLSPARK_SLURM_CPUS:-6}
MEM_MB=${DLSPARK_SLURM_MEM_MB:-12000}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

write_conf() {
    mkdir -p "$DIR/state" "$DIR/spool" "$DIR/logs"
    local total_mb
    total_mb=$(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo)
    # RealMemory must stay below what the machine has, or slurmd's node is drained.
    if [ "$MEM_MB" -ge "$total_mb" ]; then MEM_MB=$((total_mb * 3 / 4)); fi
    cat > "$CONF.tmp" <<EOF
ClusterName=dlspark
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/logs/slurmctld.log
SlurmdLogFile=$DIR/logs/slurmd.log
SlurmctldTimeout=30
SlurmdTimeout=30
KillWait=2
InactiveLimit=0
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    mv "$CONF.tmp" "$CONF"
}

node_ready() {
    local state
    state=$(sinfo -h -n "$HOST" -o %t 2>/dev/null | head -1) || return 1
    case "$state" in idle|mix|alloc) return 0 ;; *) return 1 ;; esac
}

start() {
    for tool in munged slurmctld slurmd sinfo sbatch; do
        command -v "$tool" >/dev/null || {
            echo "slurm-up: $tool not found; install: apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge" >&2
            exit 2
        }
    done
    mkdir -p "$DIR"
    local started=""
    if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        mkdir -p /run/munge /var/log/munge /var/lib/munge
        chown munge:munge /run/munge /var/log/munge /var/lib/munge
        chmod 0755 /run/munge
        runuser -u munge -- munged
        touch "$DIR/munged.ours"
        started="$started munged"
    fi
    [ -f "$CONF" ] || write_conf
    if ! alive "$DIR/slurmctld.pid"; then
        slurmctld -c -f "$CONF"
        started="$started slurmctld"
    fi
    if ! alive "$DIR/slurmd.pid"; then
        slurmd -f "$CONF"
        started="$started slurmd"
    fi
    for _ in $(seq 120); do
        node_ready && break
        sleep 0.5
    done
    if ! node_ready; then
        echo "slurm-up: node $HOST did not come up; see $DIR/logs" >&2
        sinfo -N -l >&2 || true
        exit 1
    fi
    echo "SLURM_CONF=$CONF"
    echo "STARTED=${started# }"
}

stop() {
    if [ -f "$CONF" ] && alive "$DIR/slurmctld.pid"; then
        scancel --full --quiet $(squeue -h -o %i 2>/dev/null) 2>/dev/null || true
    fi
    for d in slurmd slurmctld; do
        if alive "$DIR/$d.pid"; then
            local pid
            pid=$(cat "$DIR/$d.pid")
            kill "$pid"
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        fi
        rm -f "$DIR/$d.pid"
    done
    if [ -f "$DIR/munged.ours" ]; then
        munged --stop 2>/dev/null || true
        rm -f "$DIR/munged.ours"
    fi
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) [ -f "$CONF" ] && node_ready ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
