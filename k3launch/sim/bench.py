"""``vllm bench serve`` of the simulated image: the same command line, the same result JSON.

``python -m k3launch.sim bench serve --dataset-name random --random-input-len 128 ...`` (and the
``vllm`` of the sim's container image) is a stdlib client for an OpenAI-compatible server:
streaming ``/v1/completions`` requests with ``ignore_eos`` over keep-alive connections reused as
vLLM's aiohttp session reuses them (:mod:`k3launch.sim.pool`), ``--max-concurrency`` bounding
requests in flight, ``--request-rate`` arrivals from a gamma process (Poisson at burstiness 1),
an initial test request before the run, and ``--save-result`` writing vLLM's JSON (field names
in :mod:`k3launch.sim.bench_stats`). k3launch runs it where no engine container exists; against
a container deployment it runs the image's own ``vllm bench serve`` — either way it reads the
result JSON, never the printed summary.

Prompts are random token ids (the random dataset's prompts are random tokens too), sent as a
token-id prompt, so the input length is exact without a tokenizer. Only the ``random`` dataset
and the completions endpoint are implemented; other choices exit 2 as argparse would.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import sys
import threading
import time
import urllib.parse
from collections.abc import Sequence
from datetime import datetime

from k3launch.sim.bar import Bar
from k3launch.sim.bench_stats import DEFAULT_PERCENTILE_METRICS, METRICS, Outcome, detailed, p_word, summarize
from k3launch.sim.pool import Pool
from k3launch.sim.wire import Json

PROG = "vllm bench serve"
TOKEN_LO, TOKEN_HI = 1000, 30000  # ids every real vocabulary has; the sim only counts them
TOTAL_TIMEOUT_S = 6 * 60 * 60  # vLLM's aiohttp total timeout per request


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Benchmark online serving throughput (k3launch's stdlib client).")
    a = p.add_argument
    a("--backend", default="openai", choices=["openai", "vllm"], help="Only the completions API is implemented.")
    a("--base-url", default=None)
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=8000)
    a("--endpoint", default="/v1/completions")
    a("--model", default=None, help="Default: the first model the server lists.")
    a("--served-model-name", default=None)
    a("--tokenizer", default=None, help="Accepted for compatibility; prompts are token ids.")
    a("--trust-remote-code", action="store_true")
    a("--dataset-name", default="random", choices=["random"])
    a("--num-prompts", type=int, default=1000)
    a("--random-input-len", type=int, default=1024)
    a("--random-output-len", type=int, default=128)
    a("--random-range-ratio", type=float, default=0.0)
    a("--random-prefix-len", type=int, default=0)
    a("--max-concurrency", type=int, default=None)
    a("--request-rate", type=float, default=float("inf"))
    a("--burstiness", type=float, default=1.0)
    a("--seed", type=int, default=0)
    a("--ignore-eos", action="store_true")
    a("--temperature", type=float, default=None)
    a("--num-warmups", type=int, default=0)
    a("--ready-check-timeout-sec", type=int, default=600)
    a("--percentile-metrics", default=None)
    a("--metric-percentiles", default="99")
    a("--label", default=None)
    a("--metadata", metavar="KEY=VALUE", nargs="*")
    a("--save-result", action="store_true")
    a("--save-detailed", action="store_true")
    a("--append-result", action="store_true")
    a("--result-dir", default=None)
    a("--result-filename", default=None)
    a("--disable-tqdm", action="store_true")
    a("--request-id-prefix", default="bench-")
    return p


def main(argv: Sequence[str]) -> int:
    """``bench serve ARGS``; returns the exit code (2: usage, 1: the benchmark could not run)."""
    if not argv or argv[0] != "serve":
        sys.stderr.write("usage: vllm bench {serve} ...\nvllm bench: error: the simulated image only implements 'serve'\n")
        return 2
    args = parser().parse_args(list(argv[1:]))
    for name in ("num_prompts", "random_input_len", "random_output_len"):
        if getattr(args, name) < 1:
            parser().error(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser().error("--max-concurrency must be at least 1")
    if not args.request_rate > 0 or not args.burstiness > 0:
        parser().error("--request-rate and --burstiness must be positive")
    try:
        result = run(args)
    except BenchError as exc:
        sys.stderr.write(f"ValueError: {exc}\n")
        return 1
    if args.save_result or args.append_result:
        save(args, result)
    return 0


class BenchError(Exception):
    """The benchmark cannot run (vLLM raises ValueError: unreachable server, failed test run)."""


def _urls(args: argparse.Namespace) -> tuple[str, str]:
    base = args.base_url.rstrip("/") if args.base_url else f"http://{args.host}:{args.port}"
    return base, base + args.endpoint


def _path(url: str) -> str:
    u = urllib.parse.urlsplit(url)
    return (u.path or "/") + (f"?{u.query}" if u.query else "")


def first_model(base: str) -> str:
    conn = Pool(base, TOTAL_TIMEOUT_S).get()
    try:
        conn.request("GET", _path(base + "/v1/models"))
        body = json.loads(conn.getresponse().read() or b"{}")
        return str(body["data"][0]["id"])
    except (OSError, ValueError, KeyError, IndexError, http.client.HTTPException) as exc:
        raise BenchError(f"cannot list the models of {base} ({exc}); pass --model") from None
    finally:
        conn.close()


def sample(args: argparse.Namespace) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request, from ``--seed``: vLLM's random dataset shape."""
    rng = random.Random(args.seed)
    r = args.random_range_ratio

    def draw(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - r)), int(n * (1 + r)))) if r > 0 else n

    prefix = [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(args.random_prefix_len)]
    return [
        (prefix + [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(draw(args.random_input_len))], draw(args.random_output_len))
        for _ in range(args.num_prompts)
    ]


