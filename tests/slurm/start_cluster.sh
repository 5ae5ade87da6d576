#!/usr/bin/env bash
# Bring up a multi-node Slurm test cluster on one host (munge, MariaDB, slurmdbd, slurmctld, and one slurmd per
# node) from Debian's packages, for the tests and CI. Idempotent: a second run only checks that the cluster
# answers. Needs root. `tests/slurm/start_cluster.sh stop` takes the nodes down again (namespaces, bridge, slurmds).
#
# Nodes node1..nodeN (SNAKEBERT_NODES, default 3) are hosts as on a site: each slurmd runs in its own network
# namespace (an address on the bridge sbbr0 that this script creates, 10.213.0.0/24, the host being .1) and its own
# UTS + mount namespace (its hostname, a hosts file listing every node, its private /run/slurm and spool
# directory); the host's filesystem is the shared filesystem, as NFS or Lustre is on a cluster. slurmctld,
# slurmdbd and MariaDB run on the host (the controller), which runs no jobs. Traffic goes only between the
# addresses of the namespaces created here. Every node declares the host's cores and memory (oversubscribed: the
# nodes share them) and SNAKEBERT_FAKE_GPUS fake GPUs: character-device clones of /dev/null (slurmd drops a gpu
# gres whose File= is not a character device), so GPU rules are scheduled and accounted on a CPU-only machine.
# Partitions `cpu` (default) and `gpu` span every node, least-loaded node first (LLN), so independent jobs
# spread over the nodes. slurmdbd + MariaDB are there because without accounting `sacct` fails and the Snakemake
# plugin silently loses jobs.
set -euo pipefail

