"""The podman specifics of a launch, without podman: no ``--shm-size`` with ``--ipc=host``,
``HF_TOKEN`` never as ``-e``, the doctor's ``ps`` label format (the container path for real:
test_podman.py).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from podmanenv import INVENTORY, TAG

from k3launch.models.plan import Plan


def test_podman_start_commands_suit_podman(tmp_path: Path) -> None:
    """podman specifics: no --shm-size with --ipc=host, HF_TOKEN never as -e, `ps` label format."""
    from k3launch.deploy.ssh import doctor
    from k3launch.render import scripts as render

    inv = tmp_path / "inv.yaml"
    inv.write_text(INVENTORY.format(image=TAG, hf_cache=tmp_path / "hf", env="{}"), encoding="utf-8")
    r = subprocess.run(["k3launch", "plan", "--json", "-i", str(inv), "--name", "shimcheck"], capture_output=True, text=True, timeout=60)
    plan = Plan.model_validate_json(r.stdout)
    proc = plan.processes[0]
    host = next(h for h in plan.hosts if h.name == proc.node)
    cmd = render.start_command(plan, proc, host)
    assert not ("--ipc=host" in cmd and "--shm-size" in cmd), "podman refuses --shm-size with --ipc=host"
    assert not any(cmd[i : i + 2] == ["-e", "HF_TOKEN"] for i in range(len(cmd))), "-e HF_TOKEN puts the value in `podman inspect`"
    assert '.Label "k3launch.deployment"' not in doctor._probe_script(plan, host, router_only=False), "podman ps has no .Label"
