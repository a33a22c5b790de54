"""``weights check`` and ``weights fetch``: the plan's model on every engine node.

``check`` runs :data:`k3launch.deploy.ssh.weights.CHECK_PY` on every engine node at once (one
round trip each). ``fetch`` brings the model to the nodes that do not have it complete, all in
parallel, from one of three sources:

* ``hub``: ``huggingface_hub.snapshot_download`` run on each node by the node's Python (the
  engine's venv, the inventory's ``python``, else ``python3``), into the node's hub cache, with
  the ``HF_*`` settings and proxies of the node's engine env (a mirror's ``HF_ENDPOINT``). The
  token never travels: the inventory's ``hf_token_file`` is a path on the nodes, handed to the
  hub client as ``HF_TOKEN_PATH`` (the file is read there, by the client);
* ``path``: a directory every node sees (a shared filesystem) holding the hub cache
  (``models--ORG--NAME`` in it, or in its ``hub/``), or, for a model given as a local directory,
  a copy of that directory; ``cp -a`` on each node, symlinks kept;
* ``node``: another node of the plan that has the model complete; a ``tar`` stream from it to
  each node, relayed through this machine over the same SSH connections (no node-to-node keys).

While they run, every ``interval`` seconds one ``du`` per node reports the bytes there, and
``on_progress`` gets the sum (the CLI prints one line). Each node is checked again at the end.
"""

from __future__ import annotations

import shlex
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from k3launch.deploy.ssh import weights as w
from k3launch.deploy.ssh.launch import run_host
from k3launch.errors import K3Error
from k3launch.models.plan import Plan
from k3launch.models.weights import FetchProgress, NodeWeights, Source, Where, estimated, node_checkpoint
from k3launch.transport.fleet import Fleet

FETCH_TIMEOUT_S = 24 * 3600.0  # a 1.5 TB model over a slow link: hours, not forever
CHECK_TIMEOUT_S = 120.0


@dataclass
class _Tally:
    finished: set[str] = field(default_factory=set)
    errors: dict[str, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


def engine_nodes(plan: Plan) -> list[str]:
    return list(dict.fromkeys(p.node for p in plan.processes if p.role != "router"))


def check(plan: Plan, fleet: Fleet, nodes: list[str] | None = None) -> list[NodeWeights]:
    """The model's state on each engine node (or ``nodes``), in parallel."""
    nodes = nodes if nodes is not None else engine_nodes(plan)
    hosts = {n: run_host(fleet, n) for n in nodes}
    spots = {n: w.where(plan, hosts[n]) for n in nodes}
    out = fleet.run_many({n: w.check_command(hosts[n], spots[n]) for n in nodes}, timeout=CHECK_TIMEOUT_S)
    rows = []
    for n in nodes:
        o = out[n]
        if isinstance(o, K3Error):
            rows.append(NodeWeights(n, spots[n], None, o.message))
            continue
        state = w.parse(o.stdout)
        why = "" if state is not None else f"{w.python_word(hosts[n])} could not run the check: {(o.stdout + o.stderr).strip()[-160:]}"
        rows.append(NodeWeights(n, spots[n], state, why))
    return rows


def fetch_command(plan: Plan, fleet: Fleet, node: str, src: Source) -> str:
    """What brings the model onto ``node`` from ``src`` (hub or path; a node source is a stream)."""
    host = run_host(fleet, node)
    spot = w.where(plan, host)
    if src.kind == "hub":
        if spot.local:
            raise K3Error(
                "bad-source",
                f"{plan.model} is a local directory, not a hub model: nothing to download",
                "copy it: --from-path DIR (a directory the nodes share) or --from-node NODE",
            )
        token = ""
        if src.token_file:  # the client reads the file on the node; the token is never on a command line
            tok = w.word(src.token_file)
            token = f"if [ -r {tok} ]; then export HF_TOKEN_PATH={tok}; fi; "
        prog = (
            "import sys\nfrom huggingface_hub import snapshot_download\n"
            "print('K3F', snapshot_download(repo_id=sys.argv[1], revision=sys.argv[2], cache_dir=sys.argv[3]))"
        )
        # the hub settings the node's engines get (a mirror's HF_ENDPOINT, a proxy) apply to the download too
        env = {k: v for k, v in w.engine_env(plan, node).items() if k.startswith(("HF_", "HUGGINGFACE_")) or k.lower().endswith("_proxy")}
        exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in sorted(env.items()) if k not in ("HF_HOME", "HF_HUB_CACHE"))
        return (
            f"{token}{exports}export HF_HUB_DISABLE_PROGRESS_BARS=1; mkdir -p {w.word(spot.hub)} && {w.python_word(host)} "
            f"-c {shlex.quote(prog)} {shlex.quote(spot.model)} {shlex.quote(spot.revision)} {w.word(spot.hub)} 2>&1"
        )
    if src.kind == "path":
        base = w.word(src.path.rstrip("/") or "/")
        if spot.local:
            dst = w.word(spot.model)
            return f"[ -d {base} ] || {{ echo {shlex.quote('k3: no directory ' + src.path)}; exit 3; }}; mkdir -p {dst} && cp -a {base}/. {dst}/ 2>&1"
        repo = spot.repo_dir.rsplit("/", 1)[1]
        name = shlex.quote(repo)
        return (  # the path is the user's: quoted in the message too
            f"if [ -d {base}/{name} ]; then s={base}/{name}; elif [ -d {base}/hub/{name} ]; then s={base}/hub/{name}; "
            f"else echo {shlex.quote(f'k3: no {repo} in {src.path} or {src.path}/hub')}; exit 3; fi; "
            f'mkdir -p {w.word(spot.hub)} && cp -a "$s" {w.word(spot.hub)}/ 2>&1'
        )
    raise ValueError(src.kind)


