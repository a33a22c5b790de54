"""One test per concrete statement of the Kimi K3 recipe specification (the "seed": the recipe page's
source text, whose statements docs/planning.md follows) about composition, capacity, floors, P/D,
KV offload, features, Advanced and hardware.

Expected values are derived from the seed's own text and tables (quoted in each docstring),
never copied from k3launch's output.
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from k3launch.cli import app
from k3launch.errors import K3Error
from k3launch.models.plan import Plan, Process
from k3launch.models.selection import Selection
from k3launch.planning.build import NodeSpec, build_plan
from k3launch.planning.compose import LAYERS
from k3launch.planning.lint import lint
from k3launch.planning.recipes import RecipeTree
from k3launch.planning.schema import load_schema

# ---------------------------------------------------------------------------------------------
# The seed's figures
# ---------------------------------------------------------------------------------------------

# "2.8T × 0.5 byte/param × 1.2 headroom ≈ 1680GB"
WEIGHTS_GB = 2.8e12 * 0.5 * 1.2 / 1e9

# The Chinese original's hardware table: GPU | config (GPUs x GB) | node total | recipe verified.
#   H100 8×80G 640GB 否 · H200 8×141G 1128GB 是 · B200 8×180G 1440GB 否 · GB200 NVL4 4×192G 768GB 否
#   B300 8×268G 2144GB 是 · GB300 NVL4 4×288G 1152GB 是 · MI300X 8×192G 1536GB 否
#   MI325X 8×256G 2048GB 否 · MI355X 8×288G 2304GB 是
SEED_HW: dict[str, tuple[int, int, bool]] = {  # id: (GPUs per node, GB per GPU, recipe verified)
    "h100": (8, 80, False),
    "h200": (8, 141, True),
    "b200": (8, 180, False),
    "gb200": (4, 192, False),
    "b300": (8, 268, True),
    "gb300": (4, 288, True),
    "mi300x": (8, 192, False),
    "mi325x": (8, 256, False),
    "mi355x": (8, 288, True),
}
ALL_HW = list(SEED_HW)
HOPPER = ["h100", "h200"]
BLACKWELL = ["b200", "gb200", "b300", "gb300"]
NVIDIA = HOPPER + BLACKWELL
AMD = ["mi300x", "mi325x", "mi355x"]
NIXL_PORT = "VLLM_NIXL_SIDE_CHANNEL_PORT"
NIXL_HOST = "VLLM_NIXL_SIDE_CHANNEL_HOST"
GIB = 1024**3


def node_gb(hw: str) -> int:
    gpus, per_gpu, _ = SEED_HW[hw]
    return gpus * per_gpu


def nodes_to_fit(hw: str) -> int:
    return math.ceil(WEIGHTS_GB / node_gb(hw))


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------

TREE = RecipeTree()
SCHEMA = load_schema("0.33.0")


def plan(tree: RecipeTree = TREE, place: list[NodeSpec] | None = None, **kw: object) -> Plan:
    """Build a plan; ``place`` are the machines (placeholders when None), ``kw`` the Selection."""
    return build_plan(tree, Selection(**kw), place)  # type: ignore[arg-type]


def refusal(**kw: object) -> K3Error:
    with pytest.raises(K3Error) as info:
        plan(**kw)
    return info.value


def engines(p: Plan, role: str | None = None) -> list[Process]:
    return [pr for pr in p.processes if pr.role != "router" and (role is None or pr.role == role)]


def flag(argv: list[str], name: str) -> str | None:
    """Value after the last ``name`` in argv (None when absent)."""
    idx = [i for i, tok in enumerate(argv) if tok == name]
    return argv[idx[-1] + 1] if idx else None


def codes(p: Plan) -> set[str]:
    return {n.code for n in p.notices}


def notices(p: Plan, code: str) -> list[str]:
    return [n.message for n in p.notices if n.code == code]


def layers(pr: Process, key: str) -> list[tuple[str, str]]:
    return [(e.layer, e.value) for e in pr.provenance[key]]


def ips(count: int) -> list[NodeSpec]:
    return [NodeSpec(f"gpu{i}", f"10.0.0.{i + 1}", "ib0") for i in range(count)]


def copy_tree(tmp_path: Path) -> Path:
    root = tmp_path / "recipes"
    shutil.copytree(TREE.root, root)
    return root


def edit_yaml(path: Path, change: object) -> None:
    data = yaml.safe_load(path.read_text())
    change(data)  # type: ignore[operator]
    path.write_text(yaml.safe_dump(data, sort_keys=False))


K3_FILE = Path("models/moonshotai/Kimi-K3.yaml")

# ---------------------------------------------------------------------------------------------
# Capacity: weights and hardware
# ---------------------------------------------------------------------------------------------


def test_weights_are_2_8t_x_half_byte_x_1_2_headroom() -> None:
    """'2.8T × 0.5 byte/param × 1.2 headroom ≈ 1680GB' (MXFP4 weights, single variant)."""
    p = plan()
    assert WEIGHTS_GB == pytest.approx(1680)
    assert p.capacity.weights_gb == pytest.approx(WEIGHTS_GB)
    assert "2.8T" in p.capacity.formula and "0.5" in p.capacity.formula and "1.2" in p.capacity.formula


@pytest.mark.parametrize("hw", ALL_HW)
def test_hardware_table_gpus_and_memory_per_node(hw: str) -> None:
    """Hardware table: e.g. 'H200 8×141G 1128GB', 'GB200 NVL4 4×192G 768GB' — GPUs and GB per node."""
    p = plan(hardware=hw, strategy="multi_node_tp", nodes=3)
    assert p.gpus_per_node == SEED_HW[hw][0]
    assert p.capacity.gpu_memory_gb == pytest.approx(3 * node_gb(hw))


def test_gb200_and_gb300_are_4_gpu_nvl4_units() -> None:
    """'GB200 and GB300 ... use 4-GPU NVL4 units ... hence the 4× rather than 8×'."""
    four = {hw for hw in ALL_HW if plan(hardware=hw, strategy="multi_node_tp", nodes=3).gpus_per_node == 4}
    assert four == {"gb200", "gb300"}


@pytest.mark.parametrize("hw", ALL_HW)
def test_only_b300_mi325x_mi355x_hold_the_weights_on_one_node(hw: str) -> None:
    """'only B300, MI325X, and MI355X exceed this threshold with a single node's VRAM'."""
    single = node_gb(hw) >= WEIGHTS_GB
    assert single == (hw in {"b300", "mi325x", "mi355x"})
    if single:
        assert plan(hardware=hw, strategy="single_node_tp").capacity.fits
    else:
        assert refusal(hardware=hw, strategy="single_node_tp").code == "does-not-fit"


