"""``k3launch bench``: one load point against a live deployment, read back from vLLM's result JSON.

Where the client runs:

* ``engine`` — vLLM's own client from the engine's environment, on the head node, through the
  deployment's fleet (SSH or local): ``<runtime> exec <head container> vllm bench serve ...``
  (the engine image ships the client, tokenizer included), then ``<runtime> cp`` of the result
  file it wrote inside the container and ``cat`` of it on the node; for a real vLLM on a bare
  runtime, ``vllm bench serve`` of the node's ``venv`` (or PATH), its result in a temporary
  directory on the node, then ``cat``.
* ``local`` — ``python -m k3launch.sim bench serve ...`` on this machine: the same command line
  and JSON from k3launch's stdlib client, for deployments without a container (bare runtimes,
  the simulated engine) or whose endpoint the head node cannot reach.

``auto`` takes ``engine`` when the head engine runs vLLM itself — in a docker/podman container, or
a real vLLM (``engine: vllm``) on a bare runtime — and the public endpoint is reachable from the
head node, else ``local`` (the simulated engine, a router bound to the login node's 127.0.0.1). The figures are always parsed from
the result JSON, never from the printed summary.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from k3launch import api
from k3launch.campaign import benchprogress
from k3launch.campaign import power as powermod
from k3launch.campaign.benchprogress import BenchProgressFn
from k3launch.campaign.energy import Energy
from k3launch.errors import K3Error
from k3launch.models.backends import spec
from k3launch.models.bench import BenchMetrics, LoadPoint, bench_argv
from k3launch.models.plan import is_container
from k3launch.render.words import venv_path

if TYPE_CHECKING:
    from k3launch.models.plan import Process
    from k3launch.models.record import DeploymentRecord
    from k3launch.transport.fleet import Fleet

CONTAINER_RESULT_DIR = "/tmp/k3launch-bench"  # inside the head container


@dataclass(frozen=True)
class BenchRun:
    client: str  # local | engine
    started: str
    ended: str
    result_file: Path | None
    log_file: Path | None
    metrics: BenchMetrics | None
    error: str | None  # why there are no figures (the client failed, the JSON is unreadable)
    # True when a timed-out client could not be stopped: it may still load the deployment, so no
    # further load point against it would measure what it claims
    stray: bool = False
    energy: Energy | None = None  # the GPUs' energy over the run (k3launch.campaign.power), with figures only


@dataclass(frozen=True)
class EngineFacts:
    """What the running deployment says about itself (None where it cannot tell)."""

    vllm_version: str | None
    runtime: str
    image: str | None
    image_id: str | None


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def record(name: str, state_dir: str | Path | None = None) -> DeploymentRecord:
    for rec in api.deployments(state_dir):
        if rec.name == name:
            return rec
    known = ", ".join(r.name for r in api.deployments(state_dir)) or "none"
    raise K3Error("unknown-deployment", f"no deployment named {name!r}", f"deployments: {known} (`k3launch list`)")


def result_dir(name: str, state_dir: str | Path | None = None, out: Path | None = None) -> Path:
    """Where ``bench`` writes its result JSON and client log: ``out`` when given, else
    ``<state-dir>/bench/<deployment>/`` — never the current directory unless asked."""
    if out is not None:
        return out
    return api.bench_dir(name, state_dir)


def head(rec: DeploymentRecord) -> Process:
    """The engine process whose container runs the client: the first HTTP head (serve, else prefill)."""
    engines = [p for p in rec.plan.processes if p.role != "router" and p.head and p.http_port is not None]
    if not engines:
        raise K3Error("no-head", f"{rec.name}: the plan has no engine head with an HTTP port", "check `k3launch status`")
    return engines[0]


def served_name(proc: Process) -> str | None:
    """The first ``--served-model-name`` of an engine's argv (requests must use it), if any."""
    argv = proc.argv
    for i, a in enumerate(argv):
        if a == "--served-model-name" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--served-model-name="):
            return a.split("=", 1)[1] or None
    return None


def _loopback(url: str) -> bool:
    host = urllib.parse.urlsplit(url).hostname or ""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _bare_vllm(rec: DeploymentRecord, runtime: str) -> bool:
    """A real vLLM straight on the node (not the simulated engine): its environment has the client."""
    return runtime == "bare" and rec.plan.engine == "vllm"


