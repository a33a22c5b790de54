#!/usr/bin/env bash
# tests/infra/sshd-up.sh [DIR] -- start N real OpenSSH "hosts" on this machine for k3launch's
# end-to-end tests. Needs root. DIR (default /tmp/k3launch-sshd) holds keys, configs, pid
# files and logs; it must be an absolute path of [A-Za-z0-9._/-] (it ends up in sshd and ssh
# configs and in /etc/hosts tags, where anything fancier would need quoting).
#
# Knobs (environment):
#   SSH_HOSTS=4            number of hosts, 1..48, named ${SSH_HOST_PREFIX}1..N
#   SSH_HOST_PREFIX=k3h    lowercase letters, digits, '-'; must not end in a digit
#   SSH_MODE=auto          netns:    host i has its own network namespace NAME, eth0 =
#                                    SSH_SUBNET.(100+i)/24 on bridge SSH_BRIDGE, sshd on port 22
#                          loopback: host i is sshd on 127.0.0.(100+i), port 2222
#                          auto:     netns if namespaces can be made here, else loopback
#   SSH_SUBNET=10.213.0    the private /24 (first three octets); refused if already routed
#   SSH_BRIDGE=k3lbr0      the bridge's name
#   SSH_PORT               22 (netns) / 2222 (loopback)
#   SSH_ETC_HOSTS=1        add "ADDRESS NAME" lines (tagged, removed by down) to /etc/hosts
#   SSH_WAIT_S=60          bound on the wait for every host to accept a real login
#
# Every sshd runs in its own UTS namespace, so `ssh NAME hostname` prints NAME. Hosts share
# this machine's filesystem, users and process list, like nodes of a cluster with a shared FS.
# Login: root, key only, host keys checked strictly. Outputs in DIR:
#   ssh_config   Host NAME -> HostName/Port/HostKeyAlias, plus User/IdentityFile/... for all
#   known_hosts  one line per host ("NAME,ADDRESS" or "NAME,[ADDRESS]:PORT"), its own host key
#   hosts.txt    "NAME ADDRESS PORT USER" lines
#   hosts.json   {"mode", "hosts": [{"name", "address", "port", "user"}], "key", "ssh_config",
#                 "known_hosts", "iface", "login_address", "bridge" ("" in loopback), "dir"}
#   env.sh       exports K3LAUNCH_TEST_SSH_DIR & co.; sourcing it makes the tests reuse these hosts
# Idempotent: hosts already running are kept, missing ones (re)started, hosts beyond N stopped.
# The script returns once every host answered `ssh -F DIR/ssh_config NAME hostname` with NAME.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
K3_SELF=sshd-up
# shellcheck source=lib-netns.sh
. "$HERE/lib-netns.sh"
# shellcheck source=lib-podman.sh
. "$HERE/lib-podman.sh"

T0=$(date +%s%N)
[ "$(id -u)" = 0 ] || die "must run as root (sshd for root logins, network namespaces)"
DIR=$(realpath -m "${1:-/tmp/k3launch-sshd}")
[[ $DIR =~ ^/[A-Za-z0-9._/-]+$ ]] || die "DIR '$DIR' must be an absolute path of [A-Za-z0-9._/-]"
N=${SSH_HOSTS:-4}
if ! [[ $N =~ ^[0-9]+$ ]] || [ "$N" -lt 1 ] || [ "$N" -gt 48 ]; then die "SSH_HOSTS must be 1..48 (got '$N')"; fi
WAIT_S=${SSH_WAIT_S:-60}

mkdir -p "$DIR"/{keys,conf,run,log}
chmod 755 "$DIR" "$DIR/keys"
lock_dir "$DIR"

# ---- packages: install only what is missing ----------------------------------------------
ensure_packages() {
  local need=()
  [ -x /usr/sbin/sshd ] || need+=(openssh-server)
  { command -v ssh && command -v ssh-keygen; } >/dev/null || need+=(openssh-client)
  { command -v ip && command -v ss; } >/dev/null || need+=(iproute2)
  { command -v unshare && command -v nsenter; } >/dev/null || need+=(util-linux)
  command -v ps >/dev/null || need+=(procps)
  apt_install "$DIR/log/apt.log" "${need[@]}"   # policy-rc.d: no system-wide sshd on port 22
}
ensure_packages

