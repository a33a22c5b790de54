#!/usr/bin/env bash
# tests/infra/slurm-up.sh [DIR] -- start a real Slurm cluster of N fake-GPU nodes on this machine
# for k3launch's Slurm-backend tests. Needs root. DIR (default /tmp/k3launch-slurm) holds the
# configs, spool, pid files, logs and the fake GPU device nodes; it must be an absolute path of
# [A-Za-z0-9._/-] (it ends up in slurm.conf, gres.conf and /etc/hosts tags unquoted).
#
# Knobs (environment):
#   SLURM_NODES=4            nodes ${SLURM_NODE_PREFIX}1..N, 1..48
#   SLURM_NODE_PREFIX=k3n    lowercase letters, digits, '-'; must not end in a digit
#   SLURM_GPUS_PER_NODE=8    Gres=gpu[:TYPE]:N per node, 0..64 (0 = no GPUs)
#   SLURM_GPU_TYPE=          e.g. h100 -> Gres=gpu:h100:8 (then --gres=gpu:h100:2 works too)
#   SLURM_CPUS_PER_NODE=32   what each node claims (SlurmdParameters=config_overrides: never
#   SLURM_MEM_MB=128000      checked against this machine, all nodes share its real cores)
#   SLURM_PARTITION=gpu      the single, default partition
#   SLURM_MODE=auto          netns: node i = its own network + UTS namespace, address
#                                   SLURM_SUBNET.(100+i) on bridge SLURM_BRIDGE, hostname = node
#                                   name, slurmd on port 6818 inside the namespace
#                            multi: every slurmd on 127.0.0.1, port SLURMD_PORT_BASE+i; jobs see
#                                   this machine's hostname (use SLURMD_NODENAME)
#                            auto:  netns if namespaces can be made here, else multi
#   SLURM_SUBNET=10.214.0    the nodes' private /24 (netns); the SSH test hosts use 10.213.x,
#   SLURM_BRIDGE=k3sbr0      so both sets run side by side
#   SLURM_ETC_HOSTS=1        netns: add "ADDRESS NODE" lines (tagged, removed by down) to /etc/hosts
#   SLURM_ACCOUNTING=0       1: also a private MariaDB + slurmdbd, so sacct works
#   SLURM_LINK_ETC=auto      symlink /etc/slurm/slurm.conf -> DIR/slurm.conf so Slurm commands
#                            work without SLURM_CONF (e.g. in an ssh session); auto: only if that
#                            path is free (missing, or a link to a cluster that is gone);
#                            1: fail if it is not free; 0: never
#   SLURMCTLD_PORT=6817  SLURMD_PORT_BASE=17000 (multi)  SLURMDBD_PORT=16819  MARIADB_PORT=13306
#   SLURM_WAIT_S=60          bound on the wait for every node to be idle
# (Slurm itself sets SLURM_GPUS_PER_NODE in jobs and srun reads SLURM_PARTITION: when running this
# from inside a real Slurm job, set those knobs explicitly. tests/support/slurmcluster.py does.)
#
# Each cluster has its own munged (socket and key in DIR) and its own ports; machine-wide names
# (bridge, namespaces, ports) are claimed in the registry of lib-netns.sh, so the SSH test hosts
# and several clusters (one per DIR, other knobs) run side by side.
# Outputs in DIR: slurm.conf, gres.conf, cgroup.conf, env.sh (exports SLURM_CONF and
# K3LAUNCH_TEST_SLURM_DIR: sourcing it makes the tests reuse this cluster), cluster.json (what
# tests/support/slurmcluster.py reads), log/ (daemon logs, jobcomp.txt: one line per finished job).
# Idempotent: a running cluster is only re-checked, dead daemons are restarted; different
# settings for a running cluster are refused (run slurm-down.sh DIR first).
# Returns once `sinfo` shows every node idle (or busy with jobs), or fails within SLURM_WAIT_S;
# a failed up leaves what it made for post-mortems: slurm-down.sh DIR removes it.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
K3_SELF=slurm-up
# shellcheck source=lib-netns.sh
. "$HERE/lib-netns.sh"
# shellcheck source=lib-slurm.sh
. "$HERE/lib-slurm.sh"

