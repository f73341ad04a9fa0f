#!/usr/bin/env bash
# Cancel every job, then stop only the daemons slurm/start.sh recorded (by PID, never by name).
set -uo pipefail
source "$(dirname "$0")/common.sh"
[ -s "$PIDS" ] || { log "nothing recorded in $PIDS: nothing to stop"; exit 0; }
export SLURM_CONF=$R/etc/slurm.conf

ctld=$(pid_of slurmctld)
if [ -n "$ctld" ] && kill -0 "$ctld" 2>/dev/null; then   # drain jobs so no job process outlives slurmd
  jobs=$(squeue -h -o %i 2>/dev/null | tr '\n' ' ')
  if [ -n "${jobs// }" ]; then
    log "cancelling jobs: $jobs"
    scancel $jobs 2>/dev/null
    for _ in $(seq 150); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.2; done
  fi
fi

stop_pid() { # stop_pid <name> <pid>: SIGTERM, then SIGKILL after 20 s
  local n=$1 p=$2
  kill -0 "$p" 2>/dev/null || { log "$n ($p) already gone"; return; }
  kill -TERM "$p"
  for _ in $(seq 100); do kill -0 "$p" 2>/dev/null || { log "$n ($p) stopped"; return; }; sleep 0.2; done
  log "$n ($p) ignored SIGTERM for 20 s: SIGKILL"; kill -KILL "$p" 2>/dev/null
}
for n in slurmd slurmctld slurmdbd mariadbd munged; do
  p=$(pid_of "$n"); [ -n "$p" ] && stop_pid "$n" "$p"
done

alive=0
while read -r n p; do kill -0 "$p" 2>/dev/null && { log "still alive: $n $p"; alive=1; }; done <"$PIDS"
left=$(ps -eo pid=,args= | grep -E '^ *[0-9]+ (slurmstepd: |: slurmscriptd)' || true)
[ -n "$left" ] && { log "warning: leftover Slurm helper processes:"; echo "$left"; alive=1; }
[ $alive = 0 ] && { log "all recorded daemons are gone"; : >"$PIDS"; }
exit $alive