FAKE_GPUS=${SNAKEBERT_FAKE_GPUS:-2}
N_NODES=${SNAKEBERT_NODES:-3}
CLUSTER=snakebert
CONTROLLER=$(hostname -s)
BRIDGE=sbbr0
SUBNET=10.213.0           # .1: the controller (this host); .11, .12, ...: node1, node2, ...
NODES=$(seq -f node%g 1 "$N_NODES" | paste -sd' ')
NODE_RANGE="node[1-$N_NODES]"
STATE=/var/lib/slurm/test-cluster   # per-node run and spool directories, the nodes' hosts file
DB_PASS=snakebert-slurmdbd   # local-only database user, reachable through the unix socket only
log() { echo "start_cluster: $*" >&2; }
on_error() {
  log "failed (line $1); last daemon log lines:"
  tail -n 5 /var/log/slurm/*.log >&2 2>/dev/null || true
}
trap 'on_error $LINENO' ERR

if [ "$(id -u)" != 0 ]; then
  echo "start_cluster: needs root (installs packages, creates namespaces and starts daemons)" >&2
  exit 1
fi

node_address() { echo "$SUBNET.$((10 + ${1#node}))"; }
nodes_up() {  # every node registered and usable
  local up
  up=$(sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2 ~ /^(idle|mix|alloc)/ {print $1}' | sort -u | paste -sd' ')
  [ "$up" = "$(echo "$NODES" | tr ' ' '\n' | sort | paste -sd' ')" ]
}
cluster_ok() { nodes_up && sacct -n -X -S now >/dev/null 2>&1; }
stop_nodes() {
  for node in $NODES; do
    pkill -f "^/usr/sbin/slurmd -N $node( |$)" 2>/dev/null || true
  done
  for _ in $(seq 20); do pgrep -f '^/usr/sbin/slurmd -N node' >/dev/null || break; sleep 0.5; done
  # The host end of each veth first: deleting it removes the pair at once, where a namespace's deletion tears
  # its links down asynchronously (a quick restart then met "File exists" adding the same link).
  for node in $NODES; do ip link del "sbv${node#node}" 2>/dev/null || true; done
  for node in $NODES; do ip netns del "sb$node" 2>/dev/null || true; done
  ip link del "$BRIDGE" 2>/dev/null || true
  for _ in $(seq 20); do
    ip -br link | grep -Eq "^($BRIDGE|sbv[0-9]+)[ @]" || return 0
    sleep 0.5
  done
  log "links of a previous cluster are still there: $(ip -br link | grep -E "^($BRIDGE|sbv)" | cut -d' ' -f1 | paste -sd' ')"
  return 1
}

if [ "${1:-}" = stop ]; then
  stop_nodes
  log "nodes stopped (slurmctld, slurmdbd, MariaDB and munge keep running on the host)"
  exit 0
fi
if command -v sinfo >/dev/null && cluster_ok; then
  log "cluster already up: $(sinfo -h -N -o '%N' | sort -u | paste -sd' ')"
  exit 0
fi

# --- packages ------------------------------------------------------------------------------------------
PACKAGES="munge slurmctld slurmd slurmdbd slurm-client mariadb-server iproute2 util-linux"
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

mkdir -p /run/munge /run/mysqld /run/slurm /var/log/slurm /var/lib/slurm/slurmctld /var/lib/slurm/slurmd "$STATE"
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
SlurmctldHost=$CONTROLLER($SUBNET.1)
SlurmUser=slurm
AuthType=auth/munge
# A requeued job (a node lost, a rank killed, Slurm's time-limit warning) may start again only cred_expire seconds
# later: 120 by default, the longest wait of the cluster tests. A job's or step's credential must also be used
# within it, as the job or step starts: 20 s is still ample on this host.
AuthInfo=cred_expire=20
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
$(for node in $NODES; do
  echo "NodeName=$node NodeAddr=$(node_address "$node") CPUs=$CPUS RealMemory=$MEMORY Gres=gpu:$FAKE_GPUS State=UNKNOWN"
done)
PartitionName=cpu Nodes=$NODE_RANGE Default=YES MaxTime=INFINITE State=UP LLN=YES
PartitionName=gpu Nodes=$NODE_RANGE MaxTime=INFINITE State=UP LLN=YES
CONF
cat >/etc/slurm/gres.conf <<CONF
AutoDetect=off
NodeName=$NODE_RANGE Name=gpu File=/dev/fakegpu[0-$((FAKE_GPUS - 1))]
CONF
# The name service of the cluster: every node and the controller by their bridge addresses (gloo and srun
# advertise the address their own hostname resolves to), bind-mounted over /etc/hosts inside each node.
{
  echo "127.0.0.1 localhost"
  echo "$SUBNET.1 $CONTROLLER"
  for node in $NODES; do echo "$(node_address "$node") $node"; done
} >"$STATE/hosts"
rm -f /etc/slurm/cgroup.conf   # autodetect; nothing uses cgroups (proctrack/linuxproc, task/none)

# --- network: a bridge on the host, one veth pair per node ---------------------------------------------
stop_nodes   # a half-started cluster, or the single-host layout of an older version of this script
pkill -x slurmd 2>/dev/null || true  # a slurmd on the host itself (that older layout)
ip link add "$BRIDGE" type bridge
ip addr add "$SUBNET.1/24" dev "$BRIDGE"
ip link set "$BRIDGE" up
for node in $NODES; do
  ip netns add "sb$node"
  ip link add "sbv${node#node}" type veth peer name eth0 netns "sb$node"
  ip link set "sbv${node#node}" master "$BRIDGE" up
  ip -n "sb$node" addr add "$(node_address "$node")/24" dev eth0
  ip -n "sb$node" link set eth0 up
  ip -n "sb$node" link set lo up
done

# --- daemons -------------------------------------------------------------------------------------------
running slurmdbd || /usr/sbin/slurmdbd
wait_for 60 slurmdbd sacctmgr -n list cluster
sacctmgr -i -Q add cluster "$CLUSTER" >/dev/null 2>&1 || true
# slurmctld reads NodeName lines only when it starts (22.05: `scontrol reconfigure` does not add nodes)
pkill -x slurmctld 2>/dev/null && for _ in $(seq 30); do running slurmctld || break; sleep 0.5; done
/usr/sbin/slurmctld
wait_for 60 slurmctld scontrol ping
# Each slurmd: the node's network namespace (nsenter, not `ip netns exec`, which remounts /sys and hides the
# cgroup mounts slurmd reads), then its own hostname and mounts.
for node in $NODES; do
  mkdir -p "$STATE/$node/run" "$STATE/$node/spool"
  chown slurm:slurm "$STATE/$node/run"
  nsenter --net="/var/run/netns/sb$node" unshare --uts --mount --propagation private sh -c "
    hostname $node
    mount --bind $STATE/hosts /etc/hosts
    mount --bind $STATE/$node/run /run/slurm
    mount --bind $STATE/$node/spool /var/lib/slurm/slurmd
    exec /usr/sbin/slurmd -N $node -L /var/log/slurm/slurmd-$node.log"
done
if ! wait_for 60 "nodes $NODES" nodes_up; then
  scontrol update NodeName="$NODE_RANGE" State=RESUME || true
  wait_for 30 "nodes $NODES" nodes_up
fi
wait_for 60 "sacct" sacct -n -X -S now
log "cluster $CLUSTER up: controller $CONTROLLER ($SUBNET.1), nodes $NODES ($SUBNET.11-), each $CPUS CPUs, ${MEMORY} MB, $FAKE_GPUS fake GPUs"
