#!/usr/bin/env bash
# A one-node SLURM cluster on this machine (munged + slurmctld + slurmd as the current user), for the
# slurm profile's test and for trying `--workflow-profile profiles/slurm` without a real cluster
# (docs/cluster.md). Container-friendly: no cgroups (proctrack/linuxproc, task/none), no slurmdbd.
#   bash scripts/slurm_local.sh start [DIR]    # configure + start; prints the environment line (below)
#     with SLURM_LOCAL_OWNER=PID: a watcher stops the cluster once that process is gone, however it ended
#     (a test session killed mid-run leaves no daemon or job behind)
#   bash scripts/slurm_local.sh status [DIR]   # sinfo of the running cluster
#   bash scripts/slurm_local.sh stop [DIR]     # stop the daemons this script started (by their pid files)
#   bash scripts/slurm_local.sh env [DIR]      # `export SLURM_CONF=DIR/slurm.conf PATH=DIR/bin:$PATH`
# DIR (default $SLURM_LOCAL_DIR, else <repo>/.slurm-local) holds slurm.conf, the munge key, state, logs and
# jobcomp.txt (one line per finished job: the record of what ran as a SLURM job).
# DIR/bin holds one shim per SLURM client command (srun, sbatch, squeue, ...) that runs the real one with
# SLURM_CONF=DIR/slurm.conf: the plugin's job step drops every SLURM_* variable (SLURM_CONF too) before its
# inner `srun`, which on a real cluster finds /etc/slurm/slurm.conf; this cluster's config lives in DIR.
# Invariants: everything it writes is under DIR; it never touches /etc/slurm, /etc/munge or daemons it
# did not start; `start` exits 0 only once sinfo shows the node idle; a failure prints one `[slurm_local]`
# reason line (and the daemon log's tail) and exits non-zero.
# Job status: AccountingStorageType=none leaves `sacct` without data, so MinJobAge is an hour and
# snakemake-executor-plugin-slurm polls with `squeue --states=all` (profiles/slurm sets status-command).
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
CMD="${1:-}"
DIR="$(mkdir -p "${2:-${SLURM_LOCAL_DIR:-$REPO/.slurm-local}}" && cd "${2:-${SLURM_LOCAL_DIR:-$REPO/.slurm-local}}" && pwd)"
CONF="$DIR/slurm.conf"
SOCKET="$DIR/munge/munge.socket.2"
START_TIMEOUT="${SLURM_LOCAL_TIMEOUT:-60}"

say() { echo "[slurm_local] $*" >&2; }
die() { say "$*"; exit 1; }

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

free_port_pair() {  # the first P >= $1 with P and P+1 unused (slurmctld, slurmd)
  local port=$1
  while ! { port_free "$port" && port_free $((port + 1)); }; do port=$((port + 2)); done
  echo "$port"
}

CLIENTS=(srun sbatch squeue sinfo scontrol scancel sacct sacctmgr sshare)

write_shims() {  # DIR/bin/<client>: the real client with this cluster's SLURM_CONF
  local bin real
  mkdir -p "$DIR/bin"
  for bin in "${CLIENTS[@]}"; do
    real="$(PATH="$(echo "$PATH" | tr : '\n' | grep -vxF "$DIR/bin" | paste -sd:)" command -v "$bin")" || continue
    printf '#!/bin/sh\nSLURM_CONF=%q exec %q "$@"\n' "$CONF" "$real" >"$DIR/bin/$bin"
    chmod 755 "$DIR/bin/$bin"
  done
}

env_line() { echo "export SLURM_CONF=$CONF PATH=$DIR/bin:\$PATH"; }

