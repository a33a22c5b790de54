# shellcheck shell=bash
# tests/infra/lib-podman.sh -- sourced by podman-image.sh and sshd-up.sh: the containers.conf
# podman needs on this kind of VM. The test hosts' SSH sessions point CONTAINERS_CONF at a copy
# (sshd's SetEnv), as a cluster node would carry it in /etc/containers.

# podman_conf_write FILE: runc (crun fails here: cgroups hybrid mode), ulimits within this
# machine's hard limits (podman's defaults exceed them), cgroupfs + file events (no
# systemd/journald). Written beside and renamed, so a reader never sees half of it.
podman_conf_write() {
  local conf=$1 hn hu nofile nproc
  hn=$(ulimit -Hn); hu=$(ulimit -Hu)
  # Half the hard limit, at most 16384: runc here refuses nofile = the hard limit (20000) and
  # nproc above conmon's 32768, with "error setting rlimit type 6/7: operation not permitted".
  _podman_lim() { if [ "$1" = unlimited ] || [ "$1" -gt 32768 ]; then echo 16384; else echo $(($1 / 2)); fi; }
  nofile=$(_podman_lim "$hn"); nproc=$(_podman_lim "$hu")
  mkdir -p "$(dirname "$conf")"
  cat > "$conf.tmp.$$" <<CONF
# Written by k3launch tests/infra/lib-podman.sh: podman 4.3 on a VM with hybrid cgroups,
# no systemd and low hard ulimits. Use with CONTAINERS_CONF=$conf
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
CONF
  chmod 644 "$conf.tmp.$$"
  mv "$conf.tmp.$$" "$conf"
}