def request(pool: Pool, path: str, payload: Json, request_id: str) -> Outcome:
    """One streaming completion on a pooled connection, timed like vLLM's ``async_request_openai_completions``."""
    prompt = payload["prompt"]
    out = Outcome(prompt_len=len(prompt) if isinstance(prompt, list) else 0)
    conn = pool.get()
    st = time.perf_counter()
    out.start = st
    last = st
    resp: http.client.HTTPResponse | None = None
    try:
        conn.request("POST", path, body=json.dumps(payload), headers={"Content-Type": "application/json", "x-request-id": request_id})
        resp = conn.getresponse()
        if resp.status != 200:
            out.error = f"HTTP {resp.status} {resp.reason}: {resp.read().decode(errors='replace')[:300]}"
            return out
        got_chunk = False
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if choices := chunk.get("choices"):
                now = time.perf_counter()
                if not got_chunk:
                    got_chunk = True
                    out.ttft = now - st
                else:
                    out.itl.append(now - last)
                last = now
                out.generated_text += choices[0].get("text") or ""
            elif usage := chunk.get("usage"):
                out.output_tokens = int(usage.get("completion_tokens") or 0)
                out.prompt_len = int(usage.get("prompt_tokens") or out.prompt_len)  # as vLLM's client takes it
        resp.read()  # the end of the chunked body: the connection can serve the next request
        out.latency = last - st
        out.success = got_chunk
        if not got_chunk:
            out.error = "Never received a valid chunk to calculate TTFT. This response will be marked as failed!"
    except (OSError, ValueError, http.client.HTTPException) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        resp = None
    finally:
        if resp is not None:
            pool.put(conn, resp)
        else:
            conn.close()
    return out