def _stream(fleet: Fleet, src: str, src_cmd: str, dst: str, dst_cmd: str, timeout: float) -> str:
    """Pipe ``src_cmd``'s output on node ``src`` into ``dst_cmd`` on node ``dst``; '' or why it failed.

    Nodes that are this machine are a local pipeline. Remote nodes ride the runner's open,
    host-key-checked connections: one exec channel on each, bytes relayed through this machine."""
    s, d = fleet.target(src), fleet.target(dst)
    if s.local and d.local:
        r = subprocess.run(["bash", "-c", f"set -o pipefail; ({src_cmd}) | ({dst_cmd})"], capture_output=True, text=True, timeout=timeout)
        return "" if r.returncode == 0 else (r.stderr or r.stdout).strip()[-300:] or f"exit {r.returncode}"
    if s.local or d.local:
        return "copying between this machine and a remote node: use --from-path"
    runner: Any = fleet.remote
    chans = []
    for t, cmd in ((s, src_cmd), (d, dst_cmd)):
        transport = runner._connection(t).client.get_transport()  # the runner's own connection (keepalives, host keys)
        ch = transport.open_session(timeout=runner.connect_timeout)
        ch.settimeout(timeout)
        ch.exec_command(f"bash -c {shlex.quote(cmd)}")
        chans.append(ch)
    out, into = chans
    try:
        while chunk := out.recv(1 << 20):
            into.sendall(chunk)
        into.shutdown_write()
        rc_out, rc_in = out.recv_exit_status(), into.recv_exit_status()
    finally:
        errs = [c.recv_stderr(4096).decode(errors="replace") if c.recv_stderr_ready() else "" for c in chans]
        for c in chans:
            c.close()
    if rc_out or rc_in:
        return f"tar on {src} exited {rc_out}, on {dst} {rc_in}: {' '.join(e.strip() for e in errs if e.strip())[-300:]}"
    return ""


def _tar_commands(spot_src: Where, spot_dst: Where) -> tuple[str, str]:
    """tar of the model's directory on the source node, and its unpacking on a target."""
    if spot_src.local:
        src, dst = w.word(spot_src.model), w.word(spot_dst.model)
        return f"tar -C {src} -cf - .", f"mkdir -p {dst} && tar -C {dst} -xf -"
    name = shlex.quote(spot_src.repo_dir.rsplit("/", 1)[1])
    return f"tar -C {w.word(spot_src.hub)} -cf - {name}", f"mkdir -p {w.word(spot_dst.hub)} && tar -C {w.word(spot_dst.hub)} -xf -"


