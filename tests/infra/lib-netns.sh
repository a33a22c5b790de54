# shellcheck shell=bash
# tests/infra/lib-netns.sh -- helpers sourced by sshd-up.sh, sshd-down.sh and sshd-ctl.sh (and,
# under lib-slurm.sh, by slurm-up.sh and slurm-down.sh).
#
# A test "host" NAME is one sshd that runs
#   * in its own UTS namespace (so `hostname` prints NAME), always, and
#   * in netns mode, also in its own network namespace NAME, whose eth0 (SUBNET.(100+i)/24) is
#     one end of a veth pair; the other end, v-NAME, is a port of a private bridge (SUBNET.1/24)
#     in the root namespace. There is no default route inside: nothing leaves this machine.
#
# Ownership: everything is created for one state directory DIR. A claim file under
# $K3_REGISTRY names the DIR that owns each bridge and namespace, so a second DIR (another CI
# job, another developer's pytest on the same box) is refused instead of silently sharing or
# tearing down someone else's hosts. DIR/run/ holds the per-host pid files and markers.

K3_REGISTRY=/run/k3launch-sshd   # tmpfs: disappears on reboot together with what it describes
K3_SELF=${K3_SELF:-infra}

say() { printf '%s: %s\n' "$K3_SELF" "$*" >&2; }
die() { say "$*"; exit 1; }

# ---- locking -----------------------------------------------------------------------------
# fd 8 = this DIR (one up/down/ctl at a time per DIR), fd 9 = the registry (claims, bridge,
# /etc/hosts are machine-wide). Every daemon we start gets both closed (8>&- 9>&-): an sshd
# that inherited a lock fd would hold the lock forever and hang the next run.
lock_dir() {
  exec 8>"$1/.lock"
  flock -w "${2:-120}" 8 || die "another up/down/ctl holds $1/.lock"
}
lock_registry() {
  mkdir -p "$K3_REGISTRY"
  exec 9>"$K3_REGISTRY/.lock"
  flock -w 120 9 || die "$K3_REGISTRY/.lock held for 120 s"
}
unlock_registry() { flock -u 9 2>/dev/null || true; }

