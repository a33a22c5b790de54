"""k3launch: compose, place, launch and benchmark vLLM deployments of giant MoE models."""

__version__ = "0.1.0"
