# shellcheck shell=bash
# tests/infra/lib-slurm.sh -- helpers sourced by slurm-up.sh and slurm-down.sh, on top of
# lib-netns.sh (say/die, locks, registry claims, pid liveness, namespaces, /etc/hosts).
#
# Every daemon of a cluster but slurmdbd (it has no -f) carries its DIR in its command line
# (slurmctld/slurmd -f DIR/..., munged --socket=DIR/..., mariadbd --datadir=DIR/...); every daemon, slurmstepd
# and job task carries K3LAUNCH_SLURM_CLUSTER_DIR=DIR in its environment (daemons inherit it
# from slurm-up.sh, tasks get it from the TaskProlog). Those two
# marks, not process names, decide what belongs to a cluster: several clusters (and the
# machine's own daemons) may run side by side.

DAEMONS="slurmctld slurmd slurmdbd munged mariadbd"

# begin_cluster_script ARG ROOT_MSG -> the common start of slurm-up.sh and slurm-down.sh: T0 (for
# the closing "took N s"), root or die with ROOT_MSG, and DIR = the cluster's state directory:
# ARG (default /tmp/k3launch-slurm) made absolute; it must be of [A-Za-z0-9._/-] (it ends up
# unquoted in slurm.conf, gres.conf and the /etc/hosts tags). Call it directly, not in $(...):
# it sets T0 and DIR, and a refusal must end the script, -e or not.
begin_cluster_script() {
  # shellcheck disable=SC2034 # T0 is read by the calling script
  T0=$(date +%s%N)
  [ "$(id -u)" = 0 ] || die "$2"
  DIR=$(realpath -m "${1:-/tmp/k3launch-slurm}")
  [[ $DIR =~ ^/[A-Za-z0-9._/-]+$ ]] || die "DIR '$DIR' must be an absolute path of [A-Za-z0-9._/-]"
}

# is_num VALUE MIN MAX -> 0 if VALUE is a decimal integer in MIN..MAX
is_num() { [[ $1 =~ ^[0-9]+$ ]] && [ "${#1}" -le 10 ] && [ "$1" -ge "$2" ] && [ "$1" -le "$3" ]; }

# alive_pidfile FILE COMM -> 0 if FILE names a live COMM (pidfile_pid refuses recycled pids)
alive_pidfile() { pidfile_pid "$1" "$2" >/dev/null; }

# wait_for SECONDS CMD... -> run CMD every 0.1 s until it succeeds (0) or time is up (1)
wait_for() {
  local end=$((SECONDS + $1))
  shift
  until "$@" >/dev/null 2>&1; do
    [ "$SECONDS" -lt "$end" ] || return 1
    sleep 0.1
  done
}

# munge_works SOCKET -> 0 if a credential made through SOCKET decodes through it
munge_works() { munge -S "$1" -n 2>/dev/null | unmunge -S "$1" >/dev/null 2>&1; }

# port_listener PORT -> 0 (and prints it) if something listens on TCP PORT in this namespace,
# on any address: our daemons bind the wildcard address
port_listener() {
  local l
  l=$(ss -Hltn "sport = :$1" 2>/dev/null | awk '{ print $4 }' | head -n 1)
  [ -n "$l" ] && echo "$l"
}

# cluster_daemons DIR -> "PID COMM" of every live daemon of the cluster in DIR, found by the
# DIR in its command line (also when the pid files are gone, e.g. DIR was deleted under it)
cluster_daemons() {
  local dir=$1 p comm
  for p in /proc/[0-9]*; do
    { read -r comm <"$p/comm"; } 2>/dev/null || continue
    case " $DAEMONS " in *" $comm "*) ;; *) continue ;; esac
    tr '\0' '\n' <"$p/cmdline" 2>/dev/null | grep -qF "$dir/" || continue
    pid_alive "${p#/proc/}" && echo "${p#/proc/} $comm"
  done
  return 0
}

# marked_pids DIR -> every live process whose environment carries the cluster's marker: the
# daemons and slurmstepd's (inherited from slurm-up.sh), batch scripts and srun tasks (put there
# by the TaskProlog), and whatever those double-forked out of Slurm's reach
marked_pids() {
  local f pid
  # one grep over every environ (not one per process): down calls this several times
  grep -lzxF "K3LAUNCH_SLURM_CLUSTER_DIR=$1" /proc/[0-9]*/environ 2>/dev/null | while read -r f; do
    pid=${f#/proc/}
    pid=${pid%/environ}
    pid_alive "$pid" && echo "$pid"
  done
  return 0
}

# cluster_active DIR -> 0 if anything of the cluster in DIR is still there: a daemon, or a
# registry claim (bridge, namespace, port)
cluster_active() {
  [ -n "$(cluster_daemons "$1")" ] || [ -n "$(claims_of bridge- "$1")$(claims_of ns- "$1")$(claims_of slurm-port- "$1")" ]
}
