"""A load point, the ``vllm bench serve`` command line for it, and the figures read back from its JSON.

Pure. :class:`BenchMetrics` names its fields exactly as vLLM's result JSON does (``completed``,
``failed``, ``output_throughput``, ``p99_tpot_ms``, ...), so a result file written by the real
``vllm bench serve`` inside an engine image and one written by k3launch's own client
(:mod:`k3launch.sim.bench`) are read the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

PERCENTILE_METRICS = "ttft,tpot,itl,e2el"  # vLLM's default omits e2el; campaigns want all four
STATS = ("mean", "median", "std", "p99")
METRICS = ("ttft", "tpot", "itl", "e2el")


class LoadPoint(BaseModel):
    """One load of the random dataset: what ``vllm bench serve`` is told."""

    model_config = ConfigDict(frozen=True, extra="forbid", ser_json_inf_nan="strings", defer_build=True)

    max_concurrency: int | None = Field(default=None, ge=1)
    input_len: int = Field(default=1024, ge=1)
    output_len: int = Field(default=128, ge=1)
    request_rate: float = Field(default=math.inf, gt=0)
    num_prompts: int = Field(default=200, ge=1)

    @property
    def key(self) -> str:
        """Stable and file-name safe: ``c8-in1024-out128-rinf-n200``."""
        conc = "x" if self.max_concurrency is None else str(self.max_concurrency)
        rate = "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}"
        return f"c{conc}-in{self.input_len}-out{self.output_len}-r{rate}-n{self.num_prompts}"


class BenchMetrics(BaseModel):
    """The figures of one result JSON k3launch uses (vLLM's names; the file keeps the rest)."""

    model_config = ConfigDict(frozen=True, extra="ignore", ser_json_inf_nan="strings", defer_build=True)

    completed: int
    failed: int = 0
    duration: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    max_concurrency: int | None = None
    mean_ttft_ms: float | None = None
    median_ttft_ms: float | None = None
    std_ttft_ms: float | None = None
    p99_ttft_ms: float | None = None
    mean_tpot_ms: float | None = None
    median_tpot_ms: float | None = None
    std_tpot_ms: float | None = None
    p99_tpot_ms: float | None = None
    mean_itl_ms: float | None = None
    median_itl_ms: float | None = None
    std_itl_ms: float | None = None
    p99_itl_ms: float | None = None
    mean_e2el_ms: float | None = None
    median_e2el_ms: float | None = None
    std_e2el_ms: float | None = None
    p99_e2el_ms: float | None = None

    def stat(self, stat: str, metric: str) -> float | None:
        v = getattr(self, f"{stat}_{metric}_ms", None)
        return v if isinstance(v, float) else None


def bench_argv(load: LoadPoint, *, base_url: str, model: str, served_name: str | None = None, seed: int = 0, range_ratio: float = 0.0,
               warmups: int = 0, result_dir: str, result_filename: str, percentiles: str = "50,99") -> list[str]:
    """The arguments after ``vllm bench serve`` (the same for vLLM's client and k3launch's).

    ``model`` names the tokenizer; ``served_name`` is what requests ask for when the engine
    serves the model under another name (its ``--served-model-name``). The client's progress bar
    stays on: its log is how ``bench`` shows requests done of total."""
    argv = ["--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions", "--model", model,
            "--dataset-name", "random", "--random-input-len", str(load.input_len), "--random-output-len", str(load.output_len),
            "--num-prompts", str(load.num_prompts), "--request-rate", "inf" if math.isinf(load.request_rate) else f"{load.request_rate:g}",
            "--seed", str(seed), "--ignore-eos", "--percentile-metrics", PERCENTILE_METRICS, "--metric-percentiles", percentiles,
            "--save-result", "--result-dir", result_dir, "--result-filename", result_filename]
    if served_name and served_name != model:
        argv += ["--served-model-name", served_name]
    if load.max_concurrency is not None:
        argv += ["--max-concurrency", str(load.max_concurrency)]
    if range_ratio:
        argv += ["--random-range-ratio", f"{range_ratio:g}"]
    if warmups:
        argv += ["--num-warmups", str(warmups)]
    return argv


@dataclass(frozen=True)
class Sample:
    t: float  # seconds since the epoch when the reading was taken
    watts: tuple[float, ...]  # one per GPU of the node

    @property
    def total(self) -> float:
        return sum(self.watts)