# ---- packages ----------------------------------------------------------------------------
# apt_install LOG PKG... -> apt-get install the PKGs (nothing to do without any), output appended
# to LOG; exits the script if that fails. Without systemd, maintainer scripts start their daemons
# system-wide via invoke-rc.d (openssh-server's sshd on port 22, slurmctld, slurmd and munged):
# those would hold our ports and a system munge socket, so a policy-rc.d that exits 101 forbids
# that. Ours is removed again, also on failure (EXIT trap); one that was already there is left
# alone. A stale package list gives 404s: refresh and retry. Another apt may hold the dpkg lock
# (a CI step, another up running in parallel): wait for it instead of failing.
apt_install() {
  local log=$1 made_policy=0 attempt
  shift
  [ $# -gt 0 ] || return 0
  command -v apt-get >/dev/null || die "missing $* and there is no apt-get to install them"
  say "installing $* (log: $log)"
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\n# k3launch %s: no daemon starts during apt-get install\nexit 101\n' "$K3_SELF" >/usr/sbin/policy-rc.d
    chmod 755 /usr/sbin/policy-rc.d
    made_policy=1
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
  fi
  for attempt in 1 2 3; do
    if DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y --no-install-recommends \
      "$@" >>"$log" 2>&1; then
      break
    fi
    [ "$attempt" = 3 ] && die "apt-get install $* failed; see $log"
    sleep $((attempt * 2))
    apt-get -o DPkg::Lock::Timeout=300 update >>"$log" 2>&1 || true
  done
  if [ "$made_policy" = 1 ]; then
    rm -f /usr/sbin/policy-rc.d
    trap - EXIT
  fi
}

# ---- ownership claims --------------------------------------------------------------------
claim_owner() { cat "$K3_REGISTRY/$1" 2>/dev/null || true; }   # KEY -> owning DIR (or nothing)
claim() {                                                     # KEY DIR -> 1 if owned by another DIR
  local cur
  cur=$(claim_owner "$1")
  [ -z "$cur" ] || [ "$cur" = "$2" ] || return 1
  printf '%s\n' "$2" > "$K3_REGISTRY/$1"
}
release() { [ "$(claim_owner "$1")" = "$2" ] && rm -f "$K3_REGISTRY/$1"; return 0; }
claims_of() {                                                 # PREFIX DIR -> our keys with PREFIX
  local f
  for f in "$K3_REGISTRY/$1"*; do
    [ -f "$f" ] && [ "$(cat "$f")" = "$2" ] && printf '%s\n' "${f##*/}"
  done
  return 0
}

# ---- processes ---------------------------------------------------------------------------
# Liveness: in this kind of VM PID 1 is not a real init and reaps exited children late, so a
# dead daemon lingers as a zombie for a second or more and `kill -0` still succeeds. A pid is
# alive only if one of its tasks is in a state other than Z/X (a daemon whose main thread has
# exited shows Z while other threads still run, hence every task is looked at).
pid_alive() {
  local t st
  case "$1" in '' | *[!0-9]*) return 1 ;; esac
  for t in /proc/"$1"/task/*/stat; do
    { read -r st <"$t"; } 2>/dev/null || continue   # builtins only: called in tight loops
    st=${st##*) }                                    # drop "pid (comm) "; comm may hold ") "
    case "${st:0:1}" in '' | Z | X) ;; *) return 0 ;; esac
  done
  return 1
}

# pidfile_pid FILE COMM -> the pid in FILE if it is alive AND is a COMM (pids are recycled:
# a stale pid file must never make us signal an unrelated process)
pidfile_pid() {
  local pid
  [ -f "$1" ] || return 1
  pid=$(tr -dc '0-9' <"$1" 2>/dev/null) || return 1
  pid_alive "$pid" && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ] && echo "$pid"
}

# descendants PID -> every pid below PID (sshd's per-connection session processes, their shells)
descendants() {
  ps -e -o pid=,ppid= | awk -v root="$1" '
    { parent[$1] = $2 }
    END { for (p in parent) { q = parent[p]; n = 0
            while (q > 1 && n++ < 64) { if (q == root) { print p; break }; q = parent[q] } } }'
}

# kill_pids GRACE_S PID... -> SIGTERM (+SIGCONT: a frozen process only sees TERM once it runs),
# wait up to GRACE_S for all to exit, SIGKILL the rest, wait a little for those too.
kill_pids() {
  local grace=$1 p i left=()
  shift
  [ $# -gt 0 ] || return 0
  kill -TERM "$@" 2>/dev/null || true   # some may be gone already: not an error
  kill -CONT "$@" 2>/dev/null || true
  for ((i = 0; i < grace * 10 + 20; i++)); do
    left=()
    for p in "$@"; do pid_alive "$p" && left+=("$p"); done
    [ ${#left[@]} -eq 0 ] && return 0
    [ "$i" -eq $((grace * 10)) ] && { kill -KILL "${left[@]}" 2>/dev/null || true; }
    sleep 0.1
  done
  say "still alive after SIGKILL: ${left[*]}"
}

# uts_table -> "PID uts:[INODE]" for every process, in one pass (one fork for all of /proc)
uts_table() {
  { ls -l /proc/[0-9]*/ns/uts 2>/dev/null || true; } | awk '/ -> / { split($(NF-2), a, "/"); print a[3], $NF }'
}

# host_pids NAME DIR [UTS_TABLE] -> every process "on" host NAME:
#  * everything in its network namespace (netns mode), and
#  * everything in a UTS namespace its sshd ever ran in (DIR/run/NAME.uts; this is what finds
#    engines daemonized over ssh in loopback mode, and after an sshd restart). Namespace inode
#    numbers are recycled once a namespace dies, so a match must also still carry hostname NAME.
host_pids() {
  local name=$1 dir=$2 table=${3:-} init self uts pid
  if [ -e "/run/netns/$name" ]; then ip netns pids "$name" 2>/dev/null || true; fi
  [ -s "$dir/run/$name.uts" ] || return 0
  [ -n "$table" ] || table=$(uts_table)
  init=$(readlink /proc/1/ns/uts 2>/dev/null || true)   # unreadable in some sandboxes
  self=$(readlink /proc/$$/ns/uts 2>/dev/null || true)
  while read -r uts; do
    case "$uts" in '' | "$init" | "$self") continue ;; esac   # never the machine's own
    pid=$(awk -v u="$uts" '$2 == u { print $1; exit }' <<<"$table")
    [ -n "$pid" ] || continue                    # namespace gone: nothing left in it
    [ "$(nsenter -t "$pid" -u hostname 2>/dev/null)" = "$name" ] || continue
    awk -v u="$uts" '$2 == u { print $1 }' <<<"$table"
  done <"$dir/run/$name.uts"
}

