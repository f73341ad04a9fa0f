#!/usr/bin/env bash
# Start a real single-node Slurm (munged, MariaDB + slurmdbd, slurmctld, slurmd) without systemd; root only.
#
# Everything lives under $GEOFED_SLURM_DIR (default .slurm/ at the repository root). Afterwards
#   source $GEOFED_SLURM_DIR/run/env.sh      # exports SLURM_CONF for sbatch, squeue, sacct, scontrol
# Partitions: `low` (default; PreemptMode=REQUEUE, GraceTime=30) and `high` (PriorityTier=10): a job in
# `high` that needs the CPUs preempts a `low` job, which gets its --signal first (preempt_send_user_signal).
# Knobs: WITH_SLURMDBD=0 (no accounting: `sacct` fails, like clusters without it), SKIP_INSTALL=1,
# GEOFED_SLURM_PORTS (see common.sh), GEOFED_SLURM_REUSE=0 (refuse instead of reusing, below).
# Running it while the cluster is up does nothing (exit 0); stop with slurm/stop.sh.
#
# One cluster per host. Its ports are checked before anything starts:
# - held by the cluster of another GEOFED_SLURM_DIR (e.g. a second checkout's .slurm) that is up: this start
#   reuses it (exit 0): run/env.sh here points at it, and a lease in its run/users/ names this dir and this
#   script's parent process (the shell of `make test`). slurm/stop.sh here only releases the lease; the owner's
#   slurm/stop.sh leaves the cluster running while a lease is live and the last release stops it. With
#   GEOFED_SLURM_REUSE=0 it refuses instead, in one line naming that cluster, its pids and ports, and how to stop it.
# - held by anything else: one line naming the port and the process that holds it (exit 1), nothing started.
# A start that fails midway (a daemon that exits or does not answer) stops by PID every daemon it started itself,
# munged included, and says so; it never touches another cluster's daemons.
set -euo pipefail
source "$(dirname "$0")/common.sh"
WITH_SLURMDBD=${WITH_SLURMDBD:-1}

[ "$(id -u)" = 0 ] || die "must run as root (slurmd launches jobs as root; apt-get needs root)"
ping_at() { SLURM_CONF=$1/run/etc/slurm.conf scontrol ping >/dev/null 2>&1; }
up_at() { all_alive "$1/run/pids/started.pids" && ping_at "$1"; }
describe() { # describe <dir>: "munged pid 1, mariadbd pid 2, ..." of the daemons start.sh recorded there
  awk '{printf "%s%s pid %s", (NR>1 ? ", " : ""), $1, $2}' "$1/run/pids/started.pids" 2>/dev/null
}
if all_alive "$PIDS" && ping_at "$ROOT"; then
  if [ -e "$R/stop.requested" ]; then
    rm -f "$R/stop.requested"; log "already running under $ROOT; its pending stop is cancelled (source $R/env.sh)"
  else
    log "already running under $ROOT (source $R/env.sh)"
  fi
  exit 0
fi
if [ -s "$REUSES" ]; then   # an earlier start here reused another dir's cluster
  other=$(cat "$REUSES")
  if up_at "$other"; then
    mkdir -p "$other/run/users"; echo "$PPID $ROOT" >"$(lease_file "$other" "$ROOT" "$PPID")"
    log "reusing the test cluster under $other ($(describe "$other")) (source $R/env.sh)"; exit 0
  fi
  drop_leases "$other" "$ROOT"; rm -rf "$R"
fi
if [ -s "$PIDS" ]; then
  while read -r n p; do
    running "$p" && die "$n (pid $p) from an earlier start under $ROOT still runs: run GEOFED_SLURM_DIR=$ROOT slurm/stop.sh first"
  done <"$PIDS"
fi

