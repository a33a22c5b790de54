"""A real CPU deployment as a plan: the cpu-x86 profile, the tiny-llama recipe, the local-cpu
inventory (its venv and vllm_version), host-memory capacity, and plans written in the spelling of
the vLLM that runs (0.32.0 negates booleans with --no-x, 0.33.0 with --enable-x/--disable-x)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from inventory_helpers import example, load_example, plan_json, q, run_cli, write_yaml
from plan_checks import check_plan

from k3launch import api
from k3launch.errors import K3Error
from k3launch.models.plan import Plan
from k3launch.models.selection import Selection
from k3launch.planning.build import build_plan
from k3launch.planning.recipes import RecipeTree
from k3launch.planning.schema import load_schema

TREE = RecipeTree()
TINY = "k3launch/tiny-llama"
MODEL = "/var/cache/k3launch/vllm-cpu/tiny-llama"
CPU_INV = """name: cpus
backend: ssh
hardware: cpu-x86
{extra}
nodes:
  - {{name: c1, address: 10.1.0.1{c1}}}
  - {{name: c2, address: 10.1.0.2{c2}}}
"""


def cpu_inventory(tmp: Path, extra: str = "", c1: str = "", c2: str = "") -> Path:
    return write_yaml(tmp, CPU_INV.format(extra=extra, c1=c1, c2=c2))


def local_cpu(**kw: object) -> Plan:
    return api.plan(example("local-cpu"), recipe=TINY, **kw)


# ------------------------------------------------------------------ profile, recipe, inventory
def test_the_cpu_profile_is_one_engine_rank_per_node_and_restricted() -> None:
    hw = TREE.taxonomy.hardware_profiles["cpu-x86"]
    assert (hw.generation, hw.gpu_count, hw.vendor_platform, hw.is_cpu, hw.restricted) == ("cpu", 1, "cpu", True, True)
    # upstream's CPU profiles say only `generation: cpu`
    assert hw.model_copy(update={"platform": None}).vendor_platform == "cpu"


def test_tiny_llama_loads_strictly_and_k3_stays_the_default() -> None:
    rec = TREE.model(TINY)
    assert rec.model.model_id == MODEL and rec.meta.default_hardware == "cpu-x86" and not rec.features
    assert rec.compatible_strategies == ["single_node_tp", "multi_node_tp", "multi_node_dep", "multi_node_replicas"]
    assert "--max-model-len" in rec.model.base_args
    assert TREE.resolve("tiny-llama") == TINY and TREE.resolve(MODEL) == TINY
    assert build_plan(TREE, Selection()).recipe == "moonshotai/Kimi-K3"


def test_local_cpu_single_node_runs_the_venv_engine_on_its_own_addresses() -> None:
    plan = local_cpu()
    check_plan(load_schema("0.32.0"), plan)
    (proc,) = plan.processes
    assert (plan.platform, plan.hardware, plan.strategy, plan.vllm_version, plan.engine) == ("cpu", "cpu-x86", "single_node_tp", "0.32.0", "vllm")
    assert proc.argv == ["vllm", "serve", MODEL, "--max-model-len", "512", "--tensor-parallel-size", "1", "--port", "8000", "--host", "127.0.0.21",
                         "--disable-access-log-for-endpoints", "/health,/metrics"]
    assert proc.env["VLLM_CPU_KVCACHE_SPACE"] == "1" and proc.env["HF_HUB_OFFLINE"] == "1" and proc.image is None
    (host,) = plan.hosts
    assert host.venv == "/var/cache/k3launch/vllm-cpu/venv" and host.runtime == "bare"
    # never an address (or the router's) of local.yaml's simulated deployments
    local = {n.address for n in load_example("local").nodes} | {"127.0.0.1"}
    assert not {h.address for h in local_cpu(strategy="multi_node_dep").hosts} & local


def test_local_cpu_dep_of_the_dense_model_is_data_parallel_behind_the_head() -> None:
    # no experts to spread and one rank per node: vLLM refuses expert parallelism and (for a dense
    # model) the external load balancing hybrid LB turns into, so the recipe turns both off and the
    # head's API server balances over every DP rank; the other node joins headless, no router
    plan = local_cpu(strategy="multi_node_dep")
    head, rank1 = plan.processes
    assert [head.node, rank1.node] == ["cpu-1", "cpu-2"] and plan.endpoint == "http://127.0.0.21:8000"
    assert all(p.argv[p.argv.index("--data-parallel-size") + 1] == "2" for p in (head, rank1))
    assert rank1.argv[rank1.argv.index("--data-parallel-start-rank") + 1] == "1" and "--headless" in rank1.argv
    assert (head.http_port, rank1.http_port) == (8000, None) and not any(p.role == "router" for p in plan.processes)
    for p in (head, rank1):
        assert "--enable-expert-parallel" not in p.argv and "--no-enable-expert-parallel" in p.argv
        assert "--data-parallel-hybrid-lb" not in p.argv and "--no-data-parallel-hybrid-lb" in p.argv
        assert [e.origin for e in p.provenance["--data-parallel-hybrid-lb"]] == [
            "strategies/multi_node_dep.yaml", "models/k3launch/tiny-llama.yaml strategy_overrides.multi_node_dep"]


def test_local_cpu_tp_spans_two_nodes_with_one_tp_rank_each() -> None:
    head, rank1 = local_cpu(strategy="multi_node_tp").processes
    assert [p.argv[p.argv.index("--tensor-parallel-size") + 1] for p in (head, rank1)] == ["2", "2"]
    assert "--headless" in rank1.argv and rank1.http_port is None and head.http_port == 8000


def test_a_strategy_override_turning_hybrid_load_balancing_off_makes_the_other_nodes_headless(tmp_path: Path) -> None:
    # the layout follows what the composed command says, not the strategy file's flag alone
    import shutil

    root = tmp_path / "recipes"
    shutil.copytree(TREE.root, root)
    path = root / "models" / "k3launch" / "tiny-llama.yaml"
    path.write_text(path.read_text().replace('      - "--no-data-parallel-hybrid-lb"\n', ""))
    plan = api.plan(example("local-cpu"), recipe=TINY, recipes_dir=root, strategy="multi_node_dep")
    assert [p.http_port for p in plan.processes if p.role == "serve"] == [8000, 8000] and plan.processes[-1].role == "router"
    assert not any("--headless" in p.argv for p in plan.processes)


@pytest.mark.parametrize("strategy", ["multi_node_tep", "pd_cluster"])
def test_tiny_llama_refuses_strategies_it_does_not_list(strategy: str) -> None:
    with pytest.raises(K3Error) as e:
        local_cpu(strategy=strategy)
    assert e.value.code == "incompatible-strategy"


def test_k3_on_a_cpu_profile_is_refused_with_the_recipes_that_fit(tmp_path: Path) -> None:
    err = run_cli(["plan", "--json", "-i", str(example("local-cpu")), "--recipe", "moonshotai/Kimi-K3"], tmp_path).error()
    assert err["code"] == "restricted-hardware" and "--recipe k3launch/tiny-llama" in err["hint"], err


def test_without_a_recipe_the_cpu_inventory_gets_the_recipe_made_for_its_hardware(tmp_path: Path) -> None:
    # `k3launch up -i inventories/local-cpu.yaml` serves the tiny model: K3 does not list cpu-x86,
    # and exactly one recipe names it as its default hardware
    out = run_cli(["plan", "--json", "-i", str(example("local-cpu"))], tmp_path)
    plan = json.loads(out.stdout)
    assert plan["recipe"] == "k3launch/tiny-llama" and plan["vllm_version"] == "0.32.0", plan["notices"]
    assert any(n["code"] == "default-recipe" for n in plan["notices"])
    k3 = json.loads(run_cli(["plan", "--json", "-i", str(example("h200-pair"))], tmp_path).stdout)
    assert k3["recipe"] == "moonshotai/Kimi-K3" and not any(n["code"] == "default-recipe" for n in k3["notices"])


def test_kv_offload_is_refused_on_a_cpu_profile() -> None:
    with pytest.raises(K3Error) as e:
        local_cpu(kv_offload="simple")
    assert e.value.code == "kv-offload-hardware" and "CPU profile" in e.value.message


# ------------------------------------------------------------------ capacity on host memory
def test_capacity_uses_the_inventory_host_memory(tmp_path: Path) -> None:
    plan = api.plan(cpu_inventory(tmp_path, "defaults: {cpu_memory_gb: 12}"), recipe=TINY)
    assert plan.capacity.gpu_memory_gb == 12 and plan.capacity.fits
    (note,) = [n.message for n in plan.notices if n.code == "host-memory-capacity"]
    assert "host memory" in note and "12 GB per node" in note and "cpu_memory_gb of inventory cpus" in note


def test_capacity_falls_back_to_the_nominal_memory_and_takes_the_smallest_node(tmp_path: Path) -> None:
    plan = api.plan(cpu_inventory(tmp_path), recipe=TINY)
    (note,) = [n.message for n in plan.notices if n.code == "host-memory-capacity"]
    assert plan.capacity.gpu_memory_gb == 64 and "nominal 64 GB" in note and "set cpu_memory_gb" in note
    plan = api.plan(cpu_inventory(tmp_path, c1=", cpu_memory_gb: 200", c2=", cpu_memory_gb: 3"), recipe=TINY, strategy="multi_node_dep")
    assert [p.gpu_memory_gb for p in plan.capacity.pools] == [6]  # 2 nodes x the smaller 3 GB
    plan = api.plan(cpu_inventory(tmp_path, c1=", cpu_memory_gb: 200"), recipe=TINY, strategy="multi_node_dep")
    assert [p.gpu_memory_gb for p in plan.capacity.pools] == [128]  # c2 sets none: the nominal 64 GB counts


def test_a_model_that_does_not_fit_host_memory_is_refused_saying_so(tmp_path: Path) -> None:
    root = tmp_path / "recipes"
    import shutil

    shutil.copytree(TREE.root, root)
    path = root / "models" / "k3launch" / "tiny-llama.yaml"
    path.write_text(path.read_text().replace('parameter_count: "1.44M"', 'parameter_count: "70B"'))
    inv = cpu_inventory(tmp_path, "defaults: {cpu_memory_gb: 100}")
    with pytest.raises(K3Error) as e:  # 70B x 2 x 1.2 = 168 GB
        api.plan(inv, recipe=TINY, recipes_dir=root, strategy="single_node_tp")
    assert e.value.code == "does-not-fit" and "1 x cpu-x86 = 100 GB of host memory cannot hold the 168 GB" in e.value.message
    plan = api.plan(inv, recipe=TINY, recipes_dir=root, strategy="multi_node_dep")
    assert plan.capacity.fits and plan.nodes == 2
    plan = api.plan(inv, recipe=TINY, recipes_dir=root)  # no strategy asked: the smallest that fits, TP over 2 nodes
    assert (plan.strategy, plan.nodes, plan.capacity.fits) == ("multi_node_tp", 2, True)


# ------------------------------------------------------------------ the engine version
def test_the_version_comes_from_the_selection_else_the_inventory_else_the_default(tmp_path: Path) -> None:
    assert local_cpu().vllm_version == "0.32.0"
    assert local_cpu(vllm_version="0.33.0").vllm_version == "0.33.0"
    assert api.plan(example("local")).vllm_version == "0.33.0" and Selection().vllm_version is None
    assert plan_json(example("local-cpu"), ["--recipe", TINY, "--vllm-version", "0.33.0"], tmp_path)["vllm_version"] == "0.33.0"
    err = run_cli(["plan", "--json", "-i", str(cpu_inventory(tmp_path, 'vllm_version: "0.99.0"')), "--recipe", TINY], tmp_path).error()
    assert err["code"] == "unknown-vllm-version" and "k3launch schema dump --python" in err["hint"], err


def test_an_inventory_vllm_version_must_look_like_one(tmp_path: Path) -> None:
    err = run_cli(["plan", "--json", "-i", str(cpu_inventory(tmp_path, f"vllm_version: {q('0.32 ; rm')}"))], tmp_path).error()
    assert err["code"] == "bad-inventory" and "vllm_version" in err["message"]


@pytest.mark.parametrize("venv", ["venv", "/opt/a:b", "/opt/v\nx"])
def test_a_venv_is_an_absolute_path_without_colons(tmp_path: Path, venv: str) -> None:
    err = run_cli(["plan", "--json", "-i", str(cpu_inventory(tmp_path, f"defaults: {{venv: {q(venv)}}}"))], tmp_path).error()
    assert err["code"] == "bad-inventory" and "venv" in err["message"]


def test_hosts_carry_the_venv_only_when_set() -> None:
    assert "venv" not in api.plan(example("local")).model_dump(mode="json")["hosts"][0]
    assert local_cpu().model_dump(mode="json")["hosts"][0]["venv"] == "/var/cache/k3launch/vllm-cpu/venv"


# ------------------------------------------------------------------ spellings of the selected vLLM
@pytest.mark.parametrize(("version", "written", "emitted"), [
    ("0.32.0", "--disable-prefix-caching", "--no-enable-prefix-caching"),
    ("0.32.0", "--enable-cascade-attn", "--no-disable-cascade-attn"),
    ("0.32.0", "--no-disable-prefix-caching", "--enable-prefix-caching"),
    ("0.33.0", "--no-enable-prefix-caching", "--disable-prefix-caching"),
    ("0.33.0", "--no-disable-cascade-attn", "--enable-cascade-attn"),
])
def test_booleans_are_respelled_for_the_selected_version_with_a_notice(version: str, written: str, emitted: str) -> None:
    schema = load_schema(version)
    (arg,), problems = schema.parse([written])
    assert not problems and arg.legacy and arg.tokens() == [emitted]
    plan = local_cpu(vllm_version=version, sets=(written.removeprefix("--"),))
    assert emitted in plan.processes[0].argv and written not in plan.processes[0].argv
    notes = [n.message for n in plan.notices if n.code == "normalized-flag"]
    assert any(written in m and emitted in m and f"vLLM {version}" in m for m in notes), notes


def test_a_k3_plan_for_0_32_uses_its_spellings() -> None:
    plan = build_plan(TREE, Selection(strategy="pd_cluster", vllm_version="0.32.0"))
    check_plan(load_schema("0.32.0"), plan)
    decode = next(p for p in plan.processes if p.role == "decode")
    assert "--no-enable-prefix-caching" in decode.argv and "--disable-prefix-caching" not in decode.argv
    assert any(n.code == "normalized-flag" and "--disable-prefix-caching" in n.message for n in plan.notices)


def test_the_cli_option_says_where_the_version_comes_from(tmp_path: Path) -> None:
    res = run_cli(["plan", "--help"], tmp_path)
    assert res.code == 0 and "inventory's" in res.stdout and "vllm_version" in res.stdout


def test_local_cpu_is_the_engine_venv_on_loopback() -> None:
    inv = load_example("local-cpu")
    assert (inv.backend, inv.engine, inv.hardware, inv.vllm_version, inv.defaults.runtime) == ("local", "vllm", "cpu-x86", "0.32.0", "bare")
    assert inv.defaults.venv == "/var/cache/k3launch/vllm-cpu/venv" and inv.router.address == "127.0.0.20"
    assert [n.address for n in inv.nodes] == ["127.0.0.21", "127.0.0.22", "127.0.0.23", "127.0.0.24"]


def test_replicas_are_independent_engines_behind_the_router() -> None:
    # vLLM's way for a dense model across nodes: whole copies without --data-parallel-*, one endpoint
    plan = local_cpu(strategy="multi_node_replicas")
    check_plan(load_schema("0.32.0"), plan)
    engines = [p for p in plan.processes if p.role != "router"]
    (router,) = [p for p in plan.processes if p.role == "router"]
    assert [p.node for p in engines] == ["cpu-1", "cpu-2"] and all(p.http_port for p in engines)
    for p in engines:
        assert not any(a.startswith("--data-parallel") or a in ("--nnodes", "--headless", "--master-addr") for a in p.argv), p.argv
        assert p.argv[p.argv.index("--tensor-parallel-size") + 1] == "1"
    assert router.argv[:2] == ["vllm-router", "--worker-urls"] and router.argv[2:4] == [f"http://{p.address}:{p.http_port}" for p in engines]
    assert plan.endpoint == f"http://{router.address}:{router.http_port}"
    (pool,) = plan.capacity.pools
    assert (pool.parallelism, pool.dp, pool.gpu_memory_gb) == ("replicas", 2, 8.0)  # one node holds one copy
    assert any(n.code == "router-added" and "independent replicas" in n.message for n in plan.notices)


def test_replicas_refuse_a_model_one_node_cannot_hold(tmp_path: Path) -> None:
    # 2 MB of host memory per node: two nodes hold the 3 MB of weights split by TP, not a whole copy each
    inv = cpu_inventory(tmp_path, "defaults: {cpu_memory_gb: 0.002}")
    assert api.plan(inv, recipe=TINY, strategy="multi_node_tp", nodes=2).capacity.fits
    with pytest.raises(K3Error) as e:
        api.plan(inv, recipe=TINY, strategy="multi_node_replicas")
    assert e.value.code == "does-not-fit" and "every node holds a whole copy" in e.value.message, e.value.message