# record_uts NAME DIR PID -> remember the UTS namespace PID (NAME's sshd) runs in
record_uts() {
  local uts
  uts=$(readlink "/proc/$3/ns/uts" 2>/dev/null) || return 0
  grep -qxF "$uts" "$2/run/$1.uts" 2>/dev/null || echo "$uts" >>"$2/run/$1.uts"
}

# ---- network namespaces ------------------------------------------------------------------
# netns_supported -> 0 if a namespace and a veth pair can be made here (root + CAP_NET_ADMIN,
# a kernel with netns/veth); the probe is removed again.
netns_supported() {
  local ns="k3probe$$"
  command -v ip >/dev/null 2>&1 || return 1
  ip netns add "$ns" 2>/dev/null || return 1
  if ! ip link add "k3p$$" type veth peer name eth0 netns "$ns" 2>/dev/null; then
    ip netns del "$ns" 2>/dev/null
    return 1
  fi
  ip link del "k3p$$" 2>/dev/null
  ip netns del "$ns" 2>/dev/null
  return 0
}

_ip2int() { local a b c d; IFS=. read -r a b c d <<<"$1"; echo $((((a * 256 + b) * 256 + c) * 256 + d)); }

# subnet_in_use SUBNET(a.b.c) SKIP_DEV -> 0 (and prints the route) if a route or local address
# of any table overlaps SUBNET.0/24, other than ours on SKIP_DEV. Shadowing a real network
# would cut this machine off from it.
subnet_in_use() {
  local ours n len dst f
  ours=$(_ip2int "$1.0")
  while read -r -a f; do
    case "${f[0]:-}" in local | broadcast | unicast | blackhole | unreachable | prohibit | anycast | multicast | throw | nat) f=("${f[@]:1}") ;; esac
    case "${f[0]:-}" in '' | default | *:*) continue ;; esac
    [[ " ${f[*]} " == *" dev $2 "* ]] && continue
    dst=${f[0]%/*}
    len=32
    [[ ${f[0]} == */* ]] && len=${f[0]#*/}
    n=$((len < 24 ? len : 24))      # compare on the shorter of the two prefixes
    [ "$n" -gt 0 ] || continue
    if [ $(($(_ip2int "$dst") >> (32 - n))) -eq $((ours >> (32 - n))) ]; then
      echo "${f[*]}"
      return 0
    fi
  done < <(ip -4 -o route show table all 2>/dev/null)
  return 1
}

# bridge_up BRIDGE SUBNET DIR -> the private bridge SUBNET.1/24, claimed by DIR
bridge_up() {
  local br=$1 subnet=$2 dir=$3 r
  claim "bridge-$br" "$dir" || die "bridge $br belongs to $(claim_owner "bridge-$br"); run tests/infra/sshd-down.sh there, or set SSH_BRIDGE and SSH_SUBNET"
  if ! ip link show "$br" >/dev/null 2>&1; then
    if r=$(subnet_in_use "$subnet" "$br"); then
      release "bridge-$br" "$dir"
      die "$subnet.0/24 is already in use on this machine ($r); set SSH_SUBNET to a free /24"
    fi
    ip link add "$br" type bridge
  fi
  ip addr replace "$subnet.1/24" dev "$br"
  ip link set "$br" up
}

