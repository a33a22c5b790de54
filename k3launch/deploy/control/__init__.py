"""The one controller, its hands and its loop: :mod:`.loop` (look, decide, act, persist),
:mod:`.actor` (each action through the backend's ``Watcher``), :mod:`.process` (one controller per
deployment: its lock, stop request, spec file and detached start). The decisions are pure:
:mod:`k3launch.models.control`."""
