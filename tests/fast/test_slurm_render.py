"""The Slurm backend's sbatch script (``k3launch.render.sbatch.make_sbatch_string``).

Two levels, like the ssh renderer's tests (one real job on the local cluster:
test_slurm_render_e2e.py):

* goldens: one script per strategy in ``tests/golden/slurm/<case>.sbatch``, built from slurm
  inventories without a nodelist (plan nodes are ``slurm-node-i`` placeholders), across the pyxis,
  apptainer and bare container modes, and two copies (``--replicas 2``) of K3 DEP and multi-node TP
  in one job. Regenerate with
  ``K3LAUNCH_UPDATE_GOLDEN=1 pytest tests/fast/test_slurm_render.py`` and read the diff.
* execution with fakes: the whole script runs under bash with a fake ``scontrol`` (prints the
  "allocated" host names) and a fake ``srun`` (records its argv NUL-separated and its environment,
  then exits or sleeps as told). Each step's command after the srun options must be exactly the
  plan's, every placeholder address replaced by the host bound to it; hostile values arrive as
  data and no ``pwned-*`` file appears. The fail-fast tail names the failed process and exits 1.
"""

from __future__ import annotations

import difflib
import os
import re
import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from infrahelpers import pid_alive
from paths import TESTS
from pydantic import ValidationError
from sbatchcases import (
    CASES,
    FAKE_ADDRS,
    FAKE_HOSTS,
    LOG_DIR,
    TREE,
    bash_n,
    case_plan,
    hostile_inventory,
    node_order,
    slurm_inventory,
)

from k3launch.errors import K3Error
from k3launch.models.caches import CACHE_ENV
from k3launch.models.plan import Plan, Process
from k3launch.models.selection import Selection
from k3launch.planning.build import build_plan
from k3launch.render.sbatch import DOCTOR_FAILED_EXIT, job_library, make_array_string, make_sbatch_string
from k3launch.render.scripts import cache_meta_json
from k3launch.render.words import cache_dir

if TYPE_CHECKING:
    pass


GOLDEN = TESTS / "golden" / "slurm"
UPDATE = os.environ.get("K3LAUNCH_UPDATE_GOLDEN") == "1"
HF = "/root/.cache/huggingface"  # where the HF cache is mounted in containers
CC = "/root/.cache/k3launch-compile"  # where the compile caches are mounted in containers
SECRET = "secret-xyz"

FAKE_SRUN = r"""#!/bin/bash
# fake srun: the doctor step (--job-name=k3-doctor) answers "ok" for every host of its --nodelist
# (or "fail" for $K3_FAKE_DOCTOR_FAIL); the prepare step (k3-prepare) records its argv and answers "ok" for
# every host, or with K3_FAKE_PREPARE set (a test whose directories are all under its tmp_path) runs its
# command here once per host, as that host (SLURMD_NODENAME); any other step records its argv (NUL-separated) and
# environment, waits until every step is recorded, then exits 0, or (K3_FAKE_FAIL set) exits 7
# if it is that step, else sleeps like a server.
d=$K3_FAKE_OUT f=$K3_FAKE_OUT/srun.$$
name= nodes=
for a in "$@"; do case $a in --job-name=*) name=${a#--job-name=} ;; --nodelist=*) nodes=${a#--nodelist=} ;; esac; done
if [ "$name" = k3-doctor ]; then
  printf '%s\0' "$@" >"$d/doctor.argv"
  for h in ${nodes//,/ }; do
    if [ "$h" = "${K3_FAKE_DOCTOR_FAIL:-}" ]; then echo "k3launch-doctor $h fail 0 of 8 GPUs visible"; else echo "k3launch-doctor $h ok"; fi
  done
  exit 0
fi
if [ "$name" = k3-prepare ]; then
  printf '%s\0' "$@" >"$d/prepare.argv"
  while [ "${1#-}" != "$1" ]; do shift; done  # srun's options (all --opt or --opt=value)
  for h in ${nodes//,/ }; do
    if [ -n "${K3_FAKE_PREPARE:-}" ]; then SLURMD_NODENAME=$h "$@"; else echo "k3launch-prepare $h ok"; fi
  done
  exit 0
fi
env -0 >"$f.env"
printf '%s\0' "$@" >"$f.tmp" && mv "$f.tmp" "$f.argv"
shopt -s nullglob
for _ in $(seq 500); do a=("$d"/srun.*.argv); [ "${#a[@]}" -ge "$K3_FAKE_N" ] && break; /bin/sleep 0.01; done
if [ -n "${K3_FAKE_DIE:-}" ]; then  # "name:seconds:code ...": that step exits then, with that code; the others serve
  for d in $K3_FAKE_DIE; do
    IFS=: read -r n t c <<<"$d"
    [ "$name" = "$n" ] && { /bin/sleep "$t"; exit "$c"; }
  done
  exec /bin/sleep 30
fi
if [ -n "${K3_FAKE_FAIL:-}" ]; then
  [ "$name" = "$K3_FAKE_FAIL" ] && exit 7
  exec /bin/sleep 30
fi
exit 0
"""
FAKE_SCONTROL = r"""#!/bin/bash
# fake scontrol: `show hostnames LIST` prints the "allocated" hosts; `show node -o HOST` its NodeAddr 10.77.0.<position>
if [ "$1 $2 $3" = "show hostnames $K3_FAKE_NODELIST" ]; then printf '%s\n' $K3_FAKE_HOSTS; exit 0; fi
if [ "$1 $2 $3" = "show node -o" ]; then
  i=0; for h in $K3_FAKE_HOSTS; do i=$((i + 1)); [ "$h" = "$4" ] && { echo "NodeName=$h Arch=x86_64 NodeAddr=10.77.0.$i NodeHostName=$h State=ALLOCATED"; exit 0; }; done
fi
echo "fake scontrol: unexpected: $*" >&2; exit 2
"""
# fake scancel: records its argv; `--signal=SIG JOB` (no --batch) sends SIG to every step's
# process, as slurmstepd would, and never to the job script
FAKE_SCANCEL = r"""#!/bin/bash
printf '%s\n' "$*" >>"$K3_FAKE_OUT/scancel.calls"
[ "$1" = --signal=TERM ] && [ "$2" = "$SLURM_JOB_ID" ] || exit 1
shopt -s nullglob
for f in "$K3_FAKE_OUT"/srun.*.argv; do p=${f##*/srun.}; kill -TERM "${p%.argv}" 2>/dev/null; done
exit 0
"""
# sleep: recorded; waits of up to 1 s are real (the job's polling and watch windows), longer ones are skipped
FAKE_SLEEP = "#!/bin/sh\necho \"$@\" >>\"$K3_FAKE_OUT/sleep.calls\"\ncase $1 in 0.*|1) exec /bin/sleep \"$1\" ;; esac\n"


