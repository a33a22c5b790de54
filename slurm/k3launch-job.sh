# ---- k3launch job library (slurm/k3launch-job.sh, copied verbatim into every generated job script) ----
# The generated part of the script sets K3_LOGDIR (shared with the login node) and K3_NODES, then:
#   k3_bind                      plan node i -> i-th allocated host $K3_HOST_i, address $K3_ADDR_i (its NodeAddr)
#   k3_doctor GPUS PROGRAM I:PORT,PORT ...
#                                one step on every node: GPUs visible, PROGRAM found, planned ports free;
#                                a failing node is named ("k3launch: doctor failed on HOST: why") and the job exits 3
#   k3_dir I DIR META            a directory plan node I's steps need before they start (a container's bind source,
#                                a compile cache): META, when not empty, is written to DIR/k3launch.json
#   k3_prepare                   one step on every node makes its k3_dir directories (pyxis mounts before a step's
#                                command runs); one it cannot make is named ("k3launch: prepare failed on HOST:
#                                cannot make DIR") and the job exits 1
#   k3_step NAME I SRUN_ARGS... COMMAND...
#                                one srun step per process on plan node I, output in $K3_LOGDIR/NAME.log
#   k3_work COMMAND...           (job arrays) the task's own work, on the batch host, output in work.log
#   k3_control PYTHON <<'K3_CONTROL_JSON'
#                                (up --supervise) the controller's settings (one JSON line) go to $K3_LOGDIR/control.json
#                                and the script becomes `PYTHON -m k3launch.deploy.slurm.injob`, the deployment's
#                                controller: it starts every step and keeps them serving (PYTHON, the interpreter recorded
#                                at submission, must import k3launch on this node: checked first, and said when it cannot)
#   k3_supervise                 fail fast: the first step to end stops the others and fails the job,
#                                naming it; the work ending ends the job with the work's exit code;
#                                SIGTERM to the script (`k3launch down`) stops every step and ends it cleanly
# Needs bash >= 4.3 (wait -n); with bash >= 5.1 `wait -n -p` also names which step ended first.
if [ -z "${BASH_VERSINFO:-}" ] || [ "${BASH_VERSINFO[0]}" -lt 4 ] || { [ "${BASH_VERSINFO[0]}" -eq 4 ] && [ "${BASH_VERSINFO[1]}" -lt 3 ]; }; then
  echo "k3launch: this job script needs bash >= 4.3 (wait -n); found ${BASH_VERSION:-another shell}" >&2
  exit 2
fi
set -uo pipefail
K3_PIDS=()
K3_NAMES=()
K3_WORK_PID=
K3_STOP_GRACE_S=${K3_STOP_GRACE_S:-10}

k3_say() { echo "k3launch: $*"; }

k3_bind() {
  local i h addr
  mapfile -t K3_HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  if [ "${#K3_HOSTS[@]}" -lt "$K3_NODES" ]; then
    k3_say "allocation has ${#K3_HOSTS[@]} nodes, the plan needs $K3_NODES" >&2
    exit 1
  fi
  for ((i = 0; i < K3_NODES; i++)); do
    h=${K3_HOSTS[$i]}
    # NodeAddr is how Slurm itself reaches the node; engines bind it and the login node probes it.
    addr=$(scontrol show node -o "$h" 2>/dev/null | tr ' ' '\n' | sed -n 's/^NodeAddr=//p' | head -n 1)
    [ -n "$addr" ] || addr=$h
    printf -v "K3_HOST_$i" %s "$h"
    printf -v "K3_ADDR_$i" %s "$addr"
    export "K3_HOST_$i" "K3_ADDR_$i"
    k3_say "node $i = $h $addr"
  done
}

# Runs on each node (one task per node); prints one verdict line.
K3_DOCTOR_CHECK='
gpus=$1 prog=$2; shift 2
me=${SLURMD_NODENAME:-$(hostname -s)} bad=
vis=${CUDA_VISIBLE_DEVICES:-${ROCR_VISIBLE_DEVICES:-${SLURM_STEP_GPUS:-${SLURM_JOB_GPUS:-}}}}
n=0
[ -n "$vis" ] && n=$(printf "%s\n" "$vis" | tr , "\n" | grep -c .)
[ "$n" -ge "$gpus" ] || bad="$bad; $n of $gpus GPUs visible"
[ -z "$prog" ] || command -v "$prog" >/dev/null 2>&1 || bad="$bad; $prog not found"
for spec in "$@"; do
  [ "${spec%%:*}" = "$me" ] || continue
  if command -v ss >/dev/null 2>&1; then
    listening=$(ss -Htln 2>/dev/null | awk "{print \$4}")
    for p in $(printf "%s\n" "${spec#*:}" | tr , " "); do
      printf "%s\n" "$listening" | grep -Eq "[:.]$p\$" && bad="$bad; port $p already in use"
    done
  fi
