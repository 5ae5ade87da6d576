#!/usr/bin/env bash
# Bring up a single-host Slurm cluster (munge, MariaDB, slurmdbd, slurmctld, slurmd) from Debian's packages,
# for the tests and CI. Idempotent: a second run only checks that the cluster answers. Needs root.
#
# Partitions `cpu` (default) and `gpu` share the one node. Its GPUs are fake: character-device clones of
# /dev/null (slurmd drops a gpu gres whose File= is not a character device), so GPU rules are scheduled and
# accounted on a CPU-only machine. slurmdbd + MariaDB are there because without accounting `sacct` fails and
# the Snakemake plugin silently loses jobs.
set -euo pipefail

FAKE_GPUS=${SNAKEBERT_FAKE_GPUS:-2}
CLUSTER=snakebert
NODE=$(hostname -s)
DB_PASS=snakebert-slurmdbd   # local-only database user, reachable through the unix socket only
log() { echo "start_cluster: $*" >&2; }
on_error() {
  log "failed (line $1); last daemon log lines:"
  tail -n 5 /var/log/slurm/*.log >&2 2>/dev/null || true
}
trap 'on_error $LINENO' ERR

if [ "$(id -u)" != 0 ]; then
  echo "start_cluster: needs root (installs packages and starts daemons)" >&2
  exit 1
fi

cluster_ok() {
  sinfo -h -n "$NODE" -o '%t' 2>/dev/null | grep -Eq '^(idle|mix|alloc)' && sacct -n -X -S now >/dev/null 2>&1
}
if command -v sinfo >/dev/null && cluster_ok; then
  log "cluster already up"
  exit 0
fi

# --- packages ------------------------------------------------------------------------------------------
PACKAGES="munge slurmctld slurmd slurmdbd slurm-client mariadb-server"
if ! dpkg -s $PACKAGES >/dev/null 2>&1; then
  log "installing $PACKAGES"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends $PACKAGES >/dev/null
fi

wait_for() {  # wait_for <seconds> <what> <command...>
  local seconds=$1 what=$2; shift 2
  for _ in $(seq "$seconds"); do "$@" >/dev/null 2>&1 && return 0; sleep 1; done
  log "timed out waiting for $what"; return 1
}
running() { pgrep -x "$1" >/dev/null; }

mkdir -p /run/munge /run/mysqld /run/slurm /var/log/slurm /var/lib/slurm/slurmctld /var/lib/slurm/slurmd
chown munge:munge /run/munge
chown mysql:mysql /run/mysqld
chown slurm:slurm /run/slurm /var/log/slurm /var/lib/slurm/slurmctld

# --- munge ---------------------------------------------------------------------------------------------
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
fi
chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
running munged || runuser -u munge -- /usr/sbin/munged
wait_for 20 munge sh -c 'munge -n | unmunge'

# --- MariaDB for slurmdbd ------------------------------------------------------------------------------
[ -d /var/lib/mysql/mysql ] || mariadb-install-db --user=mysql --datadir=/var/lib/mysql >/dev/null
if ! running mariadbd; then
  runuser -u mysql -- /usr/sbin/mariadbd --datadir=/var/lib/mysql --socket=/run/mysqld/mysqld.sock \
    --bind-address=127.0.0.1 >/var/log/slurm/mariadb.log 2>&1 &
fi
wait_for 60 MariaDB mariadb-admin ping
mariadb <<SQL
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
SQL

# --- fake GPUs -----------------------------------------------------------------------------------------
for i in $(seq 0 $((FAKE_GPUS - 1))); do
  [ -c /dev/fakegpu$i ] || { rm -f /dev/fakegpu$i; mknod /dev/fakegpu$i c 1 3; chmod 666 /dev/fakegpu$i; }
done

# --- configuration -------------------------------------------------------------------------------------
CPUS=$(slurmd -C | sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' | head -1)
MEMORY=$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' | head -1)
MEMORY=$((MEMORY * 9 / 10))   # never more than slurmd -C reports, or the node is drained

cat >/etc/slurm/slurmdbd.conf <<CONF
AuthType=auth/munge
DbdHost=localhost
SlurmUser=slurm
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
LogFile=/var/log/slurm/slurmdbd.log
PidFile=/run/slurm/slurmdbd.pid
CONF
chown slurm:slurm /etc/slurm/slurmdbd.conf && chmod 600 /etc/slurm/slurmdbd.conf

# MinJobAge >= 3 x the plugin's slurm-init-seconds-before-status-checks keeps finished jobs visible to squeue.
cat >/etc/slurm/slurm.conf <<CONF
ClusterName=$CLUSTER
SlurmctldHost=$NODE
SlurmUser=slurm
AuthType=auth/munge
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStorageTRES=gres/gpu
AccountingStoreFlags=job_comment
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
MinJobAge=600
KillWait=15
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=60
NodeName=$NODE CPUs=$CPUS RealMemory=$MEMORY Gres=gpu:$FAKE_GPUS State=UNKNOWN
PartitionName=cpu Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
PartitionName=gpu Nodes=$NODE MaxTime=INFINITE State=UP
CONF
cat >/etc/slurm/gres.conf <<CONF
AutoDetect=off
NodeName=$NODE Name=gpu File=/dev/fakegpu[0-$((FAKE_GPUS - 1))]
CONF
rm -f /etc/slurm/cgroup.conf   # autodetect; nothing uses cgroups (proctrack/linuxproc, task/none)

# --- daemons -------------------------------------------------------------------------------------------
running slurmdbd || /usr/sbin/slurmdbd
wait_for 60 slurmdbd sacctmgr -n list cluster
sacctmgr -i -Q add cluster "$CLUSTER" >/dev/null 2>&1 || true
running slurmctld || /usr/sbin/slurmctld
wait_for 60 slurmctld scontrol ping
running slurmd || /usr/sbin/slurmd
wait_for 60 "node $NODE" sh -c "sinfo -h -n $NODE -o %t | grep -Eq '^(idle|mix|alloc)'" || {
  scontrol update NodeName="$NODE" State=RESUME || true
  wait_for 30 "node $NODE" sh -c "sinfo -h -n $NODE -o %t | grep -Eq '^(idle|mix|alloc)'"
}
wait_for 60 "sacct" sacct -n -X -S now
log "cluster $CLUSTER up: node $NODE, $CPUS CPUs, ${MEMORY} MB, $FAKE_GPUS fake GPUs"