# bridge_down BRIDGE DIR -> delete our bridge once no port is left on it
bridge_down() {
  local br=$1 dir=$2
  [ "$(claim_owner "bridge-$br")" = "$dir" ] || return 0
  if ip link show "$br" >/dev/null 2>&1; then
    if [ -n "$(ls "/sys/class/net/$br/brif" 2>/dev/null)" ]; then
      say "bridge $br still has ports ($(cd "/sys/class/net/$br/brif" && echo *)); left in place"
      return 0
    fi
    ip link del "$br"
  fi
  release "bridge-$br" "$dir"
}

veth_of() { echo "v-$1"; }   # root-side end of host NAME's veth pair (<= 15 chars: NAME <= 13)

# host_net_up NAME IP BRIDGE DIR -> namespace NAME, eth0 = IP/24 on BRIDGE, lo up (idempotent)
host_net_up() {
  local name=$1 ip=$2 br=$3 dir=$4 veth
  veth=$(veth_of "$name")
  claim "ns-$name" "$dir" || die "namespace $name belongs to $(claim_owner "ns-$name"); run tests/infra/sshd-down.sh there, or set SSH_HOST_PREFIX"
  if [ ! -e "/run/netns/$name" ]; then
    ip link show "$veth" >/dev/null 2>&1 && die "interface $veth exists but is not ours; set SSH_HOST_PREFIX"
    ip netns add "$name"
  fi
  if ! ip link show "$veth" >/dev/null 2>&1; then
    ip link add "$veth" type veth peer name eth0 netns "$name"
  elif ! ip -o link show "$veth" | grep -qE " link-netns $name( |$)"; then
    die "interface $veth exists but its peer is not in namespace $name"
  fi
  ip link set "$veth" master "$br" up
  ip -n "$name" link set lo up
  ip -n "$name" addr replace "$ip/24" dev eth0
  ip -n "$name" link set eth0 up
}

# host_net_down NAME IP BRIDGE DIR -> drop the veth (and any pinned neighbour entry) and the namespace
host_net_down() {
  local name=$1 ip=$2 br=$3 dir=$4
  [ "$(claim_owner "ns-$name")" = "$dir" ] || return 0
  # each may be gone already (partial up, second down): not an error
  [ -z "$ip" ] || ip neigh del "$ip" dev "$br" 2>/dev/null || true
  ip link del "$(veth_of "$name")" 2>/dev/null || true
  ip netns del "$name" 2>/dev/null || true
  release "ns-$name" "$dir"
}

# host_net_isolate NAME IP BRIDGE PEERS... -> the host stops answering: its veth goes down, and
# its MAC is pinned in the root namespace's (and the other hosts') neighbour tables. Without the
# pin, ARP fails after ~3 s and connect() returns "No route to host"; with it, SYNs are sent into
# the dead port and connect() hangs until the caller's timeout, like a host that fell off the net.
host_net_isolate() {
  local name=$1 ip=$2 br=$3 mac peer
  shift 3
  mac=$(ip -n "$name" -br link show eth0 | awk '{print $3}')
  ip neigh replace "$ip" lladdr "$mac" dev "$br" nud permanent
  for peer in "$@"; do
    [ "$peer" != "$name" ] && [ -e "/run/netns/$peer" ] && ip -n "$peer" neigh replace "$ip" lladdr "$mac" dev eth0 nud permanent
  done
  ip link set "$(veth_of "$name")" down
}
host_net_heal() {
  local name=$1 ip=$2 br=$3 peer
  shift 3
  ip link set "$(veth_of "$name")" up
  ip neigh del "$ip" dev "$br" 2>/dev/null || true   # a pin may be missing (partial isolate)
  for peer in "$@"; do
    if [ "$peer" != "$name" ] && [ -e "/run/netns/$peer" ]; then
      ip -n "$peer" neigh del "$ip" dev eth0 2>/dev/null || true
    fi
  done
}