@pytest.mark.parametrize(("hw", "total_gb"), [("h100", 1280), ("gb200", 1536)])
def test_two_h100_or_two_gb200_are_refused_with_smallest_fitting_count(hw: str, total_gb: int) -> None:
    """'2×H100 yields 1280GB total, and 2×GB200 NVL4 yields 1536GB — neither can hold the weights'
    (the page may still generate a command; k3launch refuses, naming the smallest node count that fits)."""
    assert 2 * node_gb(hw) == total_gb < WEIGHTS_GB
    err = refusal(hardware=hw, strategy="multi_node_tp", nodes=2)
    assert err.code == "does-not-fit"
    assert str(total_gb) in err.message
    assert f"--nodes {nodes_to_fit(hw)}" in err.hint
    # Following the hint works.
    assert plan(hardware=hw, strategy="multi_node_tp", nodes=nodes_to_fit(hw)).capacity.fits


def test_single_node_refusal_hint_is_actionable() -> None:
    """'All other hardware requires multiple nodes or multiple NVL4 units': the refusal of one H100 node
    must point at a multi-node layout, since single_node_tp cannot take --nodes 3."""
    err = refusal(hardware="h100", strategy="single_node_tp")
    assert err.code == "does-not-fit"
    assert "multi_node" in err.hint


def test_default_hardware_is_the_recipes_b300_not_the_ui_h200x2() -> None:
    """'The recipe YAML specifies default_hardware: b300 ... the page defaults to H200 × 2' (a UI state only)."""
    p = plan()
    assert p.hardware == "b300"
    assert p.verified


@pytest.mark.parametrize("hw", ALL_HW)
def test_verified_marker_and_unverified_hardware_is_allowed_with_notice(hw: str) -> None:
    """Table column 'Recipe 已验证': H200, B300, GB300 NVL4, MI355X are 是 (verified); others 否."""
    p = plan(hardware=hw, strategy="multi_node_tp", nodes=3)
    assert p.verified is SEED_HW[hw][2]
    assert ("unverified-hardware" in codes(p)) is (not SEED_HW[hw][2])


def test_h200_without_strategy_defaults_to_multi_node_tp_on_two_nodes() -> None:
    """H200 (1128 GB/node) cannot hold 1680 GB on one node: it needs multi-node TP on 2 nodes."""
    p = plan(hardware="h200")
    assert (p.strategy, p.nodes) == ("multi_node_tp", nodes_to_fit("h200"))
    assert "strategy-defaulted" in codes(p)


# ---------------------------------------------------------------------------------------------
# Hardware: software stack and mandated backends
# ---------------------------------------------------------------------------------------------

STRATEGY_CASES = [
    {"strategy": "multi_node_tp", "nodes": 4},
    {"strategy": "multi_node_tep", "nodes": 4},
    {"strategy": "multi_node_dep", "nodes": 4},
    {"strategy": "pd_cluster", "prefill_nodes": 3, "decode_nodes": 4},
]


@pytest.mark.parametrize("hw", ALL_HW)
def test_nvidia_images_are_cuda_amd_images_are_rocm(hw: str) -> None:
    """'NVIDIA uses CUDA, AMD uses ROCm, and the corresponding Docker images ... differ'."""
    images = {pr.image for pr in engines(plan(hardware=hw))}
    assert len(images) == 1 and None not in images
    image = images.pop()
    assert image is not None
    assert ("rocm" in image.lower()) is (hw in AMD)


@pytest.mark.parametrize("hw", HOPPER)
def test_hopper_forces_marlin_moe_backend_in_every_strategy(hw: str) -> None:
    """'Hopper (H100/H200) mandates the marlin MoE backend' — also over P/D decode's own MoE backend."""
    for case in STRATEGY_CASES:
        for pr in engines(plan(hardware=hw, **case)):
            assert flag(pr.argv, "--moe-backend") == "marlin", (case, pr.id)


@pytest.mark.parametrize("hw", BLACKWELL)
def test_blackwell_forces_trtllm_ragged_mla_prefill_in_every_strategy(hw: str) -> None:
    """'Blackwell mandates TRT-LLM Ragged MLA'."""
    for case in STRATEGY_CASES:
        for pr in engines(plan(hardware=hw, **case)):
            cfg = json.loads(flag(pr.argv, "--attention-config") or "{}")
            assert cfg.get("mla_prefill_backend") == "TRTLLM_RAGGED", (case, pr.id)


@pytest.mark.parametrize("hw", AMD)
def test_amd_uses_the_aiter_path_in_every_strategy(hw: str) -> None:
    """'AMD uses the AITER path'."""
    for case in STRATEGY_CASES:
        for pr in engines(plan(hardware=hw, **case)):
            assert pr.env.get("VLLM_ROCM_USE_AITER") == "1", (case, pr.id)


