"""The detached controller's entry point: ``python -m k3launch.api._controller NAME STATE_DIR``.

:func:`k3launch.api.supervise_detached` starts it in a session of its own after writing the
deployment's spec; everything it needs beyond the name (policy, ``--on-event`` command, SSH
settings) is read from that spec as JSON, never from a command line, so nothing below the CLI
builds a ``k3launch`` command. Its output goes to ``<state>/supervise/NAME.log``.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    from k3launch.api.supervision import supervise
    from k3launch.deploy.control.process import read_spec
    from k3launch.deploy.state import StateStore
    from k3launch.errors import K3Error
    from k3launch.models.access import Access

    if len(argv) != 2:
        print("usage: python -m k3launch.api._controller NAME STATE_DIR", file=sys.stderr)
        return 2
    name, state_dir = argv
    spec = read_spec(StateStore(Path(state_dir)), name)
    try:
        outcome = supervise(name, state_dir=state_dir, policy=spec.policy if spec is not None else None,
                            on_event_command=spec.hook if spec is not None else None, detached=True,
                            access=spec.access if spec is not None else Access(),
                            on_event=lambda e: print(e.model_dump_json(exclude_defaults=True), flush=True))
    except K3Error as err:
        print(f"{err.message} [{err.code}]" + (f"; hint: {err.hint}" if err.hint else ""), flush=True)
        return 2
    return 1 if outcome == "failed" else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
