import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# tests import their helpers (plan_checks, sshhosts, ...) as top-level modules; the fakes are k3launch.testing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiers import missing_markers


@pytest.hookimpl(tryfirst=True)  # before -m deselects: every collected test is checked
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    problems = missing_markers(items)
    if problems:
        raise pytest.UsageError("tests that start infrastructure need its markers (pytestmark = [pytest.mark.e2e, ...]; "
                                "see tests/tiers.py):\n  " + "\n  ".join(problems))


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