def test_amd_pd_decode_keeps_the_aiter_moe_path() -> None:
    """'AMD uses the AITER path ... recipe-level hardware overrides that users cannot modify': the AMD
    decode pool must not run the NVIDIA-only DeepGEMM / FlashInfer MoE kernels."""
    p = plan(hardware="mi355x", strategy="pd_cluster")
    for pr in engines(p):
        assert "deep_gemm" not in (flag(pr.argv, "--moe-backend") or ""), pr.id
        assert "flashinfer" not in (flag(pr.argv, "--all2all-backend") or ""), pr.id


@pytest.mark.parametrize(
    ("hw", "setting"),
    [
        ("h100", "moe-backend=triton"),
        ("h200", "moe-backend=deep_gemm_mega_moe"),
        ("b300", "attention-config.mla_prefill_backend=FLASHINFER"),
        ("gb300", 'attention-config={"use_prefill_query_quantization":false}'),
        ("mi355x", "moe-backend=triton"),
    ],
)
def test_set_cannot_change_hardware_mandated_backends(hw: str, setting: str) -> None:
    """'These are all recipe-level hardware overrides that users cannot modify.'"""
    err = refusal(hardware=hw, sets=(setting,))
    assert err.code == "locked-by-hardware"


def test_set_cannot_change_hopper_backend_in_pd_pools_either() -> None:
    """'users cannot modify' holds for every process, P/D pools included."""
    assert refusal(hardware="h200", strategy="pd_cluster", sets=("moe-backend=deep_gemm_mega_moe",)).code == "locked-by-hardware"


# ---------------------------------------------------------------------------------------------
# Strategies and floors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["single_node_tp", "multi_node_tp", "multi_node_tep", "multi_node_dep", "pd_cluster"])
def test_the_five_strategies_compose(strategy: str) -> None:
    """'The K3 recipe supports five strategies at the bottom layer' (TP, multi-node TP, TEP, DEP, P/D)."""
    p = plan(hardware="b300", strategy=strategy)
    assert p.strategy == strategy
    assert engines(p) and all(pr.argv[:3] == ["vllm", "serve", p.model] for pr in engines(p))


def test_multi_node_tp_two_8_gpu_nodes_is_tp16_head_serves_others_headless() -> None:
    """'two 8-GPU servers correspond to TP=16. The head node serves the HTTP API, while the other
    nodes participate in compute only via --headless'."""
    p = plan(hardware="h200", strategy="multi_node_tp", nodes=2)
    procs = engines(p)
    assert len(procs) == 2
    assert all(flag(pr.argv, "--tensor-parallel-size") == "16" for pr in procs)
    head, other = procs
    assert head.head and head.http_port is not None and "--headless" not in head.argv
    assert not other.head and other.http_port is None and "--headless" in other.argv
    assert p.endpoint.endswith(f":{head.http_port}")


def test_multi_node_tp_size_is_all_gpus_of_the_cluster() -> None:
    """Multi-node TP 'extends a single TP group across multiple machines': TP = GPUs/node × nodes."""
    p = plan(hardware="h100", strategy="multi_node_tp", nodes=3)
    assert {flag(pr.argv, "--tensor-parallel-size") for pr in engines(p)} == {str(3 * 8)}
    assert sum("--headless" in pr.argv for pr in engines(p)) == 2


def test_tep_is_tp_plus_expert_parallel() -> None:
    """'TEP builds on TP by additionally applying EP (Expert Parallel) at the MoE layers'."""
    for pr in engines(plan(hardware="h200", strategy="multi_node_tep", nodes=2)):
        assert flag(pr.argv, "--tensor-parallel-size") == "16"
        assert "--enable-expert-parallel" in pr.argv


def test_dep_on_two_8_gpu_nodes_generates_the_seed_flags_with_tp1() -> None:
    """'two 8-GPU nodes generate: --data-parallel-size 16 --data-parallel-size-local 8
    --data-parallel-hybrid-lb --enable-expert-parallel' and 'In the multi-node DEP configuration ... TP=1'."""
    procs = engines(plan(hardware="h200", strategy="multi_node_dep", nodes=2))
    assert len(procs) == 2
    for pr in procs:
        assert flag(pr.argv, "--data-parallel-size") == "16"
        assert flag(pr.argv, "--data-parallel-size-local") == "8"
        assert "--data-parallel-hybrid-lb" in pr.argv
        assert "--enable-expert-parallel" in pr.argv
        assert flag(pr.argv, "--tensor-parallel-size") in (None, "1")


def test_dep_each_gpu_is_one_dp_rank_dp_size_is_all_gpus() -> None:
    """'Each GPU maps to one local DP rank, the cluster's total GPU count is the DP size' (4 NVL4 trays)."""
    p = plan(hardware="gb300", strategy="multi_node_dep", nodes=4)
    procs = engines(p)
    assert {flag(pr.argv, "--data-parallel-size") for pr in procs} == {"16"}
    assert {flag(pr.argv, "--data-parallel-size-local") for pr in procs} == {"4"}
    ranks = sorted(r for pr in procs for r in range(pr.dp_start_rank or 0, (pr.dp_start_rank or 0) + 4))
    assert ranks == list(range(16))


@pytest.mark.parametrize("hw", ["h200", "b300", "mi355x"])
def test_dep_floor_is_two_8_gpu_nodes_raised_with_notice(hw: str) -> None:
    """'when using DEP on 8-GPU nodes, the floor is 2 nodes — meaning at least 16 GPUs' and 'if the
    user's GPU count falls short, the generator automatically raises it to a valid value'."""
    p = plan(hardware=hw, strategy="multi_node_dep", nodes=1)
    assert p.nodes == 2 and p.nodes * p.gpus_per_node >= 16
    assert "floor-raised" in codes(p)


