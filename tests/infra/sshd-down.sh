#!/usr/bin/env bash
# tests/infra/sshd-down.sh [DIR] -- undo tests/infra/sshd-up.sh DIR (default /tmp/k3launch-sshd).
#
# Stops only what that up started: sshds whose pid files are in DIR/run (and only if the pid
# still is an sshd), their session processes, and everything still running on those hosts --
# engines started over ssh and daemonized live in the hosts' namespaces, not under sshd. Then
# removes the namespaces, veths, the bridge (once no port is left) and DIR's tagged /etc/hosts
# lines. Keys, configs and logs stay in DIR for post-mortems. Safe to run twice, or after a
# failed or partial up.
set -uo pipefail   # no -e: clean up as much as possible even if one step fails
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
K3_SELF=sshd-down
# shellcheck source=lib-netns.sh
. "$HERE/lib-netns.sh"

[ "$(id -u)" = 0 ] || die "must run as root"
DIR=$(realpath -m "${1:-/tmp/k3launch-sshd}")
[[ $DIR =~ ^/[A-Za-z0-9._/-]+$ ]] || die "DIR '$DIR' must be an absolute path of [A-Za-z0-9._/-]"
# DIR may be gone (rm -rf by a careless cleanup) while its hosts still run: the registry's
# claims and the /etc/hosts tags still name it, so carry on without the per-DIR lock then
[ -d "$DIR/run" ] && lock_dir "$DIR"
load_settings "$DIR" || true

# every host we may have touched: pid files, host markers, UTS records, namespace claims
mapfile -t names < <(
  for f in "$DIR"/run/*.host "$DIR"/run/*.pid "$DIR"/run/*.uts; do
    [ -e "$f" ] && basename "${f%.*}"
  done
  claims_of ns- "$DIR" | sed 's/^ns-//'
  true
)
mapfile -t names < <(printf '%s\n' "${names[@]}" | grep . | sort -u)

lock_registry
hosts_down "$DIR" "${names[@]}"
for key in $(claims_of bridge- "$DIR"); do bridge_down "${key#bridge-}" "$DIR"; done
etc_hosts_clear "$DIR"
unlock_registry
# without these, the helpers would take the (now dead) hosts for running ones
rm -f "$DIR"/{settings,hosts.json,hosts.txt,env.sh}
echo "sshd-down: ${#names[@]} host(s) of $DIR down"
