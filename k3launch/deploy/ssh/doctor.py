"""The ``doctor`` stage: check every node before anything starts.

One shell round trip per node collects everything, then Python judges it:

* reachable (the command ran at all);
* GPUs: model and count from ``nvidia-smi``/``rocm-smi`` match the plan — *skipped* (never
  passed) when the engine is the simulated one, or the platform is ``cpu`` (vLLM's CPU build);
* the runtime (and for containers the image) is present; ``vllm-router`` on the router's host;
  on a bare runtime ``vllm`` is found (in the node's ``venv`` when it names one);
* the engine's version (``engine: vllm``): on a bare runtime, the version of the ``vllm``
  distribution in the interpreter of the ``vllm`` script (what ``vllm --version`` prints, without
  its ~7 s import of vLLM; ``vllm --version`` when that cannot be asked);
  ``<rt> run --rm --entrypoint vllm IMAGE --version`` for docker/podman when the image is there; its release (local tags like ``+cpu`` aside) must be the plan's ``vllm_version``, the
  schema the plan was written against — else the node is refused, with the fix in the hint;
* the directories ``up`` makes before a start can be made or written: a container's hf_cache
  (its bind source) and every engine's compile-cache directory (:mod:`k3launch.deploy.ssh.binds`);
* every planned port of the node's address is free;
* no leftover engine: no process or container marked by k3launch whose deployment is not live
  (or that carries this deployment's own name) — only a warning on a router-only host (the
  login node is shared: other deployments' routers hold no GPU, and their ports are checked),
  and on the ``local`` backend, whose nodes are all this one machine, only this deployment's own
  name counts unless the plan needs the machine's GPUs (other deployments there are a warning);
* no stale vLLM/NCCL files in ``/dev/shm`` (a warning);
* the GPUs, the RDMA fabric, ``/dev/shm``, memlock, NIC, MTU and clocks
  (:mod:`k3launch.deploy.ssh.preflight`);
* the model's weights complete in the node's Hugging Face cache, and the disk free beside them
  (:mod:`k3launch.deploy.ssh.weights`): for the real engine, or the simulated one when the
  node's env sets ``K3LAUNCH_CHECK_WEIGHTS=1``. A node without them refuses ``up`` with
  ``weights-missing`` instead of a wait until the readiness deadline.

The probe runs with the ``PATH`` the node's engines get: k3launch's own programs first on this
machine, then the ``PATH`` the inventory's ``env`` gives the node, then the login shell's.
"""

from __future__ import annotations

import re
import shlex
import time
from collections.abc import Iterable

from k3launch.deploy.ssh import binds, preflight
from k3launch.deploy.ssh import weights as model_weights
from k3launch.deploy.ssh.gpus import FAIL, PASS, SKIP, WARN
from k3launch.deploy.ssh.launch import router_install_hint, run_host, tools_dir
from k3launch.errors import K3Error
from k3launch.models.plan import Host, Plan, is_container
from k3launch.models.reports import Check, DoctorReport
from k3launch.render import snippets as remote
from k3launch.render.words import path_word
from k3launch.transport.fleet import Fleet

PROBE_TIMEOUT_S = 60.0
VERSION_TIMEOUT_S = 120  # one `vllm --version` (a bare runtime: ~7 s; a container adds its start)
_VERSION = re.compile(r"v?(\d+\.\d+[0-9A-Za-z.+_-]*)")


def _bounded(cmd: str, seconds: int) -> str:
    """``cmd`` under ``timeout`` when the node has it; prints ``rc N`` then the output's last lines."""
    return (
        f"if command -v timeout >/dev/null 2>&1; then k3v=$(timeout {seconds} {cmd} 2>&1); else k3v=$({cmd} 2>&1); fi; "
        'echo "rc $?"; printf \'%s\\n\' "$k3v" | tail -n 5'
    )


def _venv_bin(venv: str) -> str:
    """``<venv>/bin`` as one shell word (``~/...`` expands on the node)."""
    return path_word(venv.rstrip("/") + "/bin")