begin_cluster_script "${1:-}" "must run as root (slurmd runs jobs as any user; namespaces; mknod)"
mkdir -p "$DIR"/{run,log,spool,dev,etc}
# slurmd, slurmstepd and the jobs read slurm.conf and gres.conf from here
chmod 755 "$DIR"
lock_dir "$DIR"
WAIT_S=${SLURM_WAIT_S:-60}
is_num "$WAIT_S" 1 3600 || die "SLURM_WAIT_S must be 1..3600 (got '$WAIT_S')"

# ---- packages: install only what is missing ----------------------------------------------
ensure_packages() {
  local need=() p
  for p in slurmctld slurmd slurm-client munge; do dpkg -s "$p" >/dev/null 2>&1 || need+=("$p"); done
  if [ "${SLURM_ACCOUNTING:-0}" = 1 ] || { [ -f "$DIR/settings" ] && grep -qx 'C_ACCT=1' "$DIR/settings"; }; then
    for p in slurmdbd mariadb-server; do dpkg -s "$p" >/dev/null 2>&1 || need+=("$p"); done
  fi
  { command -v ip && command -v ss; } >/dev/null || need+=(iproute2)
  { command -v unshare && command -v flock; } >/dev/null || need+=(util-linux)
  command -v ps >/dev/null || need+=(procps)
  apt_install "$DIR/log/apt.log" "${need[@]}"   # policy-rc.d: slurmctld, slurmd, munged stay down
}
ensure_packages

# ---- settings: a running cluster keeps its own ------------------------------------------
# Changing node names, ports or the subnet under running daemons would strand them, so an
# explicit knob that contradicts the running cluster is an error, not a silent restart.
if cluster_active "$DIR" && load_settings "$DIR"; then
  same() { [ -z "$1" ] || [ "$1" = "$2" ] || die "$DIR runs a cluster with $3=$2 (asked for $1); run slurm-down.sh $DIR first"; }
  [ "${SLURM_MODE:-auto}" = auto ] || same "$SLURM_MODE" "$C_MODE" SLURM_MODE
  same "${SLURM_NODES:-}" "$C_NODES" SLURM_NODES
  same "${SLURM_NODE_PREFIX:-}" "$C_PREFIX" SLURM_NODE_PREFIX
  same "${SLURM_GPUS_PER_NODE:-}" "$C_GPUS" SLURM_GPUS_PER_NODE
  same "${SLURM_GPU_TYPE:-}" "$C_GTYPE" SLURM_GPU_TYPE
  same "${SLURM_CPUS_PER_NODE:-}" "$C_CPUS" SLURM_CPUS_PER_NODE
  same "${SLURM_MEM_MB:-}" "$C_MEM" SLURM_MEM_MB
  same "${SLURM_PARTITION:-}" "$C_PART" SLURM_PARTITION
  same "${SLURM_ACCOUNTING:-}" "$C_ACCT" SLURM_ACCOUNTING
  same "${SLURMCTLD_PORT:-}" "$C_CTLD_PORT" SLURMCTLD_PORT
  same "${SLURMD_PORT_BASE:-}" "$C_SLURMD_BASE" SLURMD_PORT_BASE
  same "${SLURMDBD_PORT:-}" "$C_DBD_PORT" SLURMDBD_PORT
  same "${MARIADB_PORT:-}" "$C_DB_PORT" MARIADB_PORT
  if [ "$C_MODE" = netns ]; then
    same "${SLURM_SUBNET:-}" "$C_SUBNET" SLURM_SUBNET
    same "${SLURM_BRIDGE:-}" "$C_BRIDGE" SLURM_BRIDGE
  fi