def _du(fleet: Fleet, spots: dict[str, Where]) -> int:
    cmds = {n: f"du -sk {w.word(s.repo_dir)} 2>/dev/null | cut -f1" for n, s in spots.items()}
    total = 0
    for o in fleet.run_many(cmds, timeout=60).values():
        if not isinstance(o, K3Error) and o.stdout.strip().isdigit():
            total += int(o.stdout.strip()) * 1024
    return total


def fetch(
    plan: Plan,
    fleet: Fleet,
    src: Source,
    on_progress: Callable[[FetchProgress], None] | None = None,
    interval: float = 10.0,
    timeout: float = FETCH_TIMEOUT_S,
) -> list[NodeWeights]:
    """Bring the model to every engine node that lacks it; the state of every node afterwards."""
    before = check(plan, fleet)
    todo = [r for r in before if not r.complete and r.error == ""]
    origin: NodeWeights | None = None
    if src.kind == "node":
        origin = next((r for r in before if r.node == src.node), None)
        if origin is None and src.node in fleet.nodes():  # a node of the plan that runs no engine (the router's)
            origin = check(plan, fleet, [src.node])[0]
        if origin is None or not origin.complete:
            why = "not a node of this plan" if origin is None else (origin.error or (origin.state.problem() if origin.state else ""))
            raise K3Error(
                "bad-source",
                f"--from-node {src.node}: the model is not complete there ({why})",
                "pick a node `k3launch weights check` reports complete, or --from-path / the hub",
            )
        todo = [r for r in todo if r.node != src.node]
    # the copy's size: the source's files; else the checkpoint as a node's index gives it, else the recipe's estimate
    ck = next((node_checkpoint(plan, r.state, r.node) for r in before if r.state is not None and r.state.total), estimated(plan))
    per_node = (origin.state.bytes if origin is not None and origin.state else 0) or int(ck.gb * w.GB)
    tally = _Tally()
    t0 = time.monotonic()

    def one(r: NodeWeights) -> None:
        try:
            if origin is not None:
                a, b = _tar_commands(origin.where, r.where)
                why = _stream(fleet, src.node, a, r.node, b, timeout)
            else:
                res = fleet.run(r.node, fetch_command(plan, fleet, r.node, src), timeout=timeout)
                why = "" if res.exit_code == 0 else (res.stdout + res.stderr).strip()[-300:] or f"exit {res.exit_code}"
        except K3Error as exc:
            why = exc.message
        except Exception as exc:  # a broken stream: say which node, go on with the others
            why = f"{type(exc).__name__}: {exc}"
        with tally.lock:
            tally.finished.add(r.node)
            if why:
                tally.errors[r.node] = why

    if todo:
        if src.kind != "node":
            fetch_command(plan, fleet, todo[0].node, src)  # refuses a source that cannot work before anything starts
        with ThreadPoolExecutor(max_workers=min(len(todo), fleet.concurrency)) as pool:
            futures = [pool.submit(one, r) for r in todo]
            spots = {r.node: r.where for r in todo}
            while not all(f.done() for f in futures):
                if on_progress is not None:
                    on_progress(FetchProgress(_du(fleet, spots), per_node * len(todo), len(tally.finished), len(todo), time.monotonic() - t0))
                for _ in range(max(1, int(interval / 0.1))):
                    if all(f.done() for f in futures):
                        break
                    time.sleep(0.1)
        if on_progress is not None:
            on_progress(
                FetchProgress(_du(fleet, {r.node: r.where for r in todo}), per_node * len(todo), len(todo), len(todo), time.monotonic() - t0)
            )
    after = {r.node: r for r in check(plan, fleet, [r.node for r in todo])} if todo else {}
    rows = []
    for r in before:
        if r.node in after:
            a = after[r.node]
            rows.append(NodeWeights(r.node, a.where, a.state, tally.errors.get(r.node, a.error), fetched=True))
        else:
            rows.append(r)
    return rows