# What `vllm --version` prints is the version of the `vllm` distribution in the interpreter of the
# `vllm` script: ask that interpreter (its shebang) directly, in ~40 ms, instead of importing vLLM
# (~7 s on two cores); `vllm --version` itself when that cannot be done.
VERSION_CMD = "bash -c " + shlex.quote(
    'v=$(command -v vllm) && read -r l < "$v" && p=${l#\\#!} && [ "$p" != "$l" ] '
    "&& $p -c \"import importlib.metadata as m; print(m.version('vllm'))\" 2>/dev/null || vllm --version"
)


def _bare_vllm(venv: str | None) -> tuple[str, str]:
    """The runtime and version probes of a bare ``vllm``: with a venv, its ``bin/`` first on PATH."""
    if not venv:
        return (
            "command -v vllm >/dev/null 2>&1 && echo ok || echo missing",
            f"if command -v vllm >/dev/null 2>&1; then {_bounded(VERSION_CMD, VERSION_TIMEOUT_S)}; fi",
        )
    bindir = _venv_bin(venv)
    return (
        f"[ -x {bindir}/vllm ] && echo ok || echo missing",
        f'if [ -x {bindir}/vllm ]; then (PATH={bindir}:"$PATH"; {_bounded(VERSION_CMD, VERSION_TIMEOUT_S)}); fi',
    )


def _probe_script(plan: Plan, host: Host, router_only: bool) -> str:
    parts = [preflight.section("listening", remote.LISTENING), preflight.section("procs", remote.find_any_deployment())]
    ports = [u.port for u in plan.ports if u.node == host.name]
    if ports:  # who holds a planned port that is taken: the hint names it
        parts.append(preflight.section("holders", remote.port_holders(ports)))
    if router_only:
        parts.append(preflight.section("runtime", "command -v vllm-router >/dev/null 2>&1 && echo ok || echo missing"))
        return "".join(parts)
    rt = host.runtime
    if is_container(rt) or rt == "apptainer":
        q = shlex.quote(rt)
        check = f"command -v {q} >/dev/null 2>&1 && echo ok || echo missing"
        parts.append(preflight.section("runtime", check))
        image = next((p.image for p in plan.processes if p.node == host.name and p.image), None)
        if image and is_container(rt):
            parts.append(preflight.section("image", f"{q} image inspect {shlex.quote(image)} >/dev/null 2>&1 && echo ok || echo missing"))
            if plan.engine == "vllm":  # only an image that is there: never pull from here
                run = f"{q} run --rm --entrypoint vllm {shlex.quote(image)} --version"
                parts.append(
                    preflight.section(
                        "version", f"if {q} image inspect {shlex.quote(image)} >/dev/null 2>&1; then {_bounded(run, VERSION_TIMEOUT_S)}; fi"
                    )
                )
            # -a: a stopped leftover still holds its name; podman's ps has no .Label method
            label = '{{index .Labels "k3launch.deployment"}}' if rt == "podman" else '{{.Label "k3launch.deployment"}}'
            parts.append(
                preflight.section("containers", f"{q} ps -a --filter label=k3launch.deployment --format {shlex.quote(label)} 2>/dev/null || true")
            )
    elif plan.engine == "sim":
        py = shlex.quote(host.python or "python3")
        # from /, like the engine from its run directory: not k3launch found in the caller's cwd
        parts.append(preflight.section("runtime", f"(cd / && {py} -c 'import k3launch.sim') >/dev/null 2>&1 && echo ok || echo missing"))
    else:
        found, version = _bare_vllm(host.venv)
        parts.append(preflight.section("runtime", found))
        parts.append(preflight.section("version", version))
    parts.append(binds.sections(plan, host))
    parts.append(preflight.section("shm", remote.shm_files()))
    parts.append(preflight.probe(plan, host))
    if not model_weights.wanted(plan, host.name):
        parts.append(preflight.section("weights", model_weights.check_command(host, model_weights.where(plan, host))))
    return "".join(parts)


