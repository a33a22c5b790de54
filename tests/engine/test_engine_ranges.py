"""Planning refuses exactly the values real vLLM refuses (k3launch.planning.ranges), in vLLM's own words.

A table of ``--set`` values on both sides of each bound and cross-field rule vLLM's config classes
check is planned with the tiny-llama recipe on ``inventories/local-cpu.yaml`` (vLLM 0.32.0), and the
same values go through real vLLM's own path from arguments to config: ``vllm serve``'s parser, then
``AsyncEngineArgs.from_cli_args(args).create_engine_config()`` -- what ``vllm serve`` runs before it
starts any engine process; it needs no accelerator and reads only the local tiny model's config.
Every case planning refuses must be refused there with the words planning quoted; every case it
accepts must build a config. The whole table runs in one child process of the engine's venv
(importing vLLM costs ~10 s; a case, milliseconds).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from typing import TYPE_CHECKING

import pytest
from inventory_helpers import example

from k3launch import api
from k3launch.errors import K3Error
from k3launch.planning.layers import set_tokens
from k3launch.planning.ranges import constraints
from k3launch.planning.schema import load_schema

if TYPE_CHECKING:
    from enginecpu import VllmCpu

pytestmark = [pytest.mark.e2e, pytest.mark.engine]

RECIPE = "k3launch/tiny-llama"  # its base args set --max-model-len 512 (the long-prefill rule is against it)

# (--set values, planning refuses?) -- both sides of each bound, then of each cross-field rule.
CASES: list[tuple[tuple[str, ...], bool]] = [
    (("gpu-memory-utilization=0",), True), (("gpu-memory-utilization=0.0001",), False),
    (("gpu-memory-utilization=1",), False), (("gpu-memory-utilization=1.5",), True), (("gpu-memory-utilization=nan",), True),
    (("max-num-seqs=0",), True), (("max-num-seqs=1",), False), (("max-num-seqs=-3",), True),
    (("max-num-batched-tokens=0",), True), (("max-num-batched-tokens=1k",), False),
    (("block-size=0",), True), (("block-size=1",), False),
    (("max-model-len=-2",), True), (("max-model-len=-1",), False),
    (("max-logprobs=-2",), True), (("max-logprobs=-1",), False),
    (("watermark=1.0",), True), (("watermark=0.99",), False), (("watermark=-1",), True), (("watermark=0",), False),
    (("kv-cache-metrics-sample=0",), True), (("kv-cache-metrics-sample=1",), False),
    (("stream-interval=0",), True), (("stream-interval=1",), False),
    (("cpu-offload-gb=-1",), True), (("cpu-offload-gb=0",), False),
    (("max-num-active-seqs=0",), True), (("spec-tokens=0",), True),
    (("enable-lora", "max-loras=0"), True), (("max-loras=0",), False),  # LoRAConfig is built only with --enable-lora
    # cross-field rules
    (("max-num-seqs=64", "max-num-batched-tokens=32"), True), (("max-num-seqs=64", "max-num-batched-tokens=64"), False),
    (("max-num-seqs=8", "max-num-active-seqs=9"), True), (("max-num-seqs=8", "max-num-active-seqs=8"), False),
    (("long-prefill-token-threshold=513",), True), (("long-prefill-token-threshold=512",), False),
    (("decode-context-parallel-size=2",), True), (("decode-context-parallel-size=1",), False),
    (("enable-lora", "max-loras=4", "max-cpu-loras=2"), True), (("enable-lora", "max-loras=4", "max-cpu-loras=4"), False),
]

VLLM_WORDS = re.compile(r"refuses (?:it|them): (.*) \([A-Za-z_.]+\)$")  # planning's message quotes vLLM, then names the config

# Runs in the engine's venv: one JSON list of argvs (model first) on stdin, one result line per case.
ENGINE_SIDE = r'''
import json, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.usage.usage_lib import UsageContext
from vllm.utils.argparse_utils import FlexibleArgumentParser

top = FlexibleArgumentParser(description="vLLM CLI")
parser = ServeSubcommand().subparser_init(top.add_subparsers(required=False, dest="subparser"))
for argv in json.load(sys.stdin):
    try:
        args = parser.parse_args(argv)
        args.model = args.model_tag  # as ServeSubcommand.cmd does
        AsyncEngineArgs.from_cli_args(args).create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        said = None
    except SystemExit as exc:  # argparse refused the value itself
        said = f"argparse exit {exc.code}"
    except Exception as exc:
        said = f"{type(exc).__name__}: {exc}"
    print("K3-CASE " + json.dumps(said), flush=True)
'''


def _vllm_says(vllm_cpu: VllmCpu, argvs: list[list[str]]) -> list[str | None]:
    env = {**os.environ, **vllm_cpu.env, "VLLM_LOGGING_LEVEL": "ERROR"}
    proc = subprocess.run([vllm_cpu.python, "-c", ENGINE_SIDE], input=json.dumps(argvs), capture_output=True, text=True,
                          timeout=600, env=env, check=False)
    out = [json.loads(line.removeprefix("K3-CASE ")) for line in proc.stdout.splitlines() if line.startswith("K3-CASE ")]
    assert proc.returncode == 0 and len(out) == len(argvs), proc.stderr[-3000:]
    return out


def test_planning_refuses_exactly_what_vllm_refuses(vllm_cpu: VllmCpu) -> None:
    inventory = example("local-cpu")
    base = api.plan(inventory, recipe=RECIPE)
    schema = load_schema(base.vllm_version)
    assert base.vllm_version == "0.32.0" and constraints("0.32.0").rules, "the table is for the vendored 0.32.0 constraints"
    base_argv = [vllm_cpu.model, *base.processes[0].argv[3:]]
    planned: list[K3Error | None] = []
    argvs: list[list[str]] = []
    for sets, _ in CASES:
        try:
            plan = api.plan(inventory, recipe=RECIPE, sets=list(sets))
        except K3Error as err:
            planned.append(err)  # vLLM gets what planning refused: the plan's command plus the values
            argvs.append([*base_argv, *(tok for s in sets for tok in set_tokens(s, schema))])
        else:
            planned.append(None)  # vLLM gets the very command planning composed
            argvs.append([vllm_cpu.model, *plan.processes[0].argv[3:]])
    said = _vllm_says(vllm_cpu, argvs)

    rows, wrong = [], []
    for (sets, want), err, vllm in zip(CASES, planned, said, strict=True):
        m = VLLM_WORDS.search(err.message) if err else None
        words = m.group(1) if m else "(no words of vLLM in planning's message)"
        agree = (err is None) == (vllm is None) and (err is None or words in (vllm or ""))
        lines = (vllm or "config built").splitlines()
        shown = next((ln.strip() for ln in lines if words in ln), lines[0])  # the line with vLLM's words
        rows.append(f"{' '.join(sets):<50} {err.code if err else 'accepted':<19} {shown[:100]:<100} {'ok' if agree else 'DISAGREE'}")
        if not agree or (err is not None) != want:
            wrong.append((sets, err.message if err else None, vllm))
    print("\n" + f"{'--set':<50} {'planning':<19} {'vLLM 0.32.0 (create_engine_config)':<100} agree\n" + "\n".join(rows))
    refused = sum(e is not None for e in planned)
    print(f"[{len(CASES)} cases: {refused} refused by both, {len(CASES) - refused} accepted by both]" if not wrong else "")
    assert not wrong, wrong
