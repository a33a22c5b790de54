"""Live progress: phases from the engine's own log lines (real vLLM and the simulated engine), the
log reads that ride along in the liveness poll, and how ``up`` and ``bench`` show them.

The real log is vLLM 0.32.0's (CPU build) own, kept as a fixture (tests/data/vllm-0.32-cpu-serve.log,
from one ``vllm serve`` of the tiny model: tests/support/enginecpu.py); the GPU-side lines are quoted from
vLLM's sources (weights loading, torch.compile, CUDA graph capture, KV cache, NCCL).
"""

from __future__ import annotations

import io
import subprocess
import threading
from pathlib import Path

import pytest
from paths import TESTS
from rich.console import Console

from k3launch.cli import show_progress
from k3launch.deploy import logtail
from k3launch.deploy.progress import Tracker
from k3launch.models.phases import BringUp, LogDelta, Phase, ProcessProgress, classify, clean
from k3launch.models.plan import Plan
from k3launch.planning.schema import load_schema
from k3launch.render import logread
from k3launch.sim import startup
from k3launch.sim.bar import render as bar_line
from k3launch.sim.cli import parse_serve
from k3launch.sim.logs import Logger
from k3launch.sim.options import Knobs
from k3launch.transport.runners import LocalRunner, Target

DATA = TESTS / "data"
REAL_LOG = DATA / "vllm-0.32-cpu-serve.log"


def _plan() -> Plan:
    from k3launch import api

    return api.plan(api.bundled_inventory("local"), name="prog", strategy="multi_node_dep", nodes=2)


def _phases(text: str) -> list[Phase]:
    """The phases a process goes through reading ``text`` line by line (one poll per line)."""
    plan = _plan()
    pid = plan.processes[0].id
    t = Tracker(plan, started=0.0)
    for i, line in enumerate(text.splitlines(keepends=True), 1):
        t.update({pid: LogDelta(line)}, (), "alive", now=float(i))
    return [s.phase for s in next(p for p in t.timeline(ready=False, now=1e6).processes if p.id == pid).phases]


# ---------------------------------------------------------------------- the patterns
def test_the_real_vllm_log_goes_through_every_phase_in_order() -> None:
    phases = _phases(REAL_LOG.read_text())
    assert phases[0] == Phase.STARTING
    assert [p for p in phases if p != Phase.COMPILING][1:] == [
        Phase.WAITING_FOR_PEERS,
        Phase.LOADING_WEIGHTS,
        Phase.KV_CACHE,
        Phase.API_SERVER,
    ], phases
    assert Phase.COMPILING in phases  # the CPU build's warm-up compiles


# quoted from vLLM 0.33's GPU code paths (model_loader/weight_utils.py's bar format, gpu_model_runner.py,
# compilation/monitor.py and backends.py, gpu_worker.py, kv_cache_utils.py, parallel_state.py, NCCL, uvicorn)
GPU_LINES = [
    (
        "(EngineCore_DP0 pid=811) INFO 03-02 10:00:01 [parallel_state.py:1165] world_size=16 rank=8 local_rank=0 "
        "distributed_init_method=tcp://10.0.0.1:29500 backend=nccl",
        Phase.WAITING_FOR_PEERS,
        None,
    ),
    (
        "node-2:811:811 [0] NCCL INFO comm 0x5581 rank 8 nranks 16 cudaDev 0 nvmlDev 0 busId 18000 commId 0x9f1e - Init START",
        Phase.WAITING_FOR_PEERS,
        None,
    ),
    (
        "(EngineCore_DP0 pid=811) INFO 03-02 10:00:09 [gpu_model_runner.py:2602] Starting to load model moonshotai/Kimi-K3...",
        Phase.LOADING_WEIGHTS,
        None,
    ),
    ("Loading safetensors checkpoint shards:  45% Completed | 45/100 [03:12<03:55,  4.27s/it]", Phase.LOADING_WEIGHTS, 45.0),
    (
        "(EngineCore_DP0 pid=811) INFO 03-02 10:07:10 [gpu_model_runner.py:2634] Model loading took 118.2 GiB memory and 421.031 seconds",
        Phase.LOADING_WEIGHTS,
        None,
    ),
    ("(EngineCore_DP0 pid=811) INFO 03-02 10:07:31 [backends.py:548] Dynamo bytecode transform time: 18.70 s", Phase.COMPILING, None),
    ("(EngineCore_DP0 pid=811) INFO 03-02 10:08:02 [monitor.py:34] torch.compile takes 49.21 s in total", Phase.COMPILING, None),
    ("(EngineCore_DP0 pid=811) INFO 03-02 10:08:09 [gpu_worker.py:298] Available KV cache memory: 21.37 GiB", Phase.KV_CACHE, None),
    ("(EngineCore_DP0 pid=811) INFO 03-02 10:08:09 [kv_cache_utils.py:1087] GPU KV cache size: 1,119,616 tokens", Phase.KV_CACHE, None),
    ("Capturing CUDA graphs (mixed prefill-decode, PIECEWISE):  67%|██████▋   | 45/67 [00:04<00:01, 11.2it/s]", Phase.COMPILING, 67.0),
    (
        "(EngineCore_DP0 pid=811) INFO 03-02 10:08:21 [gpu_model_runner.py:3480] Graph capturing finished in 12 secs, took 0.61 GiB",
        Phase.COMPILING,
        None,
    ),
    (
        "(APIServer pid=700) INFO 03-02 10:08:24 [api_server.py:1895] Starting vLLM API server 0 on http://10.0.0.1:8000",
        Phase.API_SERVER,
        None,
    ),
    ("INFO:     Application startup complete.", Phase.API_SERVER, None),
    ("(APIServer pid=700) INFO 03-02 10:08:20 [core.py:210] init engine (profile, create kv cache, warmup model) took 71.8 s", None, None),
    ('(APIServer pid=700) INFO:     10.0.0.9:50812 - "GET /health HTTP/1.1" 200 OK', None, None),
]