# ------------------------------------------------------------------ the ports: free, or another cluster's to reuse
NEEDED="$CTLD_PORT:slurmctld $SLURMD_PORT:slurmd"
[ "$WITH_SLURMDBD" = 1 ] && NEEDED="$NEEDED $DBD_PORT:slurmdbd $MYSQL_PORT:mariadb"
PORT_LIST=$(for i in $NEEDED; do printf '%s, ' "${i%%:*} (${i#*:})"; done); PORT_LIST=${PORT_LIST%, }
busy="" other=""
for item in $NEEDED; do
  port=${item%%:*} role=${item#*:}
  holder=$(port_holder "$port"); [ -n "$holder" ] || continue
  read -r proc pid <<<"$holder"
  owner=""; [ "$pid" = "?" ] || owner=$(owner_of "$pid")
  if [ -n "$owner" ] && [ "$owner" != "$ROOT" ] && { [ -z "$other" ] || [ "$owner" = "$other" ]; }; then
    other=$owner
  elif [ "$owner" = "$ROOT" ]; then
    busy="$busy; port $port ($role) is held by $proc (pid $pid), left behind by an earlier start under $ROOT: end it with kill $pid"
  elif [ -n "$owner" ]; then
    busy="$busy; port $port ($role) is held by $proc (pid $pid) of the test cluster under $owner: stop it with GEOFED_SLURM_DIR=$owner slurm/stop.sh"
  elif [ "$pid" = "?" ]; then
    busy="$busy; port $port ($role) is in use by a process not visible here"
  else
    busy="$busy; port $port ($role) is in use by $proc (pid $pid)"
  fi
done
if [ -n "$busy" ]; then
  die "${busy#; }; nothing started: free it, or choose other ports with GEOFED_SLURM_PORTS='<slurmctld> <slurmd> <slurmdbd> <mariadb>' (now: $CTLD_PORT $SLURMD_PORT $DBD_PORT $MYSQL_PORT)"
fi
if [ -n "$other" ]; then
  up_at "$other" || die "ports $PORT_LIST are held by the test cluster under $other ($(describe "$other")), which is not up (still starting, or broken): wait, or stop it with GEOFED_SLURM_DIR=$other slurm/stop.sh"
  what="the test cluster under $other is running ($(describe "$other"); ports $PORT_LIST)"
  [ "${GEOFED_SLURM_REUSE:-1}" = 1 ] || die "$what: use it (source $other/run/env.sh, or GEOFED_SLURM_DIR=$other make test), or stop it first with GEOFED_SLURM_DIR=$other slurm/stop.sh"
  [ "$WITH_SLURMDBD" = 0 ] || grep -q '^slurmdbd ' "$other/run/pids/started.pids" \
    || die "$what without slurmdbd (sacct fails there): set WITH_SLURMDBD=0 to reuse it, or stop it first with GEOFED_SLURM_DIR=$other slurm/stop.sh"
  rm -rf "$R"; mkdir -p "$R/etc" "$other/run/users"
  ln -s "$other/run/etc/slurm.conf" "$R/etc/slurm.conf"
  echo "$other" >"$REUSES"
  echo "export SLURM_CONF=$other/run/etc/slurm.conf" >"$R/env.sh"
  echo "$PPID $ROOT" >"$(lease_file "$other" "$ROOT" "$PPID")"
  log "$what: reusing it instead of starting a second one; source $R/env.sh"
  log "GEOFED_SLURM_DIR=$ROOT slurm/stop.sh releases it (it keeps running); GEOFED_SLURM_DIR=$other slurm/stop.sh stops it once nobody reuses it"
  exit 0
fi

# munged refuses a socket whose directories are not all world-executable (mktemp -d makes 0700 ones).
d=$R
while [ "$d" != / ] && [ -n "$d" ]; do
  [ -e "$d" ] && [ "$(stat -c %A "$d" | cut -c10)" = - ] \
    && die "munged needs every directory above its socket ($R/munge) world-executable, and $d is not: chmod o+x $d"
  d=$(dirname "$d")
done
t0=$(date +%s.%N)
[ "${SKIP_INSTALL:-0}" = 1 ] || WITH_SLURMDBD=$WITH_SLURMDBD "$SLURM_SCRIPTS/install.sh"
for cmd in munged slurmctld slurmd sbatch; do command -v $cmd >/dev/null || die "$cmd not found: run slurm/install.sh"; done

# ------------------------------------------------------------------ layout and configuration
rm -rf "$R"
mkdir -p "$R"/{etc,state,spool,log,pids,munge,mysql}
: >"$PIDS"
on_exit() { # a start that failed stops, by PID, what it started (stop.sh reads only this start's $PIDS)
  local rc=$?
  trap - EXIT
  if [ "$rc" != 0 ] && [ -s "$PIDS" ]; then
    local began; began=$(describe "$ROOT")
    log "start did not finish (exit $rc): stopping what it started ($began)"
    GEOFED_SLURM_DIR=$ROOT "$SLURM_SCRIPTS/stop.sh" 2>&1 | sed 's/^/  /'
    if all_dead; then
      echo "[slurm/start] error: start failed; stopped every daemon it had started ($began); logs: $R/log/" >&2
    else
      echo "[slurm/start] error: start failed; some daemons it started still run: $(describe "$ROOT")" >&2
    fi
  fi
  exit "$rc"
}
all_dead() { local n p; while read -r n p; do ! running "$p" || return 1; done <"$PIDS"; }
trap on_exit EXIT
trap 'exit 130' INT
trap 'exit 143' TERM HUP
chmod 0755 "$R/munge"   # munged insists that its socket directory is world-executable
NCPU=$(nproc)
MEM_MB=$(awk '/MemTotal/{printf "%d", $2/1024*0.85}' /proc/meminfo)   # below what slurmd detects
SOCK=$R/munge/munge.socket.2
if [ "$WITH_SLURMDBD" = 1 ]; then
  # The persistent connection to slurmdbd does not use AuthInfo's socket; it uses AccountingStoragePass.
  ACCT="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
AccountingStoragePass=$SOCK
JobAcctGatherType=jobacct_gather/linux"
else
  ACCT="AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none"
fi
cat >"$R/etc/slurm.conf" <<CONF
ClusterName=$CLUSTER
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire=10: a requeued job may start again after 10 s instead of the default 120 s
AuthInfo=socket=$SOCK,cred_expire=10
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
StateSaveLocation=$R/state
SlurmdSpoolDir=$R/spool
SlurmctldPidFile=$R/pids/slurmctld.pid
SlurmdPidFile=$R/pids/slurmd.pid
SlurmctldLogFile=$R/log/slurmctld.log
SlurmdLogFile=$R/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
# No cgroups: linuxproc and task/none work in containers and without systemd.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
$ACCT
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# Short scheduling passes: a requeued job starts soon after its hold (cred_expire) ends.
SchedulerParameters=bf_interval=2,sched_interval=2
ReturnToService=2
JobRequeue=1
KillWait=10
MinJobAge=3600
# Preemption: a job in 'high' requeues jobs in 'low'. preempt_send_user_signal delivers the job's --signal
# (submitit: USR2) at preemption time; without it a preempted job only gets SIGTERM after GraceTime.
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$NCPU RealMemory=$MEM_MB State=UNKNOWN
PartitionName=low  Nodes=localhost Default=YES MaxTime=INFINITE State=UP PriorityTier=1  PreemptMode=REQUEUE GraceTime=30
PartitionName=high Nodes=localhost Default=NO  MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
CONF
export SLURM_CONF=$R/etc/slurm.conf
echo "export SLURM_CONF=$SLURM_CONF" >"$R/env.sh"

start_bg() { # start_bg <name> <cmd...>: start in the background, record "name pid"
  local name=$1; shift
  nohup "$@" >"$R/log/$name.stdout" 2>&1 </dev/null &
  echo "$name $!" >>"$PIDS"
  log "started $name (pid $!)"
}
wait_up() { # wait_up <timeout_s> <daemon> <cmd...>: poll until the command succeeds; give up when the daemon exits
  local t=$1 n=$2 p; shift 2; local end=$(( $(date +%s) + t )); p=$(pid_of "$n")
  until "$@" >/dev/null 2>&1; do
    running "$p" || { log "$n (pid $p) has exited"; return 1; }
    [ "$(date +%s)" -ge "$end" ] && return 1
    sleep 0.2
  done
}

# ------------------------------------------------------------------ daemons
dd if=/dev/urandom of="$R/munge/munge.key" bs=1024 count=1 status=none
chmod 0400 "$R/munge/munge.key"
start_bg munged munged --foreground --key-file="$R/munge/munge.key" --socket="$SOCK" \
  --pid-file="$R/munge/munged.pid" --log-file="$R/log/munged.log" --seed-file="$R/munge/munged.seed"
wait_up 20 munged bash -c "munge -S '$SOCK' -n | unmunge -S '$SOCK'" || { tail "$R/log/munged.stdout" || true; die "munged did not come up"; }

if [ "$WITH_SLURMDBD" = 1 ]; then
  mariadb-install-db --no-defaults --datadir="$R/mysql/data" --user=root --skip-test-db >"$R/log/mariadb-install.log" 2>&1 \
    || { tail "$R/log/mariadb-install.log" || true; die "mariadb-install-db failed"; }
  start_bg mariadbd mariadbd --no-defaults --datadir="$R/mysql/data" --user=root --port="$MYSQL_PORT" \
    --bind-address=127.0.0.1 --socket="$R/mysql/mysqld.sock" --pid-file="$R/mysql/mysqld.pid" \
    --log-error="$R/log/mariadb.err" --innodb-buffer-pool-size=64M --innodb-lock-wait-timeout=900
  wait_up 60 mariadbd mariadb --no-defaults -S "$R/mysql/mysqld.sock" -uroot -e 'select 1' \
    || { tail "$R/log/mariadb.err" || true; die "mariadb did not come up"; }
  mariadb --no-defaults -S "$R/mysql/mysqld.sock" -uroot -e \
    "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurmpw'; GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1'; FLUSH PRIVILEGES;"
  cat >"$R/etc/slurmdbd.conf" <<CONF
AuthType=auth/munge
AuthInfo=socket=$SOCK
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$R/pids/slurmdbd.pid
LogFile=$R/log/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$MYSQL_PORT
StorageUser=slurm
StoragePass=slurmpw
StorageLoc=slurm_acct_db
CONF
  chmod 0600 "$R/etc/slurmdbd.conf"   # slurmdbd refuses a world-readable config
  start_bg slurmdbd slurmdbd -D        # finds slurmdbd.conf next to $SLURM_CONF
  wait_up 60 slurmdbd grep -q 'slurmdbd version .* started' "$R/log/slurmdbd.log" \
    || { tail "$R/log/slurmdbd.log" || true; die "slurmdbd did not come up"; }
fi

start_bg slurmctld slurmctld -D -c -f "$SLURM_CONF"   # -c: start clean, ignore any old state
wait_up 30 slurmctld scontrol ping || { tail -20 "$R/log/slurmctld.log" || true; die "slurmctld does not answer"; }
start_bg slurmd slurmd -D -N localhost -f "$SLURM_CONF"   # -N: the node name, whatever the hostname
node_idle() { scontrol show node localhost 2>/dev/null | grep -q 'State=IDLE '; }
wait_up 120 slurmd node_idle || { scontrol show node localhost; tail -20 "$R/log/slurmctld.log" "$R/log/slurmd.log" || true; die "node never became IDLE"; }
if [ "$WITH_SLURMDBD" = 1 ]; then   # slurmctld registers the cluster itself; make sure before anyone calls sacct
  wait_for 30 bash -c "sacctmgr -n -P show cluster format=cluster | grep -qx $CLUSTER" || sacctmgr -i add cluster $CLUSTER
fi
sinfo
log "ready in $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')s; pids: $(awk '{printf "%s=%s ", $1, $2}' "$PIDS")"
log "source $R/env.sh"
