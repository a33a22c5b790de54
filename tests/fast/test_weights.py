"""``k3launch weights check / fetch`` and ``up``'s ``weights-missing`` refusal.

The node-side check (a stdlib Python program) runs for real on stand-in Hugging Face caches
(tests/support/standin.py: the hub layout, real safetensors headers) on this machine's local
nodes; fetches copy from a shared path and from another node. No hub access anywhere: the hub
download is checked for what it runs (the token stays in its file). ``up``'s refusal end to end:
test_weights_e2e.py; a fetch between sshd test hosts: test_weights_ssh.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import standin
from e2e_helpers import Cli
from paths import ROOT

from k3launch import api
from k3launch.deploy.ssh import weights
from k3launch.deploy.ssh.fetch import fetch_command
from k3launch.errors import K3Error
from k3launch.models.weights import FetchProgress as Progress
from k3launch.models.weights import Source
from k3launch.testing import FakeRunner
from k3launch.transport.fleet import Fleet

if TYPE_CHECKING:
    pass

TINY = Path("/var/cache/k3launch/vllm-cpu/tiny-llama")


def states(rows: list[Any]) -> dict[str, tuple[bool, str]]:
    return {r.node: (r.complete, r.error or (r.state.problem() if r.state else "")) for r in rows}


def test_check_reads_the_hub_layout_and_catches_missing_and_truncated_shards(tmp_path: Path) -> None:
    inv, caches = standin.two_nodes(tmp_path)
    snap = standin.hf_cache(caches["w-1"] / "hub", shards=3)
    plan = api.plan(inv, strategy="multi_node_tp", nodes=2)
    got = states(api.weights_check(plan, inv))
    assert got["w-1"] == (True, "") and not got["w-2"][0] and "no refs/main" in got["w-2"][1], got
    (r1,) = [r for r in api.weights_check(plan, inv) if r.node == "w-1"]
    assert r1.state is not None and r1.state.files == 3 and r1.state.dir == str(snap) and r1.state.commit == standin.COMMIT
    assert r1.state.free is not None and r1.state.free > 0
    assert r1.state.total == 3 * standin.TENSOR_BYTES  # the index's metadata.total_size: the checkpoint's own size

    standin.truncate(snap, "model-00002-of-00003.safetensors")
    (snap / "model-00003-of-00003.safetensors").unlink()
    got = states(api.weights_check(plan, inv))
    assert not got["w-1"][0] and "1 file(s) missing: model-00003-of-00003.safetensors" in got["w-1"][1], got
    size = len(standin.shard(index=1))
    assert f"model-00002-of-00003.safetensors is {size - 64} bytes, its header says {size}" in got["w-1"][1], got


def test_check_follows_the_plans_revision_and_reads_a_plain_model_directory(tmp_path: Path) -> None:
    inv, caches = standin.two_nodes(tmp_path)
    other = "f" * 40
    for c in caches.values():
        standin.hf_cache(c / "hub", commit=other, ref="v2")  # only the revision v2 (and commit ffff...) is there
    plan = api.plan(inv, strategy="multi_node_tp", nodes=2)
    assert not any(c for c, _ in states(api.weights_check(plan, inv)).values())  # main: not there
    pinned = api.plan(inv, strategy="multi_node_tp", nodes=2, sets=[f"revision={other}"])
    assert weights.revision(pinned) == other
    assert all(c for c, _ in states(api.weights_check(pinned, inv)).values())
    if not TINY.is_dir():
        pytest.skip(f"{TINY} not built (tests/infra/vllm-cpu-up.sh)")
    cpu = api.plan(ROOT / "inventories" / "local-cpu.yaml", recipe="k3launch/tiny-llama")
    (row,) = api.weights_check(cpu, ROOT / "inventories" / "local-cpu.yaml")
    assert row.complete and row.state is not None and row.state.dir == str(TINY) and row.state.files == 1, (
        row
    )  # one model.safetensors, no index


def test_fetch_from_a_shared_path_then_from_another_node(tmp_path: Path) -> None:
    inv, caches = standin.two_nodes(tmp_path)
    shared = tmp_path / "shared"
    standin.hf_cache(shared / "hub")  # an HF_HOME on a shared filesystem
    plan = api.plan(inv, strategy="multi_node_tp", nodes=2)
    seen: list[Progress] = []
    rows = api.weights_fetch(plan, inv, from_path=str(shared), on_progress=seen.append, interval=0.1)
    assert all(r.complete and r.fetched for r in rows), states(rows)
    assert seen and seen[-1].nodes_done == seen[-1].nodes == 2 and seen[-1].done_bytes > 0
    assert (
        caches["w-2"] / "hub" / "models--moonshotai--Kimi-K3" / "snapshots" / standin.COMMIT / "config.json"
    ).is_symlink()  # cp -a kept the layout

    # w-2 loses a shard; w-1 has the model: copy it over (a tar stream between the two nodes)
    snap2 = caches["w-2"] / "hub" / "models--moonshotai--Kimi-K3" / "snapshots" / standin.COMMIT
    standin.truncate(snap2, "model-00001-of-00002.safetensors")
    rows = api.weights_fetch(plan, inv, from_node="w-1", interval=0.1)
    got = {r.node: r for r in rows}
    assert got["w-2"].complete and got["w-2"].fetched and got["w-1"].complete and not got["w-1"].fetched, states(rows)


def test_fetch_refuses_a_source_that_cannot_work(tmp_path: Path) -> None:
    inv, _ = standin.two_nodes(tmp_path)
    plan = api.plan(inv, strategy="multi_node_tp", nodes=2)
    with pytest.raises(K3Error) as exc:
        api.weights_fetch(plan, inv, from_node="w-1")  # w-1 has nothing to give
    assert exc.value.code == "bad-source" and "not complete there" in exc.value.message
    rows = api.weights_fetch(plan, inv, from_path=str(tmp_path / "nowhere"), interval=0.1)
    assert not any(r.complete for r in rows) and all("no models--moonshotai--Kimi-K3 in" in r.error for r in rows), states(rows)


def test_the_hub_download_runs_on_the_node_with_the_token_file_never_the_token(tmp_path: Path) -> None:
    inv, _ = standin.two_nodes(tmp_path)
    plan = api.plan(inv, strategy="multi_node_tp", nodes=2)
    fleet = Fleet.for_plan(plan, FakeRunner(), FakeRunner())
    cmd = fetch_command(plan, fleet, "w-1", Source("hub", token_file="~/.hf/token"))
    assert 'export HF_TOKEN_PATH="$HOME"/.hf/token' in cmd and "snapshot_download(repo_id=sys.argv[1], revision=sys.argv[2]" in cmd
    assert f"moonshotai/Kimi-K3 main {tmp_path}/hf-1/hub" in cmd and "HF_TOKEN=" not in cmd
    cpu = api.plan(ROOT / "inventories" / "local-cpu.yaml", recipe="k3launch/tiny-llama")
    with pytest.raises(K3Error) as exc:
        fetch_command(cpu, Fleet.for_plan(cpu, FakeRunner(), FakeRunner()), cpu.processes[0].node, Source("hub"))
    assert exc.value.code == "bad-source" and "--from-path" in exc.value.hint


def test_weights_cli_exit_codes_table_and_json(tmp_path: Path) -> None:
    inv, caches = standin.two_nodes(tmp_path)
    standin.hf_cache(caches["w-1"] / "hub")
    sel = ("-i", str(inv), "--strategy", "multi_node_tp", "--nodes", "2")
    r = Cli(tmp_path / "state").run("weights", "check", *sel, "--json", timeout=120)
    out = json.loads(r.stdout)
    assert r.returncode == 1 and not out["complete"], r.stdout + r.stderr
    assert [(n["node"], n["complete"]) for n in out["nodes"]] == [("w-1", True), ("w-2", False)]
    assert [n["index_total_bytes"] for n in out["nodes"]] == [2 * standin.TENSOR_BYTES, None]  # w-2 has no index
    r = Cli(tmp_path / "state").run("weights", "fetch", *sel, "--from-node", "w-1", "--interval", "0.1", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "weights fetch: 1/1 node(s) done" in r.stderr and "complete" in r.stdout
    assert all(len(line) < 200 for line in r.stderr.splitlines())  # plain lines, not a wrapped table