@pytest.mark.parametrize(("line", "phase", "percent"), GPU_LINES, ids=[f"{i}" for i in range(len(GPU_LINES))])
def test_vllm_gpu_lines_map_to_their_phase_and_percentage(line: str, phase: Phase | None, percent: float | None) -> None:
    hit = classify(line)
    assert (hit.phase if hit else None) == phase
    assert (hit.percent if hit else None) == percent


def test_the_simulated_engine_writes_the_same_phases_as_the_real_one() -> None:
    out = io.StringIO()
    log = Logger(stream=out)
    opts = parse_serve(load_schema("0.32.0"), ["tiny", "--max-model-len", "4096"], {})
    startup.distributed_init(log, opts)
    startup.load(log, opts, Knobs.from_env({"K3LAUNCH_SIM_LOAD_S": "0.01"}), threading.Event(), 0.0)
    log.info("Starting vLLM server on http://127.0.0.1:8000", src="entry.py")
    log.uvicorn("Application startup complete.")
    sim = _phases(out.getvalue())
    # as a GPU engine goes: torch.compile in the profile run, the KV cache, then CUDA graph capture
    assert sim == [
        Phase.STARTING,
        Phase.WAITING_FOR_PEERS,
        Phase.LOADING_WEIGHTS,
        Phase.COMPILING,
        Phase.KV_CACHE,
        Phase.COMPILING,
        Phase.API_SERVER,
    ]
    real = _phases(REAL_LOG.read_text())
    assert [p for p in sim if p != Phase.COMPILING] == [p for p in real if p != Phase.COMPILING]  # the CPU build compiles elsewhere
    lines = out.getvalue().splitlines()
    shards = [h.percent for line in lines if (h := classify(line)) and h.phase == Phase.LOADING_WEIGHTS and h.percent is not None]
    assert shards == [float(f"{100 * i / startup.SHARDS:.0f}") for i in range(startup.SHARDS + 1)]  # shard by shard, as tqdm rounds


def test_a_process_never_moves_back_and_an_unfinished_line_is_not_taken_twice() -> None:
    plan = _plan()
    pid = plan.processes[0].id
    t = Tracker(plan, started=0.0)
    t.update(
        {pid: LogDelta("Starting to load model m...\n", "Loading safetensors checkpoint shards:  12% Completed | 1/8 [")}, (), "alive", 1.0
    )
    snap = t.update({pid: LogDelta("", "Loading safetensors checkpoint shards:  12% Completed | 1/8 [")}, (), "alive", 2.0)
    me = next(p for p in snap.processes if p.id == pid)
    assert (me.phase, me.percent, me.since) == (Phase.LOADING_WEIGHTS, 12.0, 1.0)  # the unfinished bar counts...
    assert me.last_line == "Starting to load model m..."  # ...but only a whole line is shown
    # a second engine of the same process starting later does not send it back
    t.update({pid: LogDelta("world_size=8 rank=1 local_rank=1 distributed_init_method=tcp://x:1 backend=nccl\n")}, (), "alive", 3.0)
    t.update({}, {pid}, "health", 4.0)
    spans = next(p for p in t.timeline(ready=True, now=5.0).processes if p.id == pid).phases
    assert [(s.phase, s.start, s.end) for s in spans] == [
        (Phase.STARTING, 0.0, 1.0),
        (Phase.LOADING_WEIGHTS, 1.0, 4.0),
        (Phase.HEALTHY, 4.0, 5.0),
    ]