# ---- settings: hosts already set up from DIR keep theirs ----------------------------------
# An explicit knob that contradicts them is refused: changing the subnet or the names under
# running hosts would strand them. Settings of an up that failed before creating anything
# (no host marker, no claim) bind nothing.
dir_active() {
  compgen -G "$DIR/run/*.host" >/dev/null || compgen -G "$DIR/run/*.pid" >/dev/null || [ -n "$(claims_of '' "$DIR")" ]
}
if dir_active && load_settings "$DIR"; then
  same() { [ -z "$1" ] || [ "$1" = "$2" ] || die "$DIR runs hosts with $3=$2 (asked for $1); run sshd-down.sh $DIR first"; }
  [ "${SSH_MODE:-auto}" = auto ] || same "$SSH_MODE" "$S_MODE" SSH_MODE
  same "${SSH_HOST_PREFIX:-}" "$S_PREFIX" SSH_HOST_PREFIX
  same "${SSH_PORT:-}" "$S_PORT" SSH_PORT
  if [ "$S_MODE" = netns ]; then
    same "${SSH_SUBNET:-}" "$S_SUBNET" SSH_SUBNET
    same "${SSH_BRIDGE:-}" "$S_BRIDGE" SSH_BRIDGE
  fi
else
  S_PREFIX=${SSH_HOST_PREFIX:-k3h}
  S_SUBNET=${SSH_SUBNET:-10.213.0}
  S_BRIDGE=${SSH_BRIDGE:-k3lbr0}
  S_ETC_HOSTS=${SSH_ETC_HOSTS:-1}
  [[ $S_PREFIX =~ ^[a-z]([a-z0-9-]*[a-z-])?$ ]] || die "SSH_HOST_PREFIX '$S_PREFIX': lowercase letters, digits, '-', starting with a letter, not ending in a digit"
  IFS=. read -r o1 o2 o3 <<<"$S_SUBNET"
  if ! [[ $S_SUBNET =~ ^[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$ ]] || [ "$o1" -gt 255 ] || [ "$o2" -gt 255 ] || [ "$o3" -gt 255 ]; then
    die "SSH_SUBNET '$S_SUBNET' must be the first three octets of a /24, e.g. 10.213.0"
  fi
  [[ $S_BRIDGE =~ ^[a-z][a-z0-9]{0,14}$ ]] || die "SSH_BRIDGE '$S_BRIDGE': up to 15 lowercase letters and digits"
  case "${SSH_MODE:-auto}" in
    netns) netns_supported || die "SSH_MODE=netns but network namespaces cannot be made here (try SSH_MODE=loopback)"
      S_MODE=netns ;;
    loopback) S_MODE=loopback ;;
    auto) if netns_supported; then S_MODE=netns; else S_MODE=loopback; fi ;;
    *) die "SSH_MODE must be auto, netns or loopback (got '$SSH_MODE')" ;;
  esac
  if [ "$S_MODE" = netns ]; then S_PORT=${SSH_PORT:-22}; else S_PORT=${SSH_PORT:-2222}; fi
  if ! [[ $S_PORT =~ ^[0-9]+$ ]] || [ "$S_PORT" -lt 1 ] || [ "$S_PORT" -gt 65535 ]; then die "SSH_PORT '$S_PORT' is not a port"; fi
  printf 'S_MODE=%s\nS_PREFIX=%s\nS_SUBNET=%s\nS_BRIDGE=%s\nS_PORT=%s\nS_ETC_HOSTS=%s\n' \
    "$S_MODE" "$S_PREFIX" "$S_SUBNET" "$S_BRIDGE" "$S_PORT" "$S_ETC_HOSTS" >"$DIR/settings"