def _parse(out: str) -> dict[str, list[str]]:
    sections: dict[str, list[str]] = {}
    cur = None
    for line in out.splitlines():
        if line.startswith("@@"):
            cur = line[2:].strip()
            sections[cur] = []
        elif cur is not None and line.strip():
            sections[cur].append(line.strip())
    return sections


def _runtime_hint(label: str, host: Host, local: bool) -> str:
    """What installs a missing runtime where it is looked for."""
    n = host.name
    if label == "vllm-router":
        return router_install_hint(n, local)
    if label == "k3launch.sim":
        py = host.python or "python3"
        return (
            f"{py} on {n} cannot import k3launch: install k3launch there (`{py} -m pip install k3launch`), "
            "or set the node's `python:` in the inventory to an interpreter that has it"
        )
    if label == "vllm":
        return f"install vLLM on {n}, or set the node's `venv:` in the inventory to the virtualenv that has it"
    if label in ("docker", "podman", "apptainer"):
        return f"install {label} on {n} (on the PATH of a non-interactive shell), or set the node's `runtime:` in the inventory to one it has"
    return ""


def _image_check(host: Host, image: str, status: list[str], runtime_found: bool) -> Check:
    """The node has the image (k3launch never pulls: a pull of many GB inside `up` would look like a hang)."""
    n = host.name
    if not runtime_found:
        return Check(n, "image", SKIP, f"{host.runtime} not found: cannot look for {image}")
    if status == ["ok"]:
        return Check(n, "image", PASS, "image present")
    return Check(n, "image", FAIL, f"image {image} not on this node",
                 hint=f"`{host.runtime} pull {image}` on {n} (k3launch does not pull), or set `image:` in the inventory to one it has")


def _port_hint(host: Host, router_only: bool, holders: list[str], deployments: list[str]) -> str:
    """What frees a planned port, or moves the deployment off it (a login node cannot be excluded)."""
    n = host.name
    stop = f"`k3launch down {deployments[0]}`" if deployments else f"stop {', '.join(holders) or 'what listens there'} on {n}"
    if router_only:
        return f"{stop}, or give the router another port: `router.port` in the inventory, or --port-base N"
    return f"{stop}, use other ports with --port-base N, or --exclude {n}"


def _judge(
    plan: Plan, host: Host, sec: dict[str, list[str]], live: set[str], router_only: bool, gpus_expected: int, local: bool = False
) -> list[Check]:
    n = host.name
    checks = [Check(n, "reachable", PASS)]
    rt_label = (
        "vllm-router" if router_only else (host.runtime if host.runtime != "bare" else ("k3launch.sim" if plan.engine == "sim" else "vllm"))
    )
    where = f" in {host.venv.rstrip('/')}/bin" if rt_label == "vllm" and host.venv else ""
    found = sec.get("runtime") == ["ok"]
    checks.append(
        Check(
            n,
            "runtime",
            PASS if found else FAIL,
            f"{rt_label} {'found' if found else 'not found'}{where}",
            hint="" if found else _runtime_hint(rt_label, host, local),
        )
    )
    if "image" in sec:
        image = next((p.image for p in plan.processes if p.node == n and p.image), "")
        checks.append(_image_check(host, image, sec["image"], found))
    checks += binds.judge(plan, host, sec)
    if not router_only:
        checks += preflight.judge(plan, host, sec, gpus_expected)
        if "weights" in sec:
            checks += model_weights.judge(plan, host, sec["weights"])
        elif why := model_weights.wanted(plan, n):
            checks.append(Check(n, "weights", SKIP, why))
    if sec.get("version"):
        checks.append(version_check(plan, host, sec["version"]))
    listening = remote.parse_listening("\n".join(sec.get("listening", [])))
    taken = [u for u in plan.ports if u.node == n and remote.port_busy(listening, u.address, u.port)]
    marked = {ln.split()[0]: ln.split()[1] for ln in sec.get("procs", []) if len(ln.split()) >= 2}  # pid → its deployment
    held = [
        h
        for h in remote.parse_holders("\n".join(sec.get("holders", [])))
        if any(h[1] == u.port and h[0] in (u.address, "0.0.0.0") for u in taken)
    ]
    holders = sorted({f"pid {pid} ({comm})" for _, _, pid, _, comm in held if pid != "?"})
    deployments = sorted({marked[pid] for _, _, pid, _, _ in held if pid in marked})
    busy = [f"{u.port} ({u.purpose})" for u in taken]
    detail = ("in use: " + ", ".join(busy) + (f" by {', '.join(holders)}" if holders else "")) if busy else "planned ports free"
    checks.append(
        Check(n, "ports", FAIL if busy else PASS, detail, hint=_port_hint(host, router_only, holders, deployments) if busy else "")
    )
    checks.append(_leftovers(plan, n, sec, live, router_only))
    if sec.get("shm"):
        checks.append(Check(n, "shm", WARN, f"{len(sec['shm'])} stale file(s) in /dev/shm: {', '.join(sec['shm'][:3])}"))
    return checks