def test_clean_keeps_the_last_redraw_without_colour_codes() -> None:
    assert clean("\x1b[32mINFO\x1b[0m a\r 10%|#  |\r 20%|## |\r") == "20%|## |"
    assert len(clean("x" * 1000)) == 300


# ---------------------------------------------------------------------- reading logs in the poll
def _sh(script: str) -> str:
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True, timeout=30).stdout


def test_the_poll_reads_each_log_from_where_it_left_off_whole_lines_only(tmp_path: Path) -> None:
    log = tmp_path / "serve-0.log"
    log.write_text("line one\nline two\nhalf")
    cur = logtail.LogCursor()
    rest, got = logtail.cut_sections("3141 up\n" + _sh(logread.log_from("serve-0", str(log), 0)))
    assert rest == "3141 up\n"
    first = cur.take("serve-0", got["serve-0"])
    assert first == LogDelta("line one\nline two\n", "half") and cur.offsets["serve-0"] == len("line one\nline two\n")
    with log.open("a") as f:
        f.write(" done\nnext\n")
    _, got = logtail.cut_sections(_sh(logread.log_from("serve-0", str(log), cur.offsets["serve-0"])))
    assert cur.take("serve-0", got["serve-0"]) == LogDelta("half done\nnext\n", "")
    _, got = logtail.cut_sections(_sh(logread.log_from("serve-0", str(log), cur.offsets["serve-0"])))
    assert cur.take("serve-0", got["serve-0"]) == LogDelta() and cur.offsets["serve-0"] == len("line one\nline two\nhalf done\nnext\n")
    _, got = logtail.cut_sections(_sh(logread.log_from("serve-0", str(tmp_path / "none.log"), 0)))
    assert got == {"serve-0": ""}  # no log yet


def test_the_local_runner_passes_vllms_crlf_lines_through_so_only_whole_lines_are_shown(tmp_path: Path) -> None:
    """vLLM ends the lines of a multi-line message with ``\\r\\n`` (its NewLineFormatter: the banner, the
    OpenMP binding). Decoded in text mode they became ``\\n``, the cursor fell a byte behind per such line,
    and the next poll began inside a line already read: "t -n", "ead.", "[1]" as the last log line."""
    data = REAL_LOG.read_bytes()
    assert b"\r\n" in data
    lines = data.splitlines(keepends=True)
    complete = {clean(line.decode()) for line in lines}
    plan = _plan()
    pid = plan.processes[0].id
    log = tmp_path / "serve-0.log"
    log.write_bytes(b"")
    cur, runner, t = logtail.LogCursor(), LocalRunner(), Tracker(plan, started=0.0)
    shown = []
    for i in range(0, len(lines), 4):
        with log.open("ab") as f:
            f.write(b"".join(lines[i : i + 4]))
        for _ in range(2):  # a poll that brings lines, then one that brings none
            out = runner.run(Target("n"), logread.log_from(pid, str(log), cur.offsets.get(pid, 0))).stdout
            snap = t.update({pid: cur.take(pid, logtail.cut_sections(out)[1][pid])}, (), "alive", now=float(i))
            shown.append(next(p.last_line for p in snap.processes if p.id == pid))
    assert cur.offsets[pid] == len(data)
    assert [s for s in shown if s not in complete] == []


# the sections polls read in one `up` of the real engine: the cursor a few bytes behind, so each began
# with the end of a line read before (shown as the last log line)
NOISY = ["t -n\n", "ead.\n", "[1]\r\n"]


@pytest.mark.parametrize("fragment", NOISY, ids=[f.strip() for f in NOISY])
def test_a_read_that_does_not_start_where_a_line_starts_skips_to_the_next_line(fragment: str) -> None:
    cur = logtail.LogCursor(offsets={"serve-0": 4096})
    nxt = "(APIServer pid=2156) INFO 12-01 18:29:09 [model.py:2152] Using max model len 512\n"
    assert cur.take("serve-0", fragment.rstrip("\r\n")) == LogDelta()  # no line start in sight: nothing is taken
    assert cur.offsets["serve-0"] == 4096
    assert cur.take("serve-0", fragment + nxt + "(APIServer pid=2156) INF") == LogDelta(nxt, "(APIServer pid=2156) INF")
    assert cur.offsets["serve-0"] == 4096 - 1 + len(fragment) + len(nxt)  # the read began a byte before the offset
    assert cur.take("serve-0", "\nnext\n") == LogDelta("next\n")  # led by the newline before it: where a line starts


