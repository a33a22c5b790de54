"""``k3launch render``: one launch script per node (and the router) plus plan.json.

Quoting is proven, not assumed: every script passes ``bash -n``, and rendered scripts are
*executed* with fake ``vllm``/``python3``/``docker``/``podman``/``apptainer``/``vllm-router``
programs first on PATH that record their argv (one word per line) and environment. The argv a
fake receives must be exactly the plan's, hostile inventory values must arrive as data, and no
``/tmp/pwned-<uuid>`` (or ``./pwned-*``) file may appear. HF_TOKEN never reaches a file.

Golden scripts live in ``tests/golden/render/<inventory>__<selection>/``; regenerate with
``K3LAUNCH_UPDATE_GOLDEN=1 pytest tests/fast/test_render.py`` and read the diff.
"""

from __future__ import annotations

import difflib
import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from inventory_helpers import ROOT, example, plan_json, q, run_cli, write_yaml
from paths import TESTS

from k3launch.models.caches import CACHE_ENV
from k3launch.models.plan import Plan, Process
from k3launch.render.words import cache_dir

GOLDEN = TESTS / "golden" / "render"
UPDATE = os.environ.get("K3LAUNCH_UPDATE_GOLDEN") == "1"
SECRET = "secret-xyz"
FAKES = ("vllm", "vllm-router", "python3", "docker", "podman", "apptainer")
# A fake program: argv one per line (written atomically), then its environment.
FAKE = """#!/bin/sh
case "$1" in secret) cat >/dev/null ;; esac  # podman secret create reads stdin
f="$K3_FAKE_OUT/$(basename "$0").$$"
env > "$f.env"
printf '%s\\n' "$@" > "$f.tmp"
mv "$f.tmp" "$f.argv"
"""
GOLDEN_CASES = {
    "local__pd_cluster": ("local", ["--strategy", "pd_cluster"]),
    "mi355x-pair__multi_node_dep": ("mi355x-pair", ["--strategy", "multi_node_dep"]),
    "h200-pair__multi_node_tp": ("h200-pair", []),
    "h200-staged__multi_node_dep": ("h200-staged", ["--strategy", "multi_node_dep"]),  # weights staged, read as the inventory says
    "gb300-nvl4x4__multi_node_dep": ("gb300-nvl4x4", ["--strategy", "multi_node_dep"]),
    "local-cpu__single_node_tp": ("local-cpu", ["--recipe", "k3launch/tiny-llama", "--strategy", "single_node_tp"]),
}


# ------------------------------------------------------------------ helpers
def render(inv: Path, args: list[str], out: Path, home: Path, env: dict[str, str] | None = None) -> Plan:
    res = run_cli(["render", "--json", "-i", str(inv), *args, "--out", str(out)], home, env)
    assert res.code == 0, res.stdout + res.stderr
    files = res.json()["files"]
    assert sorted(files) == sorted(p.name for p in out.iterdir()), files
    return Plan.model_validate_json((out / "plan.json").read_text())


def bash_n(path: Path) -> None:
    out = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, f"{path.name}: {out.stderr}"


def fake_bin(tmp: Path) -> Path:
    bindir = tmp / "fakebin"
    bindir.mkdir()
    for name in FAKES:
        make_fake(bindir / name)
    return bindir


def make_fake(path: Path) -> None:
    path.write_text(FAKE)
    path.chmod(0o755)


def run_script(script: Path, bindir: Path, home: Path, out: Path, cwd: Path, env: dict[str, str] | None = None) -> None:
    full = {"PATH": f"{bindir}:/usr/bin:/bin", "HOME": str(home), "K3_FAKE_OUT": str(out), **(env or {})}
    res = subprocess.run(["bash", str(script)], capture_output=True, text=True, cwd=cwd, env=full, timeout=30)
    assert res.returncode == 0, f"{script.name}: {res.stdout}{res.stderr}"


