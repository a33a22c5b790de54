#!/usr/bin/env bash
# tests/infra/sshd-ctl.sh DIR COMMAND [NAME] -- faults on ONE host started by sshd-up.sh DIR.
#
#   stop NAME     kill NAME's sshd (listener and open sessions): new connections are refused,
#                 processes daemonized on the host keep running -- "sshd killed on one host"
#   start NAME    start it again (same config, host key, address) and wait until it answers
#   isolate NAME  the host stops answering: connections hang until the client's timeout,
#                 nothing is refused -- "a host that never answers". netns mode: its veth goes
#                 down (and its MAC is pinned, see lib-netns.sh); loopback mode has no link to
#                 cut, so every process of the host (sshd included) is frozen with SIGSTOP: TCP
#                 connects still complete in the kernel, but no SSH banner ever comes
#   heal NAME     undo isolate; waits until the host answers again if its sshd runs
#   status [NAME] "NAME ADDRESS up|down [isolated]" per host
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
K3_SELF=sshd-ctl
# shellcheck source=lib-netns.sh
. "$HERE/lib-netns.sh"

[ $# -ge 2 ] || die "usage: sshd-ctl.sh DIR stop|start|isolate|heal|status [NAME]"
[ "$(id -u)" = 0 ] || die "must run as root"
DIR=$(realpath -m "$1")
CMD=$2
NAME=${3:-}
load_settings "$DIR" || die "no hosts in $DIR (run sshd-up.sh $DIR first)"
lock_dir "$DIR" 60
if [ -n "$NAME" ]; then
  [ -f "$DIR/run/$NAME.host" ] || die "$NAME is not a host of $DIR"
  IP=$(cat "$DIR/run/$NAME.host")
fi
[ "$CMD" = status ] || [ -n "$NAME" ] || die "$CMD needs a host NAME"
peers() { for f in "$DIR"/run/*.host; do basename "$f" .host; done; }
freeze() { local p; mapfile -t p < <(host_pids "$NAME" "$DIR" | sort -u); [ ${#p[@]} -eq 0 ] || kill "-$1" "${p[@]}" 2>/dev/null || true; }

case "$CMD" in
  stop)
    if pid=$(pidfile_pid "$DIR/run/$NAME.pid" sshd); then
      mapfile -t kids < <(descendants "$pid")
      kill_pids 5 "$pid" "${kids[@]}"
    fi
    rm -f "$DIR/run/$NAME.pid"
    ;;
  start)
    if ! pidfile_pid "$DIR/run/$NAME.pid" sshd >/dev/null; then
      sshd_spawn "$NAME" "$DIR" || die "$NAME: sshd did not start; see $DIR/log/$NAME.log"
      sshd_wait "$NAME" "$DIR" 10 || exit 1
    fi
    if [ -f "$DIR/run/$NAME.isolated" ]; then
      [ "$S_MODE" = loopback ] && freeze STOP   # the new sshd must not answer either
    else
      ssh_check "$NAME" "$DIR" 20
    fi
    ;;
  isolate)
    if [ ! -f "$DIR/run/$NAME.isolated" ]; then
      if [ "$S_MODE" = netns ]; then
        mapfile -t all < <(peers)
        host_net_isolate "$NAME" "$IP" "$S_BRIDGE" "${all[@]}"
      else
        freeze STOP
      fi
      touch "$DIR/run/$NAME.isolated"
    fi
    ;;
  heal)
    if [ -f "$DIR/run/$NAME.isolated" ]; then
      if [ "$S_MODE" = netns ]; then
        mapfile -t all < <(peers)
        host_net_heal "$NAME" "$IP" "$S_BRIDGE" "${all[@]}"
      else
        freeze CONT
      fi
      rm -f "$DIR/run/$NAME.isolated"
    fi
    if pidfile_pid "$DIR/run/$NAME.pid" sshd >/dev/null; then ssh_check "$NAME" "$DIR" 20; fi
    ;;
  status)
    for h in $(if [ -n "$NAME" ]; then echo "$NAME"; else peers | sort -V; fi); do
      st=down
      pidfile_pid "$DIR/run/$h.pid" sshd >/dev/null && st=up
      [ -f "$DIR/run/$h.isolated" ] && st="$st isolated"
      echo "$h $(cat "$DIR/run/$h.host") $st"
    done
    ;;
  *) die "unknown command '$CMD' (stop|start|isolate|heal|status)" ;;
esac