# ------------------------------------------------------------------ the cases' scripts (cases: sbatchcases.py)
SLURM_ID = "5a1e0b3c-d00d1e"  # the deployment id of the goldens' jobs (`up` makes a new one: models.identity)


def case_script(case: str, log_dir: str = LOG_DIR) -> str:
    plan, slurm, c = case_plan(case)
    return make_sbatch_string(plan, slurm, log_dir, c.extra_sbatch, c.exclude, ident=SLURM_ID)


# ------------------------------------------------------------------ reading plans and scripts
def node_index(plan: Plan, proc: Process) -> int:
    order = node_order(plan)
    return order.index(proc.node) if proc.node in order else 0  # the login router runs on node 0


def substitute(plan: Plan, hosts: list[str]) -> Callable[[str], str]:
    """Replace every plan-node address inside a word by the host bound to that node."""
    addr = {h.address: hosts[i] for i, h in enumerate(next(x for x in plan.hosts if x.name == n) for n in node_order(plan))}
    pattern = re.compile("|".join(re.escape(a) for a in sorted(addr, key=len, reverse=True)))
    return lambda word: pattern.sub(lambda m: addr[m.group(0)], word)


def directives(script: str) -> list[str]:
    return [line[len("#SBATCH "):] for line in script.splitlines() if line.startswith("#SBATCH ")]


def steps(script: str) -> dict[str, list[str]]:
    """process id -> the words of its ``k3_step`` call (shlex-split: "$K3_ADDR_0" stays $K3_ADDR_0)."""
    out: dict[str, list[str]] = {}
    lines = script.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"# ([a-z0-9-]+): \w+(?: \(head\))? on plan node \d+ ", line)
        if m:
            end = next(j for j in range(i + 1, len(lines)) if not lines[j].endswith("\\"))
            out[m.group(1)] = shlex.split("\n".join(lines[i + 1:end + 1]).replace("\\\n", " "))
    return out


def addr_words(plan: Plan) -> Callable[[str], str]:
    """What the script's words look like before expansion: addresses -> $K3_ADDR_i."""
    return substitute(plan, [f"$K3_ADDR_{i}" for i in range(len(node_order(plan)))])


# ------------------------------------------------------------------ goldens
@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_sbatch(case: str) -> None:
    path = GOLDEN / f"{case}.sbatch"
    got = case_script(case)
    if UPDATE:
        GOLDEN.mkdir(parents=True, exist_ok=True)
        path.write_text(got, encoding="utf-8")
        return
    assert path.is_file(), f"{path} missing: run K3LAUNCH_UPDATE_GOLDEN=1 pytest tests/fast/test_slurm_render.py and review it"
    want = path.read_text(encoding="utf-8")
    if got != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True), f"golden/slurm/{case}.sbatch", "now"))
        pytest.fail(f"{case} differs from its golden (K3LAUNCH_UPDATE_GOLDEN=1 to accept):\n{diff}")


def test_no_stale_slurm_goldens() -> None:
    assert sorted(p.stem for p in GOLDEN.glob("*.sbatch")) == sorted(CASES)


