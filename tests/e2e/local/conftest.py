"""tests/e2e/local: end-to-end tests on this machine alone: simulated engines (and vllm-router,
supervisors, campaigns) as real processes on the suite's loopback range, no sshd hosts, Slurm or
podman. Marker ``e2e``; ``-m "not e2e"`` leaves them out.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_helpers import Cli, cleanup


@pytest.fixture
def state_cli(tmp_path: Path) -> Iterator[Cli]:
    """The CLI with a state directory of its own; whatever the test left up is taken down after it."""
    c = Cli(tmp_path / "state")
    try:
        yield c
    finally:
        recs = c.state_dir / "deployments"
        cleanup(c, [r.stem for r in recs.glob("*.json")] if recs.is_dir() else [])