def choose_client(rec: DeploymentRecord, mode: str) -> str:
    h = head(rec)
    runtime = rec.processes[h.id].runtime if h.id in rec.processes else "bare"
    in_container = is_container(runtime) or _bare_vllm(rec, runtime)
    reachable = spec(rec.plan.backend).this_machine or not _loopback(rec.endpoint)  # a login-node router on 127.0.0.1 is not
    if mode == "engine":
        if not in_container:
            raise K3Error("no-container", f"{rec.name}: the head engine runs {runtime}, not in a container, and is not a real vLLM "
                          "with its own client (the simulated engine)", "use --client local")
        if not reachable:
            raise K3Error("endpoint-unreachable", f"{rec.name}: {rec.endpoint} is a login-node address the head node cannot reach",
                          "use --client local")
        return "engine"
    if mode == "local":
        return "local"
    return "engine" if in_container and reachable else "local"


def run(rec: DeploymentRecord, load: LoadPoint, *, out_dir: Path, tag: str, client: str = "auto", seed: int = 0,
        range_ratio: float = 0.0, warmups: int = 0, timeout_s: float = 3600.0, power: bool = True,
        percentiles: str = "50,99", on_progress: BenchProgressFn | None = None) -> BenchRun:
    """Run one load point; a client failure is a BenchRun with ``error`` (the caller decides).
    ``power``: sample the GPUs' power on every node meanwhile (:mod:`k3launch.campaign.power`).
    ``on_progress``: requests done of total while it runs (:mod:`k3launch.campaign.benchprogress`)."""
    mode = choose_client(rec, client)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise K3Error("bad-result-dir", f"{out_dir}: {exc.strerror or exc}", "choose a directory you can write (created if missing)") from None
    result = out_dir / f"{tag}.json"
    log = out_dir / f"{tag}.log"
    result.unlink(missing_ok=True)  # never read an earlier attempt's figures
    sampler = powermod.start(rec) if power else None  # its first reading precedes the client's start
    started, t0 = now_iso(), time.time()
    kw = {"base_url": rec.endpoint, "model": rec.plan.model, "served_name": served_name(head(rec)), "seed": seed, "range_ratio": range_ratio, "warmups": warmups,
          "result_filename": result.name, "percentiles": percentiles}
    stray = False
    progress = (tag, load.num_prompts, on_progress) if on_progress is not None else None
    try:
        if mode == "local":
            error = _run_local(bench_argv(load, result_dir=str(out_dir), **kw), log, timeout_s, progress)  # type: ignore[arg-type]
        else:
            c = _engine_client(rec, result)
            with benchprogress.Heartbeat(progress[2], tag, load.num_prompts) if progress else contextlib.nullcontext():
                error, stray = _run_engine(rec, c, bench_argv(load, result_dir=c.result_dir, **kw), result, log, timeout_s)  # type: ignore[arg-type]
            if progress:
                benchprogress.report(progress[2], tag, log, load.num_prompts, time.time() - t0)
    except BaseException:
        powermod.finish(sampler, t0, time.time(), None, out_dir / f"{tag}.power.csv")  # stops it (Ctrl-C, SIGTERM)
        raise
    t1 = time.time()
    metrics = None
    if error is None:
        metrics, error = read_result(result)
    energy = powermod.finish(sampler, t0, t1, metrics, out_dir / f"{tag}.power.csv")
    return BenchRun(mode, started, now_iso(), result if result.is_file() else None, log, metrics, error, stray, energy)


def read_result(path: Path) -> tuple[BenchMetrics | None, str | None]:
    try:
        return BenchMetrics.model_validate(json.loads(path.read_text(encoding="utf-8"))), None
    except FileNotFoundError:
        return None, f"the client wrote no result file ({path.name})"
    except (ValueError, ValidationError) as exc:
        return None, f"unreadable result JSON {path.name}: {str(exc).splitlines()[0]}"