def _leftovers(plan: Plan, n: str, sec: dict[str, list[str]], live: set[str], router_only: bool) -> Check:
    """Marked processes and labelled containers of deployments that are not live here, or of this
    deployment's own name. On the ``local`` backend every node is this one machine, whose loopback
    addresses are only names: another deployment's engines there run beside this plan's, not on
    its node, and what of theirs could collide (a planned port) the ports check refuses. Unless the
    plan needs this machine's GPUs (which any engine here may hold), only this deployment's own
    name is a leftover there; the others are a note."""
    stale = {
        ln.split()[1] for ln in sec.get("procs", []) if len(ln.split()) >= 2 and (ln.split()[1] not in live or ln.split()[1] == plan.name)
    }
    stale |= {c for c in sec.get("containers", []) if c not in live or c == plan.name}
    kind = "routers" if router_only else "engines"
    if not stale:
        return Check(n, "leftovers", PASS, "none")
    beside = plan.backend == "local" and (plan.engine == "sim" or plan.platform == "cpu")
    if beside and not router_only and plan.name not in stale:
        return Check(
            n, "leftovers", WARN, f"{kind} of {', '.join(sorted(stale))} also run on this machine (deployments not in this state dir)"
        )
    if beside and plan.name in stale:
        stale = {plan.name}  # the others are not this node's
    return Check(n, "leftovers", WARN if router_only else FAIL, f"{kind} of {', '.join(sorted(stale))} still run")


def version_check(plan: Plan, host: Host, lines: list[str]) -> Check:
    """Judge the ``version`` section (``rc N`` and the last lines of ``vllm --version``)."""
    n = host.name
    rc = lines[0].split()[-1] if lines and lines[0].startswith("rc ") else "?"
    out = lines[1:] if rc != "?" else lines
    found = [m.group(1) for ln in out if (m := _VERSION.fullmatch(ln))]
    if rc != "0" or not found:
        why = "timed out" if rc == "124" else f"exit {rc}"
        return Check(
            n,
            "vllm-version",
            FAIL,
            f"vllm --version failed ({why}): {(out or ['no output'])[-1][:160]}",
            hint="check the engine's installation on the node (`vllm --version` there)",
        )
    got = found[-1]
    release = got.split("+", 1)[0]
    if release == plan.vllm_version:
        return Check(n, "vllm-version", PASS, f"vLLM {got}, the version the plan is for")
    return Check(
        n, "vllm-version", FAIL, f"vLLM {got} runs here; the plan is for vLLM {plan.vllm_version}", hint=version_hint(release, host)
    )


def version_hint(release: str, host: Host) -> str:
    """How to plan for the vLLM that runs: its version (and first its flag schema, when k3launch has none)."""
    from k3launch.planning.schema import available_versions

    plan_it = f"plan with --vllm-version {release}, or set vllm_version: {release} in the inventory"
    if release in available_versions():
        return plan_it
    python = f"{host.venv.rstrip('/')}/bin/python" if host.venv else "<a python that imports this vLLM>"
    return f"k3launch has no flag schema for vLLM {release}: `k3launch schema dump --python {python}`, then {plan_it}"