def test_only_whole_lines_of_the_process_are_shown_never_job_control_or_an_unfinished_line() -> None:
    plan = _plan()
    pid = plan.processes[0].id
    t = Tracker(plan, started=0.0)
    line = "(APIServer pid=2156) INFO 12-01 18:29:09 [model.py:2152] Using max model len 512"
    noise = "[1] 12345\n[1]+  Done                    sleep 1\n[2]-  Exit 1                  false\n[3]+  Killed   x\n"
    snap = t.update({pid: LogDelta(f"{line}\n{noise}", "(APIServer pid=2156) WARNING 12-01 18:29:09 [system_utils.py:255] Found ulimi")},
                    (), "alive", 1.0)
    assert next(p.last_line for p in snap.processes if p.id == pid) == line
    assert clean("[1] 12345") == clean("[12]+  Terminated              vllm serve m") == ""
    assert clean("[1] reserved") == "[1] reserved"  # a log line that merely starts like one is shown


def test_container_lines_keep_their_carriage_returns_and_an_unfinished_one_waits() -> None:
    cur = logtail.LogCursor()
    bar = "\rLoading safetensors checkpoint shards:   0% Completed | 0/1 [00:00<?, ?it/s]"
    got = cur.take_container("d-0", f"2025-03-02T10:00:01Z {bar}\n2025-03-02T10:00:02Z (APIServer pid=1) WARNING Found ulimi")
    assert got == LogDelta(f"{bar}\n", "(APIServer pid=1) WARNING Found ulimi") and cur.since["d-0"] == "2025-03-02T10:00:01Z"
    got = cur.take_container("d-0", "2025-03-02T10:00:02Z (APIServer pid=1) WARNING Found ulimit -n\n")
    assert got == LogDelta("(APIServer pid=1) WARNING Found ulimit -n\n") and cur.since["d-0"] == "2025-03-02T10:00:02Z"


def test_an_answer_cut_short_yields_no_section_and_a_marker_mid_line_is_text() -> None:
    out = "1 up\n@@k3log a\nx @@k3log b\ny\n@@k3end a\n@@k3log b\npartial"
    rest, got = logtail.cut_sections(out)
    assert rest == "1 up\n" and got == {"a": "x @@k3log b\ny"}


def test_container_lines_are_taken_once_by_timestamp() -> None:
    cur = logtail.LogCursor()
    first = cur.take_container("d-0", "2025-03-02T10:00:01.5Z a\n2025-03-02T10:00:02.25Z b\n")
    again = cur.take_container("d-0", "2025-03-02T10:00:02.25Z b\n2025-03-02T10:00:03Z c\n")
    assert (first.text, again.text, cur.since["d-0"]) == ("a\nb\n", "c\n", "2025-03-02T10:00:03Z")


def test_a_shared_log_file_is_read_by_offset(tmp_path: Path) -> None:
    log = tmp_path / "p.log"
    log.write_bytes("é one\ntw".encode())
    cur = logtail.LogCursor()
    assert logtail.read_file(log, cur, "p") == LogDelta("é one\n", "tw")
    assert logtail.read_file(tmp_path / "missing.log", cur, "q") == LogDelta()


# ---------------------------------------------------------------------- how up shows it
def _snap(now: float, *procs: tuple[str, Phase, str]) -> BringUp:
    return BringUp(0.0, now, "alive", tuple(ProcessProgress(i, "node-1", "serve", ph, 0.0, 45.0, line) for i, ph, line in procs))


def test_plain_progress_is_a_line_per_phase_change_and_a_summary_every_ten_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(show_progress.time, "monotonic", lambda: clock[0])
    out = io.StringIO()
    view = show_progress.UpView(Console(file=out, width=80, soft_wrap=False))
    long = "Loading safetensors checkpoint shards:  45% Completed | 45/100 [03:12<03:55,  4.27s/it] " + "x" * 80
    assert not view.live_ok  # not a terminal: plain lines
    view.progress(_snap(1.0, ("serve-0", Phase.LOADING_WEIGHTS, long), ("serve-1", Phase.STARTING, "")))
    clock[0] += 5
    view.progress(_snap(6.0, ("serve-0", Phase.LOADING_WEIGHTS, long), ("serve-1", Phase.STARTING, "")))
    clock[0] += 5
    view.progress(_snap(11.0, ("serve-0", Phase.LOADING_WEIGHTS, long), ("serve-1", Phase.STARTING, "")))
    lines = out.getvalue().splitlines()
    assert len(lines) == 3, lines
    assert "serve-0 on node-1: loading weights 45% | " + long in lines[0]  # whole: never cut or wrapped at 80 columns
    assert "serve-1 on node-1: starting" in lines[1]
    # the summary: the process furthest behind first
    assert lines[2].endswith("progress   alive, 11s: serve-1 starting 11s; serve-0 loading weights 45% 11s"), lines[2]