def _payload(args: argparse.Namespace, model: str, prompt: list[int], output_len: int) -> Json:
    """vLLM's request body; like vLLM's client it sends a temperature only when given one."""
    body: Json = {
        "model": args.served_model_name or model,
        "prompt": prompt,
        "repetition_penalty": 1.0,
        "max_tokens": output_len,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos or args.dataset_name == "random":  # vLLM forces ignore_eos for the random dataset
        body["ignore_eos"] = True
    if args.temperature is not None:
        body["temperature"] = args.temperature
    return body


def _delays(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Send times from the start, gamma-distributed gaps rescaled to n / rate (vLLM's get_request)."""
    if rate == float("inf"):
        return [0.0] * n
    theta = 1.0 / (rate * burstiness)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.gammavariate(burstiness, theta)
        out.append(t)
    scale = (n / rate) / out[-1] if out[-1] > 0 else 1.0
    return [d * scale for d in out]


def _ready_check(args: argparse.Namespace, pool: Pool, path: str, payload: Json) -> None:
    deadline = time.monotonic() + args.ready_check_timeout_sec
    while True:
        first = request(pool, path, payload, f"{args.request_id_prefix}ready")
        if first.success:
            print("Initial test run completed.")
            return
        if time.monotonic() >= deadline:
            raise BenchError(
                f"Initial test run failed - Please make sure benchmark arguments are correctly specified. Error: {first.error}"
            )
        time.sleep(1.0)


def _fire(pool: Pool, path: str, payloads: list[Json], delays: list[float], limit: int | None, prefix: str,
          bar: Bar | None = None) -> list[Outcome]:
    """Send every request at its time; at most ``limit`` in flight (a waiting request's clock starts when it is sent)."""
    outcomes: list[Outcome | None] = [None] * len(payloads)
    sem = threading.BoundedSemaphore(limit) if limit else None

    def one(i: int) -> None:
        if sem is None:
            outcomes[i] = request(pool, path, payloads[i], f"{prefix}{i}")
        else:
            with sem:
                outcomes[i] = request(pool, path, payloads[i], f"{prefix}{i}")
        if bar is not None:
            bar.update()

    t0 = time.perf_counter()
    threads = []
    for i, d in enumerate(delays):
        wait = t0 + d - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        th = threading.Thread(target=one, args=(i,), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    return [o if o is not None else Outcome(prompt_len=0, error="not run") for o in outcomes]


def run(args: argparse.Namespace) -> Json:
    base, url = _urls(args)
    if not args.endpoint.endswith("completions") or args.endpoint.endswith("chat/completions"):
        raise BenchError(f"endpoint {args.endpoint}: k3launch's client implements /v1/completions only")
    model = args.model or first_model(base)
    requests = sample(args)
    payloads = [_payload(args, model, p, n) for p, n in requests]
    pool, path = Pool(url, TOTAL_TIMEOUT_S), _path(url)  # one pool for the whole run, as vLLM's one session
    try:
        if args.ready_check_timeout_sec > 0:
            _ready_check(args, pool, path, payloads[0])
        if args.num_warmups > 0:
            _fire(
                pool,
                path,
                [payloads[0]] * args.num_warmups,
                [0.0] * args.num_warmups,
                args.max_concurrency,
                f"{args.request_id_prefix}warmup-",
            )
        print(f"Traffic request rate: {args.request_rate}\nMaximum request concurrency: {args.max_concurrency}")
        delays = _delays(len(payloads), args.request_rate, args.burstiness, random.Random(args.seed))
        bar = Bar(len(payloads), disable=args.disable_tqdm)  # vLLM's tqdm bar on stderr: how far the run got
        t0 = time.perf_counter()
        outcomes = _fire(pool, path, payloads, delays, args.max_concurrency, args.request_id_prefix, bar)
        duration = time.perf_counter() - t0
        bar.close()
    finally:
        pool.close()
    metrics = [m for m in (args.percentile_metrics or DEFAULT_PERCENTILE_METRICS).split(",") if m]
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise BenchError(f"--percentile-metrics: unknown metric {unknown[0]!r} (allowed: {', '.join(METRICS)})")
    pcts = [float(p) for p in args.metric_percentiles.split(",") if p]
    bench = summarize(outcomes, duration, metrics, pcts)
    _print(bench, args.max_concurrency, metrics, pcts)
    result: Json = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": args.backend,
        "backend": args.backend,
        "label": args.label,
        "model_id": model,
        "tokenizer_id": args.tokenizer or model,
        "num_prompts": args.num_prompts,
    }
    for item in args.metadata or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise BenchError("Invalid metadata format. Please use KEY=VALUE format.")
        result[key.strip()] = value.strip()
    result["request_rate"] = args.request_rate if args.request_rate < float("inf") else "inf"
    result["burstiness"] = args.burstiness
    result["max_concurrency"] = args.max_concurrency
    result.update(bench)
    if args.save_detailed:
        result.update(detailed(outcomes))
    return result


def _print(bench: Json, concurrency: int | None, metrics: list[str], pcts: list[float]) -> None:
    names = {
        "ttft": ("TTFT", "Time to First Token"),
        "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
        "itl": ("ITL", "Inter-token Latency"),
        "e2el": ("E2EL", "End-to-end Latency"),
    }
    lines = [
        "{:=^50}".format(" Serving Benchmark Result "),
        f"{'Successful requests:':<40} {bench['completed']}",
        f"{'Failed requests:':<40} {bench['failed']}",
    ]
    if concurrency is not None:
        lines.append(f"{'Maximum request concurrency:':<40} {concurrency}")
    for label, key in (
        ("Benchmark duration (s):", "duration"),
        ("Total input tokens:", "total_input_tokens"),
        ("Total generated tokens:", "total_output_tokens"),
        ("Request throughput (req/s):", "request_throughput"),
        ("Output token throughput (tok/s):", "output_throughput"),
        ("Total Token throughput (tok/s):", "total_token_throughput"),
    ):
        v = bench[key]
        lines.append(f"{label:<40} {v:<10.2f}" if isinstance(v, float) else f"{label:<40} {v}")
    for m in (m for m in METRICS if m in metrics):
        short, header = names[m]
        lines.append(f"{header:-^50}")
        lines += [
            f"{f'Mean {short} (ms):':<40} {bench[f'mean_{m}_ms']:<10.2f}",
            f"{f'Median {short} (ms):':<40} {bench[f'median_{m}_ms']:<10.2f}",
        ]
        lines += [f"{f'P{p_word(p)} {short} (ms):':<40} {bench[f'p{p_word(p)}_{m}_ms']:<10.2f}" for p in pcts]
    print("\n".join([*lines, "=" * 50]), flush=True)


def save(args: argparse.Namespace, result: Json) -> str:
    """Write (or append) the result JSON where vLLM would; returns the path."""
    label = args.label or args.backend
    conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    base_model = str(result["model_id"]).split("/")[-1]
    name = args.result_filename or f"{label}-{args.request_rate}qps{conc}-{base_model}-{result['date']}.json"
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    with open(name, "a+" if args.append_result else "w", encoding="utf-8") as f:
        if args.append_result and f.tell() != 0:
            f.write("\n")
        json.dump(result, f)
    return name