def calls(out: Path, want: int) -> list[tuple[str, list[str], dict[str, str]]]:
    """Wait for ``want`` recorded calls (background ones land a moment later): (program, argv, env)."""
    deadline = time.monotonic() + 15
    while len(found := sorted(out.glob("*.argv"))) < want and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(found) == want, [p.name for p in found]
    result = []
    for path in found:
        env_lines = path.with_suffix(".env").read_text().splitlines()
        env = dict(line.split("=", 1) for line in env_lines if "=" in line)
        result.append((path.name.split(".")[0], path.read_text().split("\n")[:-1], env))
    return result


def blocks(script: str) -> dict[str, list[str]]:
    """process id -> the words of its command, as the shell will split them."""
    out: dict[str, list[str]] = {}
    current: str | None = None
    lines: list[str] = []
    for line in [*script.splitlines(), ""]:
        if line.startswith("# ") and ": " in line and line[2:].split(":")[0].count(" ") == 0 and current is None and lines == []:
            current = line[2:].split(":")[0]
        elif current is not None and line == "":
            out[current] = shlex.split("\n".join(lines).replace("\\\n", " "))
            current, lines = None, []
        elif current is not None:
            lines.append(line)
    return out


@pytest.fixture()
def pwned() -> Iterator[str]:
    """A unique marker; fails the test if any /tmp/pwned-<marker>* file appears."""
    marker = uuid.uuid4().hex[:12]
    yield marker
    hits = list(Path("/tmp").glob(f"pwned-{marker}*"))
    for h in hits:
        h.unlink()
    assert not hits, f"shell injection: {hits}"


# The deployment id rendered scripts carry is a new one of the state directory (models.identity):
# fixed here, so goldens stay byte-identical.
FIXED_ID = "5a1e0b3c-d00d1e"


@pytest.fixture(autouse=True)
def _fixed_deployment_id(monkeypatch: pytest.MonkeyPatch) -> None:
    from k3launch.models import identity

    monkeypatch.setattr(identity, "new_deployment_id", lambda state_id: FIXED_ID)


@pytest.fixture()
def deployment() -> Iterator[str]:
    """A unique deployment name; bare processes log under /tmp/k3launch/<name>.<id>, removed afterwards."""
    name = f"k3t-{uuid.uuid4().hex[:10]}"
    yield name
    shutil.rmtree(Path("/tmp/k3launch") / f"{name}.{FIXED_ID}", ignore_errors=True)


# ------------------------------------------------------------------ goldens and structure
@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_golden_scripts(case: str, tmp_path: Path) -> None:
    inv, args = GOLDEN_CASES[case]
    out = tmp_path / "out"
    plan = render(example(inv), args, out, tmp_path)
    want_dir = GOLDEN / case
    got = {p.name: p.read_text() for p in sorted(out.glob("*.sh"))}
    if UPDATE:
        shutil.rmtree(want_dir, ignore_errors=True)
        want_dir.mkdir(parents=True)
        for name, text in got.items():
            (want_dir / name).write_text(text)
        return
    assert want_dir.is_dir(), f"{want_dir} missing: run K3LAUNCH_UPDATE_GOLDEN=1 pytest tests/fast/test_render.py"
    assert sorted(p.name for p in want_dir.iterdir()) == sorted(got)
    for name, text in got.items():
        want = (want_dir / name).read_text()
        if want != text:
            diff = "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True), f"golden/render/{case}/{name}", "now"))
            pytest.fail(f"{case}/{name} differs from its golden:\n{diff}")
    # plan.json is exactly `plan --json` (the placement golden).
    assert plan.model_dump(mode="json") == plan_json(example(inv), args, tmp_path)


def test_no_stale_render_goldens() -> None:
    assert sorted(p.name for p in GOLDEN.iterdir()) == sorted(GOLDEN_CASES)


