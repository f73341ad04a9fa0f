#!/usr/bin/env bash
# Cancel every job, then stop only the daemons slurm/start.sh recorded (by PID, never by name).
# Where start.sh reused the cluster of another dir (see start.sh), this only releases it: that cluster keeps
# running, unless its owner's stop.sh was run meanwhile and this was its last user, then it is stopped now.
# While other dirs reuse this dir's cluster (live leases in run/users/), it keeps running and the last release
# stops it; GEOFED_SLURM_FORCE=1 stops it at once.
set -uo pipefail
source "$(dirname "$0")/common.sh"

if [ -s "$REUSES" ]; then
  other=$(cat "$REUSES")
  mine=$(lease_file "$other" "$ROOT" "$PPID")
  # The lease of the shell that ran start.sh (make's recipe, pytest); from another shell: all of this dir's.
  if [ -e "$mine" ]; then rm -f "$mine"; else drop_leases "$other" "$ROOT"; fi
  still=0
  for f in "$(dirname "$mine")/${ROOT//\//_}@"*; do
    [ -f "$f" ] || continue
    read -r p _ <"$f" || true
    if running "$p"; then still=1; else rm -f "$f"; fi
  done
  if [ $still = 0 ]; then rm -rf "$R"; fi
  log "released the test cluster under $other that $ROOT reused; it keeps running"
  if [ -e "$other/run/stop.requested" ] && [ -z "$(live_users "$other")" ]; then
    log "its owner asked to stop it and nobody reuses it any more: stopping it"
    GEOFED_SLURM_DIR=$other exec "$SLURM_SCRIPTS/stop.sh"
  fi
  exit 0
fi
[ -s "$PIDS" ] || { log "nothing recorded in $PIDS: nothing to stop"; exit 0; }
export SLURM_CONF=$R/etc/slurm.conf

users=$(live_users "$ROOT")
if [ -n "$users" ] && [ "${GEOFED_SLURM_FORCE:-0}" != 1 ] && all_alive "$PIDS"; then
  touch "$R/stop.requested"
  log "not stopping the cluster under $ROOT: reused by $(echo "$users" | paste -sd, - | sed 's/,/, /g');" \
    "the last of them to release it (its slurm/stop.sh) stops it; GEOFED_SLURM_FORCE=1 slurm/stop.sh stops it now"
  exit 0
fi

ctld=$(pid_of slurmctld)
if [ -n "$ctld" ] && running "$ctld"; then   # drain jobs so no job process outlives slurmd
  jobs=$(squeue -h -o %i 2>/dev/null | tr '\n' ' ')
  if [ -n "${jobs// }" ]; then
    log "cancelling jobs: $jobs"
    # shellcheck disable=SC2086  # one argument per job id
    scancel $jobs 2>/dev/null
    for _ in $(seq 150); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.2; done
  fi
fi

stop_pid() { # stop_pid <name> <pid>: SIGTERM, then SIGKILL after 20 s
  local n=$1 p=$2
  running "$p" || { log "$n ($p) already gone"; return; }
  kill -TERM "$p"
  for _ in $(seq 100); do running "$p" || { log "$n ($p) stopped"; return; }; sleep 0.2; done
  log "$n ($p) ignored SIGTERM for 20 s: SIGKILL"; kill -KILL "$p" 2>/dev/null
}
for n in slurmd slurmctld slurmdbd mariadbd munged; do
  p=$(pid_of "$n"); [ -n "$p" ] && stop_pid "$n" "$p"
done

alive=0
while read -r n p; do running "$p" && { log "still alive: $n $p"; alive=1; }; done <"$PIDS"
if [ -n "$(pid_of slurmd)" ]; then   # job helpers exist only where this cluster ran a slurmd
  # shellcheck disable=SC2009  # pgrep cannot match these rewritten process titles by their start
  left=$(ps -eo pid=,args= | grep -E '^ *[0-9]+ (slurmstepd: |: slurmscriptd)' || true)
  [ -n "$left" ] && { log "warning: leftover Slurm helper processes:"; echo "$left"; alive=1; }
fi
[ $alive = 0 ] && { log "all recorded daemons are gone"; : >"$PIDS"; rm -rf "$R/users" "$R/stop.requested"; }
exit $alive
