"""tests/e2e/podman: the container path with podman on this machine (markers ``e2e``, ``podman``;
root): a locally built image whose ``vllm`` is the simulated engine (tests/infra/podman-image.sh),
built once and cached between sessions (K3LAUNCH_PODMAN_REBUILD=1 rebuilds it,
K3LAUNCH_PODMAN_RMI=1 removes it at the end); skipped without root or a podman that can run
containers here, unless K3LAUNCH_TEST_PODMAN_REQUIRED=1 (then it fails).

The real engine in a container is the engine tier's (tests/engine/test_engine_podman.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from paths import TESTS
from podmanenv import K3, PREFIX, TAG, podman, sweep

SCRIPT = TESTS / "infra" / "podman-image.sh"


def _bridges() -> set[str]:
    return {n for n in os.listdir("/sys/class/net") if n.startswith("cni-podman") or n.startswith("podman")}


def _skip(reason: str) -> None:
    """Skip, unless CI requires the container path (K3LAUNCH_TEST_PODMAN_REQUIRED=1): then fail."""
    if os.environ.get("K3LAUNCH_TEST_PODMAN_REQUIRED") == "1":
        pytest.fail(f"podman is required here: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def podman_env() -> Iterator[str]:
    """Build (or reuse) the image; CONTAINERS_CONF in os.environ for every k3launch started here."""
    if os.geteuid() != 0:
        _skip("podman tests need root (apt install, rootful podman storage)")
    if shutil.which("podman") is None and shutil.which("apt-get") is None:
        _skip("podman is not installed and there is no apt-get to install it")
    before = _bridges() if Path("/sys/class/net").is_dir() else set()
    t0 = time.monotonic()
    try:
        r = subprocess.run(["bash", str(SCRIPT), TAG], capture_output=True, text=True, timeout=900,
                           env={**os.environ, "PYTHON": sys.executable})  # the image gets this interpreter
    except subprocess.TimeoutExpired:
        _skip("podman cannot run containers here: tests/infra/podman-image.sh took over 900 s")
    if r.returncode != 0:
        tail = "\n".join((r.stderr + r.stdout).strip().splitlines()[-5:])
        _skip(f"podman cannot run containers here: tests/infra/podman-image.sh exited {r.returncode}:\n{tail}")
    conf = r.stdout.strip().splitlines()[-1].removeprefix("export CONTAINERS_CONF=")
    sys.stderr.write(f"\n[podman image ready in {time.monotonic() - t0:.1f}s] {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ''}\n")
    old = os.environ.get("CONTAINERS_CONF")
    os.environ["CONTAINERS_CONF"] = conf  # k3launch's local runner (and podman below) inherit it
    try:
        yield conf
    finally:
        sweep(PREFIX)
        for b in _bridges() - before:  # none expected (host network only); never leave one behind
            subprocess.run(["ip", "link", "del", b], capture_output=True, timeout=30)
        if os.environ.get("K3LAUNCH_PODMAN_RMI") == "1":
            podman("rmi", "-f", TAG, check=False)
        if old is None:
            os.environ.pop("CONTAINERS_CONF", None)
        else:
            os.environ["CONTAINERS_CONF"] = old


@pytest.fixture
def k3(podman_env: str, tmp_path: Path) -> Iterator[K3]:
    """The CLI with its own state directory and the podman inventory; what the test started is swept after it."""
    k = K3(tmp_path)
    try:
        yield k
    finally:
        k.cleanup()