fi
# the veth is "v-NAME" and interface names have at most 15 characters
[ $((${#S_PREFIX} + ${#N})) -le 13 ] || die "host names ${S_PREFIX}1..$N would be longer than 13 characters"
NAMES=()
for i in $(seq 1 "$N"); do NAMES+=("$S_PREFIX$i"); done
if [ "$S_MODE" = netns ]; then
  IFACE=eth0 LOGIN_ADDR=$S_SUBNET.1 BRIDGE_OUT=$S_BRIDGE
else
  IFACE=lo LOGIN_ADDR=127.0.0.1 BRIDGE_OUT=
fi

# ---- keys: one client key, one host key per host (so a host's key never vouches for another)
KEY=$DIR/keys/id_ed25519
[ -f "$KEY" ] || ssh-keygen -q -t ed25519 -N '' -C k3launch-test-client -f "$KEY"
chmod 600 "$KEY"
cp "$KEY.pub" "$DIR/keys/authorized_keys"
for name in "${NAMES[@]}"; do
  hk=$DIR/keys/${name}_host_ed25519
  [ -f "$hk" ] || ssh-keygen -q -t ed25519 -N '' -C "k3launch-test-host-$name" -f "$hk"
  chmod 600 "$hk"
done
# sshd's privilege-separation directory; missing it, sshd exits at once
mkdir -p /run/sshd && chmod 755 /run/sshd
# podman in the hosts' SSH sessions reads this (SetEnv below), as a node reads /etc/containers
podman_conf_write "$DIR/containers.conf"

# ---- shrink: hosts from an earlier, larger up that are beyond N ---------------------------
extra=()
for f in "$DIR"/run/*.host; do
  [ -e "$f" ] || continue
  name=$(basename "$f" .host)
  i=$(host_index "$name")
  [[ $i =~ ^[0-9]+$ ]] && [ "$i" -le "$N" ] || extra+=("$name")
done
if [ ${#extra[@]} -gt 0 ]; then
  lock_registry
  hosts_down "$DIR" "${extra[@]}"
  unlock_registry
fi

# ---- network and configs (machine-wide state: under the registry lock) --------------------
lock_registry
[ "$S_MODE" = netns ] && bridge_up "$S_BRIDGE" "$S_SUBNET" "$DIR"
tested=0
for name in "${NAMES[@]}"; do
  ip=$(host_ip "$name")
  if [ "$S_MODE" = netns ]; then
    host_net_up "$name" "$ip" "$S_BRIDGE" "$DIR"
  elif ! pidfile_pid "$DIR/run/$name.pid" sshd >/dev/null; then
    # loopback: a listener on this port there (or on the wildcard) would make our sshd fail
    busy=$(ss -Hltn "sport = :$S_PORT" 2>/dev/null | awk -v a="$ip:$S_PORT" -v p="$S_PORT" \
      '$4 == a || $4 == "0.0.0.0:" p || $4 == "*:" p || $4 == "[::]:" p { print $4 }')
    [ -z "$busy" ] || die "$name: something else listens on $busy; set SSH_PORT"
  fi
  echo "$ip" >"$DIR/run/$name.host"
  cfg=$DIR/conf/$name.sshd_config
  cat >"$cfg.tmp" <<EOF
# generated by tests/infra/sshd-up.sh for test host $name; re-run it rather than editing this
Port $S_PORT
ListenAddress $ip
AddressFamily inet
HostKey $DIR/keys/${name}_host_ed25519
PidFile $DIR/run/$name.pid
# key-only root login
AuthorizedKeysFile $DIR/keys/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
# PAM would want a full system (logind, /etc/pam.d session modules); keys need none of it
UsePAM no
# the keys live under a world-writable /tmp, which StrictModes' ownership checks refuse
StrictModes no
UseDNS no
PrintMotd no
PrintLastLog no
# k3launch opens one connection per node at once; OpenSSH's default 10:30:100 starts dropping
# unauthenticated connections at random once 10 handshakes are in flight
MaxStartups 256:30:512
MaxSessions 64
LoginGraceTime 30
X11Forwarding no
LogLevel INFO
AcceptEnv LANG LC_*
Subsystem sftp internal-sftp
SetEnv K3LAUNCH_TEST_HOST=$name CONTAINERS_CONF=$DIR/containers.conf
EOF
  if cmp -s "$cfg.tmp" "$cfg"; then
    rm -f "$cfg.tmp"
  else
    mv "$cfg.tmp" "$cfg"
    # a running sshd read its config at start: SIGHUP makes it re-exec with the new one
    # (sessions already open are kept)
    if pid=$(pidfile_pid "$DIR/run/$name.pid" sshd); then kill -HUP "$pid" 2>/dev/null || true; fi
    # all configs come from one template: checking the first new one catches template errors
    # without paying ~30 ms per host
    if [ "$tested" = 0 ]; then
      /usr/sbin/sshd -t -f "$cfg" || die "sshd rejects $cfg"
      tested=1
    fi
  fi
done
if [ "$S_ETC_HOSTS" = 1 ]; then
  for name in "${NAMES[@]}"; do echo "$(host_ip "$name") $name"; done | etc_hosts_set "$DIR"
fi
unlock_registry

# ---- start the sshds that are not running (their readiness is awaited below, in parallel) --
started=0
for name in "${NAMES[@]}"; do
  if ! pidfile_pid "$DIR/run/$name.pid" sshd >/dev/null; then
    sshd_spawn "$name" "$DIR" || die "$name: sshd did not start; see $DIR/log/$name.log"
    started=$((started + 1))
  fi
done

# ---- client files --------------------------------------------------------------------------
{
  echo "# generated by tests/infra/sshd-up.sh -- use: ssh -F $DIR/ssh_config ${S_PREFIX}1"
  for name in "${NAMES[@]}"; do
    # HostKeyAlias: OpenSSH looks the key up under NAME, whatever address/port it dials
    printf 'Host %s\n  HostName %s\n  Port %s\n  HostKeyAlias %s\n' "$name" "$(host_ip "$name")" "$S_PORT" "$name"
  done
  cat <<EOF
Host ${NAMES[*]}
  User root
  IdentityFile $KEY
  IdentitiesOnly yes
  UserKnownHostsFile $DIR/known_hosts
  GlobalKnownHostsFile /dev/null
  StrictHostKeyChecking yes
  BatchMode yes
  ConnectTimeout 5
  # a session to a host that went silent (sshd-ctl.sh isolate) ends after ~15 s, not never
  ServerAliveInterval 5
  ServerAliveCountMax 3
  LogLevel ERROR
EOF
} >"$DIR/ssh_config.tmp"
: >"$DIR/known_hosts.tmp"
: >"$DIR/hosts.txt.tmp"
json_hosts=()
for name in "${NAMES[@]}"; do
  ip=$(host_ip "$name")
  # paramiko/fabric ignore HostKeyAlias and look keys up by address ("[addr]:port" off port 22)
  if [ "$S_PORT" = 22 ]; then at=$ip; else at="[$ip]:$S_PORT"; fi
  echo "$name,$at $(cut -d' ' -f1,2 "$DIR/keys/${name}_host_ed25519.pub")" >>"$DIR/known_hosts.tmp"
  echo "$name $ip $S_PORT root" >>"$DIR/hosts.txt.tmp"
  json_hosts+=("{\"name\": \"$name\", \"address\": \"$ip\", \"port\": $S_PORT, \"user\": \"root\"}")
done
# every value is from a checked character set, so plain printf makes valid JSON
joined=$(printf ',\n    %s' "${json_hosts[@]}")
cat >"$DIR/hosts.json.tmp" <<EOF
{
  "mode": "$S_MODE",
  "hosts": [${joined:1}
  ],
  "key": "$KEY",
  "ssh_config": "$DIR/ssh_config",
  "known_hosts": "$DIR/known_hosts",
  "iface": "$IFACE",
  "login_address": "$LOGIN_ADDR",
  "bridge": "$BRIDGE_OUT",
  "dir": "$DIR"
}
EOF
cat >"$DIR/env.sh.tmp" <<EOF
# source this (. $DIR/env.sh): k3launch's tests then reuse these hosts instead of starting their own
export K3LAUNCH_TEST_SSH_DIR=$DIR
export K3LAUNCH_TEST_SSH_CONFIG=$DIR/ssh_config
export K3LAUNCH_TEST_SSH_KNOWN_HOSTS=$DIR/known_hosts
export K3LAUNCH_TEST_SSH_KEY=$KEY
EOF
for f in ssh_config known_hosts hosts.txt hosts.json env.sh; do
  chmod 644 "$DIR/$f.tmp"
  mv "$DIR/$f.tmp" "$DIR/$f"
done

# ---- wait until every host answers a real login with its own name (in parallel, bounded) ----
# (the checkers do not inherit the DIR lock: if this script is killed, the orphans must not
# keep a following sshd-down.sh waiting)
jobs_=()
for name in "${NAMES[@]}"; do
  { sshd_wait "$name" "$DIR" 10 && ssh_check "$name" "$DIR" "$WAIT_S"; } 8>&- 9>&- &
  jobs_+=("$!")
done
failed=()
for k in "${!jobs_[@]}"; do
  wait "${jobs_[$k]}" || failed+=("${NAMES[$k]}")
done
[ ${#failed[@]} -eq 0 ] || die "not answering: ${failed[*]} (logs in $DIR/log/)"

printf 'sshd-up: %d host(s) up (%s mode, %d started now) in %.2fs; ssh -F %s %s1\n' "$N" "$S_MODE" "$started" \
  "$(awk -v a="$T0" -v b="$(date +%s%N)" 'BEGIN { print (b - a) / 1e9 }')" "$DIR/ssh_config" "$S_PREFIX"
