"""Model weights on the nodes: is the model complete in each node's Hugging Face cache, how much
disk is free there, and the checks ``doctor`` (and so ``up``) makes of it.

Where a node keeps the model is where the engine will look for it:

* a model id (``moonshotai/Kimi-K3``): the hub cache ``<hub>/models--ORG--NAME/snapshots/<commit>/``
  (files are symlinks into ``blobs/``); ``<hub>`` is the node's ``hf_cache`` + ``/hub`` for
  containers (they mount it as their ``HF_HOME``), and for a bare engine its env's
  ``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``; the commit is the
  plan's ``--revision`` (default ``main``) through ``refs/<revision>``, or the revision itself
  when it is a commit hash;
* a local path (``/var/cache/k3launch/vllm-cpu/tiny-llama``): that directory.

Complete means ``config.json`` and every file the safetensors index names (or, without an index,
every ``*.safetensors`` file) is there with the right size: a safetensors file's size is fixed by
its own header (8 bytes of header length, the JSON header, then the tensors up to the largest
``data_offsets`` end), so a truncated download is caught without the hub. The check is one small
stdlib Python program run on the node, in the same round trip as the doctor's other checks.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping

from k3launch.models.plan import Host, Plan, is_container
from k3launch.models.reports import Check
from k3launch.models.weights import Checkpoint, State, Where, node_checkpoint, revision
from k3launch.render.words import path_word

OPT_IN = "K3LAUNCH_CHECK_WEIGHTS"  # a node env: "1" checks the simulated engine's weights too, "0" never checks
GB = 1e9
DEFAULT_HOME = "~/.cache/huggingface"  # huggingface_hub's HF_HOME when nothing says otherwise

# Runs on the node (python3 -c, any Python >= 3.6, stdlib only). argv: hub dir, model, revision.
CHECK_PY = r"""
import json, os, sys
hub, model, rev = [os.path.expanduser(a) for a in sys.argv[1:4]]
out = {"dir": "", "commit": "", "files": 0, "bytes": 0, "missing": [], "bad": [], "free": None, "error": "", "total": None}
if model.startswith(("/", "~", ".")):
    snap = os.path.expanduser(model)
else:
    repo = os.path.join(hub, "models--" + model.replace("/", "--"))
    commit = rev if len(rev) == 40 and all(c in "0123456789abcdef" for c in rev) else ""
    if not commit:
        try:
            commit = open(os.path.join(repo, "refs", rev)).read().strip()
        except OSError:
            out["error"] = "no refs/%s in %s" % (rev, repo)
    out["commit"] = commit
    snap = os.path.join(repo, "snapshots", commit) if commit else ""
p = snap or hub
while p and not os.path.isdir(p) and os.path.dirname(p) != p:
    p = os.path.dirname(p)
try:
    st = os.statvfs(p or "/")
    out["free"] = st.f_bavail * st.f_frsize
except OSError:
    pass
if snap and not os.path.isdir(snap):
    out["error"] = out["error"] or "no directory " + snap
