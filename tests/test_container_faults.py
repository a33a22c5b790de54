"""Container faults, said in one line with a hint, before anything starts: podman absent on a node,
an image the node does not have, an hf_cache (the containers' bind source) that cannot be created
or is not writable.

``k3launch doctor`` / ``up`` run for real on the local backend (inventories/local-cpu.yaml on the
test range, ``runtime: podman``): the node probe is the real shell script. What podman answers is
a stand-in on PATH (a script: no root, no image needed), and "absent" is a PATH without podman (and
docker): every program of this machine's bin directories but those.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.e2e

IMAGE = "localhost/k3launch-vllm-cpu:test"
RECIPE = "k3launch/tiny-llama"
BINS = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
# A podman that has IMAGE (or not: K3_FAKE_NO_IMAGE) and says vLLM 0.32.0+cpu is in it.
FAKE_PODMAN = """#!/bin/sh
case "$1" in
  image) [ -z "${K3_FAKE_NO_IMAGE:-}" ]; exit $? ;;
  run) echo "0.32.0+cpu"; exit 0 ;;
  *) exit 0 ;;
esac
"""


def path_without(tmp: Path, *missing: str, fake_podman: bool) -> str:
    """A PATH of this machine's programs, ``missing`` left out, podman a stand-in when asked."""
    d = tmp / "bin"
    d.mkdir()
    for b in BINS:
        if not os.path.isdir(b):
            continue
        for name in os.listdir(b):
            if name not in missing and not (d / name).exists():
                (d / name).symlink_to(os.path.join(b, name))
    if fake_podman:
        (d / "podman").write_text(FAKE_PODMAN)
        (d / "podman").chmod(stat.S_IRWXU)
    return str(d)


def podman_inventory(src: Path, dest: Path, **defaults: str) -> Path:
    data = yaml.safe_load(src.read_text(encoding="utf-8"))
    data["defaults"].pop("venv", None)
    data["defaults"].update(runtime="podman", image=IMAGE, **defaults)
    dest.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return dest


def k3(tmp: Path, path: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "k3launch", *args], capture_output=True, text=True, timeout=120, cwd=tmp,
                          env={**os.environ, "PATH": path, "K3LAUNCH_STATE_DIR": str(tmp / "state"), "COLUMNS": "200", **env},
                          stdin=subprocess.DEVNULL)


def doctor_error(tmp: Path, inv: Path, path: str, **env: str) -> dict[str, str]:
    """``doctor``'s refusal: exactly one ``error:`` line and one ``hint:`` line (after the table)."""
    r = k3(tmp, path, "doctor", "-i", str(inv), "--recipe", RECIPE, **env)
    assert r.returncode != 0, r.stdout + r.stderr
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith(("error:", "hint:"))]
    assert [ln.split(":")[0] for ln in lines] == ["error", "hint"], r.stdout + r.stderr
    return {"message": lines[0].removeprefix("error: "), "hint": lines[1].removeprefix("hint: ")}


def test_podman_absent_on_the_node_is_one_line_naming_what_to_install(tmp_path: Path, local_cpu_inventory: Path) -> None:
    inv = podman_inventory(local_cpu_inventory, tmp_path / "inv.yaml")
    path = path_without(tmp_path, "podman", "docker", fake_podman=False)
    err = doctor_error(tmp_path, inv, path)
    assert err["message"] == "pre-flight checks failed on cpu-1: runtime: podman not found", err
    assert "install podman on cpu-1" in err["hint"] and "`runtime:`" in err["hint"], err
    # `up` stops at the same check, before anything starts: one error line, one hint line
    up = k3(tmp_path, path, "up", "-i", str(inv), "--recipe", RECIPE, "--name", "cf-noman")
    assert up.returncode == 2, up.stdout + up.stderr
    lines = [ln for ln in up.stderr.splitlines() if ln.startswith(("error:", "hint:"))]
    assert len(lines) == 2 and "runtime: podman not found" in lines[0] and "install podman on cpu-1" in lines[1], up.stderr
    assert not (tmp_path / "state" / "deployments" / "cf-noman.json").exists()


def test_a_missing_image_names_the_image_and_the_pull_k3launch_does_not_do(tmp_path: Path, local_cpu_inventory: Path) -> None:
    inv = podman_inventory(local_cpu_inventory, tmp_path / "inv.yaml")
    path = path_without(tmp_path, "podman", "docker", fake_podman=True)
    err = doctor_error(tmp_path, inv, path, K3_FAKE_NO_IMAGE="1")
    assert f"image: image {IMAGE} not on this node" in err["message"], err
    assert f"`podman pull {IMAGE}` on cpu-1" in err["hint"], err


@pytest.mark.parametrize(("hf_cache", "detail"), [
    # the nearest existing "parent" is a file: mkdir -p cannot make the bind source
    ("/etc/hostname/hf", "hf_cache /etc/hostname/hf does not exist and cannot be created (/etc/hostname is not a writable directory)"),
    # a directory nothing can be written to (even root: /proc)
    ("/proc", "hf_cache /proc is not writable"),
])
def test_an_hf_cache_the_container_cannot_use_is_one_line_with_a_hint(tmp_path: Path, local_cpu_inventory: Path, hf_cache: str,
                                                                      detail: str) -> None:
    inv = podman_inventory(local_cpu_inventory, tmp_path / "inv.yaml", hf_cache=hf_cache)
    err = doctor_error(tmp_path, inv, path_without(tmp_path, "podman", "docker", fake_podman=True))
    assert f"hf-cache: {detail}" in err["message"], err
    assert "set `hf_cache:` in the inventory to a directory cpu-1 can write" in err["hint"], err


def test_a_writable_or_creatable_hf_cache_passes(tmp_path: Path, local_cpu_inventory: Path) -> None:
    path = path_without(tmp_path, "podman", "docker", fake_podman=True)
    for hf_cache, detail in ((str(tmp_path), "writable"), (str(tmp_path / "new" / "hf"), "does not exist yet; `up` creates it")):
        inv = podman_inventory(local_cpu_inventory, tmp_path / "inv.yaml", hf_cache=hf_cache)
        r = k3(tmp_path, path, "doctor", "-i", str(inv), "--recipe", RECIPE, "--json")
        checks = {(c["node"], c["name"]): c for c in json.loads(r.stdout)["checks"]}
        c = checks[("cpu-1", "hf-cache")]
        assert c["status"] == "pass" and c["detail"] == f"hf_cache {hf_cache} {detail}", c
    assert not (tmp_path / "new").exists()  # doctor only looks: it creates nothing
