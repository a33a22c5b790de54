"""``python -m k3launch.sim serve MODEL [flags]``: how bare-runtime plans start the simulated engine."""

from k3launch.sim.cli import main

raise SystemExit(main())