elif snap:
    out["dir"] = snap
    index = os.path.join(snap, "model.safetensors.index.json")
    try:
        with open(index) as fh:
            data = json.load(fh)
        files = sorted(set(data["weight_map"].values()))
        total = (data.get("metadata") or {}).get("total_size")
        out["total"] = total if type(total) is int and total > 0 else None
    except OSError:
        files = sorted(f for f in os.listdir(snap) if f.endswith(".safetensors"))
    except (ValueError, KeyError, TypeError):
        files, out["error"] = [], "unreadable model.safetensors.index.json"
    if not files and not out["error"]:
        out["error"] = "no safetensors index or *.safetensors file in " + snap
    if not os.path.isfile(os.path.join(snap, "config.json")):
        out["missing"].append("config.json")
    for f in files:
        path = os.path.join(snap, f)
        try:
            size = os.stat(path).st_size
        except OSError:
            out["missing"].append(f)
            continue
        out["files"] += 1
        out["bytes"] += size
        try:
            with open(path, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                head = json.loads(fh.read(n)) if 0 < n < (1 << 30) else None
            want = 8 + n + max([v["data_offsets"][1] for k, v in head.items() if k != "__metadata__"] or [0])
        except Exception:
            want = None
        if want != size:
            out["bad"].append([f, size, want])
print("K3W " + json.dumps(out))
"""


def engine_env(plan: Plan, node: str) -> dict[str, str]:
    """The environment the node's engines get (the first engine process of the node)."""
    return next((p.env for p in plan.processes if p.node == node and p.role != "router"), {})


def where(plan: Plan, host: Host) -> Where:
    """Where the engine on ``host`` looks: containers mount the node's ``hf_cache`` as their
    ``HF_HOME``; a bare engine reads ``HF_HUB_CACHE`` or ``HF_HOME`` from its env, else the
    Hugging Face default."""
    if is_container(host.runtime) or host.runtime == "apptainer":
        return Where(plan.model, revision(plan), (host.hf_cache or DEFAULT_HOME).rstrip("/") + "/hub")
    env = engine_env(plan, host.name)
    hub = env.get("HF_HUB_CACHE") or (env.get("HF_HOME") or DEFAULT_HOME).rstrip("/") + "/hub"
    return Where(plan.model, revision(plan), hub)


def wanted(plan: Plan, node: str) -> str:
    """'' when ``up``'s doctor checks the node's weights; else why not (the skip's reason)."""
    opt = engine_env(plan, node).get(OPT_IN)
    if opt == "0":
        return f"the node's env sets {OPT_IN}=0"
    if plan.engine == "sim" and opt != "1":
        return f'simulated engine: it loads no weights (env {OPT_IN}: "1" checks them anyway)'
    return ""


def python_word(host: Host) -> str:
    """The node's interpreter as one shell word: the engine's venv, the inventory's ``python``, else python3."""
    return path_word(f"{host.venv.rstrip('/')}/bin/python" if host.venv else (host.python or "python3"))


word = path_word  # a path on the node as one shell word (``~/...`` expands there)


def check_command(host: Host, w: Where) -> str:
    """The shell text that prints the node's :class:`State` (one ``K3W {...}`` line)."""
    return f"{python_word(host)} -c {shlex.quote(CHECK_PY)} {word(w.hub)} {shlex.quote(w.model)} {shlex.quote(w.revision)} 2>&1"


def parse(out: str) -> State | None:
    """The :class:`State` in a command's output; None when the program did not run (no Python)."""
    for line in reversed(out.splitlines()):
        if line.startswith("K3W "):
            try:
                d = json.loads(line[4:])
                return State(
                    d["dir"],
                    d["commit"],
                    d["files"],
                    d["bytes"],
                    list(d["missing"]),
                    [(str(b[0]), int(b[1]), None if b[2] is None else int(b[2])) for b in d["bad"]],
                    d["free"],
                    d["error"],
                    d.get("total") if type(d.get("total")) is int else None,  # older k3launch programs did not report it
                )
            except (ValueError, KeyError, TypeError, IndexError):
                return None
    return None


def reported_checkpoint(plan: Plan, sections: Mapping[str, list[str]]) -> Checkpoint | None:
    """The checkpoint's size as the first node whose index gives it reported it (the nodes'
    ``weights`` sections, in plan order); None when none did."""
    for node, lines in sections.items():
        state = parse("\n".join(lines))
        if state is not None and state.total:
            return node_checkpoint(plan, state, node)
    return None


def fetch_hint(plan: Plan) -> str:
    rev = f" at {revision(plan)}" if revision(plan) != "main" else ""
    return (
        f"`k3launch weights fetch` with the options of this `up` brings {plan.model}{rev} to every node (from the hub; "
        "--from-path DIR or --from-node NODE copy it instead); or --exclude the node"
    )


def judge(plan: Plan, host: Host, lines: list[str]) -> list[Check]:
    """The ``weights`` and ``disk`` rows of one node from the ``weights`` section of its probe."""
    n = host.name
    w = where(plan, host)
    state = parse("\n".join(lines))
    if state is None:
        tail = lines[-1][:160] if lines else "no output"
        return [
            Check(
                n,
                "weights",
                "fail",
                f"cannot check {w.model} here: {tail}",
                code="weights-missing",
                hint=f"the check runs {python_word(host)} on {n}: install python3 there, or set the node's `python:`",
            )
        ]
    ck = node_checkpoint(plan, state, n)  # the bytes of the checkpoint, not the GPU memory (with headroom) that holds it
    need = ck.gb
    free = f"{state.free / GB:,.0f} GB free" if state.free is not None else "free space unknown"
    if state.complete:
        rows = [
            Check(
                n, "weights", "pass", f"{w.model}@{w.revision} complete in {state.dir}: {state.files} file(s), {state.bytes / GB:,.1f} GB"
            )
        ]
        return [*rows, Check(n, "disk", "pass", f"{free} beside the model")]
    where_ = state.dir or w.repo_dir
    if plan.stage is not None:  # `up` copies it there before its doctor: only a standalone doctor sees this
        rows = [Check(n, "weights", "warn", f"{w.model}@{w.revision} not staged in {where_} yet ({state.problem()}): "
                      f"`up` copies it from {plan.stage.source} first")]
    else:
        rows = [Check(n, "weights", "fail", f"{w.model}@{w.revision} not complete in {where_}: {state.problem()}", code="weights-missing",
                      hint=fetch_hint(plan))]
    if state.free is None:
        return [*rows, Check(n, "disk", "skip", f"free space of {w.hub} not reported")]
    short = state.free + state.bytes < need * GB
    return [
        *rows,
        Check(
            n,
            "disk",
            "fail" if short else "pass",
            f"{free} for {w.hub}; the model needs {need:,.0f} GB ({ck.source})",
            hint=f"free space on {n}, or point the node's hf_cache at a larger disk" if short else "",
        ),
    ]