def test_the_summary_counts_phases_when_there_are_many_processes() -> None:
    procs = [(f"p-{i}", Phase.LOADING_WEIGHTS, "") for i in range(30)] + [("p-30", Phase.WAITING_FOR_PEERS, "NCCL INFO Init START")]
    line = show_progress.summary(_snap(40.0, *procs))
    assert "30 loading weights" in line and "1 waiting for peers" in line and line.endswith("| p-30: NCCL INFO Init START")


def test_json_output_stays_quiet() -> None:
    out = io.StringIO()
    view = show_progress.UpView(Console(file=out), quiet=True)
    view.progress(_snap(1.0, ("serve-0", Phase.LOADING_WEIGHTS, "x")))
    assert out.getvalue() == ""


# ---------------------------------------------------------------------- bench
def test_bench_progress_is_read_from_the_clients_own_bar(tmp_path: Path) -> None:
    from k3launch.campaign import benchprogress

    real = "\r  0%|          | 0/200 [00:00<?, ?it/s]\r 45%|████▌     | 90/200 [00:10<00:12,  8.90it/s]"  # vLLM's tqdm
    assert benchprogress.parse("Initial test run completed.\n" + real) == (90, 200)
    assert benchprogress.parse("\r" + bar_line(3, 8, 1.5)) == (3, 8)  # k3launch's client draws the same
    assert benchprogress.parse("Traffic request rate: inf\n") is None
    out = io.StringIO()
    view = show_progress.BenchView(Console(file=out, width=80))
    view("c4-in128", None, 200, 0.5)
    view("c4-in128", 90, 200, 10.0)  # within ten seconds of the last line: not printed
    view("c4-in128", 200, 200, 20.0)
    view("c4-in128", 200, 200, 20.5)  # done once
    assert out.getvalue().splitlines() == [
        "bench c4-in128: ?/200 requests (not known until it ends), 0s elapsed",
        "bench c4-in128: 200/200 requests, 20s elapsed, done",
    ]
    assert show_progress.bench_line(50, 200, 10.0) == "50/200 requests, 10s elapsed, ETA 30s"


def test_slurm_polls_read_each_process_log_in_the_shared_log_dir_from_where_they_left_off(tmp_path: Path) -> None:
    from k3launch.deploy.slurm.client import JobInfo
    from k3launch.deploy.slurm.launch import SlurmLaunch
    from k3launch.deploy.state import StateStore
    from k3launch.models.selection import Selection
    from k3launch.planning.build import build_plan
    from k3launch.planning.inventory import Inventory
    from k3launch.planning.recipes import RecipeTree
    from k3launch.testing import FakeSlurm

    inv = Inventory.model_validate(
        {
            "name": "u",
            "backend": "slurm",
            "hardware": "b300",
            "engine": "sim",
            "defaults": {"runtime": "bare"},
            "slurm": {"container": "bare", "log_dir": str(tmp_path / "logs")},
        }
    )
    plan = build_plan(RecipeTree(), Selection(strategy="multi_node_tp", nodes=2), inventory=inv, name="u-prog")
    out = "k3launch: node 0 = k3n1 10.0.0.1\nk3launch: node 1 = k3n2 10.0.0.2\nk3launch: doctor: 2 node(s) ok\n"
    fake = FakeSlurm([JobInfo("42", "RUNNING", ["k3n1", "k3n2"])], steps={"serve-0": "k3n1", "serve-1": "k3n2"}, output=out)
    sl = SlurmLaunch(plan, inv, StateStore(tmp_path / "state"), client=fake)
    sl.start()
    logs = tmp_path / "logs" / "u-prog"
    (logs / "serve-0.log").write_text("world_size=16 rank=0 local_rank=0 distributed_init_method=tcp://a:1 backend=nccl\nStarting to")
    first = sl.poll(None)
    assert first.logs["serve-0"] == LogDelta(
        "world_size=16 rank=0 local_rank=0 distributed_init_method=tcp://a:1 backend=nccl\n", "Starting to"
    )
    assert first.logs["serve-1"] == LogDelta()  # its log is not there yet
    with (logs / "serve-0.log").open("a") as f:
        f.write(" load model m...\n")
    assert sl.poll(None).logs["serve-0"] == LogDelta("Starting to load model m...\n")
