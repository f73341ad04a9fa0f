#!/usr/bin/env bash
# Exit 0 when the test cluster slurm/start.sh started is up (every recorded daemon alive, slurmctld answers).
set -uo pipefail
source "$(dirname "$0")/common.sh"
all_alive && SLURM_CONF=$R/etc/slurm.conf scontrol ping >/dev/null 2>&1 || { log "not running (under $ROOT)"; exit 1; }
log "running under $ROOT; SLURM_CONF=$R/etc/slurm.conf"
