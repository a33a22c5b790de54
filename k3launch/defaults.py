"""Defaults every layer agrees on, with no dependencies (the simulated engine imports this too)."""

from __future__ import annotations

DEFAULT_VLLM_VERSION = "0.33.0"  # the vendored flag schema a plan is checked against unless told otherwise
DEFAULT_RECIPE = "moonshotai/Kimi-K3"
# The seed's four Advanced knobs: what `--advanced all` selects (their values live in planning.layers)
ADVANCED_ALL = ("max-num-batched-tokens", "max-num-seqs", "gpu-memory-utilization", "max-model-len")
# What k3launch, a router and Prometheus poll on every engine, every few seconds: their access-log
# lines are noise (engines are told not to log them, progress and `logs` leave out those that are)
PROBE_PATHS = ("/health", "/metrics")