def test_every_strategy_and_container_mode_has_a_golden() -> None:
    strategies = {c.sel.strategy for c in CASES.values()}
    assert "hostile_values" in CASES
    assert strategies == {"single_node_tp", "multi_node_tp", "multi_node_tep", "multi_node_dep", "pd_cluster"}
    assert {c.container for c in CASES.values()} == {"pyxis", "apptainer", "bare"}
    assert {(c.sel.strategy, c.sel.nodes) for c in CASES.values()} >= {("multi_node_tp", 2), ("multi_node_tp", 3),
                                                                      ("multi_node_dep", 2), ("multi_node_dep", 4)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sbatch_structure(case: str, tmp_path: Path) -> None:
    plan, slurm, c = case_plan(case)
    text = case_script(case)
    path = tmp_path / f"{case}.sbatch"
    path.write_text(text)
    bash_n(path)
    assert all(h.placeholder and h.name == h.address == f"slurm-node-{i}" for i, h in enumerate(plan.hosts) if h.gpus)
    order = node_order(plan)
    # Directives: all before the first command (sbatch stops reading them there), extra ones verbatim and last.
    lines = text.splitlines()
    first_cmd = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    assert all(not line.startswith("#SBATCH") for line in lines[first_cmd:])
    d = directives(text)
    extra = [*slurm.extra_sbatch, *c.extra_sbatch]
    assert d[len(d) - len(extra):] == extra
    gpus = f"--gres=gpu:{plan.gpus_per_node}" if slurm.gres == "gres" else f"--gpus-per-node={plan.gpus_per_node}"
    want = {f"--job-name=k3-{plan.name}", f"--nodes={len(order)}", "--ntasks-per-node=1", f"--output={LOG_DIR}/slurm-%j.out",
            f"--time={slurm.time_limit}", gpus, "--no-requeue", f"--comment=k3launch-id={SLURM_ID}"}
    want |= {f"--{k}={getattr(slurm, k)}" for k in ("partition", "account", "qos", "reservation", "constraint") if getattr(slurm, k)}
    want |= {"--exclusive"} if slurm.exclusive else set()
    excl = [x for x in [slurm.exclude, *c.exclude] if x]
    want |= {"--exclude=" + ",".join(excl)} if excl else set()
    assert sorted(d[:len(d) - len(extra)]) == sorted(want)
    assert len(order) == len({p.node for p in plan.processes if p.role != "router"})
    # One srun step per process, on the host bound to its plan node; every address bound.
    st = steps(text)
    assert sorted(st) == sorted(p.id for p in plan.processes)
    sub = addr_words(plan)
    kept = {p.id: str(cache_dir(plan, p, next(h for h in plan.hosts if h.name == p.node))).replace("~", "$HOME", 1) for p in plan.processes}
    for proc in plan.processes:
        words = st[proc.id]
        i = node_index(plan, proc)
        assert words[:3] == ["k3_step", proc.id, str(i)], proc.id
        assert words[-len(proc.argv):] == [sub(w) for w in proc.argv], proc.id
        assert not any("slurm-node-" in w for w in words), proc.id
        env_words = {f"{k}={sub(v)}" for k, v in proc.env.items()}
        assert env_words <= set(words), proc.id  # env values (VLLM_HOST_IP, URLs, ...) are bound too
        if proc.role != "router" and c.container == "pyxis":
            assert f"--container-image={proc.image}" in words and f"--container-mounts={c.defaults['hf_cache']}:{HF},{kept[proc.id]}:{CC}" in words
        if proc.role != "router" and c.container == "apptainer":
            assert f"docker://{proc.image}" in words and ("--rocm" if plan.platform == "rocm" else "--nv") in words
        if proc.role == "router" or c.container == "bare":
            assert not any(w.startswith("--container") or w == "apptainer" for w in words), proc.id
    assert any("$K3_ADDR_" in w for ws in st.values() for w in ws)
    # The job library, verbatim; bind and doctor before the first step; supervision (fail fast) last.
    assert job_library() in text
    calls = [ln.split()[0] for ln in lines[lines.index("# ---- end of the k3launch job library ----"):] if ln.startswith("k3_")]
    # before any step, each directory a step needs on its node, once (a container's hf_cache, every
    # engine's compile cache: their golden plans run the real engine), then one step makes them
    engines = [p for p in plan.processes if p.role != "router"]
    need = {(node_index(plan, p), d) for p in engines for d in [*([c.defaults["hf_cache"]] if c.container != "bare" else []), kept[p.id]]}
    dirs = [shlex.split(ln)[1:3] for ln in lines if ln.startswith("k3_dir ")]
    assert len(dirs) == len(need) and {(int(i), d) for i, d in dirs} == need
    assert calls == ["k3_bind", "k3_doctor", *["k3_dir"] * len(need), "k3_prepare", *["k3_step"] * len(plan.processes), "k3_supervise"]
    assert text.endswith("k3_supervise\n") and text.startswith("#!/bin/bash\n")
    assert not re.search(r"(?<![A-Z_])HF_TOKEN=", text)  # by name only (APPTAINERENV_HF_TOKEN copies it at run time)


def test_multi_node_tp_2_golden_binds_addresses_inside_urls_and_env_values() -> None:
    text = case_script("multi_node_tp_2")
    assert "K3_PEER_URL=http://\"$K3_ADDR_1\"" in text
    words = steps(text)["serve-0"]
    assert "K3_PEER_URL=http://$K3_ADDR_1:9000/metrics?from=$K3_ADDR_0" in words
    assert "VLLM_HOST_IP=$K3_ADDR_0" in words and "--master-addr" in words
    assert words[words.index("--master-addr") + 1] == "$K3_ADDR_0"


# Copies in one job: the flag where a copy's ranks meet, and (by position in its copy) which engines serve HTTP.
COPIES = {"multi_node_dep_2_replicas_2": ("--data-parallel-address", (0, 1)),  # hybrid LB: every node of a copy serves
          "multi_node_tp_2_replicas_2": ("--master-addr", (0,))}  # TP: the head alone


def _arg(words: list[str], flag: str) -> str | None:
    return words[words.index(flag) + 1] if flag in words else None


def _worker_urls(words: list[str]) -> list[str]:
    i = words.index("--worker-urls") + 1
    return words[i:next(j for j in range(i, len(words)) if words[j].startswith("--"))]


@pytest.mark.parametrize("case", sorted(COPIES))
def test_each_copy_in_the_one_job_meets_at_its_own_head_and_the_router_lists_every_copy(case: str, tmp_path: Path) -> None:
    """Two copies of a two-node engine share one job of four nodes: copy 0 on allocation nodes 0-1,
    copy 1 on 2-3. Each copy's ranks rendezvous at their own head (never the other copy's), the
    doctor checks each head's rendezvous port on that head's node, and the router, on node 0,
    fronts every copy's HTTP servers; under the fakes the same holds with the bound addresses."""
    flag, serving = COPIES[case]
    plan, _, c = case_plan(case)
    text = case_script(case)
    st = steps(text)
    assert plan.replicas == 2 and node_order(plan) == [f"slurm-node-{i}" for i in range(4)]
    assert directives(text).count("--nodes=4") == 1
    port = next(p.http_port for p in plan.processes if p.id == "r0-serve-0")
    rendezvous = {"--master-addr": "29501", "--data-parallel-address": "13345"}[flag]
    want = []  # allocation nodes of the HTTP servers the router must list, in copy order
    for k, head in ((0, 0), (1, 2)):
        for i in range(2):
            pid, node = f"r{k}-serve-{i}", head + i
            words = st[pid]
            assert words[:3] == ["k3_step", pid, str(node)]
            assert _arg(words, flag) == f"$K3_ADDR_{head}", pid  # its own copy's head
            assert f"VLLM_HOST_IP=$K3_ADDR_{node}" in words, pid
            if i in serving:  # binds its own node, on the port every copy uses (the copies share no node)
                assert _arg(words, "--host") == f"$K3_ADDR_{node}" and _arg(words, "--port") == str(port), pid
                want.append(node)
            else:
                assert "--headless" in words and "--host" not in words, pid
    assert st["router"][:3] == ["k3_step", "router", "0"]
    assert _worker_urls(st["router"]) == [f"http://$K3_ADDR_{n}:{port}" for n in want]
    doctor = next(ln.split() for ln in text.splitlines() if ln.startswith("k3_doctor "))
    checked = {int(e.split(":")[0]): e.split(":")[1].split(",") for e in doctor[3:]}
    assert sorted(checked) == [0, 1, 2, 3] and [n for n in checked if rendezvous in checked[n]] == [0, 2], doctor

    run = run_fake(case_script(case, str(tmp_path / "logs")), tmp_path, len(plan.processes), list(FAKE_HOSTS))
    check_steps(run, plan, c.container, c.defaults["hf_cache"])
    for k, head in ((0, 0), (1, 2)):
        for i in range(2):
            cmd = run.calls[f"r{k}-serve-{i}"].command
            assert _arg(cmd, flag) == FAKE_ADDRS[head] and f"VLLM_HOST_IP={FAKE_ADDRS[head + i]}" in cmd
    assert _worker_urls(run.calls["router"].command) == [f"http://{FAKE_ADDRS[n]}:{port}" for n in want]


# ------------------------------------------------------------------ running scripts with fakes
@dataclass
class Call:
    argv: list[str]
    env: dict[str, str]
    pid: int

    @property
    def options(self) -> list[str]:
        return self.argv[:self._cut()]

    @property
    def command(self) -> list[str]:
        return self.argv[self._cut():]

    def _cut(self) -> int:
        return next(i for i, w in enumerate(self.argv) if not w.startswith("-"))


@dataclass
class Run:
    rc: int
    stdout: str
    stderr: str
    calls: dict[str, Call]  # --job-name (process id) -> the srun call
    out: Path


def fake_bin(tmp: Path) -> Path:
    bindir = tmp / "fakebin"
    bindir.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("scancel", FAKE_SCANCEL), ("sleep", FAKE_SLEEP)):
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    return bindir