pid_alive() { [[ -f "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

write_conf() {
  local node hw user port
  for bin in munged mungekey slurmctld slurmd sinfo sbatch squeue; do
    command -v "$bin" >/dev/null 2>&1 || die "missing $bin (Debian: slurmctld slurmd slurm-client munge; scripts/setup.sh --test)"
  done
  node="$(hostname -s)"
  # slurmd -C: this host's real CPUs / sockets / cores / threads / memory, as a NodeName line
  hw="$(slurmd -C 2>/dev/null | head -1 | sed -E 's/^NodeName=[^ ]+ //')" || true
  [[ "$hw" == *CPUs=* ]] || die "slurmd -C could not describe this host"
  user="$(id -un)"
  port="$(free_port_pair "${SLURM_LOCAL_PORT:-6817}")"
  mkdir -p "$DIR/munge" "$DIR/ctld" "$DIR/spool" "$DIR/log"
  chmod 700 "$DIR/munge"
  cat >"$CONF" <<EOF
# Written by scripts/slurm_local.sh: a one-node cluster on $node for tests (docs/cluster.md).
ClusterName=draftforge-local
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=$user
SlurmdUser=$user
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SOCKET
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups (containers): processes tracked through /proc, no task binding, no memory enforcement.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
ReturnToService=2
# No slurmdbd: finished jobs stay visible to squeue for MinJobAge, and each one leaves a line in JobCompLoc.
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/jobcomp.txt
MinJobAge=3600
KillWait=5
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=$node NodeAddr=127.0.0.1 $hw State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
}

start_munge() {
  pid_alive "$DIR/munged.pid" && return 0
  [[ -f "$DIR/munge/munge.key" ]] || mungekey --create --keyfile="$DIR/munge/munge.key" >/dev/null
  chmod 600 "$DIR/munge/munge.key"
  munged --force --key-file="$DIR/munge/munge.key" --socket="$SOCKET" --pid-file="$DIR/munged.pid" \
    --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed" \
    || { tail -5 "$DIR/log/munged.log" >&2 2>/dev/null; die "munged failed to start"; }
}

start_daemon() {  # start_daemon NAME ARGS...: start it unless its pid file names a live process
  local name=$1; shift
  pid_alive "$DIR/$name.pid" && return 0
  SLURM_CONF="$CONF" "$name" "$@" || { tail -5 "$DIR/log/$name.log" >&2 2>/dev/null; die "$name failed to start"; }
}

wait_idle() {
  local deadline=$((SECONDS + START_TIMEOUT)) state=""
  while ((SECONDS < deadline)); do
    for name in slurmctld slurmd; do
      if [[ -f "$DIR/$name.pid" ]] && ! pid_alive "$DIR/$name.pid"; then
        tail -5 "$DIR/log/$name.log" >&2 2>/dev/null; die "$name exited after start (log: $DIR/log/$name.log)"
      fi
    done
    state="$(SLURM_CONF="$CONF" sinfo -h -o %T 2>/dev/null | head -1)" || true
    [[ "$state" == idle ]] && return 0
    sleep 1
  done
  tail -5 "$DIR/log/slurmd.log" >&2 2>/dev/null
  die "node not idle after ${START_TIMEOUT}s (sinfo state: '${state:-none}'; logs: $DIR/log)"
}

start_watcher() {  # with SLURM_LOCAL_OWNER: stop this cluster once that process has exited
  [[ -n "${SLURM_LOCAL_OWNER:-}" ]] || return 0
  kill -0 "$SLURM_LOCAL_OWNER" 2>/dev/null || die "SLURM_LOCAL_OWNER=$SLURM_LOCAL_OWNER is not a running process"
  pid_alive "$DIR/watcher.pid" && return 0
  SLURM_LOCAL_WATCHER=1 setsid bash -c 'while kill -0 "$1" 2>/dev/null; do sleep 1; done; exec bash "$2" stop "$3"' \
    _ "$SLURM_LOCAL_OWNER" "$REPO/scripts/slurm_local.sh" "$DIR" </dev/null >>"$DIR/log/watcher.log" 2>&1 &
  echo $! >"$DIR/watcher.pid"
}

cancel_jobs() {  # every job of this cluster's controller, so no job step outlives its slurmd
  pid_alive "$DIR/slurmctld.pid" || return 0
  SLURM_CONF="$CONF" scancel --user="$(id -un)" 2>/dev/null || return 0
  for _ in $(seq 20); do
    [[ -z "$(SLURM_CONF="$CONF" squeue -h -o %i 2>/dev/null)" ]] && return 0
    sleep 0.5
  done
}

stop_all() {  # only the daemons (and the watcher) this script's start wrote pid files for
  local name pid
  cancel_jobs
  if [[ -z "${SLURM_LOCAL_WATCHER:-}" ]] && pid_alive "$DIR/watcher.pid"; then kill "$(cat "$DIR/watcher.pid")" 2>/dev/null || true; fi
  rm -f "$DIR/watcher.pid"
  for name in slurmd slurmctld munged; do
    if pid_alive "$DIR/$name.pid"; then
      pid="$(cat "$DIR/$name.pid")"
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
      kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$DIR/$name.pid"
  done
}

case "$CMD" in
  start)
    if ! pid_alive "$DIR/slurmctld.pid"; then write_conf; fi
    write_shims
    start_munge
    # -c: a fresh controller state (no jobs left over from an earlier start in DIR)
    start_daemon slurmctld -c
    start_daemon slurmd -N "$(hostname -s)"
    wait_idle
    start_watcher
    env_line
    ;;
  stop) stop_all ;;
  status) SLURM_CONF="$CONF" sinfo ;;
  env) env_line ;;
  *) echo "usage: $0 start|stop|status|env [DIR]" >&2; exit 2 ;;
esac