@pytest.mark.parametrize(("hw", "asked"), [("gb200", 2), ("gb200", 3), ("gb300", 2), ("gb300", 3)])
def test_dep_floor_is_four_4_gpu_nodes_raised_with_notice(hw: str, asked: int) -> None:
    """'for 4-GPU nodes (GB200/GB300), at least 4 nodes are required'."""
    p = plan(hardware=hw, strategy="multi_node_dep", nodes=asked)
    assert p.nodes == 4
    assert "floor-raised" in codes(p)


def test_dep_at_or_above_floor_is_not_raised() -> None:
    """The floor is a minimum: a node count that already meets it is kept, with no floor notice."""
    p = plan(hardware="h200", strategy="multi_node_dep", nodes=3)
    assert p.nodes == 3 and "floor-raised" not in codes(p)
    assert {flag(pr.argv, "--data-parallel-size") for pr in engines(p)} == {"24"}


# ---------------------------------------------------------------------------------------------
# P/D disaggregation
# ---------------------------------------------------------------------------------------------


def test_pd_defaults_prefill_tep_decode_dep() -> None:
    """'The K3 recipe defaults to TEP for Prefill and DEP for Decode.'"""
    p = plan(hardware="b300", strategy="pd_cluster")
    assert [(c.role, c.parallelism) for c in p.capacity.pools] == [("prefill", "tep"), ("decode", "dep")]


def test_pd_tep_and_dep_pools_enable_expert_parallel() -> None:
    """'TEP ... additionally applying EP' and DEP's '--enable-expert-parallel' hold for P/D pools too."""
    p = plan(hardware="b300", strategy="pd_cluster")
    for pr in engines(p):
        assert "--enable-expert-parallel" in pr.argv, pr.id


def test_pd_kv_cache_flows_prefill_to_decode_over_nixl() -> None:
    """'Request → Prefill pool generates KV Cache → KV Cache transferred via NIXL side channel → Decode pool'."""
    p = plan(hardware="b300", strategy="pd_cluster")
    for pr in engines(p):
        cfg = json.loads(flag(pr.argv, "--kv-transfer-config") or "{}")
        assert cfg.get("kv_connector") == "NixlConnector", pr.id
        assert cfg.get("kv_role") == ("kv_producer" if pr.role == "prefill" else "kv_consumer"), pr.id


def test_pd_http_ports_8001_8002() -> None:
    """'The two roles use separate HTTP ports (default 8001/8002)'."""
    p = plan(hardware="h200", strategy="pd_cluster")
    ports = {(pr.role, pr.http_port) for pr in engines(p) if pr.http_port is not None}
    assert ports == {("prefill", 8001), ("decode", 8002)}


def test_pd_nixl_side_channel_ports_5557_5558() -> None:
    """'NIXL side-channel ports (5557/5558)'."""
    p = plan(hardware="h200", strategy="pd_cluster")
    for pr in engines(p):
        assert pr.env[NIXL_PORT] == ("5557" if pr.role == "prefill" else "5558"), pr.id


def test_pd_side_channel_host_is_the_nodes_own_address() -> None:
    """KV cache travels 'via NIXL side channel': each node advertises its own address."""
    p = plan(hardware="h200", strategy="pd_cluster", place=ips(4))
    procs = engines(p)
    assert len({pr.address for pr in procs}) == 4
    for pr in procs:
        assert pr.env[NIXL_HOST] == pr.address, pr.id


def test_pd_pools_have_separate_coordination_addresses_on_disjoint_nodes() -> None:
    """'separate ... cross-node coordination addresses' for the two roles, on two GPU pools."""
    p = plan(hardware="h200", strategy="pd_cluster", place=ips(4))
    pre, dec = engines(p, "prefill"), engines(p, "decode")
    assert not {pr.node for pr in pre} & {pr.node for pr in dec}
    pre_head = next(pr for pr in pre if pr.head)
    dec_head = next(pr for pr in dec if pr.head)
    assert {flag(pr.argv, "--master-addr") for pr in pre} == {pre_head.address}  # TEP: TP master
    assert {flag(pr.argv, "--data-parallel-address") for pr in dec} == {dec_head.address}  # DEP: DP coordinator
    assert pre_head.address != dec_head.address


def test_pd_router_in_front_of_both_pools() -> None:
    """'with a Router directing requests to the appropriate endpoint'."""
    p = plan(hardware="h200", strategy="pd_cluster", place=ips(4))
    routers = [pr for pr in p.processes if pr.role == "router"]
    assert len(routers) == 1
    argv = " ".join(routers[0].argv)
    for pr in engines(p):
        if pr.http_port is not None:
            assert f"{pr.address}:{pr.http_port}" in argv
    assert p.endpoint.endswith(f":{routers[0].http_port}") and routers[0].address in p.endpoint


def test_pd_each_pool_must_hold_the_full_weights() -> None:
    """'two groups of GPUs still each have to hold the full weights' (两组 GPU 仍然各自要装下完整权重):
    1 prefill + 2 decode H200 nodes total 3384 GB, but the 1128 GB prefill pool is refused."""
    assert 3 * node_gb("h200") > WEIGHTS_GB > node_gb("h200")
    err = refusal(hardware="h200", strategy="pd_cluster", prefill_nodes=1, decode_nodes=2)
    assert err.code == "does-not-fit"
    assert "prefill" in err.message + err.hint


def test_pd_capacity_is_reported_per_pool() -> None:
    """Per-pool capacity: every pool's GPU memory is compared to the full 1680 GB."""
    p = plan(hardware="h200", strategy="pd_cluster", prefill_nodes=2, decode_nodes=3)
    assert {(c.role, c.nodes) for c in p.capacity.pools} == {("prefill", 2), ("decode", 3)}
    for c in p.capacity.pools:
        assert c.weights_gb == pytest.approx(WEIGHTS_GB)
        assert c.gpu_memory_gb == pytest.approx(c.nodes * node_gb("h200"))
        assert c.fits
    assert p.nodes == 5