def run_fake(script: str, tmp: Path, want_steps: int, hosts: list[str], fail: str | None = None,
             extra_env: dict[str, str] | None = None) -> Run:
    """Run the whole sbatch script under bash with the fakes first on PATH, as its batch step would."""
    path, out, cwd = tmp / "job.sbatch", tmp / "rec", tmp / "cwd"
    for d in (out, cwd):
        d.mkdir(parents=True, exist_ok=True)
    path.write_text(script)
    bash_n(path)
    env = {"PATH": f"{fake_bin(tmp)}:/usr/bin:/bin", "HOME": str(tmp / "home"), "SLURM_JOB_NODELIST": "fake[1-9]",
           "SLURM_JOB_ID": "4242", "HF_TOKEN": SECRET, "K3_FAKE_OUT": str(out), "K3_FAKE_NODELIST": "fake[1-9]",
           "K3_FAKE_HOSTS": " ".join(hosts), "K3_FAKE_N": str(want_steps), "K3_REPORT_WINDOW_S": "0", **({"K3_FAKE_FAIL": fail} if fail else {}), **(extra_env or {})}
    try:
        res = subprocess.run(["bash", str(path)], capture_output=True, text=True, cwd=cwd, env=env, timeout=30)
    finally:
        calls = _calls(out)
        for c in calls:  # nothing the fakes started may outlive the test
            _kill(c.pid)
    by_name = {next(w.split("=", 1)[1] for w in c.options if w.startswith("--job-name=")): c for c in calls}
    assert len(by_name) == len(calls)
    return Run(res.returncode, res.stdout, res.stderr, by_name, out)


def _calls(out: Path) -> list[Call]:
    result = []
    for p in sorted(out.glob("srun.*.argv")):
        argv = [w.decode() for w in p.read_bytes().split(b"\0")[:-1]]
        env = dict(e.decode().split("=", 1) for e in p.with_suffix(".env").read_bytes().split(b"\0") if b"=" in e)
        result.append(Call(argv, env, int(p.name.split(".")[1])))
    return result


def _kill(pid: int) -> None:
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass


def expected_step(plan: Plan, proc: Process, container: str, hf_cache: str, sub: Callable[[str], str],
                  home: str = "") -> tuple[set[str], list[str]]:
    """(srun options, command) a step of ``proc`` must receive, from the plan alone."""
    host = FAKE_HOSTS[node_index(plan, proc)]
    kept = cache_dir(plan, proc, next(h for h in plan.hosts if h.name == proc.node))
    kept = kept.replace("~", home, 1) if kept and kept.startswith("~/") else kept  # ~ expanded on the node
    # compile/JIT caches: a bare engine's in the node's cache directory, a container's where that is mounted
    caches = [f"{k}={kept}/{d}" for k, d in CACHE_ENV.items()] if kept and container == "bare" else []
    inside = [f"{k}={CC}/{d}" for k, d in CACHE_ENV.items()] if kept else []
    env = {**{k: sub(v) for k, v in proc.env.items()}, "K3LAUNCH_DEPLOYMENT": plan.name, "K3LAUNCH_PROCESS": proc.id, "K3LAUNCH_ID": SLURM_ID}
    argv = [sub(w) for w in proc.argv]
    opts = {"--nodes=1", "--ntasks=1", f"--nodelist={host}", "--kill-on-bad-exit=1", f"--job-name={proc.id}", "--overlap"}
    if proc.role == "router" or container == "bare":
        return opts, ["env", *caches, *(f"{k}={v}" for k, v in env.items()), *argv]
    if container == "pyxis":
        mounts = f"{hf_cache}:{HF}" + (f",{kept}:{CC}" if kept else "")
        opts |= {f"--container-image={proc.image}", f"--container-mounts={mounts}", "--container-env=" + ",".join([*env, "HF_TOKEN"])}
        return opts, ["env", *inside, *(f"{k}={v}" for k, v in env.items()), *argv]
    gpu = "--rocm" if plan.platform == "rocm" else "--nv"
    cache = ["--bind", f"{kept}:{CC}", *(w for e in inside for w in ("--env", e))] if kept else []
    return opts, ["apptainer", "exec", gpu, "--cleanenv", "--bind", f"{hf_cache}:{HF}", *cache,
                  *(w for k, v in env.items() for w in ("--env", f"{k}={v}")), f"docker://{proc.image}", *argv]


def prepared(out: Path) -> list[tuple[str, str, str]]:
    """(host, directory, META) of the prepare step, as the fake srun received them."""
    argv = (out / "prepare.argv").read_bytes().decode().split("\0")[:-1]
    rest = argv[argv.index("k3-prepare", argv.index("-c")) + 1:]
    return [(rest[i], rest[i + 1], rest[i + 2]) for i in range(0, len(rest), 3)]


def expected_dirs(plan: Plan, container: str, hf_cache: str, home: str) -> set[tuple[str, str, str]]:
    """What the prepare step must make: on each engine's host its compile cache with what the key
    stands for, and a container's hf_cache (no META)."""
    want = set()
    for proc in plan.processes:
        host = next(h for h in plan.hosts if h.name == proc.node)
        if proc.role == "router":
            continue
        if container != "bare":
            want.add((FAKE_HOSTS[node_index(plan, proc)], hf_cache.replace("~", home, 1) if hf_cache.startswith("~/") else hf_cache, ""))
        kept = cache_dir(plan, proc, host)
        if kept is not None:
            want.add((FAKE_HOSTS[node_index(plan, proc)], kept.replace("~", home, 1) if kept.startswith("~/") else kept,
                      cache_meta_json(plan, proc, host)))
    return want