def node_path(plan: Plan, fleet: Fleet, node: str) -> str:
    """The line that gives a probe the PATH the node's processes have: programs installed with
    k3launch first (this machine), then the PATH of the inventory's env for the node, then the shell's."""
    path = [d for d in (tools_dir(fleet, node), model_weights.engine_env(plan, node).get("PATH")) if d]
    return f'PATH={shlex.quote(":".join(path))}:"$PATH"\n' if path else ""


def doctor(plan: Plan, fleet: Fleet, live_deployments: Iterable[str]) -> DoctorReport:
    live = set(live_deployments) - {plan.name}
    hosts = {h.name: h for h in plan.hosts}
    router_nodes = {p.node for p in plan.processes if p.role == "router"}
    engine_nodes = {p.node for p in plan.processes if p.role != "router"}
    scripts = {}
    for name in hosts:
        hosts[name] = run_host(fleet, name)  # as `up` runs it: this machine's nodes with k3launch's interpreter
        # PATH as the processes will have it: programs installed with k3launch first, then the inventory's env PATH
        scripts[name] = node_path(plan, fleet, name) + preflight.clock_section(plan, hosts[name])
        scripts[name] += _probe_script(plan, hosts[name], router_only=name in router_nodes and name not in engine_nodes)
        if name in router_nodes and name in engine_nodes:
            scripts[name] += preflight.section("router", "command -v vllm-router >/dev/null 2>&1 && echo ok || echo missing")
    checks: list[Check] = []
    versions = plan.engine == "vllm"  # a `vllm --version` in the probe: allow for it
    timeout = PROBE_TIMEOUT_S + (VERSION_TIMEOUT_S + 30 if versions else 0)
    t0 = time.time()
    outcomes = fleet.run_many(scripts, timeout=timeout)
    window = (t0, time.time())
    answers: dict[str, dict[str, list[str]]] = {}
    for name, o in outcomes.items():
        if isinstance(o, K3Error):
            checks.append(Check(name, "reachable", FAIL, o.message, o.code))
            continue
        sec = answers[name] = _parse(o.stdout)
        gpus = max((p.gpus for p in plan.processes if p.node == name), default=0)
        router_only = name in router_nodes and name not in engine_nodes
        local = fleet.target(name).local
        checks += _judge(plan, hosts[name], sec, live, router_only, gpus, local)
        if "router" in sec:
            ok = sec["router"] == ["ok"]
            checks.append(
                Check(
                    name,
                    "router",
                    PASS if ok else FAIL,
                    "vllm-router " + ("found" if ok else "not found"),
                    hint="" if ok else router_install_hint(name, local),
                )
            )
    order = {n: i for i, n in enumerate(hosts)}  # each node's rows together, the cross-node ones with them
    return PreflightReport(sorted(checks + preflight.fleet_checks(answers, window), key=lambda c: order.get(c.node, len(order))),
                           model_weights.reported_checkpoint(plan, {n: answers[n]["weights"] for n in hosts if "weights" in answers.get(n, {})}))


class PreflightReport(DoctorReport):
    """The doctor's report; a refusal over missing weights has its own code, ``weights-missing``,
    and the fetch command in its hint (connection problems still come first)."""

    def error(self) -> K3Error:
        err = super().error()
        missing = [c for c in self.failures() if c.code == "weights-missing"]
        if err.code != "doctor-failed" or not missing:
            return err
        nodes = ", ".join(sorted({c.node for c in missing}))
        others = sorted({c.name for c in self.failures()} - {"weights", "disk"})
        also = f" (also failed: {', '.join(others)})" if others else ""
        return K3Error("weights-missing", f"model weights missing on {nodes}: {missing[0].detail}{also}", missing[0].hint)