def _tail(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def _run_local(argv: list[str], log: Path, timeout_s: float, progress: tuple[str, int, BenchProgressFn] | None = None) -> str | None:
    cmd = [sys.executable, "-m", "k3launch.sim", "bench", "serve", *argv]
    with log.open("w", encoding="utf-8") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        # its own session: a timeout or Ctrl-C stops the client and everything it started, so no
        # stray load reaches the deployment's next load point
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            if progress is None:
                p.wait(timeout=timeout_s)
            else:
                benchprogress.wait_watching(p, log, timeout_s, *progress)
        except subprocess.TimeoutExpired:
            _kill_group(p)
            return f"the benchmark client did not finish within {timeout_s:g}s"
        except BaseException:
            _kill_group(p)
            raise
    if p.returncode != 0:
        return f"the benchmark client exited {p.returncode}: {_tail(log.read_text(encoding='utf-8'))}"
    return None


def _kill_group(p: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
    p.wait()


@dataclass(frozen=True)
class _EngineClient:
    """vLLM's own client on the head node: how to run it, stop it, and read what it wrote."""

    node: str
    result_dir: str  # where the client writes (in the head container, or a directory of its own on the node)
    run: str  # the client's command line on the node (argv appended)
    stop: str  # stops a timed-out client by its unique result name (the node's `pkill`)
    fetch: str  # prints the result JSON on stdout (and cleans up)
    where: str  # the result, for messages


def _engine_client(rec: DeploymentRecord, result: Path) -> _EngineClient:
    h = head(rec)
    pr = rec.processes[h.id]
    if _bare_vllm(rec, pr.runtime):
        host = next(x for x in rec.plan.hosts if x.name == h.node)
        tmp = f"/tmp/k3launch-bench-{rec.name}-{result.stem}"
        env = " ".join(["env", *venv_path(host.venv)]) + " " if host.venv else ""
        return _EngineClient(h.node, tmp, f"mkdir -p {shlex.quote(tmp)} && {env}vllm bench serve", f"pkill -INT -f {shlex.quote(tmp)}",
                             f"cat {shlex.quote(tmp + '/' + result.name)}; rc=$?; rm -rf {shlex.quote(tmp)}; exit $rc",
                             f"{tmp}/{result.name} on {h.node}")
    ex = f"{shlex.quote(pr.runtime)} exec {shlex.quote(pr.handle)}"
    inner = f"{CONTAINER_RESULT_DIR}/{result.name}"
    # `<runtime> cp` to the node, then cat there: engine images need not ship cat (or a shell)
    tmp = shlex.quote(f"/tmp/k3launch-bench-{result.name}")
    fetch = f"{shlex.quote(pr.runtime)} cp {shlex.quote(f'{pr.handle}:{inner}')} {tmp} && cat {tmp}; rc=$?; rm -f {tmp}; exit $rc"
    # after a timeout the exec client on the node is gone, the benchmark inside the container is
    # not: stop it by its unique result file name (images without pkill cannot be helped)
    return _EngineClient(h.node, CONTAINER_RESULT_DIR, f"{ex} vllm bench serve", f"{ex} pkill -INT -f {shlex.quote(result.name)}", fetch,
                         f"{inner} in the head container on {h.node}")


def _run_engine(rec: DeploymentRecord, c: _EngineClient, argv: list[str], result: Path, log: Path, timeout_s: float) -> tuple[str | None, bool]:
    """(error, stray): ``stray`` when a timed-out client could not be stopped."""
    cmd = f"{c.run} {shlex.join(argv)}"
    with api.fleet(rec) as fleet:
        return _engine_round(fleet, c, cmd, result, log, timeout_s)


def _engine_round(fleet: Fleet, c: _EngineClient, cmd: str, result: Path, log: Path, timeout_s: float) -> tuple[str | None, bool]:
    try:
        r = fleet.run(c.node, f"{cmd} 2>&1", timeout=timeout_s)
        log.write_text(f"$ {cmd}\n{r.stdout}{r.stderr}", encoding="utf-8")
        if r.exit_code == 124:
            stop = fleet.run(c.node, c.stop, timeout=30)
            return f"vllm bench serve on {c.node} did not finish within {timeout_s:g}s", stop.exit_code not in (0, 1)
        if not r.ok:
            return f"vllm bench serve on {c.node} exited {r.exit_code}: {_tail(r.stdout + r.stderr)}", False
        got = fleet.run(c.node, c.fetch, timeout=60)
        if not got.ok:
            return f"cannot read {c.where}: {_tail(got.stderr)}", False
        result.write_text(got.stdout, encoding="utf-8")
        return None, False
    except K3Error as exc:
        return f"{c.node}: {exc.message}", False


def engine_facts(rec: DeploymentRecord) -> EngineFacts:
    """vLLM's own ``/version`` of the head engine, and the container image id where there is one."""
    h = head(rec)
    version = None
    with contextlib.suppress(OSError, ValueError):
        with urllib.request.urlopen(f"http://{h.address}:{h.http_port}/version", timeout=5) as r:
            said = json.loads(r.read().decode() or "{}").get("version")
            version = str(said) if said else None
    pr = rec.processes.get(h.id)
    runtime = pr.runtime if pr else "bare"
    image_id = None
    if pr is not None and is_container(runtime):
        with api.fleet(rec) as fleet:
            try:
                r = fleet.run(h.node, f"{shlex.quote(runtime)} inspect --format '{{{{.Image}}}}' {shlex.quote(pr.handle)}", timeout=30)
                image_id = (r.stdout.strip() or None) if r.ok else None
            except K3Error:
                image_id = None
    return EngineFacts(version, runtime, h.image if is_container(runtime) else None, image_id)