# ---- /etc/hosts --------------------------------------------------------------------------
# Our lines end in " # k3launch-sshd:DIR" and are the only ones ever removed. The file is
# rewritten in place (cat >), never replaced: in containers /etc/hosts is often a bind mount
# that cannot be renamed over. If it did not end in a newline we add one and remember it, so
# down restores the file byte for byte.
etc_hosts_tag() { echo " # k3launch-sshd:$1"; }
_etc_hosts_without() {   # TAG -> /etc/hosts minus lines ending in TAG, on stdout
  awk -v t="$1" 'length($0) < length(t) || substr($0, length($0) - length(t) + 1) != t' /etc/hosts
}
etc_hosts_set() {        # DIR, then "IP NAME" lines on stdin; call with the registry locked
  local dir=$1 tag tmp
  tag=$(etc_hosts_tag "$dir")
  tmp=$(mktemp)
  _etc_hosts_without "$tag" >"$tmp"
  if [ -s /etc/hosts ] && [ -n "$(tail -c1 /etc/hosts)" ] && ! grep -qF "$tag" /etc/hosts; then
    touch "$dir/run/etc_hosts.noeol"
  fi
  awk -v t="$tag" 'NF == 2 { printf "%s\t%s%s\n", $1, $2, t }' >>"$tmp"
  cmp -s "$tmp" /etc/hosts || cat "$tmp" >/etc/hosts
  rm -f "$tmp"
}
etc_hosts_clear() {      # DIR; call with the registry locked
  local dir=$1 tag tmp
  tag=$(etc_hosts_tag "$dir")
  if grep -qF "$tag" /etc/hosts 2>/dev/null; then
    tmp=$(mktemp)
    _etc_hosts_without "$tag" >"$tmp"
    cat "$tmp" >/etc/hosts
    rm -f "$tmp"
    # the newline we had to add before our first line goes again
    if [ -f "$dir/run/etc_hosts.noeol" ] && [ -s /etc/hosts ] && [ -z "$(tail -c1 /etc/hosts)" ]; then
      truncate -s -1 /etc/hosts
    fi
  fi
  rm -f "$dir/run/etc_hosts.noeol"
}

# ---- the sshd hosts of one DIR -----------------------------------------------------------
# DIR/settings (written by sshd-up.sh) sets S_MODE S_PREFIX S_SUBNET S_BRIDGE S_PORT S_ETC_HOSTS.
load_settings() {
  [ -f "$1/settings" ] || return 1
  # shellcheck disable=SC1091
  . "$1/settings"
}

host_index() { echo "${1#"$S_PREFIX"}"; }
host_ip() {   # NAME -> its address in the current mode
  local i
  i=$(host_index "$1")
  if [ "$S_MODE" = netns ]; then echo "$S_SUBNET.$((100 + i))"; else echo "127.0.0.$((100 + i))"; fi
}

# sshd_spawn NAME DIR -> start NAME's sshd in a fresh UTS namespace (inside its network
# namespace in netns mode). `ip netns exec` (not a bare nsenter --net) matters: it also gives
# the host a /sys of its own namespace, so /sys/class/net/eth0 is the host's NIC (k3launch's
# doctor looks there). sshd daemonizes and writes DIR/run/NAME.pid once it listens.
sshd_spawn() {
  local name=$1 dir=$2 run=() cg=:
  rm -f "$dir/run/$name.pid"
  echo "=== k3launch sshd start $(date '+%F %T')" >>"$dir/log/$name.log"
  if [ "$S_MODE" = netns ]; then run=(ip netns exec "$name"); cg=$(cgroup_mounts); fi
  # shellcheck disable=SC2016,SC2094 # $1..$4 are the inner sh's; the log is only appended to
  "${run[@]}" unshare --uts /bin/sh -c '{ eval "$4" || echo "sshd-up: cgroup hierarchies not mounted: podman cannot run containers on $1"; } && hostname "$1" && exec /usr/sbin/sshd -f "$2" -E "$3"' \
    sh "$name" "$dir/conf/$name.sshd_config" "$dir/log/$name.log" "$cg" </dev/null >>"$dir/log/$name.log" 2>&1 8>&- 9>&-
}