else
  C_NODES=${SLURM_NODES:-4}
  C_PREFIX=${SLURM_NODE_PREFIX:-k3n}
  C_GPUS=${SLURM_GPUS_PER_NODE:-8}
  C_GTYPE=${SLURM_GPU_TYPE:-}
  C_CPUS=${SLURM_CPUS_PER_NODE:-32}
  C_MEM=${SLURM_MEM_MB:-128000}
  C_PART=${SLURM_PARTITION:-gpu}
  C_ACCT=${SLURM_ACCOUNTING:-0}
  C_CLUSTER=k3launch
  C_SUBNET=${SLURM_SUBNET:-10.214.0}
  C_BRIDGE=${SLURM_BRIDGE:-k3sbr0}
  C_ETC_HOSTS=${SLURM_ETC_HOSTS:-1}
  C_CTLD_PORT=${SLURMCTLD_PORT:-6817}
  C_SLURMD_BASE=${SLURMD_PORT_BASE:-17000}
  C_DBD_PORT=${SLURMDBD_PORT:-16819}
  C_DB_PORT=${MARIADB_PORT:-13306}
  is_num "$C_NODES" 1 48 || die "SLURM_NODES must be 1..48 (got '$C_NODES')"
  is_num "$C_GPUS" 0 64 || die "SLURM_GPUS_PER_NODE must be 0..64 (got '$C_GPUS')"
  is_num "$C_CPUS" 1 4096 || die "SLURM_CPUS_PER_NODE must be 1..4096 (got '$C_CPUS')"
  is_num "$C_MEM" 100 100000000 || die "SLURM_MEM_MB must be 100..1e8 (got '$C_MEM')"
  for v in C_CTLD_PORT C_SLURMD_BASE C_DBD_PORT C_DB_PORT; do
    is_num "${!v}" 1024 65000 || die "${v#C_} must be a port 1024..65000 (got '${!v}')"
  done
  [[ $C_PREFIX =~ ^[a-z]([a-z0-9-]*[a-z-])?$ ]] || die "SLURM_NODE_PREFIX '$C_PREFIX': lowercase letters, digits, '-', starting with a letter, not ending in a digit"
  [[ $C_GTYPE =~ ^([a-z][a-z0-9_-]{0,31})?$ ]] || die "SLURM_GPU_TYPE '$C_GTYPE': lowercase letters, digits, '_', '-'"
  [[ $C_PART =~ ^[a-z][a-z0-9_-]{0,31}$ ]] || die "SLURM_PARTITION '$C_PART': lowercase letters, digits, '_', '-'"
  [[ $C_BRIDGE =~ ^[a-z][a-z0-9]{0,14}$ ]] || die "SLURM_BRIDGE '$C_BRIDGE': up to 15 lowercase letters and digits"
  [[ $C_ACCT =~ ^[01]$ ]] || die "SLURM_ACCOUNTING must be 0 or 1"
  IFS=. read -r o1 o2 o3 <<<"$C_SUBNET"
  if ! [[ $C_SUBNET =~ ^[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$ ]] || [ "$o1" -gt 255 ] || [ "$o2" -gt 255 ] || [ "$o3" -gt 255 ]; then
    die "SLURM_SUBNET '$C_SUBNET' must be the first three octets of a /24, e.g. 10.214.0"
  fi
  case "${SLURM_MODE:-auto}" in
    netns) netns_supported || die "SLURM_MODE=netns but network namespaces cannot be made here (try SLURM_MODE=multi)"
      C_MODE=netns ;;
    multi) C_MODE=multi ;;
    auto) if netns_supported; then C_MODE=netns; else C_MODE=multi; fi ;;
    *) die "SLURM_MODE must be auto, netns or multi (got '$SLURM_MODE')" ;;
  esac
  for v in C_MODE C_NODES C_PREFIX C_GPUS C_GTYPE C_CPUS C_MEM C_PART C_ACCT C_CLUSTER C_SUBNET C_BRIDGE \
    C_ETC_HOSTS C_CTLD_PORT C_SLURMD_BASE C_DBD_PORT C_DB_PORT; do
    printf '%s=%s\n' "$v" "${!v}"
  done >"$DIR/settings"