def test_pd_pool_sizes_accept_1_and_16_nodes() -> None:
    """'with 1 to 16 nodes configurable for each'."""
    p = plan(hardware="b300", strategy="pd_cluster", prefill_nodes=1, decode_nodes=16)
    assert {(c.role, c.nodes) for c in p.capacity.pools} == {("prefill", 1), ("decode", 16)}


@pytest.mark.parametrize("kw", [{"prefill_nodes": 17}, {"decode_nodes": 17}, {"prefill_nodes": 0}])
def test_pd_pool_sizes_outside_1_to_16_are_refused(kw: dict[str, int]) -> None:
    """'with 1 to 16 nodes configurable for each'."""
    assert isinstance(refusal(hardware="b300", strategy="pd_cluster", **kw), K3Error)


def test_pd_pools_choose_their_strategy_independently() -> None:
    """'Both Prefill and Decode can independently choose TP, TEP, or DEP'."""
    p = plan(hardware="b300", strategy="pd_cluster", prefill_strategy="dep", decode_strategy="tp")
    assert [(c.role, c.parallelism) for c in p.capacity.pools] == [("prefill", "dep"), ("decode", "tp")]
    assert {flag(pr.argv, "--data-parallel-size") for pr in engines(p, "prefill")} == {"16"}


def test_pd_tp_decode_pool_has_no_data_parallel_flags() -> None:
    """'Both Prefill and Decode can independently choose TP, TEP, or DEP': a TP decode pool is TP only."""
    p = plan(hardware="b300", strategy="pd_cluster", decode_strategy="tp", decode_nodes=1)
    for pr in engines(p, "decode"):
        assert flag(pr.argv, "--tensor-parallel-size") == "8"
        assert not [t for t in pr.argv if t.startswith("--data-parallel")], pr.argv


# ---------------------------------------------------------------------------------------------
# KV offload
# ---------------------------------------------------------------------------------------------


def test_simple_offload_reserves_about_220_gib_host_ram_per_rank() -> None:
    """'Enabling Simple also reserves roughly 220 GiB of CPU memory per rank'."""
    p = plan(hardware="b300", kv_offload="simple")
    kv = p.capacity.kv_offload
    assert kv is not None and kv.option == "simple"
    assert kv.host_gib_per_rank == pytest.approx(220)
    assert kv.host_gib_per_node == pytest.approx(220 * SEED_HW["b300"][0])
    cfg = json.loads(flag(engines(p)[0].argv, "--kv-transfer-config") or "{}")
    assert cfg["kv_connector_extra_config"]["cpu_bytes_to_use_per_rank"] == pytest.approx(220 * GIB, rel=0.02)


def test_kv_offload_off_adds_nothing() -> None:
    """'Off: KV Cache stays in GPU HBM'."""
    p = plan(hardware="b300")
    assert p.capacity.kv_offload is None
    assert all("--kv-transfer-config" not in pr.argv for pr in engines(p))


OFFLOAD_STRATEGIES = {
    "single_node_tp": {"strategy": "single_node_tp"},
    "multi_node_tp": {"strategy": "multi_node_tp", "nodes": 2},
    "multi_node_tep": {"strategy": "multi_node_tep", "nodes": 2},
    "multi_node_dep": {"strategy": "multi_node_dep", "nodes": 2},
    "pd_cluster": {"strategy": "pd_cluster"},
}
# The Chinese original's support matrix (策略 | Off | Simple | Mooncake | LMCache).
OFFLOAD_MATRIX = {
    "single_node_tp": {"simple": True, "mooncake": False, "lmcache": True},
    "multi_node_tp": {"simple": True, "mooncake": False, "lmcache": False},
    "multi_node_tep": {"simple": True, "mooncake": False, "lmcache": False},
    "multi_node_dep": {"simple": True, "mooncake": False, "lmcache": False},
    "pd_cluster": {"simple": False, "mooncake": False, "lmcache": False},
}


@pytest.mark.parametrize(("strategy", "option"), [(s, o) for s in OFFLOAD_MATRIX for o in OFFLOAD_MATRIX[s]])
def test_kv_offload_support_matrix(strategy: str, option: str) -> None:
    """Matrix: single-node TP: Simple ✓ Mooncake ✗ LMCache ✓; multi-node TP/TEP/DEP: Simple only; P/D: none."""
    kw = {**OFFLOAD_STRATEGIES[strategy], "hardware": "b300", "kv_offload": option}
    if OFFLOAD_MATRIX[strategy][option]:
        p = plan(**kw)
        assert p.kv_offload == option
        for pr in engines(p):
            assert pr.provenance["--kv-transfer-config"][-1].layer == "kv_offload"
    else:
        refusal(**kw)


@pytest.mark.parametrize("hw", ALL_HW)
def test_mooncake_is_unsupported_on_all_nine_gpus(hw: str) -> None:
    """'Mooncake is marked as unsupported across all 9 hardware options for K3.'"""
    err = refusal(hardware=hw, kv_offload="mooncake")
    assert err.code != "does-not-fit"
    assert "mooncake" in err.message.lower()


@pytest.mark.parametrize("option", ["simple", "lmcache"])
def test_offload_never_makes_one_h100_node_fit(option: str) -> None:
    """'enabling KV Offload still won't let a single 8×H100 node fit Kimi K3'."""
    assert refusal(hardware="h100", strategy="single_node_tp", kv_offload=option).code == "does-not-fit"


