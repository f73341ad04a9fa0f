# shellcheck shell=bash disable=SC2034
# Shared by the slurm/ scripts (sourced, not run): where the test cluster lives and small helpers.
# GEOFED_SLURM_DIR holds config, state, logs and PIDs; default: .slurm/ at the repository root.
# GEOFED_SLURM_PORTS="<slurmctld> <slurmd> <slurmdbd> <mariadb>" replaces the default ports (16817 16818 16819
# 13306), e.g. when another program holds one of them.
SLURM_SCRIPTS=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=${GEOFED_SLURM_DIR:-$SLURM_SCRIPTS/../.slurm}
mkdir -p "$ROOT"
ROOT=$(cd "$ROOT" && pwd)
R=$ROOT/run
PIDS=$R/pids/started.pids
CLUSTER=geofed
# In a dir whose start.sh reused the cluster of another dir: that dir (see start.sh).
REUSES=$R/reuses
# Non-default ports, so nothing clashes with a distribution's own Slurm or MariaDB.
read -r CTLD_PORT SLURMD_PORT DBD_PORT MYSQL_PORT _ <<<"${GEOFED_SLURM_PORTS:-16817 16818 16819 13306}"

log() { echo "[slurm/$(basename "$0" .sh) $(date +%T)] $*"; }
die() { echo "[slurm/$(basename "$0" .sh)] error: $*" >&2; exit 1; }
for _port in "$CTLD_PORT" "$SLURMD_PORT" "$DBD_PORT" "$MYSQL_PORT"; do
  [[ $_port =~ ^[0-9]+$ ]] || die "GEOFED_SLURM_PORTS must be four port numbers (slurmctld slurmd slurmdbd mariadb), not '${GEOFED_SLURM_PORTS:-}'"
done
wait_for() { # wait_for <timeout_s> <cmd...>: poll every 0.2 s until the command succeeds
  local t=$1; shift; local end=$(( $(date +%s) + t ))
  until "$@" >/dev/null 2>&1; do [ "$(date +%s)" -ge "$end" ] && return 1; sleep 0.2; done
}
pid_of() { [ -s "$PIDS" ] && awk -v n="$1" '$1==n{p=$2} END{print p}' "$PIDS"; }
running() { # running <pid>: the process exists and is not a zombie
  [ -n "$1" ] && [ -r "/proc/$1/stat" ] && ! awk '{exit $3!="Z"}' "/proc/$1/stat" 2>/dev/null
}
all_alive() { # all_alive [pids file]: every daemon recorded by start.sh (in $PIDS by default) is still running
  local f=${1:-$PIDS} n p
  [ -s "$f" ] || return 1
  while read -r n p; do running "$p" || return 1; done <"$f"
}
owner_of() { # owner_of <pid>: the GEOFED_SLURM_DIR whose start.sh started that daemon; empty for anything else
  local p=$1
  case $(cat "/proc/$p/comm" 2>/dev/null) in munged|mariadbd|slurmdbd|slurmctld|slurmd) ;; *) return 0 ;; esac
  # start.sh exports SLURM_CONF=<dir>/run/etc/slurm.conf to every daemon, and names files under <dir>/run in their
  # command lines (slurmctld -f, mariadbd --datadir, munged --socket).
  { tr '\0' '\n' <"/proc/$p/environ"; tr '\0' '\n' <"/proc/$p/cmdline"; } 2>/dev/null \
    | sed -nE 's#^(SLURM_CONF=|--datadir=|--socket=)?(/.+)/run/(etc/slurm\.conf|mysql/data|munge/munge\.socket\.2)$#\2#p' \
    | head -1
}
port_holder() { # port_holder <port>: "<process> <pid>" listening on that TCP port; empty when it is free
  local line inode fd pid
  if command -v ss >/dev/null; then
    line=$(ss -Hltnp "sport = :$1" 2>/dev/null | head -1)
    [ -n "$line" ] || return 0
    [[ $line =~ users:\(\(\"([^\"]+)\",pid=([0-9]+) ]] && { echo "${BASH_REMATCH[1]} ${BASH_REMATCH[2]}"; return 0; }
  fi
  # without ss (or its process column): the listening socket's inode in /proc/net/tcp*, then the fd that holds it
  inode=$(awk -v p="$(printf '%04X' "$1")" '$4=="0A" && $2 ~ ":"p"$" {print $10; exit}' /proc/net/tcp /proc/net/tcp6 2>/dev/null)
  [ -n "$inode" ] || return 0
  fd=$(find /proc/[0-9]*/fd -lname "socket:\[$inode\]" -print -quit 2>/dev/null)
  pid=${fd#/proc/}; pid=${pid%%/*}
  [ -n "$pid" ] && echo "$(cat "/proc/$pid/comm" 2>/dev/null || echo unknown) $pid" || echo "unknown ?"
}
live_users() { # live_users <dir>: "<other dir> (pid <p>)" for each live reuse lease on <dir>'s cluster; drops dead ones
  local f d p
  for f in "$1"/run/users/*; do
    [ -f "$f" ] || continue
    read -r p d <"$f" || true
    if running "$p"; then echo "$d (pid $p)"; else rm -f "$f"; fi
  done
}
lease_file() { # lease_file <cluster dir> <user dir> <pid>: the file ("<pid> <user dir>") that records one reuse
  echo "$1/run/users/${2//\//_}@$3"
}
drop_leases() { # drop_leases <cluster dir> <user dir>: forget every reuse of that cluster by that dir
  local f
  for f in "$1/run/users/${2//\//_}@"*; do rm -f "$f"; done
}
