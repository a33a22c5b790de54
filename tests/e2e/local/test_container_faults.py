"""Container faults, said in one line with a hint, before anything starts: podman absent on a node,
an image the node does not have, an hf_cache (the containers' bind source) that cannot be created
or is not writable, a compile cache (the other bind source; bare engines write it too) that cannot
be created, apptainer's hf_cache that cannot be created (apptainer refuses a missing bind source).

``k3launch doctor`` / ``up`` run for real on the local backend (inventories/local-cpu.yaml on the
test range, ``runtime: podman``): the node probe is the real shell script. What podman answers is
a stand-in on PATH (a script: no root, no image needed), and "absent" is a PATH without podman (and
docker): every program of this machine's bin directories but those.
"""

from __future__ import annotations

import json
import os
import re
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


def path_without(tmp: Path, *missing: str, fake_podman: bool, fake_apptainer: bool = False) -> str:
    """A PATH of this machine's programs, ``missing`` left out, podman (apptainer) a stand-in when asked."""
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
    if fake_apptainer:
        (d / "apptainer").write_text("#!/bin/sh\nexit 0\n")
        (d / "apptainer").chmod(stat.S_IRWXU)
    return str(d)


def podman_inventory(src: Path, dest: Path, runtime: str = "podman", **defaults: str) -> Path:
    data = yaml.safe_load(src.read_text(encoding="utf-8"))
    data["defaults"].pop("venv", None)
    data["defaults"].update(runtime=runtime, image=IMAGE, **defaults)
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
    message, _, code = lines[0].removeprefix("error: ").rpartition(" [")  # text errors end with their code: `... [doctor-failed]`
    return {"message": message, "code": code.rstrip("]"), "hint": lines[1].removeprefix("hint: ")}


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


def doctor_rows(tmp: Path, inv: Path, path: str) -> dict[tuple[str, str], dict[str, str]]:
    r = k3(tmp, path, "doctor", "-i", str(inv), "--recipe", RECIPE, "--json")
    return {(c["node"], c["name"]): c for c in json.loads(r.stdout)["checks"]}


# the key of the tiny model's engine: <model>-<vLLM version>-<12 hex digits> (models.caches)
KEY = r"[A-Za-z0-9._-]+-0\.32\.0-[0-9a-f]{12}"


@pytest.mark.parametrize(("compile_cache", "detail"), [
    # under a file: mkdir -p cannot make the key's directory (up would start the engine without its bind source)
    ("/etc/hostname/cc", rf"compile_cache /etc/hostname/cc/{KEY} does not exist and cannot be created \(/etc/hostname is not a writable directory\)"),
    # under a directory nothing can write to (root included: a file is written, not `test -w`)
    ("/proc", rf"compile_cache /proc/{KEY} does not exist and cannot be created \(/proc is not a writable directory\)"),
])
def test_a_compile_cache_that_cannot_be_made_is_one_line_from_doctor_and_up(tmp_path: Path, local_cpu_inventory: Path,
                                                                             compile_cache: str, detail: str) -> None:
    inv = podman_inventory(local_cpu_inventory, tmp_path / "inv.yaml", compile_cache=compile_cache)
    path = path_without(tmp_path, "podman", "docker", fake_podman=True)
    err = doctor_error(tmp_path, inv, path)
    assert re.fullmatch(rf"pre-flight checks failed on cpu-1: compile-cache: {detail}", err["message"]), err
    assert err["hint"] == ("set `compile_cache:` in the inventory to a directory cpu-1 can write (or `off`: no compile caches), "
                           f"or make {compile_cache} a writable directory there"), err
    # `up` stops at the same row, before anything starts: the same error line and hint
    up = k3(tmp_path, path, "up", "-i", str(inv), "--recipe", RECIPE, "--name", "cf-cc")
    assert up.returncode == 2, up.stdout + up.stderr
    lines = [ln for ln in up.stderr.splitlines() if ln.startswith(("error:", "hint:"))]
    assert lines == [f"error: {err['message']} [{err['code']}]", f"hint: {err['hint']}"], up.stderr
    assert not (tmp_path / "state" / "deployments" / "cf-cc.json").exists()


def test_a_writable_or_creatable_compile_cache_passes_and_off_has_no_row(tmp_path: Path, local_cpu_inventory: Path) -> None:
    path = path_without(tmp_path, "podman", "docker", fake_podman=True)
    (tmp_path / "kept").mkdir()
    for root, detail in ((tmp_path / "kept", "does not exist yet; `up` creates it"), (tmp_path / "new" / "cc", "does not exist yet; `up` creates it")):
        inv = podman_inventory(local_cpu_inventory, tmp_path / "inv.yaml", compile_cache=str(root))
        c = doctor_rows(tmp_path, inv, path)[("cpu-1", "compile-cache")]
        assert c["status"] == "pass" and re.fullmatch(rf"compile_cache {re.escape(str(root))}/{KEY} {re.escape(detail)}", c["detail"]), c
    assert not (tmp_path / "new").exists() and list((tmp_path / "kept").iterdir()) == []  # doctor only looks: it creates nothing
    key = re.search(KEY + "$", c["detail"].removesuffix(" " + detail))
    assert key is not None
    (tmp_path / "kept" / key.group(0)).mkdir()  # the key's directory from an earlier start
    inv = podman_inventory(local_cpu_inventory, tmp_path / "inv.yaml", compile_cache=str(tmp_path / "kept"))
    assert doctor_rows(tmp_path, inv, path)[("cpu-1", "compile-cache")]["detail"] == f"compile_cache {tmp_path}/kept/{key.group(0)} writable"
    inv = podman_inventory(local_cpu_inventory, tmp_path / "inv.yaml", compile_cache="off")
    assert ("cpu-1", "compile-cache") not in doctor_rows(tmp_path, inv, path)


def test_apptainers_hf_cache_must_be_creatable_and_a_read_only_one_is_a_warning(tmp_path: Path, local_cpu_inventory: Path) -> None:
    """apptainer refuses a missing bind source (`up` makes the hf_cache first, as for podman); it binds a
    read-only one as it is, enough for weights that are complete there."""
    path = path_without(tmp_path, "podman", "docker", "apptainer", fake_podman=False, fake_apptainer=True)
    inv = podman_inventory(local_cpu_inventory, tmp_path / "inv.yaml", runtime="apptainer", hf_cache="/etc/hostname/hf")
    err = doctor_error(tmp_path, inv, path)
    assert err["message"].endswith("hf-cache: hf_cache /etc/hostname/hf does not exist and cannot be created "
                                   "(/etc/hostname is not a writable directory)"), err
    assert "set `hf_cache:` in the inventory to a directory cpu-1 can write" in err["hint"], err
    inv = podman_inventory(local_cpu_inventory, tmp_path / "inv.yaml", runtime="apptainer", hf_cache="/proc")
    c = doctor_rows(tmp_path, inv, path)[("cpu-1", "hf-cache")]
    assert c["status"] == "warn" and c["detail"].startswith("hf_cache /proc is not writable"), c
