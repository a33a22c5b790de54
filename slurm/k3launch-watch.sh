# ---- k3launch watch library (slurm/k3launch-watch.sh, copied verbatim after the job library into supervised job scripts) ----
# `k3launch up --supervise` on Slurm: the job keeps its deployment serving by itself, inside its
# allocation, under the inventory's restart: policy. The decisions are those of
# k3launch.models.supervise.Supervision (tests/test_slurm_supervise.py runs the k3_rs_* functions
# on a fake clock against it). The generated part of the script sets K3_DEPLOYMENT and the policy
# (K3_RS_POLICY, K3_RS_MAX, K3_RS_WINDOW_MS, K3_RS_BACKOFF_MS, K3_RS_BACKOFF_MAX_MS,
# K3_RS_START_TIMEOUT_MS, K3_RS_POLL_MS: times in integer milliseconds), then:
#   k3_start NAME I SRUN_ARGS... COMMAND...   k3_step, remembering its arguments to start it again
#   k3_unit NAME ROLE PROCESS[=HEALTH_URL]... a recovery unit: its steps stop and start again together,
#                                in this order (the ranks of one multi-node engine; an engine or the router alone)
#   k3_watch                     instead of k3_supervise: every K3_RS_POLL_MS, a step that ended fails its
#                                unit, which restarts (the first time at once, then after a doubling backoff)
#                                and serves again once every HEALTH_URL answers 200, or is given up after
#                                K3_RS_MAX restarts within K3_RS_WINDOW_MS; when a role has no unit left, every
#                                step is stopped and the job fails, naming the reason.
# Every event is one JSON line appended to $K3_LOGDIR/events.jsonl (`k3launch events NAME` reads it).
K3_STEP_ARGS=()
K3_STEP_NAME=()
K3_STEP_HOST=()
K3_U_NAME=()

k3_start() {
  local host_var=K3_HOST_$2
  K3_STEP_ARGS+=("$(printf '%q ' "$@")")
  K3_STEP_NAME+=("$1")
  K3_STEP_HOST+=("${!host_var:-}")
  k3_step "$@"
}

