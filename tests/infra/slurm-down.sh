#!/usr/bin/env bash
# tests/infra/slurm-down.sh [DIR] -- undo tests/infra/slurm-up.sh DIR (default /tmp/k3launch-slurm).
#
# Cancels the cluster's jobs (so Slurm ends them the normal way and logs them in jobcomp.txt),
# then stops only what that up started: slurmd's, slurmstepd's and job processes (also those
# that double-forked away from their step), slurmctld, slurmdbd and MariaDB, the private munged.
# A process belongs to the cluster if its pid file in DIR/run names it (comm checked: pids are
# recycled), if its command line names DIR, if it carries the cluster's environment marker, or
# if it runs in one of the cluster's node namespaces. Then removes the namespaces, veths, the
# bridge (once no port is left), DIR's tagged /etc/hosts lines, the registry claims and the
# /etc/slurm/slurm.conf link (only if it points to DIR). Configs and logs stay in DIR for
# post-mortems. Safe to run twice, after a failed or partial up, or with DIR deleted.
set -uo pipefail   # no -e: clean up as much as possible even if one step fails
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
K3_SELF=slurm-down
# shellcheck source=lib-netns.sh
. "$HERE/lib-netns.sh"
# shellcheck source=lib-slurm.sh
. "$HERE/lib-slurm.sh"

begin_cluster_script "${1:-}" "must run as root"
# DIR may be gone (rm -rf by a careless cleanup) while its daemons still run: the command lines,
# environment markers and registry claims still name it, so carry on without the DIR lock then
[ -d "$DIR/run" ] && lock_dir "$DIR"
CONF=$DIR/slurm.conf
export SLURM_CONF=$CONF

# ---- 1. cancel every job while slurmctld still answers (bounded) ---------------------------
cancelled=0
if alive_pidfile "$DIR/run/slurmctld.pid" slurmctld && [ -f "$CONF" ]; then
  mapfile -t ids < <(timeout 10 squeue -h -o %A 2>/dev/null | sort -u)
  if [ ${#ids[@]} -gt 0 ]; then
    timeout 10 scancel "${ids[@]}" 2>/dev/null || true
    cancelled=${#ids[@]}
    # KillWait=3 in slurm.conf: steps get SIGKILL 3 s after SIGTERM; leave room for completing
    end=$((SECONDS + 15))
    while [ -n "$(timeout 5 squeue -h -o %A 2>/dev/null)" ] && [ "$SECONDS" -lt "$end" ]; do sleep 0.2; done
  fi
fi

# ---- 2. stop processes: nodes and jobs first, then the controller, database, munge ------------
# never this script or its callers (it might run from a shell that carries the job marker)
mine=" $$ "
p=$$
while p=$(awk '/^PPid:/ { print $2 }' "/proc/$p/status" 2>/dev/null) && [ "${p:-0}" -gt 1 ]; do mine+="$p "; done
netns_of_dir() { claims_of ns- "$DIR" | sed 's/^ns-//'; }
# the pids in DIR/run/*.pid that still are the daemon the file is for (pids are recycled)
daemon_pidfile_pids() {
  local f
  for f in "$DIR"/run/slurmd-*.pid; do [ -f "$f" ] && pidfile_pid "$f" slurmd; done
  pidfile_pid "$DIR/run/slurmctld.pid" slurmctld
  pidfile_pid "$DIR/run/slurmdbd.pid" slurmdbd
  pidfile_pid "$DIR/run/mysqld.pid" mariadbd
  pidfile_pid "$DIR/run/munged.pid" munged
  return 0
}
# everything of the cluster whose comm is (or is not, with "!") in the list $1
cluster_pids() {
  local want=$1 pid comm
  {
    daemon_pidfile_pids
    cluster_daemons "$DIR" | awk '{ print $1 }'
    marked_pids "$DIR"
    for ns in $(netns_of_dir); do ip netns pids "$ns" 2>/dev/null; done
  } | sort -un | while read -r pid; do
    { [ -n "$pid" ] && pid_alive "$pid"; } || continue
    case "$mine" in *" $pid "*) continue ;; esac
    comm=$(cat "/proc/$pid/comm" 2>/dev/null) || continue
    case "$want" in
      '!'*) case " ${want#!} " in *" $comm "*) continue ;; esac ;;
      *) case " $want " in *" $comm "*) ;; *) continue ;; esac ;;
    esac
    echo "$pid"
  done
}
stopped=0
stop_group() {   # GRACE_S COMM-FILTER: a few rounds, a job may fork a replacement while dying
  local round pids
  for round in 1 2 3; do
    mapfile -t pids < <(cluster_pids "$2")
    [ ${#pids[@]} -gt 0 ] || return 0
    [ "$round" = 1 ] || say "round $round: still running: ${pids[*]}"
    stopped=$((stopped + ${#pids[@]}))
    kill_pids "$1" "${pids[@]}"
  done
}
stop_group 5 '!slurmctld slurmdbd mariadbd munged'   # slurmd, slurmstepd, jobs
stop_group 10 'slurmctld slurmdbd'
stop_group 30 'mariadbd'                            # flushes InnoDB: can take a few seconds
stop_group 5 'munged'
rm -f "$DIR"/run/*.pid "$DIR/run/munge.socket" "$DIR/run/munge.socket.lock" "$DIR/run/mysqld.sock"

# ---- 3. network, /etc/hosts, claims ----------------------------------------------------------
mkdir -p "$K3_REGISTRY"
lock_registry
mapfile -t nss < <(netns_of_dir)
for ns in "${nss[@]}"; do host_net_down "$ns" "" "none" "$DIR"; done
for key in $(claims_of bridge- "$DIR"); do bridge_down "${key#bridge-}" "$DIR"; done
for key in $(claims_of slurm-port- "$DIR"); do release "$key" "$DIR"; done
etc_hosts_clear "$DIR"
if [ "$(readlink /etc/slurm/slurm.conf 2>/dev/null)" = "$CONF" ]; then rm -f /etc/slurm/slurm.conf; fi
if [ -f "$DIR/run/etc_dir_made" ]; then
  rmdir /etc/slurm 2>/dev/null || true   # only if it is still empty
  rm -f "$DIR/run/etc_dir_made"
fi
unlock_registry

# without these, tests/support/slurmcluster.py would take the (now dead) cluster for a running one
rm -f "$DIR"/{settings,cluster.json,env.sh}
printf 'slurm-down: cluster of %s down (%d job(s) cancelled, %d process(es) stopped, %d node namespace(s) removed) in %.2fs\n' \
  "$DIR" "$cancelled" "$stopped" "${#nss[@]}" "$(awk -v a="$T0" -v b="$(date +%s%N)" 'BEGIN { print (b - a) / 1e9 }')"