def test_offload_does_not_change_the_weight_figures() -> None:
    """'KV Offload ... cannot solve the 2.8T model weight capacity problem': weights stay in GPU memory."""
    off, simple = plan(hardware="h200", nodes=2), plan(hardware="h200", nodes=2, kv_offload="simple")
    assert (simple.capacity.weights_gb, simple.capacity.gpu_memory_gb) == (off.capacity.weights_gb, off.capacity.gpu_memory_gb)
    assert simple.nodes == off.nodes


# ---------------------------------------------------------------------------------------------
# Features
# ---------------------------------------------------------------------------------------------


def test_tool_calling_adds_kimi_k3_tool_parser() -> None:
    """'Tool Calling: Enables the API to accept a tools parameter and uses the Kimi K3 parser'."""
    on = engines(plan(hardware="b300", features=("tool_calling",)))[0].argv
    off = engines(plan(hardware="b300", no_features=("tool_calling",)))[0].argv
    assert flag(on, "--tool-call-parser") == "kimi_k3" and "--enable-auto-tool-choice" in on
    assert "--tool-call-parser" not in off and "--enable-auto-tool-choice" not in off


def test_reasoning_adds_kimi_k3_reasoning_parser() -> None:
    """'Reasoning: Uses the kimi_k3 reasoning parser'."""
    on = engines(plan(hardware="b300", features=("reasoning",)))[0].argv
    off = engines(plan(hardware="b300", no_features=("reasoning",)))[0].argv
    assert flag(on, "--reasoning-parser") == "kimi_k3"
    assert "--reasoning-parser" not in off


@pytest.mark.parametrize("hw", ALL_HW)
def test_spec_decoding_draft_model_tokens_backend_and_seq_cap(hw: str) -> None:
    """'Spec Decoding: Loads Inferact/Kimi-K3-DSpark ... up to 7 candidate tokens ... NVIDIA uses the
    FLASHINFER_MLA backend; AMD uses TRITON_MLA ... on NVIDIA, max-num-seqs is also capped at 32' (AMD 128)."""
    for pr in engines(plan(hardware=hw, features=("spec_decoding",))):
        spec = json.loads(flag(pr.argv, "--speculative-config") or "{}")
        assert spec["model"] == "Inferact/Kimi-K3-DSpark"
        assert spec["num_speculative_tokens"] == 7
        assert spec["attention_backend"] == ("TRITON_MLA" if hw in AMD else "FLASHINFER_MLA")
        assert flag(pr.argv, "--max-num-seqs") == ("128" if hw in AMD else "32")


def test_spec_decoding_is_absent_unless_enabled() -> None:
    """Spec decoding is a toggle: off, no draft model is loaded."""
    argv = engines(plan(hardware="b300"))[0].argv
    assert "--speculative-config" not in argv


@pytest.mark.parametrize(("hw", "cap"), [("b300", "32"), ("h200", "32"), ("mi355x", "128")])
def test_spec_decoding_overrides_advanced_max_num_seqs_256(hw: str, cap: str) -> None:
    """'max-num-seqs=256 ... if Spec Decoding is also enabled, the Feature layer will then override this with
    NVIDIA 32 or AMD 128 ... the override chain becomes Advanced → Features'."""
    p = plan(hardware=hw, features=("spec_decoding",), advanced=("max-num-seqs",))
    for pr in engines(p):
        assert flag(pr.argv, "--max-num-seqs") == cap
        assert layers(pr, "--max-num-seqs")[-2:] == [("advanced", "256"), ("features", cap)]
    assert any("--max-num-seqs" in m for m in notices(p, "overridden"))


def test_spec_decoding_overrides_a_set_value_too() -> None:
    """'Features in turn override Advanced' — --set writes at the Advanced layer."""
    argv = engines(plan(hardware="b300", features=("spec_decoding",), sets=("max-num-seqs=64",)))[0].argv
    assert flag(argv, "--max-num-seqs") == "32"


def test_text_only_adds_language_model_only() -> None:
    """'Text Only: Adds --language-model-only, skipping the vision encoder.'"""
    assert "--language-model-only" in engines(plan(hardware="b300", features=("text_only",)))[0].argv
    assert "--language-model-only" not in engines(plan(hardware="b300"))[0].argv


# ---------------------------------------------------------------------------------------------
# Advanced
# ---------------------------------------------------------------------------------------------


def test_advanced_batched_tokens_overrides_pd_prefill_16384_and_decode_32() -> None:
    """'max-num-batched-tokens=8192: Overrides PD Prefill's 16384, PD Decode's 32 ...'."""
    before = plan(hardware="b300", strategy="pd_cluster")
    after = plan(hardware="b300", strategy="pd_cluster", advanced=("max-num-batched-tokens",))
    for role, tuned in (("prefill", "16384"), ("decode", "32")):
        assert {flag(pr.argv, "--max-num-batched-tokens") for pr in engines(before, role)} == {tuned}
        for pr in engines(after, role):
            assert flag(pr.argv, "--max-num-batched-tokens") == "8192"
            assert layers(pr, "--max-num-batched-tokens")[-1] == ("advanced", "8192")
    assert notices(after, "overridden")


def test_advanced_batched_tokens_overrides_blackwell_32768() -> None:
    """'... and Blackwell's 32768'."""
    pr = engines(plan(hardware="b300", advanced=("max-num-batched-tokens",)))[0]
    assert flag(pr.argv, "--max-num-batched-tokens") == "8192"
    assert layers(pr, "--max-num-batched-tokens") == [("hardware", "32768"), ("advanced", "8192")]


def test_advanced_max_num_seqs_overrides_amd_128() -> None:
    """'max-num-seqs=256: Overrides AMD's default of 128 ...'."""
    assert flag(engines(plan(hardware="mi355x"))[0].argv, "--max-num-seqs") == "128"
    pr = engines(plan(hardware="mi355x", advanced=("max-num-seqs",)))[0]
    assert flag(pr.argv, "--max-num-seqs") == "256"
    assert layers(pr, "--max-num-seqs") == [("hardware", "128"), ("advanced", "256")]