fi
# the veth of node NAME is "v-NAME" and interface names have at most 15 characters
[ $((${#C_PREFIX} + ${#C_NODES})) -le 13 ] || die "node names ${C_PREFIX}1..$C_NODES would be longer than 13 characters"
CTL_HOST=$(hostname -s)
[[ $CTL_HOST =~ ^[A-Za-z0-9][A-Za-z0-9-]*$ ]] || die "this machine's short hostname '$CTL_HOST' is not usable as SlurmctldHost"
NAMES=()
for i in $(seq 1 "$C_NODES"); do NAMES+=("$C_PREFIX$i"); done
if [ "$C_MODE" = netns ]; then CTL_ADDR=$C_SUBNET.1; else CTL_ADDR=127.0.0.1; fi
CONF=$DIR/slurm.conf
MUNGE_SOCK=$DIR/run/munge.socket
export SLURM_CONF=$CONF

# A fresh start (no daemon of DIR runs) begins from empty job state: stale jobs of an earlier
# run would otherwise be "recovered" onto the new nodes, and job ids would not start at 1.
if [ -z "$(cluster_daemons "$DIR")" ]; then
  rm -rf "$DIR/spool" "$DIR"/run/*.pid
  : >"$DIR/log/jobcomp.txt"
fi
mkdir -p "$DIR/spool/ctld"

# ---- machine-wide resources (ports, bridge, namespaces, /etc/hosts): under the registry ---
# lock, claimed for DIR in the registry that the SSH hosts use too, so neither set can take
# the other's bridge or names and two clusters (two CI jobs on one box) cannot collide.
ports_needed() {
  alive_pidfile "$DIR/run/slurmctld.pid" slurmctld || echo "$C_CTLD_PORT slurmctld SLURMCTLD_PORT"
  if [ "$C_ACCT" = 1 ]; then
    alive_pidfile "$DIR/run/slurmdbd.pid" slurmdbd || echo "$C_DBD_PORT slurmdbd SLURMDBD_PORT"
    alive_pidfile "$DIR/run/mysqld.pid" mariadbd || echo "$C_DB_PORT mariadbd MARIADB_PORT"
  fi
  if [ "$C_MODE" = multi ]; then
    for i in $(seq 1 "$C_NODES"); do
      alive_pidfile "$DIR/run/slurmd-$C_PREFIX$i.pid" slurmd || echo "$((C_SLURMD_BASE + i)) slurmd SLURMD_PORT_BASE"
    done
  fi
}
lock_registry
claim "slurm-port-$C_CTLD_PORT" "$DIR" || die "slurmctld port $C_CTLD_PORT is already in use by the cluster of $(claim_owner "slurm-port-$C_CTLD_PORT"); set SLURMCTLD_PORT"
while read -r port what knob; do
  if l=$(port_listener "$port"); then
    release "slurm-port-$C_CTLD_PORT" "$DIR"
    die "port $port (for $what) is already in use on this machine ($l); set $knob"
  fi
done < <(ports_needed)
if [ "$C_MODE" = netns ]; then
  # checked here with Slurm's knob names; lib-netns.sh's own messages speak of the SSH knobs
  owner=$(claim_owner "bridge-$C_BRIDGE")
  [ -z "$owner" ] || [ "$owner" = "$DIR" ] || die "bridge $C_BRIDGE belongs to $owner; set SLURM_BRIDGE and SLURM_SUBNET"
  if ! ip link show "$C_BRIDGE" >/dev/null 2>&1 && r=$(subnet_in_use "$C_SUBNET" "$C_BRIDGE"); then
    die "$C_SUBNET.0/24 is already in use on this machine ($r); set SLURM_SUBNET to a free /24"
  fi
  for name in "${NAMES[@]}"; do
    owner=$(claim_owner "ns-$name")
    [ -z "$owner" ] || [ "$owner" = "$DIR" ] || die "namespace $name belongs to $owner; set SLURM_NODE_PREFIX"
  done
  bridge_up "$C_BRIDGE" "$C_SUBNET" "$DIR"
  for i in $(seq 1 "$C_NODES"); do
    host_net_up "$C_PREFIX$i" "$C_SUBNET.$((100 + i))" "$C_BRIDGE" "$DIR"
  done
  if [ "$C_ETC_HOSTS" = 1 ]; then
    for i in $(seq 1 "$C_NODES"); do echo "$C_SUBNET.$((100 + i)) $C_PREFIX$i"; done | etc_hosts_set "$DIR"
  fi
fi
unlock_registry

# ---- fake GPUs ---------------------------------------------------------------------------
# slurmd 22.05 drops a GPU whose gres.conf line has no File= ("Removing file-less GPU") and the
# controller then marks the node INVAL; a regular file instead of a device is logged as an error
# per GPU. So: real character device nodes, major 195 (NVIDIA's), one directory per node. No
# driver is behind them and nothing opens them; Slurm only stat()s them and sets
# CUDA_VISIBLE_DEVICES / SLURM_JOB_GPUS from their index.
for name in "${NAMES[@]}"; do
  mkdir -p "$DIR/dev/$name"
  for ((g = 0; g < C_GPUS; g++)); do
    [ -c "$DIR/dev/$name/nvidia$g" ] || { rm -f "$DIR/dev/$name/nvidia$g"; mknod "$DIR/dev/$name/nvidia$g" c 195 "$g"; }
  done
done

# ---- configs -----------------------------------------------------------------------------
gres_node=
if [ "$C_GPUS" -gt 0 ]; then gres_node="Gres=gpu:${C_GTYPE:+$C_GTYPE:}$C_GPUS"; fi
write_if_changed() {   # FILE: stdin -> FILE, untouched when equal (keeps mtimes of a running cluster)
  cat >"$1.tmp"
  if cmp -s "$1.tmp" "$1"; then rm -f "$1.tmp"; else mv "$1.tmp" "$1"; fi
}
{
  cat <<EOF
# generated by tests/infra/slurm-up.sh ($C_MODE mode) for k3launch's tests; re-run it rather
# than editing this file (slurm-down.sh $DIR, then slurm-up.sh $DIR with other knobs)
ClusterName=$C_CLUSTER
SlurmctldHost=$CTL_HOST($CTL_ADDR)
SlurmctldPort=$C_CTLD_PORT
SlurmdPort=6818
# every daemon runs as root: no slurm user or file ownership to set up on a throw-away box
SlurmUser=root
SlurmdUser=root
# a private munged (DIR/run/munge.socket) with a key of its own: no system munge to start
# or share, and stopping this cluster cannot break another one
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCK
StateSaveLocation=$DIR/spool/ctld
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# the default MailProg is missing here and slurmctld would log an error for it
MailProg=/bin/true
# no cgroups: the machine has hybrid v1/v2 cgroups and no systemd. Processes are tracked by
# parentage (a job that double-forks escapes scancel; slurm-down.sh still finds it by the
# marker the TaskProlog puts in every task's environment). CPUs, memory and GPUs are not
# enforced, only accounted by the scheduler.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
TaskProlog=$DIR/etc/task-prolog.sh
MpiDefault=none
# schedule at once: the defaults (batch_sched_delay=3, ...) make every job take seconds to start
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
# nodes claim the CPUs/memory below whatever this machine has
SlurmdParameters=config_overrides
# a node that was DOWN (its slurmd restarted) rejoins by registering, without scontrol update
ReturnToService=2
InactiveLimit=0
# scancel: SIGTERM, then SIGKILL after this many seconds
KillWait=3
SlurmdTimeout=30
# finished jobs stay visible to squeue -t all / scontrol show job for 5 min (no sacct needed)
MinJobAge=300
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.txt
EOF
  if [ "$C_ACCT" = 1 ]; then
    cat <<EOF
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$CTL_ADDR
AccountingStoragePort=$C_DBD_PORT
# connections to slurmdbd authenticate through this munge socket (AuthInfo is not used for them)
AccountingStoragePass=$MUNGE_SOCK
AccountingStorageTRES=gres/gpu
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
EOF
  else
    cat <<EOF
# no slurmdbd: sacct fails ("Slurm accounting storage is disabled"); SLURM_ACCOUNTING=1 adds it
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
EOF
  fi
  for i in $(seq 1 "$C_NODES"); do
    if [ "$C_MODE" = netns ]; then
      echo "NodeName=$C_PREFIX$i NodeHostname=$C_PREFIX$i NodeAddr=$C_SUBNET.$((100 + i)) CPUs=$C_CPUS RealMemory=$C_MEM $gres_node State=UNKNOWN"
    else
      # several slurmd on one address: each its own port; NodeHostname is this machine
      echo "NodeName=$C_PREFIX$i NodeHostname=$CTL_HOST NodeAddr=127.0.0.1 Port=$((C_SLURMD_BASE + i)) CPUs=$C_CPUS RealMemory=$C_MEM $gres_node State=UNKNOWN"
    fi
  done
  echo "PartitionName=$C_PART Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
} | write_if_changed "$CONF"
{
  echo "# generated by tests/infra/slurm-up.sh: one line per node, each with its own fake devices"
  if [ "$C_GPUS" -gt 0 ]; then
    for name in "${NAMES[@]}"; do
      echo "NodeName=$name Name=gpu${C_GTYPE:+ Type=$C_GTYPE} File=$DIR/dev/$name/nvidia[0-$((C_GPUS - 1))]"
    done
  fi
} | write_if_changed "$DIR/gres.conf"
write_if_changed "$DIR/cgroup.conf" <<'EOF'
# generated by tests/infra/slurm-up.sh. No cgroup plugin is loaded (ProctrackType=linuxproc,
# TaskPlugin=task/none in slurm.conf); this file only keeps Slurm from looking for a system one.
CgroupPlugin=cgroup/v1
EOF
write_if_changed "$DIR/etc/task-prolog.sh" <<EOF
#!/bin/sh
# TaskProlog of the cluster in $DIR: runs before every task; "export" lines on stdout land in the
# task's environment. The marker lets slurm-down.sh find job processes that left their step.
echo "export K3LAUNCH_SLURM_CLUSTER_DIR=$DIR"
EOF
chmod 755 "$DIR/etc/task-prolog.sh"
for f in slurm.conf gres.conf cgroup.conf; do chmod 644 "$DIR/$f"; done

# ---- munge: private daemon, socket and key ------------------------------------------------
# Every daemon started from here on inherits the cluster's marker (slurmstepd's inherit it from
# slurmd), so slurm-down.sh finds them even when pid files or DIR itself are gone.
export K3LAUNCH_SLURM_CLUSTER_DIR=$DIR
started=0
if ! alive_pidfile "$DIR/run/munged.pid" munged; then
  if [ ! -s "$DIR/etc/munge.key" ]; then
    (umask 077 && dd if=/dev/urandom of="$DIR/etc/munge.key" bs=1024 count=1 status=none)
  fi
  chmod 400 "$DIR/etc/munge.key"
  rm -f "$MUNGE_SOCK" "$MUNGE_SOCK.lock"
  # --force: munged refuses sockets under world-writable trees like /tmp without it
  /usr/sbin/munged --force --socket="$MUNGE_SOCK" --key-file="$DIR/etc/munge.key" --pid-file="$DIR/run/munged.pid" \
    --log-file="$DIR/log/munged.log" --seed-file="$DIR/run/munged.seed" </dev/null >>"$DIR/log/munged.log" 2>&1 8>&- 9>&- \
    || die "munged did not start: $(tail -n 3 "$DIR/log/munged.log" | tr '\n' ' ')"
  started=$((started + 1))
fi
wait_for 10 munge_works "$MUNGE_SOCK" || die "munge does not answer on $MUNGE_SOCK; see $DIR/log/munged.log"

# ---- accounting: private MariaDB + slurmdbd ------------------------------------------------
if [ "$C_ACCT" = 1 ]; then
  DB_SOCK=$DIR/run/mysqld.sock
  db() { mariadb --no-defaults -S "$DB_SOCK" -uroot "$@"; }
  if ! alive_pidfile "$DIR/run/mysqld.pid" mariadbd; then
    if [ ! -d "$DIR/db/mysql" ]; then
      mkdir -p "$DIR/db"
      mariadb-install-db --no-defaults --datadir="$DIR/db" --user=root --auth-root-authentication-method=normal \
        --skip-test-db >"$DIR/log/mariadb-install.log" 2>&1 || die "mariadb-install-db failed; see $DIR/log/mariadb-install.log"
    fi
    # on 127.0.0.1 and a port of its own: never the system's MariaDB, never reachable from outside
    setsid mariadbd --no-defaults --datadir="$DIR/db" --user=root --bind-address=127.0.0.1 --port="$C_DB_PORT" \
      --socket="$DB_SOCK" --pid-file="$DIR/run/mysqld.pid" --log-error="$DIR/log/mariadb.err" \
      --innodb-buffer-pool-size=64M --innodb-lock-wait-timeout=900 </dev/null >/dev/null 2>&1 8>&- 9>&- &
    wait_for 60 db -e 'select 1' || die "MariaDB did not start; see $DIR/log/mariadb.err"
    started=$((started + 1))
    db -e "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
           GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1'; FLUSH PRIVILEGES;"
  fi
  write_if_changed "$DIR/slurmdbd.conf" <<EOF
# generated by tests/infra/slurm-up.sh
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCK
DbdHost=$CTL_HOST
DbdAddr=$CTL_ADDR
DbdPort=$C_DBD_PORT
SlurmUser=root
LogFile=$DIR/log/slurmdbd.log
PidFile=$DIR/run/slurmdbd.pid
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$C_DB_PORT
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
  chmod 600 "$DIR/slurmdbd.conf"   # slurmdbd refuses a readable config (it holds the password)
  if ! alive_pidfile "$DIR/run/slurmdbd.pid" slurmdbd; then
    # slurmdbd has no -f: it reads slurmdbd.conf next to $SLURM_CONF
    slurmdbd </dev/null >>"$DIR/log/slurmdbd.log" 2>&1 8>&- 9>&- \
      || die "slurmdbd did not start; see $DIR/log/slurmdbd.log"
    wait_for 30 sacctmgr -n list cluster || die "slurmdbd does not answer; see $DIR/log/slurmdbd.log"
    started=$((started + 1))
  fi
  # the cluster must exist in the database before slurmctld registers with it
  sacctmgr -n -P list cluster format=cluster | grep -qx "$C_CLUSTER" || sacctmgr -i add cluster "$C_CLUSTER" >/dev/null
fi

# ---- slurmctld and one slurmd per node ------------------------------------------------------
if ! alive_pidfile "$DIR/run/slurmctld.pid" slurmctld; then
  echo "=== k3launch slurmctld start $(date '+%F %T')" >>"$DIR/log/slurmctld.log"
  slurmctld -f "$CONF" </dev/null >>"$DIR/log/slurmctld.log" 2>&1 8>&- 9>&- || die "slurmctld did not start; see $DIR/log/slurmctld.log"
  started=$((started + 1))
fi
for name in "${NAMES[@]}"; do
  mkdir -p "$DIR/spool/$name"   # slurmd does not create it ("Domain socket directory ...: No such file")
  alive_pidfile "$DIR/run/slurmd-$name.pid" slurmd && continue
  echo "=== k3launch slurmd start $(date '+%F %T')" >>"$DIR/log/slurmd-$name.log"
  if [ "$C_MODE" = netns ]; then
    # `ip netns exec` (not a bare nsenter --net): the node also gets a /sys of its own network
    # namespace. The UTS namespace gives it its own hostname, which every job inherits.
    # shellcheck disable=SC2016 # $1..$3 belong to the inner sh
    ip netns exec "$name" unshare --uts /bin/sh -c 'hostname "$1" && exec slurmd -f "$2" -N "$1"' sh "$name" "$CONF" \
      </dev/null >>"$DIR/log/slurmd-$name.log" 2>&1 8>&- 9>&- || die "$name: slurmd did not start; see $DIR/log/slurmd-$name.log"
  else
    slurmd -f "$CONF" -N "$name" </dev/null >>"$DIR/log/slurmd-$name.log" 2>&1 8>&- 9>&- \
      || die "$name: slurmd did not start; see $DIR/log/slurmd-$name.log"
  fi
  started=$((started + 1))
done

# ---- client files ---------------------------------------------------------------------------
{
  echo "# source this (. $DIR/env.sh): Slurm commands then use this cluster, and k3launch's tests reuse it"
  echo "export SLURM_CONF=$CONF"
  echo "export K3LAUNCH_TEST_SLURM_DIR=$DIR"
} | write_if_changed "$DIR/env.sh"
# every value is from a checked character set, so plain printf makes valid JSON
json_nodes=()
for i in $(seq 1 "$C_NODES"); do
  if [ "$C_MODE" = netns ]; then addr=$C_SUBNET.$((100 + i)) port=6818; else addr=127.0.0.1 port=$((C_SLURMD_BASE + i)); fi
  json_nodes+=("{\"name\": \"$C_PREFIX$i\", \"address\": \"$addr\", \"slurmd_port\": $port}")
done
joined=$(printf ',\n    %s' "${json_nodes[@]}")
[ "$C_MODE" = netns ] && bridge_json=$C_BRIDGE || bridge_json=
write_if_changed "$DIR/cluster.json" <<EOF
{
  "mode": "$C_MODE",
  "dir": "$DIR",
  "conf": "$CONF",
  "cluster_name": "$C_CLUSTER",
  "partition": "$C_PART",
  "controller": {"host": "$CTL_HOST", "address": "$CTL_ADDR", "port": $C_CTLD_PORT},
  "nodes": [${joined:1}
  ],
  "gpus_per_node": $C_GPUS,
  "gpu_type": "$C_GTYPE",
  "cpus_per_node": $C_CPUS,
  "mem_mb": $C_MEM,
  "accounting": $([ "$C_ACCT" = 1 ] && echo true || echo false),
  "bridge": "$bridge_json"
}
EOF
chmod 644 "$DIR/env.sh" "$DIR/cluster.json"

# /etc/slurm/slurm.conf -> ours, so sbatch & co. work without SLURM_CONF (ssh sessions, cron,
# tools that scrub the environment). Never over a real file or another live cluster's link.
if [ "${SLURM_LINK_ETC:-auto}" != 0 ]; then
  lock_registry
  target=$(readlink /etc/slurm/slurm.conf 2>/dev/null || true)
  if [ "$target" = "$CONF" ]; then
    :
  elif [ ! -e /etc/slurm/slurm.conf ] && { [ ! -L /etc/slurm/slurm.conf ] || [[ $target == */slurm.conf ]]; }; then
    # missing, or a link whose cluster (DIR/slurm.conf) is gone
    [ -d /etc/slurm ] || { mkdir -p /etc/slurm && touch "$DIR/run/etc_dir_made"; }
    ln -sfn "$CONF" /etc/slurm/slurm.conf
  elif [ "${SLURM_LINK_ETC:-auto}" = 1 ]; then
    die "/etc/slurm/slurm.conf is taken (${target:-a real file}); SLURM_LINK_ETC=1 cannot link it"
  fi
  unlock_registry
fi

# ---- wait until every node is usable (bounded) ----------------------------------------------
# idle / allocated / mixed / completing and no suffix (* = not responding, ~ = powered off, ...)
deadline=$((SECONDS + WAIT_S))
while :; do
  states=$(sinfo -h -N -p "$C_PART" -o '%N %t' 2>/dev/null || true)
  ready=$(awk '$2 ~ /^(idle|alloc|mix|comp)$/ { n++ } END { print n + 0 }' <<<"$states")
  [ "$ready" = "$C_NODES" ] && break
  # a node the controller rejected will not recover by waiting: fail now, with its reason
  if grep -qE ' inval|drain' <<<"$states"; then
    sinfo -N -o '%N %T %E' >&2 || true
    die "nodes rejected by slurmctld (see $DIR/log/slurmctld.log)"
  fi
  for name in "${NAMES[@]}"; do
    pidf=$DIR/run/slurmd-$name.pid
    # slurmd daemonizes before it writes its pid file; give it a moment before judging
    if [ $((SECONDS + WAIT_S - deadline)) -ge 3 ] && ! alive_pidfile "$pidf" slurmd; then
      tail -n 5 "$DIR/log/slurmd-$name.log" >&2 || true
      die "$name: slurmd exited (log: $DIR/log/slurmd-$name.log)"
    fi
  done
  if [ "$SECONDS" -ge "$deadline" ]; then
    sinfo -N -o '%N %T %E' >&2 || true
    tail -n 5 "$DIR/log/slurmctld.log" >&2 || true
    die "nodes not ready after ${WAIT_S}s (logs in $DIR/log/)"
  fi
  sleep 0.1
done

printf 'slurm-up: %d node(s) ready (%s mode, accounting=%s, %d daemon(s) started now) in %.2fs; . %s/env.sh\n' \
  "$C_NODES" "$C_MODE" "$C_ACCT" "$started" "$(awk -v a="$T0" -v b="$(date +%s%N)" 'BEGIN { print (b - a) / 1e9 }')" "$DIR"