@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_one_script_per_node_and_router(case: str, tmp_path: Path) -> None:
    inv, args = GOLDEN_CASES[case]
    out = tmp_path / "out"
    plan = render(example(inv), args, out, tmp_path)
    assert sorted(p.name for p in out.iterdir()) == sorted(["plan.json", *(f"{h.name}.sh" for h in plan.hosts)])
    assert {h.name for h in plan.hosts} == {p.node for p in plan.processes}
    for h in plan.hosts:
        path = out / f"{h.name}.sh"
        assert stat.S_IMODE(path.stat().st_mode) == 0o755
        bash_n(path)
        text = path.read_text()
        assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text
        mine = blocks(text)
        assert sorted(mine) == sorted(p.id for p in plan.processes if p.node == h.name)
        for pid, words in mine.items():
            proc = next(p for p in plan.processes if p.id == pid)
            # The engine command line is the plan's argv, word for word, at the end of the command.
            tail = proc.argv[1:] if h.runtime in ("docker", "podman") and proc.role != "router" else proc.argv
            if plan.engine == "sim" and h.runtime == "bare" and proc.role != "router":
                tail = ["python3", "-m", "k3launch.sim", *proc.argv[1:]]
            assert words[-len(tail):] == tail, pid


def test_render_refuses_a_non_empty_out_dir_unless_forced(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    res = run_cli(["render", "--json", "-i", str(example("local")), "--out", str(out)], tmp_path)
    assert res.error()["code"] == "out-not-empty" and sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    res = run_cli(["render", "--json", "-i", str(example("local")), "--out", str(out), "--force"], tmp_path)
    assert res.code == 0 and (out / "keep.txt").read_text() == "mine" and (out / "local-1.sh").is_file()


# ------------------------------------------------------------------ executing rendered scripts
def test_local_bare_scripts_start_exactly_the_planned_argv(tmp_path: Path, deployment: str) -> None:
    """local.yaml: runtime bare, engine sim: `python3 -m k3launch.sim serve ...` and the router, detached."""
    out, rec = tmp_path / "out", tmp_path / "rec"
    rec.mkdir()
    plan = render(example("local"), ["--strategy", "pd_cluster", "--name", deployment], out, tmp_path)
    bindir = fake_bin(tmp_path)
    for h in plan.hosts:
        run_script(out / f"{h.name}.sh", bindir, tmp_path, rec, tmp_path)
    got = calls(rec, len(plan.processes))
    by_process = {env["K3LAUNCH_PROCESS"]: (prog, argv, env) for prog, argv, env in got}
    assert sorted(by_process) == sorted(p.id for p in plan.processes)
    for proc in plan.processes:
        prog, argv, env = by_process[proc.id]
        if proc.role == "router":
            assert (prog, argv) == ("vllm-router", proc.argv[1:])
        else:
            assert (prog, argv) == ("python3", ["-m", "k3launch.sim", *proc.argv[1:]])
        assert {k: env.get(k) for k in proc.env} == proc.env
        assert (env["K3LAUNCH_DEPLOYMENT"], env["K3LAUNCH_ID"]) == (deployment, FIXED_ID)
        # the run directory is the deployment identity's: name and id
        assert (Path("/tmp/k3launch") / f"{deployment}.{FIXED_ID}" / proc.id / f"{proc.id}.log").is_file()


# Inventory env values (defaults, node override): `env K=V` on a bare runtime.
BARE_ENV = ("a $(touch pwned-{m}-env1) `touch pwned-{m}-env2`", "b'; touch pwned-{m}-env3; '\" && touch pwned-{m}-env4")


def _hostile_bare(tmp: Path, marker: str, engine: str) -> Path:
    # A directory whose name would run commands if it were ever unquoted; the fake python3 lives in it.
    # (File names cannot hold '/', so these injections would touch ./pwned-* in the script's cwd.)
    weird = tmp / f"py dir $(touch pwned-{marker}-dollar) `touch pwned-{marker}-tick`; touch pwned-{marker}-semi 'q\"u"
    weird.mkdir()
    make_fake(weird / "python3")
    token = tmp / f"tok $(touch pwned-{marker}-tok)"
    token.write_text("token-from-file\n")
    return write_yaml(tmp, f"""name: hostile-bare
backend: local
hardware: b300
engine: {engine}
hf_token_file: {q(str(token))}
defaults:
  runtime: bare
  iface: lo
  cpu_memory_gb: 4096
  python: {q(str(weird / "python3"))}
  hf_cache: {q(f"~/hf $(touch /tmp/pwned-{marker}-cache)")}
  workdir: {q(f"/srv/$(touch /tmp/pwned-{marker}-wd)")}
  env: {{K3_NOTE: {q(BARE_ENV[0].format(m=marker))}}}
nodes:
  - {{name: local-1, address: 127.0.0.11}}
  - {{name: local-2, address: 127.0.0.12, env: {{K3_NOTE: {q(BARE_ENV[1].format(m=marker))}}}}}
router: {{node: login, address: 127.0.0.1}}
""")


@pytest.mark.parametrize("engine", ["sim", "vllm"])
def test_hostile_bare_values_end_up_as_data(tmp_path: Path, pwned: str, deployment: str, engine: str) -> None:
    inv = _hostile_bare(tmp_path, pwned, engine)
    out, rec = tmp_path / "out", tmp_path / "rec"
    rec.mkdir()
    plan = render(inv, ["--strategy", "multi_node_dep", "--name", deployment], out, tmp_path)
    bindir = fake_bin(tmp_path)
    for h in plan.hosts:
        bash_n(out / f"{h.name}.sh")
        run_script(out / f"{h.name}.sh", bindir, tmp_path, rec, tmp_path)
    got = {env["K3LAUNCH_PROCESS"]: (prog, argv, env) for prog, argv, env in calls(rec, len(plan.processes))}
    for proc in plan.processes:
        prog, argv, env = got[proc.id]
        if proc.role == "router":
            assert (prog, argv) == ("vllm-router", proc.argv[1:])
        elif engine == "vllm":
            assert (prog, argv) == ("vllm", proc.argv[1:])
        else:  # the hostile-path python3 really ran, with the plan's argv
            assert (prog, argv) == ("python3", ["-m", "k3launch.sim", *proc.argv[1:]])
        # hf_token_file (a hostile path) was read at run time: the value is in the process, not the script.
        assert env.get("HF_TOKEN") == "token-from-file" and "APPTAINERENV_HF_TOKEN" not in env  # apptainer's variable: apptainer only
        if proc.role != "router":  # the inventory's env, node over defaults, arrives verbatim
            want = BARE_ENV[proc.node == "local-2"].format(m=pwned)
            assert proc.env["K3_NOTE"] == want and env.get("K3_NOTE") == want, proc.id
    assert not list(tmp_path.glob("pwned-*")), list(tmp_path.glob("pwned-*"))
    assert "token-from-file" not in "".join(p.read_text() for p in out.iterdir())


def test_the_venv_engine_runs_before_the_one_on_path(tmp_path: Path, pwned: str, deployment: str) -> None:
    """A node's venv goes first on the engine's PATH: its `vllm` runs, not the one on PATH (a hostile path stays data)."""
    venv = tmp_path / f"venv $(touch pwned-{pwned}-v) `touch pwned-{pwned}-t` 'q\""
    (venv / "bin").mkdir(parents=True)
    fake = venv / "bin" / "vllm"
    make_fake(fake)
    fake.write_text(fake.read_text().replace('$(basename "$0")', "venv-vllm"))  # tells the two fakes apart
    inv = write_yaml(tmp_path, f"""name: cpu-venv
backend: local
hardware: cpu-x86
engine: vllm
defaults: {{runtime: bare, iface: lo, venv: {q(str(venv))}}}
nodes:
  - {{name: c1, address: 127.0.0.31}}
""")
    out, rec = tmp_path / "out", tmp_path / "rec"
    rec.mkdir()
    plan = render(inv, ["--recipe", "k3launch/tiny-llama", "--name", deployment], out, tmp_path)
    run_script(out / "c1.sh", fake_bin(tmp_path), tmp_path, rec, tmp_path)  # fake_bin holds a `vllm` too
    ((prog, argv, env),) = calls(rec, 1)
    assert (prog, argv) == ("venv-vllm", plan.processes[0].argv[1:])
    assert env["PATH"].split(":")[0] == f"{venv}/bin" and env["K3LAUNCH_PROCESS"] == "serve-0"
    assert not list(tmp_path.glob("pwned-*"))


IMAGES = ("reg.example:5000/team/img@sha256:" + "0f" * 32, "vllm/vllm-openai:v0.33.0")


def _hostile_container(tmp: Path, marker: str, runtime: str) -> Path:
    m = f"/tmp/pwned-{marker}"
    cache1, cache2 = f"~/hf cache/$(touch {m}-1)", f'{tmp}/data/a b"c$(touch {m}-5)'
    shm1, shm2 = f"64g' ; touch {m}-4 ; '", f"$((1+1))g | touch {m}-7"
    env1, env2 = f"INFO $(touch {m}-2) `touch {m}-3`", f"WARN'; touch {m}-6; '\" || touch {m}-8"
    return write_yaml(tmp, f"""name: hostile-{runtime}
backend: ssh
hardware: b300
defaults:
  runtime: {runtime}
  iface: eth0
  cpu_memory_gb: 4096
  hf_cache: {q(cache1)}
  image: {q(IMAGES[0])}
  shm_size: {q(shm1)}
  workdir: {q(f"/srv/x $(touch {m}-wd)")}
  env: {{NCCL_DEBUG: {q(env1)}, K3_NOTE: {q(f"-v/:/host --privileged; touch {m}-9")}}}
nodes:
  - {{name: n1, address: 10.0.0.1}}
  - {{name: n2, address: 10.0.0.2, hf_cache: {q(cache2)}, image: {q(IMAGES[1])}, shm_size: {q(shm2)}, env: {{NCCL_DEBUG: {q(env2)}}},
      compile_cache: {q(f"~/k3 cc/$(touch {m}-10)")}}}
""")


def _after(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, tok in enumerate(argv[:-1]) if tok == flag]


@pytest.mark.parametrize("runtime", ["docker", "podman", "apptainer"])
def test_hostile_container_values_end_up_as_data(tmp_path: Path, pwned: str, deployment: str, runtime: str) -> None:
    inv = _hostile_container(tmp_path, pwned, runtime)
    out, rec = tmp_path / "out", tmp_path / "rec"
    rec.mkdir()
    home = tmp_path / "home"
    home.mkdir()
    plan = render(inv, ["--strategy", "multi_node_dep", "--name", deployment], out, home, {"HF_TOKEN": SECRET})
    hosts = {h.name: h for h in plan.hosts}
    bindir = fake_bin(tmp_path)
    for h in plan.hosts:
        bash_n(out / f"{h.name}.sh")
        run_script(out / f"{h.name}.sh", bindir, home, rec, tmp_path, {"HF_TOKEN": SECRET})
    engines = {p.id: p for p in plan.processes if p.role != "router"}
    got = calls(rec, len(plan.processes) + (2 * len(engines) if runtime == "podman" else 0))
    secret_calls = [argv for prog, argv, env in got if argv[:1] == ["secret"]]
    if runtime == "podman":  # per container: drop a stale HF_TOKEN secret, create it from the environment
        assert sorted(a[:2] for a in secret_calls) == [["secret", "create"]] * len(engines) + [["secret", "rm"]] * len(engines)
    seen: set[str] = set()
    for prog, argv, env in got:
        if argv[:1] == ["secret"]:
            continue
        if prog == "vllm-router":
            router = next(p for p in plan.processes if p.role == "router")
            assert argv == router.argv[1:]
            seen.add("router")
            continue
        assert prog == runtime
        proc = _engine_of(argv, engines, runtime)
        host = hosts[proc.node]
        seen.add(proc.id)
        cache = host.hf_cache.replace("~", str(home), 1) if host.hf_cache and host.hf_cache.startswith("~/") else host.hf_cache
        compiled = str(cache_dir(plan, proc, host)).replace("~", str(home), 1)  # n2's hostile compile_cache, as data
        assert compiled.startswith(f"{home}/k3 cc/$(touch" if proc.node == "n2" else f"{home}/.cache/k3launch/compile/")
        kept = {f"{k}=/root/.cache/k3launch-compile/{sub}" for k, sub in CACHE_ENV.items()}
        if runtime == "apptainer":
            assert argv[-len(proc.argv) - 1:] == [f"docker://{proc.image}", *proc.argv]
            assert _after(argv, "--bind") == [f"{cache}:/root/.cache/huggingface", f"{compiled}:/root/.cache/k3launch-compile"]
            assert kept <= set(_after(argv, "--env"))
            assert set(_after(argv, "--env")) >= {f"{k}={v}" for k, v in proc.env.items()}
            assert env.get("APPTAINERENV_HF_TOKEN") == SECRET
        else:
            i = argv.index("--entrypoint")
            assert argv[i + 1:] == [proc.argv[0], proc.image, *proc.argv[1:]]
            assert _after(argv, "--shm-size") == ([host.shm_size] if runtime == "docker" else [])  # podman: not with --ipc=host
            assert _after(argv, "-v") == [f"{cache}:/root/.cache/huggingface", f"{compiled}:/root/.cache/k3launch-compile"]
            token = {"HF_TOKEN"} if runtime == "docker" else {"HF_TOKEN_PATH=/run/secrets/hf_token"}
            assert set(_after(argv, "-e")) == {f"{k}={v}" for k, v in proc.env.items()} | {
                f"K3LAUNCH_DEPLOYMENT={deployment}", f"K3LAUNCH_PROCESS={proc.id}", f"K3LAUNCH_ID={FIXED_ID}"} | token | kept
            labels = set(_after(argv, "--label"))
            assert {f"k3launch.deployment={deployment}", f"k3launch.id={FIXED_ID}", "k3launch.owner=5a1e0b3c"} <= labels
            if runtime == "docker":
                assert env.get("HF_TOKEN") == SECRET  # passed by name from the caller's environment
            else:  # podman inspect would show an -e value: a secret file instead
                assert _after(argv, "--secret") == [f"k3-{deployment}-{proc.id}-hf-token,type=mount,target=hf_token"]
        assert proc.image == IMAGES[proc.node == "n2"]
        # The inventory's env (node over defaults) is in the plan and reached the runtime as one word each.
        assert proc.env["NCCL_DEBUG"].startswith("WARN'" if proc.node == "n2" else "INFO $(") and pwned in proc.env["NCCL_DEBUG"]
        assert proc.env["K3_NOTE"] == f"-v/:/host --privileged; touch /tmp/pwned-{pwned}-9"
        assert {f"NCCL_DEBUG={proc.env['NCCL_DEBUG']}", f"K3_NOTE={proc.env['K3_NOTE']}"} <= set(_after(argv, "--env" if runtime == "apptainer" else "-e"))
    assert seen == {p.id for p in plan.processes}
    assert not list(tmp_path.glob("pwned-*"))
    assert {hosts["n1"].shm_size, hosts["n2"].shm_size} == {f"64g' ; touch /tmp/pwned-{pwned}-4 ; '", f"$((1+1))g | touch /tmp/pwned-{pwned}-7"}
    assert {hosts["n1"].hf_cache, hosts["n2"].hf_cache} == {f"~/hf cache/$(touch /tmp/pwned-{pwned}-1)", f'{tmp_path}/data/a b"c$(touch /tmp/pwned-{pwned}-5)'}
    _assert_no_secret(out)


def _engine_of(argv: list[str], engines: dict[str, Process], runtime: str) -> Process:
    flag = "--env" if runtime == "apptainer" else "-e"
    pid = next(v.split("=", 1)[1] for v in _after(argv, flag) if v.startswith("K3LAUNCH_PROCESS="))
    return engines[pid]


def _assert_no_secret(out: Path) -> None:
    for path in out.iterdir():
        assert SECRET not in path.read_text(), path.name


# ------------------------------------------------------------------ secrets
@pytest.mark.parametrize("inv", ["local", "mi355x-pair", "h200-pair"])
def test_hf_token_from_the_environment_never_reaches_plan_or_scripts(inv: str, tmp_path: Path) -> None:
    """The real command, in a subprocess whose environment holds HF_TOKEN."""
    out = tmp_path / "out"
    env = {"HOME": str(tmp_path), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HF_TOKEN": SECRET,
           "HUGGING_FACE_HUB_TOKEN": SECRET}
    res = subprocess.run([sys.executable, "-m", "k3launch", "render", "-i", str(example(inv)), "--strategy", "multi_node_dep",
                          "--out", str(out)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert res.returncode == 0, res.stderr
    assert SECRET not in res.stdout + res.stderr
    files = list(out.iterdir())
    assert len(files) >= 3
    _assert_no_secret(out)
    grep = subprocess.run(["grep", "-r", SECRET, str(out)], capture_output=True, text=True, timeout=30)
    assert grep.returncode == 1 and grep.stdout == "", grep.stdout
    res = subprocess.run([sys.executable, "-m", "k3launch", "plan", "--json", "-i", str(example(inv))], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=60)
    assert res.returncode == 0 and SECRET not in res.stdout and json.loads(res.stdout)["processes"]


def test_hf_token_file_is_read_at_run_time_not_copied(tmp_path: Path) -> None:
    token = tmp_path / "hf token"
    token.write_text(SECRET)
    inv = write_yaml(tmp_path, example("h200-pair").read_text() + f"hf_token_file: {q(str(token))}\n")
    out = tmp_path / "out"
    render(inv, [], out, tmp_path)
    _assert_no_secret(out)
    text = (out / "h200-a.sh").read_text()
    assert f"[ -r {shlex.quote(str(token))} ]" in text and "-e HF_TOKEN \\" in text


@pytest.mark.parametrize("image", ["--privileged", "-v/:/host", "img:1;touch x", "img:`id`", "reg/img:1 && id"])
def test_an_image_that_is_not_an_image_reference_is_refused_before_any_script(tmp_path: Path, image: str) -> None:
    """docker/podman would read an image '--privileged' as an option: such an image never reaches a script."""
    inv = write_yaml(tmp_path, example("h200-pair").read_text().replace("runtime: docker", f"runtime: docker\n  image: {q(image)}"))
    res = run_cli(["render", "--json", "-i", str(inv), "--out", str(tmp_path / "out")], tmp_path)
    err = res.error()
    assert err["code"] == "bad-inventory" and "image" in err["message"] and str(inv) in err["message"], err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize("where", ["home", "missing"])
def test_an_hf_token_file_under_the_home_directory_is_read_there(where: str, tmp_path: Path) -> None:
    from k3launch.render.scripts import token_snippet

    home = tmp_path / "home"
    (home / ".cache" / "huggingface").mkdir(parents=True)
    if where == "home":
        (home / ".cache" / "huggingface" / "token").write_text("hf_secret_1")
    script = token_snippet("~/.cache/huggingface/token", apptainer=True) + 'printf "%s|%s" "${HF_TOKEN:-}" "$APPTAINERENV_HF_TOKEN"\n'
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env={"HOME": str(home), "PATH": "/usr/bin:/bin"}, timeout=30)
    if where == "home":
        assert r.stdout == "hf_secret_1|hf_secret_1" and r.stderr == ""
    else:  # said, not silently skipped (the engine would fail later with a 401)
        assert r.stdout == "|" and r.stderr.strip() == f"k3launch: hf_token_file {home}/.cache/huggingface/token is not readable here; no HF_TOKEN"