def test_advanced_max_num_seqs_overrides_pd_decode_32() -> None:
    """'... and PD Decode's 32'. Alone, the preset leaves PD Decode's --max-num-batched-tokens 32 below
    --max-num-seqs 256, which vLLM refuses (SchedulerConfig): the plan is refused, naming both writers;
    with the batch budget preset too, the override stands."""
    assert {flag(pr.argv, "--max-num-seqs") for pr in engines(plan(hardware="b300", strategy="pd_cluster"), "decode")} == {"32"}
    with pytest.raises(K3Error) as e:
        plan(hardware="b300", strategy="pd_cluster", advanced=("max-num-seqs",))
    assert e.value.code == "values-conflict" and "max_num_batched_tokens (32) must be greater than or equal to max_num_seqs (256)" in e.value.message
    assert "strategy_overrides.pd_cluster.decode, strategy layer" in e.value.message and "advanced preset max-num-seqs" in e.value.message
    assert e.value.hint == "fix the recipe, or override it with --set max-num-batched-tokens=VALUE"
    p = plan(hardware="b300", strategy="pd_cluster", advanced=("max-num-seqs", "max-num-batched-tokens"))
    for pr in engines(p, "decode"):
        assert flag(pr.argv, "--max-num-seqs") == "256"
        assert ("strategy", "32") in layers(pr, "--max-num-seqs")


def test_advanced_gpu_memory_utilization_095_does_not_change_the_command() -> None:
    """'gpu-memory-utilization=0.95: K3's base configuration already uses 0.95, so toggling this typically
    won't change the final command'."""
    plain = plan(hardware="b300")
    toggled = plan(hardware="b300", advanced=("gpu-memory-utilization",))
    assert [pr.argv for pr in engines(toggled)] == [pr.argv for pr in engines(plain)]
    assert flag(engines(toggled)[0].argv, "--gpu-memory-utilization") == "0.95"
    assert any("--gpu-memory-utilization" in m for m in notices(toggled, "unchanged"))


def test_advanced_max_model_len_auto_overrides_blackwell_1m() -> None:
    """'max-model-len=auto: Overrides Blackwell's default 1M context window limit'."""
    default = flag(engines(plan(hardware="b300"))[0].argv, "--max-model-len")
    assert default is not None and int(default) in (1_000_000, 1 << 20)
    pr = engines(plan(hardware="b300", advanced=("max-model-len",)))[0]
    assert flag(pr.argv, "--max-model-len") == "auto"
    assert [layer for layer, _ in layers(pr, "--max-model-len")] == ["hardware", "advanced"]


# ---------------------------------------------------------------------------------------------
# Composition order, contradictory booleans, silent overrides
# ---------------------------------------------------------------------------------------------


def test_layer_order_is_the_seeds() -> None:
    """'base → variant → strategy → hardware → Advanced → Features → KV Offload'."""
    assert LAYERS == ("base", "variant", "strategy", "hardware", "advanced", "features", "kv_offload")


def test_every_layer_writing_one_flag_applies_in_seed_order_last_wins(tmp_path: Path) -> None:
    """'the further right a configuration sits, the later it's written. If a later note modifies the same
    setting, the later-written value wins' — one flag written by all seven layers (values 1..7)."""
    root = copy_tree(tmp_path)

    def model(d: dict) -> None:  # type: ignore[type-arg]
        d["model"]["base_args"] += ["--max-num-seqs", "1"]
        d["variants"]["default"]["extra_args"] = ["--max-num-seqs", "2"]
        d["hardware_overrides"]["blackwell"]["extra_args"] += ["--max-num-seqs", "4"]
        d["features"]["text_only"]["args"] += ["--max-num-seqs", "6"]

    def taxonomy(d: dict) -> None:  # type: ignore[type-arg]
        d["advanced"]["max-num-seqs"]["args"] = ["--max-num-seqs", "5"]
        d["kv_offload"]["simple"]["args"] += ["--max-num-seqs", "7"]

    edit_yaml(root / K3_FILE, model)
    edit_yaml(root / "taxonomy.yaml", taxonomy)
    edit_yaml(root / "strategies/single_node_tp.yaml", lambda d: d.__setitem__("vllm_args", ["--max-num-seqs", "3"]))
    p = plan(RecipeTree(root), hardware="b300", strategy="single_node_tp", advanced=("max-num-seqs",),
             features=("text_only",), kv_offload="simple")
    pr = engines(p)[0]
    assert layers(pr, "--max-num-seqs") == list(zip(LAYERS, "1234567", strict=True))
    assert flag(pr.argv, "--max-num-seqs") == "7" and pr.argv.count("--max-num-seqs") == 1
    assert len([m for m in notices(p, "overridden") if "--max-num-seqs" in m]) == 6


SAMPLE_SELECTIONS = [
    {"hardware": hw, **case, "features": ("spec_decoding", "text_only"),
     "advanced": ("max-num-batched-tokens", "max-num-seqs", "gpu-memory-utilization", "max-model-len")}
    for hw in ("h200", "b300", "gb300", "mi355x")
    for case in STRATEGY_CASES
] + [{"hardware": hw, **case} for hw in ("h100", "b200", "mi300x") for case in STRATEGY_CASES]


def test_provenance_follows_layer_order_and_final_value_runs() -> None:
    """Override order: every flag's provenance is in seed layer order, and its last entry is what runs."""
    for kw in SAMPLE_SELECTIONS:
        p = plan(**kw)
        for pr in engines(p):
            for key, entries in pr.provenance.items():
                idx = [LAYERS.index(e.layer) for e in entries if e.layer in LAYERS]
                assert idx == sorted(idx), (kw, pr.id, key)
                if key in pr.env:
                    assert entries[-1].value == pr.env[key], (kw, pr.id, key)


