#!/usr/bin/env bash
# Exit 0 when the test cluster slurm/start.sh started under $GEOFED_SLURM_DIR is up (every recorded daemon alive,
# slurmctld answers) and stays up. Exit 1 otherwise, also where start.sh only reused another dir's cluster, and
# where this one's stop is pending until the dirs that reuse it release it (see start.sh; start.sh cancels that).
set -uo pipefail
source "$(dirname "$0")/common.sh"
if [ -s "$REUSES" ]; then
  other=$(cat "$REUSES")
  if all_alive "$other/run/pids/started.pids" && SLURM_CONF=$other/run/etc/slurm.conf scontrol ping >/dev/null 2>&1; then
    log "not running under $ROOT, which reuses the test cluster under $other (up; source $R/env.sh)"
  else
    log "not running under $ROOT; the test cluster under $other that it reused is gone"
  fi
  exit 1
fi
if ! { all_alive "$PIDS" && SLURM_CONF=$R/etc/slurm.conf scontrol ping >/dev/null 2>&1; }; then
  log "not running (under $ROOT)"; exit 1
fi
if [ -e "$R/stop.requested" ]; then
  users=$(live_users "$ROOT" | paste -sd, - | sed 's/,/, /g')
  if [ -n "$users" ]; then log "running under $ROOT, but stops once $users release it"; exit 1; fi
fi
log "running under $ROOT; SLURM_CONF=$R/etc/slurm.conf"