done
if [ -n "$bad" ]; then echo "k3launch-doctor $me fail ${bad#; }"; else echo "k3launch-doctor $me ok"; fi
'

# One task on every node of the allocation runs SCRIPT NAME ARGS... (output in $K3_LOGDIR/NAME.log). Each
# node answers "k3launch-NAME HOST ok" or "k3launch-NAME HOST fail WHY"; a failing node is said as
# "k3launch: NAME failed on HOST: WHY". Returns 1 when a node failed or did not answer.
k3_each_node() {
  local name=$1 script=$2 out line failed=0 hosts
  shift 2
  hosts=$(IFS=,; echo "${K3_HOSTS[*]:0:$K3_NODES}")
  out=$(srun --nodes="$K3_NODES" --ntasks="$K3_NODES" --ntasks-per-node=1 --nodelist="$hosts" --job-name="k3-$name" \
    --overlap --kill-on-bad-exit=0 bash -c "$script" "k3-$name" "$@" 2>&1)
  printf '%s\n' "$out" >"$K3_LOGDIR/$name.log"
  while IFS= read -r line; do
    case $line in
      "k3launch-$name "*" fail "*) line=${line#"k3launch-$name "}; k3_say "$name failed on ${line%% fail *}: ${line#* fail }" >&2; failed=1 ;;
    esac
  done <<<"$out"
  if [ "$failed" = 0 ] && [ "$(grep -c "^k3launch-$name .* ok\$" <<<"$out")" -lt "$K3_NODES" ]; then
    k3_say "$name step did not report every node: $(tail -n 3 <<<"$out" | tr '\n' ' ')" >&2
    failed=1
  fi
  return "$failed"
}

k3_doctor() {
  local gpus=$1 prog=$2 spec specs=()
  shift 2
  for spec in "$@"; do
    specs+=("${K3_HOSTS[${spec%%:*}]}:${spec#*:}")
  done
  k3_each_node doctor "$K3_DOCTOR_CHECK" "$gpus" "$prog" "${specs[@]}" || exit 3
  k3_say "doctor: $K3_NODES node(s) ok"
}

# Runs on each node (one task per node) with HOST DIR META triples; makes the directories of its own host.
K3_PREPARE_DIRS='
me=${SLURMD_NODENAME:-$(hostname -s)}
while [ "$#" -ge 3 ]; do
  if [ "$1" = "$me" ]; then
    if ! mkdir -p -- "$2" || { [ -n "$3" ] && ! printf "%s\n" "$3" >"$2/k3launch.json"; }; then echo "k3launch-prepare $me fail cannot make $2"; fi
  fi
  shift 3
done
echo "k3launch-prepare $me ok"
'
K3_DIRS=()

k3_dir() { K3_DIRS+=("${K3_HOSTS[$1]}" "$2" "$3"); }

k3_prepare() {
  k3_each_node prepare "$K3_PREPARE_DIRS" "${K3_DIRS[@]}" || exit 1
  k3_say "prepare: $((${#K3_DIRS[@]} / 3)) directory(ies) made on $K3_NODES node(s)"
}

k3_step() {
  local name=$1 i=$2 host_var
  shift 2
  host_var=K3_HOST_$i
  srun --nodes=1 --ntasks=1 --nodelist="${!host_var}" --kill-on-bad-exit=1 --job-name="$name" --overlap "$@" \
    >"$K3_LOGDIR/$name.log" 2>&1 </dev/null &
  K3_PIDS+=("$!")
  K3_NAMES+=("$name on node $i (${!host_var})")
  k3_say "started $name on node $i (${!host_var})"
}

k3_work() {
  "$@" >"$K3_LOGDIR/work.log" 2>&1 </dev/null &
  K3_WORK_PID=$!
}

# The processes to stop: every step and the work. `${a[@]+"${a[@]}"}`: bash 4.3 calls an empty
# array unbound under set -u.
k3_children() { printf '%s\n' ${K3_PIDS[@]+"${K3_PIDS[@]}"} ${K3_WORK_PID:+"$K3_WORK_PID"}; }

k3_stop() {
  local t=0 p alive grace=$K3_STOP_GRACE_S pids
  # `k3launch down --grace S` leaves its grace here (the log directory is shared with the login node)
  [ -r "$K3_LOGDIR/.k3launch-grace" ] && grace=$(tr -cd 0-9 <"$K3_LOGDIR/.k3launch-grace")
  mapfile -t pids < <(k3_children | grep .)
  [ "${#pids[@]}" -gt 0 ] || return 0
  # The steps' own processes get the TERM, through slurmstepd (`scancel --signal` without --batch
  # reaches every step but not this script): a TERM to srun would make it force the step's end,
  # TERM and KILL at once, and an engine killed like that leaves its shared memory behind (vLLM:
  # hundreds of MB in /dev/shm). srun gets the TERM itself only when scancel cannot be used.
  if [ "${#K3_PIDS[@]}" -gt 0 ] && ! { [ -n "${SLURM_JOB_ID:-}" ] && scancel --signal=TERM "$SLURM_JOB_ID" 2>/dev/null; }; then
    kill -TERM "${K3_PIDS[@]}" 2>/dev/null
  fi
  [ -z "$K3_WORK_PID" ] || kill -TERM "$K3_WORK_PID" 2>/dev/null
  while [ "$t" -lt $((${grace:-10} * 10)) ]; do
    alive=0
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && return 0
    sleep 0.1
    t=$((t + 1))
  done
  kill -KILL "${pids[@]}" 2>/dev/null
}

