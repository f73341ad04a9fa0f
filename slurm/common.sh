# Shared by the slurm/ scripts (sourced, not run): where the test cluster lives and small helpers.
# GEOFED_SLURM_DIR holds config, state, logs and PIDs; default: .slurm/ at the repository root.
SLURM_SCRIPTS=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=${GEOFED_SLURM_DIR:-$SLURM_SCRIPTS/../.slurm}
mkdir -p "$ROOT"
ROOT=$(cd "$ROOT" && pwd)
R=$ROOT/run
PIDS=$R/pids/started.pids
CLUSTER=geofed
# Non-default ports, so nothing clashes with a distribution's own Slurm or MariaDB.
CTLD_PORT=16817 SLURMD_PORT=16818 DBD_PORT=16819 MYSQL_PORT=13306

log() { echo "[slurm/$(basename "$0" .sh) $(date +%T)] $*"; }
die() { echo "[slurm/$(basename "$0" .sh)] error: $*" >&2; exit 1; }
wait_for() { # wait_for <timeout_s> <cmd...>: poll every 0.2 s until the command succeeds
  local t=$1; shift; local end=$(( $(date +%s) + t ))
  until "$@" >/dev/null 2>&1; do [ "$(date +%s)" -ge "$end" ] && return 1; sleep 0.2; done
}
pid_of() { [ -s "$PIDS" ] && awk -v n="$1" '$1==n{p=$2} END{print p}' "$PIDS"; }
all_alive() { # every daemon recorded by start.sh is still running
  [ -s "$PIDS" ] || return 1
  local n p
  while read -r n p; do kill -0 "$p" 2>/dev/null || return 1; done <"$PIDS"
}