k3_unit() {
  local u=${#K3_U_NAME[@]} p i k= steps= urls= http=
  K3_U_NAME[$u]=$1 K3_U_ROLE[$u]=$2
  shift 2
  for p in "$@"; do
    for i in "${!K3_STEP_NAME[@]}"; do [ "${K3_STEP_NAME[$i]}" = "${p%%=*}" ] && steps+=" $i" && k=$i; done
    [ "$p" = "${p#*=}" ] || { urls+=" ${p#*=}"; http=${http:-$k}; }
  done
  K3_U_STEPS[$u]=${steps# } K3_U_URLS[$u]=${urls# } K3_U_HTTP[$u]=$http  # HTTP: its first step that serves HTTP
  K3_U_STATE[$u]=serving K3_U_UNTIL[$u]=0 K3_U_TIMES[$u]= K3_U_DETECTED[$u]=0 K3_U_REASON[$u]= K3_U_LAST[$u]=
}

# ---- times, JSON, events
k3_now() { local t=${EPOCHREALTIME:-}; t=${t/[.,]/}; if [ -n "$t" ]; then K3_NOW=$((10#$t / 1000)); else K3_NOW=$(date +%s%3N); fi; }
k3_ms() { printf '%d.%03d' $(($1 / 1000)) $(($1 % 1000)); }  # 1500 -> 1.500
k3_g() { local s; s=$(k3_ms "$1"); while [[ $s == *.*0 ]]; do s=${s%0}; done; printf '%s' "${s%.}"; }  # 1500 -> 1.5, 3600000 -> 3600
k3_json() {  # VAR TEXT: TEXT as a JSON string, in VAR
  local s=$2
  s=${s//\\/\\\\} s=${s//\"/\\\"} s=${s//$'\n'/\\n} s=${s//$'\r'/\\r} s=${s//$'\t'/\\t} s=${s//[[:cntrl:]]/ }
  printf -v "$1" '"%s"' "$s"
}
k3_event() {  # NOW KIND UNIT PROCESS NODE REASON [ATTEMPT [SECONDS_MS]]: one line of events.jsonl
  local line v k i=3
  k3_json v "$K3_DEPLOYMENT"
  line="{\"time\":$(k3_ms "$1"),\"kind\":\"$2\",\"deployment\":$v"
  for k in unit process node reason; do
    if [ -n "${!i}" ]; then k3_json v "${!i}"; line+=",\"$k\":$v"; fi
    i=$((i + 1))
  done
  [ -z "${7:-}" ] || line+=",\"attempt\":$7"
  [ -z "${8:-}" ] || line+=",\"seconds\":$(k3_ms "$8")"
  printf '%s}\n' "$line" >>"$K3_LOGDIR/events.jsonl"
}

# ---- the decisions (no processes touched: each sets K3_DO to what the unit needs now)
k3_rs_delay() {  # RESTARTS_IN_WINDOW -> K3_DELAY: 0 for the first, then backoff doubling, capped
  local n=$1 d=$K3_RS_BACKOFF_MS
  K3_DELAY=0
  [ "$n" -gt 0 ] || return 0
  while [ "$n" -gt 1 ] && [ "$d" -lt "$K3_RS_BACKOFF_MAX_MS" ]; do d=$((d * 2)) n=$((n - 1)); done
  K3_DELAY=$((d < K3_RS_BACKOFF_MAX_MS ? d : K3_RS_BACKOFF_MAX_MS))
}

k3_rs_fail() {  # U NOW WHY PROCESS: restart it at once, after a backoff (K3_DO=wait), or give it up
  local u=$1 now=$2 why=$3 times n said
  read -ra times <<<"${K3_U_TIMES[$u]}"
  while [ "${#times[@]}" -gt 0 ] && [ $((now - times[0])) -gt "$K3_RS_WINDOW_MS" ]; do times=("${times[@]:1}"); done
  K3_U_TIMES[$u]=${times[*]}
  n=${#times[@]}
  K3_U_REASON[$u]=$why
  if [ "$K3_RS_POLICY" = never ] || [ "$n" -ge "$K3_RS_MAX" ]; then
    said="$n restarts within $(k3_g "$K3_RS_WINDOW_MS")s"
    [ "$K3_RS_POLICY" = never ] && said="restart policy never"
    K3_U_STATE[$u]=gave-up K3_U_REASON[$u]="$said; last failure: $why" K3_DO=give-up
    k3_event "$now" gave-up "${K3_U_NAME[$u]}" "$4" "" "${K3_U_REASON[$u]}"
    return
  fi
  k3_rs_delay "$n"
  K3_U_STATE[$u]=backoff K3_U_UNTIL[$u]=$((now + K3_DELAY))
  if [ "$K3_DELAY" -gt 0 ]; then
    K3_DO=wait
    k3_event "$now" backoff "${K3_U_NAME[$u]}" "" "" "restart $((n + 1)) in $(k3_g "$K3_DELAY")s" $((n + 1)) "$K3_DELAY"
    return
  fi
  k3_rs_restart "$u" "$now"
}

k3_rs_restart() {  # U NOW: stop it and start it again (K3_DO=restart); it must serve within the start timeout
  local u=$1 now=$2 times
  K3_U_TIMES[$u]="${K3_U_TIMES[$u]:+${K3_U_TIMES[$u]} }$now"
  read -ra times <<<"${K3_U_TIMES[$u]}"
  K3_U_STATE[$u]=starting K3_U_UNTIL[$u]=$((now + K3_RS_START_TIMEOUT_MS)) K3_DO=restart
  k3_event "$now" restarting "${K3_U_NAME[$u]}" "" "" "${K3_U_REASON[$u]}" "${#times[@]}"
}

k3_rs_started() { K3_U_UNTIL[$1]=$(($2 + K3_RS_START_TIMEOUT_MS)); }  # U NOW: its steps were started again

k3_rs_exit() {  # U NOW PROCESS CODE NODE: a step of the unit ended
  local u=$1 why="$3 exited with code $4" times
  read -ra times <<<"${K3_U_TIMES[$u]}"
  K3_DO=
  case ${K3_U_STATE[$u]} in
    serving) K3_U_DETECTED[$u]=$2; k3_event "$2" detected "${K3_U_NAME[$u]}" "$3" "$5" "$why" ;;
    starting) k3_event "$2" restart-failed "${K3_U_NAME[$u]}" "$3" "$5" "$why" "${#times[@]}" ;;
    *) k3_rs_tick "$u" "$2" 0; return ;;  # in backoff (its other ranks follow the first), or given up
  esac
  k3_rs_fail "$u" "$2" "$why" "$3"
}

k3_rs_tick() {  # U NOW SERVES(0|1) [PROCESS NODE]: no step of the unit ended; SERVES: every health URL answers
  local u=$1 now=$2 took times why
  read -ra times <<<"${K3_U_TIMES[$u]}"
  K3_DO=
  if [ "${K3_U_STATE[$u]}" = backoff ] && [ "$now" -ge "${K3_U_UNTIL[$u]}" ]; then
    k3_rs_restart "$u" "$now"
  elif [ "${K3_U_STATE[$u]}" = starting ] && [ "$now" -gt "${K3_U_UNTIL[$u]}" ]; then
    why="not serving $(k3_g "$K3_RS_START_TIMEOUT_MS")s after the restart"
    k3_event "$now" restart-failed "${K3_U_NAME[$u]}" "${4:-}" "${5:-}" "$why" "${#times[@]}"
    k3_rs_fail "$u" "$now" "$why" "${4:-}"
  elif [ "${K3_U_STATE[$u]}" = starting ] && [ "$3" = 1 ]; then
    took=$((now - K3_U_DETECTED[$u]))
    K3_U_STATE[$u]=serving
    k3_event "$now" restarted "${K3_U_NAME[$u]}" "" "" "serving again after $(((took + 50) / 1000)).$(((took + 50) / 100 % 10))s" \
      "${#times[@]}" "$took"
  fi
}

k3_rs_look() {  # U NOW SERVES [STEP CODE]: the unit's part of one look (STEP, an index: the first of its steps that ended)
  local u=$1 i
  if [ -n "${4:-}" ]; then
    # the failure `up` names if the unit is given up
    [ "${K3_U_STATE[$u]}" != serving ] && [ "${K3_U_STATE[$u]}" != starting ] || K3_U_LAST[$u]="$4 $5"
    k3_rs_exit "$u" "$2" "${K3_STEP_NAME[$4]}" "$5" "${K3_STEP_HOST[$4]}"
  else
    K3_U_LAST[$u]= i=${K3_U_HTTP[$u]}
    k3_rs_tick "$u" "$2" "$3" "${i:+${K3_STEP_NAME[$i]}}" "${i:+${K3_STEP_HOST[$i]}}"
  fi
}

k3_rs_failed() {  # NOW: a role has no unit left: the reason (K3_WHY) and the event
  local u
  K3_WHY=
  for u in "${!K3_U_NAME[@]}"; do
    [ "${K3_U_STATE[$u]}" != gave-up ] || K3_WHY+="${K3_WHY:+; }${K3_U_NAME[$u]} given up: ${K3_U_REASON[$u]}"
  done
  k3_event "$1" failed "" "" "" "$K3_WHY"
}

k3_rs_can_serve() {  # every role keeps a unit not given up (P/D needs both pools, and the router)
  local u v ok
  for u in "${!K3_U_NAME[@]}"; do
    ok=0
    for v in "${!K3_U_NAME[@]}"; do
      [ "${K3_U_ROLE[$v]}" = "${K3_U_ROLE[$u]}" ] && [ "${K3_U_STATE[$v]}" != gave-up ] && ok=1
    done
    [ "$ok" = 1 ] || return 1
  done
}

# ---- acting on them
k3_healthy() {  # URL: answers 200 within 3 s
  if command -v curl >/dev/null 2>&1; then curl -fsS -m 3 -o /dev/null "$1" 2>/dev/null; return; fi
  local hp=${1#http://} path
  path=/${hp#*/}
  hp=${hp%%/*}
  timeout 3 bash -c 'exec 3<>"/dev/tcp/${1%:*}/${1##*:}" && printf "GET %s HTTP/1.0\r\n\r\n" "$2" >&3 && read -r l <&3 &&
    [[ $l == HTTP/*" 200"* ]]' k3-probe "$hp" "$path" 2>/dev/null
}

k3_signal_steps() {  # SIGNAL NAME...: signal those steps of this job through Slurm (their processes, not srun)
  local ids
  [ -n "${SLURM_JOB_ID:-}" ] || return 1
  mapfile -t ids < <(squeue -h -s -j "$SLURM_JOB_ID" -o '%i %j' 2>/dev/null |
    awk -v want=" $* " 'index(want, " " $2 " ") && $1 !~ /\.(batch|extern)$/ {print $1}')
  [ "${#ids[@]}" -gt 0 ] && scancel --signal="$1" "${ids[@]}" 2>/dev/null
}

k3_alive() { local p; for p in "$@"; do kill -0 "$p" 2>/dev/null && return 0; done; return 1; }

k3_stop_steps() {  # STEP...: TERM through Slurm, KILL after the grace; reaped
  local i t=0 names=() pids=()
  for i in "$@"; do [ -z "${K3_PIDS[$i]}" ] || { names+=("${K3_STEP_NAME[$i]}"); pids+=("${K3_PIDS[$i]}"); }; done
  if [ "${#pids[@]}" -gt 0 ]; then
    k3_signal_steps TERM "${names[@]}" || kill -TERM "${pids[@]}" 2>/dev/null
    while k3_alive "${pids[@]}" && [ "$t" -lt $((K3_STOP_GRACE_S * 10)) ]; do sleep 0.1; t=$((t + 1)); done
    k3_alive "${pids[@]}" && k3_signal_steps KILL "${names[@]}"
    while k3_alive "${pids[@]}" && [ "$t" -lt $((K3_STOP_GRACE_S * 10 + 50)) ]; do sleep 0.1; t=$((t + 1)); done
    kill -KILL "${pids[@]}" 2>/dev/null
  fi
  for i in "$@"; do [ -z "${K3_PIDS[$i]}" ] || wait "${K3_PIDS[$i]}" 2>/dev/null; K3_PIDS[$i]=; done
}

k3_restart_unit() {  # U: stop its steps, start every one again in order (the previous log stays as NAME.log.1)
  local u=$1 i n log was=$K3_NOW
  # shellcheck disable=SC2086 # step indices
  k3_stop_steps ${K3_U_STEPS[$u]}
  for i in ${K3_U_STEPS[$u]}; do
    log=$K3_LOGDIR/${K3_STEP_NAME[$i]}.log
    [ ! -e "$log" ] || mv -f "$log" "$log.1"
    n=${#K3_PIDS[@]}
    eval "k3_step ${K3_STEP_ARGS[$i]}"
    K3_PIDS[$i]=${K3_PIDS[$n]}
    unset "K3_PIDS[$n]" "K3_NAMES[$n]"
  done
  k3_now
  k3_rs_started "$u" "$K3_NOW"
  K3_NOW=$was
}

k3_look() {  # U: one look at the unit (its first step that ended, else its health while it starts): K3_DO
  local u=$1 i rc first= code= serves=1 url
  for i in ${K3_U_STEPS[$u]}; do
    [ -n "${K3_PIDS[$i]}" ] && ! kill -0 "${K3_PIDS[$i]}" 2>/dev/null || continue
    wait "${K3_PIDS[$i]}" 2>/dev/null
    rc=$?
    K3_PIDS[$i]=
    k3_say "${K3_NAMES[$i]} ended with code $rc (unit ${K3_U_NAME[$u]}, ${K3_U_STATE[$u]})" >&2
    [ -n "$first" ] || first=$i code=$rc
  done
  if [ -z "$first" ] && [ "${K3_U_STATE[$u]}" = starting ] && [ "$K3_NOW" -le "${K3_U_UNTIL[$u]}" ]; then
    for url in ${K3_U_URLS[$u]}; do k3_healthy "$url" || { serves=0; break; }; done
  fi
  k3_rs_look "$u" "$K3_NOW" "$serves" "$first" "$code"
}

k3_act() {  # U WHAT: what k3_look decided
  case $2 in
    restart) k3_say "restarting unit ${K3_U_NAME[$1]}: ${K3_U_REASON[$1]}"; k3_restart_unit "$1" ;;
    give-up) k3_say "giving unit ${K3_U_NAME[$1]} up: ${K3_U_REASON[$1]}" >&2
      # shellcheck disable=SC2086 # step indices
      k3_stop_steps ${K3_U_STEPS[$1]} ;;
  esac
}

k3_watch() {
  local u last code todo=()
  k3_now
  k3_event "$K3_NOW" watching "" "" "${SLURMD_NODENAME:-$(hostname -s)}" \
    "job ${SLURM_JOB_ID:-?} supervises itself; units: ${K3_U_NAME[*]}"
  k3_say "supervising: units ${K3_U_NAME[*]}"
  while :; do
    k3_now
    # one look at every unit, then what it needs (as Supervision.step, then its actions)
    for u in "${!K3_U_NAME[@]}"; do todo[$u]=; [ "${K3_U_STATE[$u]}" = gave-up ] || { k3_look "$u"; todo[$u]=$K3_DO; }; done
    if k3_rs_can_serve; then
      for u in "${!K3_U_NAME[@]}"; do k3_act "$u" "${todo[$u]}"; done
    else
      k3_rs_failed "$K3_NOW"
      for u in "${!K3_U_NAME[@]}"; do
        [ "${K3_U_STATE[$u]}" = gave-up ] && [ -n "${K3_U_LAST[$u]}" ] || continue
        read -r last code <<<"${K3_U_LAST[$u]}"
        # the line `up` reads the failing process from (as the fail-fast one)
        k3_say "${K3_NAMES[$last]} exited with code $code; supervision gave up" >&2
      done
      k3_say "supervision gave up: $K3_WHY; stopping the deployment" >&2
      k3_stop
      exit 1
    fi
    sleep "$(k3_ms "$K3_RS_POLL_MS")" &
    wait $!
  done
}
# ---- end of the k3launch watch library ----
