#!/usr/bin/env bash
# Install Debian's Slurm (slurmctld, slurmd, client), munge, slurmdbd and MariaDB; root only, skips what is there.
set -euo pipefail
source "$(dirname "$0")/common.sh"
[ "$(id -u)" = 0 ] || die "must run as root (apt-get installs system packages)"
PKGS="slurmctld slurmd slurm-client munge"
[ "${WITH_SLURMDBD:-1}" = 1 ] && PKGS="$PKGS slurmdbd mariadb-server"
missing=""
for p in $PKGS; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -z "$missing" ]; then log "already installed: $PKGS"; exit 0; fi
command -v apt-get >/dev/null || die "apt-get not found: install$missing with this system's package manager"
log "apt-get install:$missing"
apt-get update -qq
# shellcheck disable=SC2086  # one argument per package
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >"$ROOT/apt-install.log" 2>&1 \
  || { tail -20 "$ROOT/apt-install.log"; die "apt-get install failed (full log: $ROOT/apt-install.log)"; }
log "installed$missing"