def test_no_value_is_overridden_silently() -> None:
    """'verify ... whether any value was silently overridden by a later configuration layer': every change
    between consecutive writers of a flag or env var is an 'overridden' notice."""
    for kw in SAMPLE_SELECTIONS:
        p = plan(**kw)
        overridden = notices(p, "overridden")
        for pr in engines(p):
            for key, entries in pr.provenance.items():
                changed = any(a.value != b.value for a, b in itertools.pairwise(entries) if b.layer != "fold")
                if changed:
                    assert any(m.startswith((f"{key}:", f"env {key}:")) for m in overridden), (kw, pr.id, key)


def test_generated_commands_have_no_contradictory_or_duplicate_flags() -> None:
    """'verify ... whether contradictory boolean flags appear simultaneously (e.g., --enable-prefix-caching
    alongside --no-enable-prefix-caching)' — lint every composed command."""
    for kw in SAMPLE_SELECTIONS:
        for pr in engines(plan(**kw)):
            bad = [f for f in lint(SCHEMA, pr.argv) if f.code in ("contradictory-boolean", "duplicate-flag")]
            assert not bad, (kw, pr.id, bad)


def test_later_disable_prefix_caching_replaces_blackwell_enable() -> None:
    """Contradictory booleans never both reach a command: --set disable-prefix-caching (Advanced) replaces
    Blackwell's --enable-prefix-caching, with a notice."""
    p = plan(hardware="b300", sets=("disable-prefix-caching",))
    argv = engines(p)[0].argv
    assert "--disable-prefix-caching" in argv and "--enable-prefix-caching" not in argv
    assert any("prefix-caching" in m for m in notices(p, "overridden"))


def test_later_layer_no_enable_form_replaces_enable(tmp_path: Path) -> None:
    """The seed's pair: a later layer's --no-enable-prefix-caching must replace the hardware layer's
    --enable-prefix-caching — one setting, one spelling in the final command."""
    root = copy_tree(tmp_path)
    edit_yaml(root / K3_FILE, lambda d: d["features"]["text_only"]["args"].append("--no-enable-prefix-caching"))
    argv = engines(plan(RecipeTree(root), hardware="b300", features=("text_only",)))[0].argv
    forms = [t for t in argv if t.endswith("prefix-caching")]
    assert len(forms) == 1 and "--enable-prefix-caching" not in forms


@pytest.mark.parametrize("negative", ["--disable-prefix-caching", "--no-enable-prefix-caching"])
def test_both_forms_in_one_layer_are_contradictory(tmp_path: Path, negative: str) -> None:
    """Both forms in one layer cannot be ordered: refused as contradictory."""
    root = copy_tree(tmp_path)
    edit_yaml(root / K3_FILE, lambda d: d["hardware_overrides"]["blackwell"]["extra_args"].append(negative))
    with pytest.raises(K3Error) as info:
        plan(RecipeTree(root), hardware="b300")
    assert info.value.code == "contradictory-flags"


# ---------------------------------------------------------------------------------------------
# CLI (user-visible behaviour)
# ---------------------------------------------------------------------------------------------

RUNNER = CliRunner()


def test_cli_two_h100_refused_exit_2_json_error() -> None:
    """'2×H100 yields 1280GB total ... neither can hold the weights' — exit 2, JSON error, no traceback."""
    r = RUNNER.invoke(app, ["plan", "--hardware", "h100", "--strategy", "multi_node_tp", "--nodes", "2", "--json"])
    assert r.exit_code == 2
    assert "Traceback" not in r.output
    err = json.loads(r.stdout)["error"]
    assert set(err) == {"code", "message", "hint"}
    assert err["code"] == "does-not-fit" and f"--nodes {nodes_to_fit('h100')}" in err["hint"]


def test_cli_two_gb200_refused_exit_2_human() -> None:
    """'2×GB200 NVL4 yields 1536GB' — refused with a hint naming the smallest fitting count."""
    r = RUNNER.invoke(app, ["plan", "--hardware", "gb200", "--strategy", "multi_node_tp", "--nodes", "2"])
    assert r.exit_code == 2
    assert "Traceback" not in r.output
    assert f"--nodes {nodes_to_fit('gb200')}" in r.output


def test_cli_default_plan_is_b300_verified() -> None:
    """'default_hardware: b300' — the recipe default, not the UI's H200 × 2."""
    r = RUNNER.invoke(app, ["plan", "--json"])
    assert r.exit_code == 0
    out = json.loads(r.stdout)
    assert (out["hardware"], out["verified"]) == ("b300", True)
    assert out["capacity"]["weights_gb"] == pytest.approx(WEIGHTS_GB)


def test_cli_locked_backend_refused() -> None:
    """'recipe-level hardware overrides that users cannot modify' — exit 2 with code locked-by-hardware."""
    r = RUNNER.invoke(app, ["plan", "--hardware", "h200", "--set", "moe-backend=triton", "--json"])
    assert r.exit_code == 2
    assert json.loads(r.stdout)["error"]["code"] == "locked-by-hardware"


def test_cli_dep_floor_raised_with_notice() -> None:
    """'the generator automatically raises it to a valid value' — visible as a floor-raised notice."""
    r = RUNNER.invoke(app, ["plan", "--hardware", "gb300", "--strategy", "multi_node_dep", "--nodes", "1", "--json"])
    assert r.exit_code == 0
    out = json.loads(r.stdout)
    assert out["nodes"] == 4 and out["gpus_per_node"] == 4
    assert "floor-raised" in {n["code"] for n in out["notices"]}
