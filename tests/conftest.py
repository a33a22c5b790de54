"""The test session's own settings, whatever tier folder runs: the helpers' import path
(tests/support), the fixtures more than one folder uses, the suite's own state directory and
loopback range, and the tier checks of tests/support/tiers.py (markers, folders).

Where a fixture lives: in the module that uses it; in its folder's conftest.py when several
modules of one folder use it; here, or in a plugin module of tests/support listed in
``pytest_plugins``, when tests of several folders use it. Each fixture name is defined once.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

# tests import their helpers (plan_checks, sshhosts, ...) from tests/support as top-level modules;
# the fakes are k3launch.testing
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

from paths import ROOT, TESTS
from tiers import misfiled, misplaced_lint, missing_markers

# The fixtures more than one tier folder uses, with the helpers they wrap: the infrastructure
# (ssh_hosts, slurm_cluster and the fixtures built on it, vllm_cpu) and simulated engine
# processes (procs), registered once for the whole session: pytest takes pytest_plugins only in
# this root conftest. A plugin's fixture starts nothing until a test asks for it, so the fast tier
# only imports these modules.
pytest_plugins = ["sshhosts", "slurmcluster", "enginecpu", "simproc"]

# The test suite's own loopback range. The bundled local inventories put their nodes on 127.0.0.x
# (local.yaml: 127.0.0.11-14, router 127.0.0.1; local-cpu.yaml: 127.0.0.21-24, router 127.0.0.20),
# where a user's deployment (the quick start's, still up) runs; the tests' local deployments run
# on the same last octets in 127.0.77.0/24 instead, so the two never share an address or a port.
# All of 127/8 is loopback on Linux: no setup needed.
TEST_NET = "127.0.77."

# A suite started in the background by a non-interactive shell (`nohup ... &`, some CI runners)
# inherits SIGINT ignored, and so would every process it starts: the tests that press Ctrl-C on
# `up`, `campaign run` or `supervise` would see it ignored. A handler (not SIG_IGN) is reset to
# the default in each child at exec, so this one line gives them the terminal's Ctrl-C back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.hookimpl(tryfirst=True)  # before -m deselects: every collected test is checked
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    problems = missing_markers(items)
    if problems:
        raise pytest.UsageError("tests that start infrastructure need its markers (pytestmark = [pytest.mark.e2e, ...]; "
                                "see tests/support/tiers.py):\n  " + "\n  ".join(problems))
    problems = misplaced_lint(items)
    if problems:
        raise pytest.UsageError("linters run in the fast tier (see tests/support/tiers.py):\n  " + "\n  ".join(problems))
    problems = misfiled(items, TESTS)
    if problems:
        raise pytest.UsageError("each test module sits in the folder of its tier (see tests/support/tiers.py):\n  " + "\n  ".join(problems))


@pytest.fixture(autouse=True, scope="session")
def _vendored_schemas_only(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Plans use the vendored vLLM flag schemas, whatever the user's ~/.k3launch/schemas holds
    (unless K3LAUNCH_SCHEMA_DIR is set on purpose)."""
    if os.environ.get("K3LAUNCH_SCHEMA_DIR"):
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("K3LAUNCH_SCHEMA_DIR", str(tmp_path_factory.mktemp("schemas")))
        yield


@pytest.fixture(autouse=True, scope="session")
def _own_state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A test that names no state dir (or a subprocess that inherits this environment) uses the
    session's own, never the user's ~/.k3launch or $K3LAUNCH_STATE_DIR: their deployments are
    neither listed, nor refused as holding nodes, nor taken down by a test. The YAML parse cache
    is the session's own too (never the user's ~/.cache/k3launch)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("K3LAUNCH_STATE_DIR", str(tmp_path_factory.mktemp("k3launch-state")))
        mp.setenv("K3LAUNCH_CACHE_DIR", str(tmp_path_factory.mktemp("k3launch-cache")))
        yield


def _moved(address: str) -> str:
    if not address.startswith("127.0.0."):
        raise AssertionError(f"{address}: a bundled local inventory's address outside 127.0.0.0/24")
    return TEST_NET + address.removeprefix("127.0.0.")


def isolated_inventory(name: str, dest: Path) -> Path:
    """A copy of the bundled inventory ``name`` with every node and the router on the test range
    (TEST_NET), everything else as shipped."""
    data = yaml.safe_load((ROOT / "inventories" / f"{name}.yaml").read_text(encoding="utf-8"))
    for node in data["nodes"]:
        node["address"] = _moved(node["address"])
    if data.get("router", {}).get("address"):
        data["router"]["address"] = _moved(data["router"]["address"])
    path = dest / f"{name}-tests.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


@pytest.fixture
def local_inventory(tmp_path: Path) -> Path:
    """inventories/local.yaml (the simulated engine) on the test range: 127.0.77.11-14, router 127.0.77.1."""
    return isolated_inventory("local", tmp_path)


@pytest.fixture
def local_cpu_inventory(tmp_path: Path) -> Path:
    """inventories/local-cpu.yaml (the real engine) on the test range: 127.0.77.21-24, router 127.0.77.20."""
    return isolated_inventory("local-cpu", tmp_path)