def check_steps(run: Run, plan: Plan, container: str, hf_cache: str) -> None:
    assert sorted(run.calls) == sorted(p.id for p in plan.processes), run.stderr
    sub = substitute(plan, list(FAKE_ADDRS))
    for proc in plan.processes:
        call = run.calls[proc.id]
        opts, command = expected_step(plan, proc, container, hf_cache, sub, call.env.get("HOME", ""))
        assert set(call.options) == opts and len(call.options) == len(opts), proc.id
        assert call.command == command, proc.id
        assert call.command[-len(proc.argv):] == [sub(w) for w in proc.argv]  # the plan's argv, addresses bound
        assert not any("slurm-node-" in w for w in call.argv), proc.id
        assert call.env.get("HF_TOKEN") == SECRET  # by name, from the job's environment
        # the binding is exported (a task's work command reads it), addresses are the hosts' NodeAddr
        assert call.env.get("K3_HOST_0") == FAKE_HOSTS[0] and call.env.get("K3_ADDR_0") == FAKE_ADDRS[0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_fake_run_binds_plan_nodes_to_allocated_hosts(case: str, tmp_path: Path) -> None:
    plan, _, c = case_plan(case)
    run = run_fake(case_script(case, str(tmp_path / "logs")), tmp_path, len(plan.processes), list(FAKE_HOSTS))
    check_steps(run, plan, c.container, c.defaults.get("hf_cache", ""))
    assert not list(Path("/tmp").glob("k3-golden-pwned*")), "a hostile value of a golden case ran as a command"
    n = len(node_order(plan))
    assert [f"k3launch: node {i} = {FAKE_HOSTS[i]} {FAKE_ADDRS[i]}" for i in range(n)] == run.stdout.splitlines()[:n]
    assert run.stdout.splitlines()[n] == f"k3launch: doctor: {n} node(s) ok"
    # then one step made what the steps need on their nodes (the real engine's plans: compile caches everywhere)
    made = prepared(run.out)
    assert len(made) == len(set(made)) and set(made) == expected_dirs(plan, c.container, c.defaults.get("hf_cache", ""), str(tmp_path / "home"))
    assert run.stdout.splitlines()[n + 1] == f"k3launch: prepare: {len(made)} directory(ies) made on {n} node(s)"
    doctor = (run.out / "doctor.argv").read_bytes().decode().split("\0")[:-1]
    assert f"--nodelist={','.join(FAKE_HOSTS[:n])}" in doctor and doctor[doctor.index("k3-doctor", doctor.index("-c")) + 1] == str(plan.gpus_per_node)
    # every step ending (here: all exit 0) ends the job, which fails and says so
    assert run.rc == 1 and re.search(r"k3launch: \S+ on node \d+ \(\S+\) exited with code 0; stopping the deployment", run.stderr), run.stderr
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == sorted(["doctor.log", "prepare.log", *(f"{p.id}.log" for p in plan.processes)])


def test_fail_fast_names_the_failed_process_and_node_and_stops_the_others(tmp_path: Path) -> None:
    plan, _, _ = case_plan("pd_cluster")
    victim = next(p for p in plan.processes if p.role == "decode")
    t0 = time.monotonic()
    run = run_fake(case_script("pd_cluster", str(tmp_path / "logs")), tmp_path, len(plan.processes), list(FAKE_HOSTS), fail=victim.id)
    assert time.monotonic() - t0 < 15
    assert run.rc == 1, run.stderr
    i = node_index(plan, victim)
    assert f"k3launch: {victim.id} on node {i} ({FAKE_HOSTS[i]}) exited with code 7; stopping the deployment" in run.stderr, run.stderr
    assert f"k3launch: node {i} = {FAKE_HOSTS[i]} {FAKE_ADDRS[i]}" in run.stdout  # node index -> host, printed at start
    others = [c.pid for pid, c in run.calls.items() if pid != victim.id]
    deadline = time.monotonic() + 5
    while any(pid_alive(p) for p in others) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(pid_alive(p) for p in others), "steps outlived the failed job"
    # the steps' processes got the TERM through Slurm, not srun (which would TERM and KILL them at once)
    assert (run.out / "scancel.calls").read_text() == "--signal=TERM 4242\n"


def test_the_step_that_ended_first_is_named_first_whatever_the_start_order(tmp_path: Path) -> None:
    """serve-1 dies first (code 9), serve-0 0.3 s later (code 5): the job names serve-1 as the one
    that ended, then serve-0 (bash >= 5.1 says which child `wait -n` reaped)."""
    assert [p.id for p in case_plan("multi_node_tp_2")[0].processes] == ["serve-0", "serve-1"]  # serve-0 starts first
    run = run_fake(case_script("multi_node_tp_2", str(tmp_path / "logs")), tmp_path, 2, list(FAKE_HOSTS),
                   extra_env={"K3_FAKE_DIE": "serve-1:0.2:9 serve-0:0.5:5", "K3_REPORT_WINDOW_S": "1"})
    assert run.rc == 1
    lines = [ln for ln in run.stderr.splitlines() if "exited with code" in ln]
    assert lines == [f"k3launch: serve-1 on node 1 ({FAKE_HOSTS[1]}) exited with code 9; stopping the deployment",
                     f"k3launch: then serve-0 on node 0 ({FAKE_HOSTS[0]}) exited with code 5"], run.stderr


def test_an_allocation_smaller_than_the_plan_fails_before_any_step(tmp_path: Path) -> None:
    plan, _, _ = case_plan("multi_node_tp_3")
    assert len(node_order(plan)) == 3
    run = run_fake(case_script("multi_node_tp_3", str(tmp_path / "logs")), tmp_path, 3, list(FAKE_HOSTS[:2]))
    assert run.rc == 1 and run.calls == {}
    assert "k3launch: allocation has 2 nodes, the plan needs 3" in run.stderr


# ------------------------------------------------------------------ hostile values
@pytest.mark.parametrize("container", ["pyxis", "apptainer", "bare"])
def test_hostile_values_end_up_as_data(container: str, tmp_path: Path) -> None:
    inv = hostile_inventory(tmp_path, container)
    assert inv.slurm is not None and inv.defaults.env is not None
    plan = build_plan(TREE, Selection(strategy="multi_node_dep", nodes=2), inventory=inv, name=f"k3t-{uuid.uuid4().hex[:8]}")
    log_dir = f"{tmp_path}/logs $(touch {tmp_path}/pwned-log) 'x"
    extra = (f"--comment=$(touch {tmp_path}/pwned-sbatch1) `touch {tmp_path}/pwned-sbatch2`; touch {tmp_path}/pwned-sbatch3",)
    script = make_sbatch_string(plan, inv.slurm, log_dir, extra, ident=SLURM_ID)
    run = run_fake(script, tmp_path, len(plan.processes), list(FAKE_HOSTS), extra_env={"K3_FAKE_PREPARE": "1"})
    check_steps(run, plan, container, str(inv.defaults.hf_cache))
    # the prepare step made every directory, by its exact name, the key's with what it stands for
    want = expected_dirs(plan, container, str(inv.defaults.hf_cache), str(tmp_path / "home"))
    assert set(prepared(run.out)) == want and all(Path(d).is_dir() for _, d, _ in want)
    assert all(Path(d, "k3launch.json").read_text() == meta + "\n" for _, d, meta in want if meta)
    assert any(d.startswith(f"{tmp_path}/cc $(touch") for _, d, _ in want)
    engines = [p for p in plan.processes if p.role != "router"]
    sub = substitute(plan, list(FAKE_ADDRS))
    for proc in engines:  # the inventory's env arrived verbatim, only the plan's addresses bound
        words = run.calls[proc.id].command
        for k, v in inv.defaults.env.items():
            assert f"{k}={sub(v)}" in words, (proc.id, k)
    assert f"K3_PEER=http://{FAKE_ADDRS[1]}:9000/?a=$(touch {tmp_path}/pwned-env6)&b={FAKE_ADDRS[0]}'x'\"y\" -v/:/host" \
        in run.calls[engines[0].id].command
    assert directives(script)[-1] == extra[0]  # passed through untouched: a directive line, never executed
    assert (Path(log_dir) / f"{engines[0].id}.log").is_file()
    assert SECRET not in script
    pwned = list(tmp_path.glob("pwned*")) + list((tmp_path / "cwd").glob("pwned*"))
    assert not pwned, f"shell injection: {pwned}"


@pytest.mark.parametrize("key", ["partition", "account", "qos", "reservation", "constraint", "nodelist", "exclude", "time_limit"])
def test_a_slurm_name_with_white_space_is_refused_since_sbatch_would_split_it_into_options(key: str) -> None:
    with pytest.raises(ValidationError, match=f"slurm.{key} .* must be one word"):
        slurm_inventory("b300", "pyxis", **{key: "gpu --uid=0"})  # type: ignore[arg-type]


@pytest.mark.parametrize("image", ["--privileged", "img:1;touch x", "img:`id`", "reg/img:1 && id", "img\nx"])
def test_an_image_that_is_not_an_image_reference_is_refused(image: str) -> None:
    with pytest.raises(ValidationError, match="image"):
        slurm_inventory("b300", "pyxis", defaults={"image": image})


# ------------------------------------------------------------------ hostile and awkward values
NEWLINE_IN = ("extra_sbatch argument", "slurm.extra_sbatch", "slurm.partition", "slurm.time_limit", "exclude argument")


def newline_inputs(where: str, bad: str) -> tuple[dict[str, Any], tuple[str, ...], tuple[str, ...]]:
    """(slurm section keys, extra_sbatch argument, exclude argument) with a newline + ``bad`` in ``where``."""
    if where == "extra_sbatch argument":
        return {}, (f"--comment=ok\n{bad}",), ()
    if where == "exclude argument":
        return {}, (), (f"gpu-01\n{bad}",)
    key = where.split(".", 1)[1]
    return {key: [f"--comment=ok\n{bad}"] if key == "extra_sbatch" else f"x\n{bad}"}, (), ()


@pytest.mark.parametrize("where", NEWLINE_IN)
def test_a_newline_in_a_directive_value_is_refused_or_harmless(where: str, tmp_path: Path) -> None:
    slurm, extra, exclude = newline_inputs(where, f"touch {tmp_path}/pwned-nl")
    try:
        inv = slurm_inventory("b300", "bare", **slurm)
        assert inv.slurm is not None
        plan = build_plan(TREE, Selection(strategy="single_node_tp"), inventory=inv, name="k3t-newline")
        script = make_sbatch_string(plan, inv.slurm, str(tmp_path / "logs"), extra, exclude)
    except (ValidationError, ValueError, K3Error):
        return  # refused: fine
    run_fake(script, tmp_path, 1, list(FAKE_HOSTS))
    text = script.splitlines()
    first_cmd = next(i for i, line in enumerate(text) if line and not line.startswith("#"))
    assert not (tmp_path / "pwned-nl").exists(), "a directive value ran as a shell command"
    assert text[first_cmd] == next(ln for ln in job_library().splitlines() if ln and not ln.startswith("#"))


@pytest.mark.parametrize("container", ["pyxis", "apptainer"])
def test_default_hf_cache_is_mounted_from_the_home_directory(container: str, tmp_path: Path) -> None:
    inv = slurm_inventory("b300", container)
    assert inv.slurm is not None
    plan = build_plan(TREE, Selection(strategy="single_node_tp"), inventory=inv, name="k3t-home")
    run = run_fake(make_sbatch_string(plan, inv.slurm, str(tmp_path / "logs")), tmp_path, 1, list(FAKE_HOSTS),
                   extra_env={"K3_FAKE_PREPARE": "1"})
    call = run.calls["serve-0"]
    mount = next(w.split("=", 1)[1] for w in call.options if w.startswith("--container-mounts=")) if container == "pyxis" \
        else ",".join(call.command[i + 1] for i, w in enumerate(call.command) if w == "--bind")
    kept = str(cache_dir(plan, plan.processes[0], plan.hosts[0])).replace("~", f"{tmp_path}/home", 1)
    assert mount == f"{tmp_path}/home/.cache/huggingface:{HF},{kept}:{CC}"
    # both bind sources were made on the node before the step (pyxis and apptainer refuse a missing one)
    assert (tmp_path / "home" / ".cache" / "huggingface").is_dir()
    assert Path(kept, "k3launch.json").read_text() == cache_meta_json(plan, plan.processes[0], plan.hosts[0]) + "\n"


@pytest.mark.parametrize("container", ["pyxis", "apptainer"])
def test_an_hf_cache_cannot_add_mounts(container: str) -> None:
    try:
        inv = slurm_inventory("b300", container, defaults={"hf_cache": "/data/hf,/:/host"})
        assert inv.slurm is not None
        plan = build_plan(TREE, Selection(strategy="single_node_tp"), inventory=inv, name="k3t-mounts")
        words = steps(make_sbatch_string(plan, inv.slurm, "/logs"))["serve-0"]
    except (ValidationError, ValueError, K3Error):
        return
    mounts = [w.split("=", 1)[1] for w in words if w.startswith("--container-mounts=")] if container == "pyxis" \
        else [words[words.index("--bind") + 1]]
    assert all("," not in m for m in mounts), mounts


def test_bare_container_mode_runs_the_simulated_engine_without_runtime_bare() -> None:
    inv = slurm_inventory("b300", "bare", engine="sim", defaults={"python": sys.executable})
    assert inv.slurm is not None
    plan = build_plan(TREE, Selection(strategy="single_node_tp"), inventory=inv, name="k3t-sim")
    words = steps(make_sbatch_string(plan, inv.slurm, "/logs"))["serve-0"]
    argv = [addr_words(plan)(w) for w in plan.processes[0].argv]
    assert words[-len(argv) - 2:] == [sys.executable, "-m", "k3launch.sim", *argv[1:]]


@pytest.mark.parametrize("case", ["pd_cluster", "multi_node_dep_2"])
def test_the_router_runs_in_the_allocation_on_node_0_at_the_plan_endpoint(case: str) -> None:
    plan, _, _ = case_plan(case)
    router = next(p for p in plan.processes if p.role == "router")
    assert router.node == "slurm-node-0" and plan.endpoint == f"http://slurm-node-0:{router.http_port}"
    words = steps(case_script(case))["router"]
    assert words[:3] == ["k3_step", "router", "0"]
    assert words[words.index("--host") + 1] == "$K3_ADDR_0"  # reachable from the login node and every other node
    serve0 = next(p for p in plan.processes if p.node == "slurm-node-0" and p.http_port is not None)
    assert router.http_port != serve0.http_port  # one address, two listeners: distinct ports


def test_a_job_array_runs_one_deployment_per_task_and_ends_with_the_work(tmp_path: Path) -> None:
    inv = slurm_inventory("b300", "bare", engine="sim", partition="gpu", defaults={"python": sys.executable})
    assert inv.slurm is not None
    plans = [build_plan(TREE, Selection(strategy="single_node_tp", sets=(f"--max-num-seqs={n}",)), inventory=inv, name=f"k3t-arr-{n}")
             for n in (8, 16, 32)]
    # each task's work waits for its engine step to be recorded (the fake srun then serves until stopped)
    wait = "for _ in $(seq 500); do ls \"$K3_FAKE_OUT\"/srun.*.argv >/dev/null 2>&1 && break; /bin/sleep 0.01; done; "
    work = [["bash", "-c", wait + f"echo task {i} at $K3_ADDR_0 >{tmp_path}/work-{i}.txt"] for i in range(3)]
    script = make_array_string(list(zip(plans, work, strict=True)), inv.slurm, f"{tmp_path}/logs", concurrency=2, name="k3-arr")
    d = directives(script)
    assert "--array=0-2%2" in d and f"--output={tmp_path}/logs/slurm-%A_%a.out" in d and "--job-name=k3-arr" in d
    for i in range(3):
        run = run_fake(script.replace('"${SLURM_ARRAY_TASK_ID:-}"', str(i)), tmp_path / f"t{i}", 1, list(FAKE_HOSTS), fail="no-such-step")
        # the work finished (exit 0): the job stops the deployment and ends with the work's code
        assert run.rc == 0, run.stderr
        assert "k3launch: work finished with code 0; stopping the deployment" in run.stdout
        assert (tmp_path / f"work-{i}.txt").read_text() == f"task {i} at {FAKE_ADDRS[0]}\n"
        call = run.calls["serve-0"]
        assert call.command[call.command.index("--max-num-seqs") + 1] == str((8, 16, 32)[i])
        assert (tmp_path / "logs" / f"task-{i}" / "serve-0.log").is_file()
    mixed = build_plan(TREE, Selection(strategy="multi_node_tp", nodes=2), inventory=inv, name="k3t-arr-2n")
    with pytest.raises(K3Error, match="one shape"):
        make_array_string([(plans[0], ["true"]), (mixed, ["true"])], inv.slurm, "/logs")


def test_a_node_that_fails_the_doctor_step_is_named_and_no_engine_starts(tmp_path: Path) -> None:
    run = run_fake(case_script("multi_node_tep_2", str(tmp_path / "logs")), tmp_path, 0, list(FAKE_HOSTS),
                   extra_env={"K3_FAKE_DOCTOR_FAIL": FAKE_HOSTS[1]})
    assert run.rc == DOCTOR_FAILED_EXIT and run.calls == {}, run.stderr
    assert f"k3launch: doctor failed on {FAKE_HOSTS[1]}: 0 of 8 GPUs visible" in run.stderr
    assert f"k3launch-doctor {FAKE_HOSTS[0]} ok" in (tmp_path / "logs" / "doctor.log").read_text()


@pytest.mark.parametrize("container", ["pyxis", "bare"])
def test_a_directory_the_prepare_step_cannot_make_is_named_and_no_step_starts(container: str, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    inv = slurm_inventory("b300", container, defaults={"compile_cache": f"{tmp_path}/file/cc $(touch {tmp_path}/pwned)"})
    assert inv.slurm is not None
    plan = build_plan(TREE, Selection(strategy="multi_node_tp", nodes=2), inventory=inv, name="k3t-prep")
    run = run_fake(make_sbatch_string(plan, inv.slurm, str(tmp_path / "logs")), tmp_path, 0, list(FAKE_HOSTS),
                   extra_env={"K3_FAKE_PREPARE": "1"})
    kept = cache_dir(plan, plan.processes[0], plan.hosts[0])
    assert run.rc == 1 and run.calls == {}, run.stderr
    said = [ln for ln in run.stderr.splitlines() if ln.startswith("k3launch: prepare failed on ")]
    assert said == [f"k3launch: prepare failed on {h}: cannot make {kept}" for h in FAKE_HOSTS[:2]], run.stderr
    assert "Not a directory" in (tmp_path / "logs" / "prepare.log").read_text()  # mkdir's own words, in the log
    assert not (tmp_path / "pwned").exists()
