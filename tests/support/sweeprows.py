"""Made-up `vllm bench serve` results and the campaign rows a run would leave with them: what the
`vllm bench sweep` export and import tests (fast, and against vLLM's own sweep code) read and write.
"""

from __future__ import annotations

import json
from pathlib import Path

from k3launch.campaign.results import ResultRow
from k3launch.models.bench import BenchMetrics, LoadPoint


def result_json(
    conc: int | None, tput: float, tpot: float, *, rate: float | str = "inf", prompts: int = 8, in_len: int = 32, out_len: int = 8
) -> dict[str, object]:
    """A `vllm bench serve` result JSON (the keys vLLM writes, with made-up figures)."""
    return {
        "date": "20250101-000000",
        "endpoint_type": "openai",
        "backend": "openai",
        "label": None,
        "model_id": "tiny",
        "tokenizer_id": "tiny",
        "num_prompts": prompts,
        "request_rate": rate,
        "burstiness": 1.0,
        "max_concurrency": conc,
        "duration": prompts * out_len / tput,
        "completed": prompts,
        "failed": 0,
        "total_input_tokens": prompts * in_len,
        "total_output_tokens": prompts * out_len,
        "request_throughput": tput / out_len,
        "request_goodput": None,
        "output_throughput": tput,
        "total_token_throughput": tput * (in_len + out_len) / out_len,
        "max_output_tokens_per_s": tput * 1.2,
        "max_concurrent_requests": conc or prompts,
        "mean_ttft_ms": 21.0,
        "median_ttft_ms": 20.5,
        "std_ttft_ms": 1.0,
        "p99_ttft_ms": 25.0,
        "p90_ttft_ms": 23.0,
        "mean_tpot_ms": tpot,
        "median_tpot_ms": tpot,
        "std_tpot_ms": 0.1,
        "p99_tpot_ms": tpot + 1,
        "mean_itl_ms": tpot,
        "median_itl_ms": tpot,
        "std_itl_ms": 0.1,
        "p99_itl_ms": tpot + 2,
        "mean_e2el_ms": 21 + 7 * tpot,
        "median_e2el_ms": 21 + 7 * tpot,
        "std_e2el_ms": 1.0,
        "p99_e2el_ms": 30 + 7 * tpot,
    }


def campaign_rows(out: Path) -> list[ResultRow]:
    """Two deployments x two concurrencies x two runs, raw JSON on disk as a campaign run leaves it; one invalid run."""
    rows = []
    for g, seqs in enumerate((4, 16)):
        for conc in (1, 4):
            for run in (0, 1):
                raw = result_json(conc, 100.0 * conc / (1 + g) + run, 4.0 + conc + run * 0.1)
                tag = f"h{g}-c{conc}-run{run}"
                (out / "bench").mkdir(parents=True, exist_ok=True)
                (out / "bench" / f"{tag}.json").write_text(json.dumps(raw))
                load = LoadPoint(max_concurrency=conc, input_len=32, output_len=8, num_prompts=8)
                valid = not (seqs == 16 and conc == 4 and run == 1)
                rows.append(
                    ResultRow(
                        campaign="demo",
                        cell=f"{g}{'a' * 11}/{load.key}",
                        group=g,
                        deployment=f"max-num-seqs={seqs}",
                        axes={"set.max-num-seqs": str(seqs)},
                        load=load,
                        valid=valid,
                        reason=None if valid else "error rate 50%",
                        metrics=BenchMetrics.model_validate(raw) if valid else None,
                        result_file=f"bench/{tag}.json",
                        run=run,
                        slo={"p90_ttft_ms": 23.0} if valid else {},
                    )
                )
    return rows