# cgroup_mounts -> a sh program that mounts, in the current mount namespace, this machine's cgroup
# hierarchies where they are here. `ip netns exec` gives a host a fresh /sys, without
# /sys/fs/cgroup's mounts, and podman (runc) cannot start a container without them ("no cgroup
# mount found in mountinfo"). A bind from this namespace is refused across mount namespaces, so
# each hierarchy is mounted anew with its own options (the kernel attaches the same v1 hierarchy).
cgroup_mounts() {
  awk '$5 ~ /^\/sys\/fs\/cgroup(\/|$)/ {
    for (i = 7; $i != "-"; i++) ;
    t = $(i + 1); o = $(i + 3); sub(/^r[ow],?/, "", o)
    if (t == "tmpfs") o = "mode=755"
    else if (t == "cgroup" && o ~ /^name=/) o = "none," o
    printf "mkdir -p %s && mount -t %s -o %s %s %s && ", $5, t, (o == "" ? "defaults" : o), t, $5
  } END { print ":" }' /proc/self/mountinfo
}

# sshd_log_tail NAME DIR -> the log lines since NAME's last start (old runs' errors do not count)
sshd_log_tail() {
  awk '/^=== k3launch sshd start/ { n = 0 } { line[n++] = $0 } END { for (i = 0; i < n; i++) print line[i] }' "$2/log/$1.log" 2>/dev/null
}

# sshd_wait NAME DIR TIMEOUT_S -> wait until NAME's sshd has written its pid file, record its
# UTS namespace; fail early if sshd logged a fatal error (e.g. "Cannot bind any address").
sshd_wait() {
  local name=$1 dir=$2 t=$3 i pid
  for ((i = 0; i < t * 20; i++)); do
    if pid=$(pidfile_pid "$dir/run/$name.pid" sshd); then
      record_uts "$name" "$dir" "$pid"
      return 0
    fi
    if [ $((i % 10)) -eq 9 ] && sshd_log_tail "$name" "$dir" | grep -qE 'fatal|Cannot bind|Bind to port'; then break; fi
    sleep 0.05
  done
  say "$name: sshd did not start; its log ($dir/log/$name.log) says:"
  sshd_log_tail "$name" "$dir" | tail -n 5 >&2
  return 1
}

# ssh_check NAME DIR TIMEOUT_S -> 0 once `ssh -F DIR/ssh_config NAME hostname` prints NAME
ssh_check() {
  local name=$1 dir=$2 deadline out=
  deadline=$((SECONDS + $3))
  while :; do
    out=$(ssh -n -F "$dir/ssh_config" -o ConnectTimeout=3 "$name" hostname 2>&1) && [ "$out" = "$name" ] && return 0
    [ "$SECONDS" -ge "$deadline" ] && break
    sleep 0.1
  done
  say "$name: no login within $3 s: ${out:-no output}"
  sshd_log_tail "$name" "$dir" | tail -n 3 >&2
  return 1
}

# hosts_down DIR NAME... -> stop those hosts completely: their sshd (pid file, comm checked),
# its session processes, everything else still running on the host (engines started over ssh
# live there), then their network plumbing and state files. Safe to repeat.
hosts_down() {
  local dir=$1 name pid table pids round ip
  shift
  [ $# -gt 0 ] || return 0
  # a few rounds: a supervisor killed in round 1 may have forked a replacement meanwhile
  for round in 1 2 3; do
    pids=()
    table=$(uts_table)
    for name in "$@"; do
      if pid=$(pidfile_pid "$dir/run/$name.pid" sshd); then
        pids+=("$pid")
        mapfile -t -O ${#pids[@]} pids < <(descendants "$pid")
      fi
      mapfile -t -O ${#pids[@]} pids < <(host_pids "$name" "$dir" "$table")
    done
    mapfile -t pids < <(for pid in "${pids[@]}"; do pid_alive "$pid" && [ "$pid" != $$ ] && echo "$pid"; done | sort -un)
    [ ${#pids[@]} -gt 0 ] || break
    [ "$round" = 1 ] || say "round $round: still running on the hosts: ${pids[*]}"
    kill_pids 5 "${pids[@]}"
  done
  for name in "$@"; do
    ip=$(cat "$dir/run/$name.host" 2>/dev/null || true)
    host_net_down "$name" "$ip" "${S_BRIDGE:-none}" "$dir"
    rm -f "$dir/run/$name".{pid,uts,host,isolated}
  done
}