# Ranks brought down by the first one's death follow it within moments; name those that ended on
# their own within a second (before k3_stop), so the login node can tell the cause from the echo.
k3_report_others() {
  local first=$1 i r
  sleep "${K3_REPORT_WINDOW_S:-1}"
  for i in ${K3_PIDS[@]+"${!K3_PIDS[@]}"}; do
    [ "${K3_NAMES[$i]}" = "$first" ] && continue
    kill -0 "${K3_PIDS[$i]}" 2>/dev/null && continue
    wait "${K3_PIDS[$i]}" 2>/dev/null
    r=$?
    k3_say "then ${K3_NAMES[$i]} exited with code $r" >&2
  done
}

# `k3launch down` sends SIGTERM to this script (scancel --batch --signal=TERM): stop every step
# within the grace period and end the job as completed, not as a failure.
k3_on_term() {
  trap - TERM
  k3_say "stop requested (SIGTERM); stopping the deployment"
  k3_stop
  exit 0
}
trap k3_on_term TERM

# bash >= 5.1 names the child `wait -n` reaped (-p); older bash cannot, and the first dead child in
# start order is named instead (its own exit code is still right).
if [ "${BASH_VERSINFO[0]}" -gt 5 ] || { [ "${BASH_VERSINFO[0]}" -eq 5 ] && [ "${BASH_VERSINFO[1]}" -ge 1 ]; }; then
  K3_WAIT_P=1
else
  K3_WAIT_P=
fi

k3_supervise() {
  local rc i r who whorc done_pid
  while :; do
    done_pid=
    if [ -n "$K3_WAIT_P" ]; then
      wait -n -p done_pid
      rc=$?
    else
      wait -n
      rc=$?
    fi
    who= whorc=
    if [ -n "$done_pid" ] && [ "$done_pid" != "$K3_WORK_PID" ]; then
      for i in ${K3_PIDS[@]+"${!K3_PIDS[@]}"}; do
        [ "${K3_PIDS[$i]}" = "$done_pid" ] && { who=${K3_NAMES[$i]}; whorc=$rc; }
      done
    elif [ -z "$done_pid" ]; then
      for i in ${K3_PIDS[@]+"${!K3_PIDS[@]}"}; do
        kill -0 "${K3_PIDS[$i]}" 2>/dev/null && continue
        wait "${K3_PIDS[$i]}" 2>/dev/null
        r=$?
        [ "$r" = 127 ] && r=$rc  # already reported by wait -n: its code is rc
        who=${K3_NAMES[$i]} whorc=$r
        break
      done
    fi
    if [ -n "$who" ]; then
      k3_say "$who exited with code $whorc; stopping the deployment" >&2
      k3_report_others "$who"
      k3_stop
      exit 1
    fi
    if [ -n "$K3_WORK_PID" ] && { [ "$done_pid" = "$K3_WORK_PID" ] || ! kill -0 "$K3_WORK_PID" 2>/dev/null; }; then
      r=$rc
      if [ "$done_pid" != "$K3_WORK_PID" ]; then
        wait "$K3_WORK_PID" 2>/dev/null
        r=$?
        [ "$r" = 127 ] && r=$rc
      fi
      k3_say "work finished with code $r; stopping the deployment"
      K3_WORK_PID=
      k3_stop
      exit "$r"
    fi
    [ "$rc" = 127 ] && { k3_say "no step left to supervise" >&2; exit 1; }
  done
}
k3_control() {
  local py=$1 why
  if ! cat >"$K3_LOGDIR/control.json"; then
    k3_say "cannot write $K3_LOGDIR/control.json (the controller's settings)" >&2
    exit 2
  fi
  if ! why=$("$py" -c 'import k3launch.deploy.slurm.injob' 2>&1); then
    k3_say "the controller cannot run on ${SLURMD_NODENAME:-$(hostname -s)}: $py cannot import k3launch.deploy.slurm.injob" \
      "(${why##*$'\n'}); the allocation's first node needs that interpreter, with k3launch installed, at the same path" >&2
    exit 2
  fi
  # from here on SIGTERM (`k3launch down`) is the controller's: it stops every step within the grace and exits 0
  trap - TERM
  exec "$py" -m k3launch.deploy.slurm.injob "$K3_LOGDIR/control.json"
}
# ---- end of the k3launch job library ----
