#!/usr/bin/env bash
# Start a real single-node Slurm (munged, MariaDB + slurmdbd, slurmctld, slurmd) without systemd; root only.
#
# Everything lives under $GEOFED_SLURM_DIR (default .slurm/ at the repository root). Afterwards
#   source $GEOFED_SLURM_DIR/run/env.sh      # exports SLURM_CONF for sbatch, squeue, sacct, scontrol
# Partitions: `low` (default; PreemptMode=REQUEUE, GraceTime=30) and `high` (PriorityTier=10): a job in
# `high` that needs the CPUs preempts a `low` job, which gets its --signal first (preempt_send_user_signal).
# Knobs: WITH_SLURMDBD=0 (no accounting: `sacct` fails, like clusters without it), SKIP_INSTALL=1.
# Running it while the cluster is up does nothing (exit 0); stop with slurm/stop.sh.
set -euo pipefail
source "$(dirname "$0")/common.sh"
WITH_SLURMDBD=${WITH_SLURMDBD:-1}

[ "$(id -u)" = 0 ] || die "must run as root (slurmd launches jobs as root; apt-get needs root)"
if all_alive && SLURM_CONF=$R/etc/slurm.conf scontrol ping >/dev/null 2>&1; then
  log "already running under $ROOT (source $R/env.sh)"; exit 0
fi
if [ -s "$PIDS" ]; then
  while read -r n p; do kill -0 "$p" 2>/dev/null && die "$n (pid $p) from an earlier start still runs: run slurm/stop.sh first"; done <"$PIDS"
fi
t0=$(date +%s.%N)
[ "${SKIP_INSTALL:-0}" = 1 ] || WITH_SLURMDBD=$WITH_SLURMDBD "$SLURM_SCRIPTS/install.sh"
for cmd in munged slurmctld slurmd sbatch; do command -v $cmd >/dev/null || die "$cmd not found: run slurm/install.sh"; done

# ------------------------------------------------------------------ layout and configuration
rm -rf "$R"
mkdir -p "$R"/{etc,state,spool,log,pids,munge,mysql}
: >"$PIDS"
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

# ------------------------------------------------------------------ daemons
dd if=/dev/urandom of="$R/munge/munge.key" bs=1024 count=1 status=none
chmod 0400 "$R/munge/munge.key"
start_bg munged munged --foreground --key-file="$R/munge/munge.key" --socket="$SOCK" \
  --pid-file="$R/munge/munged.pid" --log-file="$R/log/munged.log" --seed-file="$R/munge/munged.seed"
wait_for 20 bash -c "munge -S '$SOCK' -n | unmunge -S '$SOCK'" || { cat "$R/log/munged.log"; die "munged did not come up"; }

if [ "$WITH_SLURMDBD" = 1 ]; then
  mariadb-install-db --no-defaults --datadir="$R/mysql/data" --user=root --skip-test-db >"$R/log/mariadb-install.log" 2>&1 \
    || { tail "$R/log/mariadb-install.log"; die "mariadb-install-db failed"; }
  start_bg mariadbd mariadbd --no-defaults --datadir="$R/mysql/data" --user=root --port=$MYSQL_PORT \
    --bind-address=127.0.0.1 --socket="$R/mysql/mysqld.sock" --pid-file="$R/mysql/mysqld.pid" \
    --log-error="$R/log/mariadb.err" --innodb-buffer-pool-size=64M --innodb-lock-wait-timeout=900
  wait_for 60 mariadb --no-defaults -S "$R/mysql/mysqld.sock" -uroot -e 'select 1' \
    || { tail "$R/log/mariadb.err"; die "mariadb did not come up"; }
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
  wait_for 60 grep -q 'slurmdbd version .* started' "$R/log/slurmdbd.log" \
    || { tail "$R/log/slurmdbd.log"; die "slurmdbd did not come up"; }
fi

start_bg slurmctld slurmctld -D -c -f "$SLURM_CONF"   # -c: start clean, ignore any old state
wait_for 30 scontrol ping || { tail -20 "$R/log/slurmctld.log"; die "slurmctld does not answer"; }
start_bg slurmd slurmd -D -N localhost -f "$SLURM_CONF"   # -N: the node name, whatever the hostname
node_idle() { scontrol show node localhost 2>/dev/null | grep -q 'State=IDLE '; }
wait_for 120 node_idle || { scontrol show node localhost; tail -20 "$R/log/slurmctld.log" "$R/log/slurmd.log"; die "node never became IDLE"; }
if [ "$WITH_SLURMDBD" = 1 ]; then   # slurmctld registers the cluster itself; make sure before anyone calls sacct
  wait_for 30 bash -c "sacctmgr -n -P show cluster format=cluster | grep -qx $CLUSTER" || sacctmgr -i add cluster $CLUSTER
fi
sinfo
log "ready in $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')s; pids: $(awk '{printf "%s=%s ", $1, $2}' "$PIDS")"
log "source $R/env.sh"
