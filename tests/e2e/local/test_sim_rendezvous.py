"""Multi-node rendezvous of the sim over real TCP: TP/PP master and DP coordinator.

"Nodes" are loopback addresses 127.0.0.11-14, each sim gets the argv shape k3launch plans give
``vllm serve`` (see ``k3launch plan --strategy multi_node_tp|multi_node_dep -i inventories/local.yaml``).
Failure cases use a short rendezvous timeout so a missing rank fails within seconds.
"""

from __future__ import annotations

import json
import signal

import pytest
from simproc import Proc, Procs, free_port, get, port_open, post, wait_healthy

pytestmark = pytest.mark.e2e  # simulated engine processes
NODES = ["127.0.0.11", "127.0.0.12", "127.0.0.13", "127.0.0.14"]
SHORT = {"K3LAUNCH_SIM_RENDEZVOUS_TIMEOUT_S": "1.5"}



def tp_node(procs: Procs, rank: int, nnodes: int, master: tuple[str, int], http: int, *, tp: int = 24,
            host: str | None = None, env: dict[str, str] | None = None) -> Proc:
    host = host or NODES[rank]
    args = ["--tensor-parallel-size", str(tp), "--nnodes", str(nnodes), "--node-rank", str(rank),
            "--master-addr", master[0], "--master-port", str(master[1]), "--port", str(http)]
    if rank:
        args.append("--headless")
    return procs.sim(args, {"VLLM_HOST_IP": host, "K3LAUNCH_PROCESS": f"serve-{rank}", **(env or {})}, f"tp-{rank}-{host}")


# -- multi-node TP ------------------------------------------------------------------------------

def test_tp_three_nodes_reach_ready(procs: Procs) -> None:
    master, http = (NODES[0], free_port()), free_port()
    # Headless ranks first: they must retry until the master listens, as on a real cluster.
    workers = [tp_node(procs, r, 3, master, http) for r in (2, 1)]
    head = tp_node(procs, 0, 3, master, http)
    wait_healthy(NODES[0], http, head)
    head.wait_log("All 3 node ranks joined the TP group")
    for w in workers:
        w.wait_log("Joined the TP group at .* all 3 node ranks present")
        w.wait_log("Headless node ready")
    assert not port_open(NODES[1], http) and not port_open(NODES[2], http), "headless ranks never serve HTTP"
    status, body = post(f"http://{NODES[0]}:{http}/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 200 and body["usage"]["completion_tokens"] == 2  # type: ignore[index]

    # A clean stop of the head stops its group cleanly (k3launch down stops every rank).
    head.signal(signal.SIGTERM)
    assert [p.wait_exit(3) for p in (head, *workers)] == [0, 0, 0]


def test_tp_rank_death_takes_the_group_down(procs: Procs) -> None:
    master, http = (NODES[0], free_port()), free_port()
    head = tp_node(procs, 0, 2, master, http, tp=16)
    worker = tp_node(procs, 1, 2, master, http, tp=16)
    wait_healthy(NODES[0], http, head)
    worker.wait_log("Headless node ready")
    worker.signal(signal.SIGKILL)
    assert head.wait_exit(15) == 1
    assert "disconnected: the TP group lost a member" in head.log()


@pytest.mark.parametrize("wrong", ["addr", "port"])
def test_tp_headless_with_wrong_master_fails(procs: Procs, wrong: str) -> None:
    master, http = (NODES[0], free_port()), free_port()
    bad_master = (NODES[3], master[1]) if wrong == "addr" else (master[0], free_port())
    head = tp_node(procs, 0, 3, master, http, env=SHORT)
    good = tp_node(procs, 1, 3, master, http, env=SHORT)
    bad = tp_node(procs, 2, 3, bad_master, http, env=SHORT)
    assert [p.wait_exit(30) for p in (head, good, bad)] == [1, 1, 1]
    assert "missing node ranks: 2" in head.log()
    assert "timed out while trying to connect to" in bad.log()
    assert "rendezvous at" in good.log() and "failed" in good.log()
    assert "Starting vLLM server" not in head.log()


def test_tp_duplicate_node_rank_fails(procs: Procs) -> None:
    master, http = (NODES[0], free_port()), free_port()
    head = tp_node(procs, 0, 3, master, http)
    a = tp_node(procs, 1, 3, master, http)
    b = tp_node(procs, 1, 3, master, http, host=NODES[2])
    assert [p.wait_exit(30) for p in (head, a, b)] == [1, 1, 1]
    assert "node rank 1 joined twice" in head.log()


def test_tp_wrong_nnodes_fails(procs: Procs) -> None:
    master, http = (NODES[0], free_port()), free_port()
    head = tp_node(procs, 0, 3, master, http, tp=6)
    a = tp_node(procs, 1, 2, master, http, tp=6)  # told 2 nodes, the group has 3
    b = tp_node(procs, 2, 3, master, http, tp=6)
    assert [p.wait_exit(30) for p in (head, a, b)] == [1, 1, 1]
    assert "was started with nnodes=2 but the group has nnodes=3" in head.log()


def test_tp_master_address_not_on_this_node_fails(procs: Procs) -> None:
    head = tp_node(procs, 0, 2, ("10.255.255.1", free_port()), free_port(), tp=16)
    assert head.wait_exit(15) == 1
    assert "failed to bind to 10.255.255.1" in head.log()


# -- data parallel across nodes -----------------------------------------------------------------

def dp_node(procs: Procs, index: int, start: int, dp: int, local: int, coord: tuple[str, int], http: int,
            env: dict[str, str] | None = None) -> Proc:
    host = NODES[index]
    args = ["--enable-expert-parallel", "--data-parallel-hybrid-lb", "--tensor-parallel-size", "1",
            "--data-parallel-size", str(dp), "--data-parallel-size-local", str(local),
            "--data-parallel-address", coord[0], "--data-parallel-rpc-port", str(coord[1]), "--port", str(http)]
    if start:
        args += ["--data-parallel-start-rank", str(start)]
    return procs.sim(args, {"VLLM_HOST_IP": host, "K3LAUNCH_PROCESS": f"serve-{index}", **(env or {})}, f"dp-{index}-{start}")


@pytest.mark.parametrize("nodes", [2, 4])
def test_dep_every_node_serves_with_hybrid_lb(procs: Procs, nodes: int) -> None:
    coord, http = (NODES[0], free_port()), free_port()
    sims = [dp_node(procs, i, 8 * i, 8 * nodes, 8, coord, http) for i in reversed(range(nodes))][::-1]
    for i, p in enumerate(sims):
        wait_healthy(NODES[i], http, p)
    sims[0].wait_log(f"All {8 * nodes} DP ranks joined the DP group")
    for i in range(nodes):
        status, body = post(f"http://{NODES[i]}:{http}/v1/completions", {"prompt": "x", "max_tokens": 3})
        assert status == 200 and body["usage"]["completion_tokens"] == 3, body  # type: ignore[index]
    # every node reports its own global DP ranks as engines, as vLLM's hybrid LB does
    metrics = get(f"http://{NODES[nodes - 1]}:{http}/metrics")[1].decode()
    start = 8 * (nodes - 1)
    assert f'engine="{start}"' in metrics and f'engine="{start + 7}"' in metrics and 'engine="0"' not in metrics


def test_dep_duplicate_start_rank_fails(procs: Procs) -> None:
    coord, http = (NODES[0], free_port()), free_port()
    sims = [dp_node(procs, 0, 0, 24, 8, coord, http), dp_node(procs, 1, 8, 24, 8, coord, http),
            dp_node(procs, 2, 8, 24, 8, coord, http)]
    assert [p.wait_exit(30) for p in sims] == [1, 1, 1]
    assert "DP rank 8 joined twice" in sims[0].log()


def test_dep_missing_start_rank_fails(procs: Procs) -> None:
    coord, http = (NODES[0], free_port()), free_port()
    sims = [dp_node(procs, 0, 0, 24, 8, coord, http, SHORT), dp_node(procs, 1, 8, 24, 8, coord, http, SHORT)]
    assert [p.wait_exit(30) for p in sims] == [1, 1]
    assert "missing DP ranks: 16, 17, 18, 19, 20, 21, 22, 23" in sims[0].log()
    assert not port_open(NODES[1], http)


def test_dep_rank_out_of_range_fails(procs: Procs) -> None:
    coord, http = (NODES[0], free_port()), free_port()
    head = dp_node(procs, 0, 0, 16, 8, coord, http)
    other = dp_node(procs, 1, 8, 24, 8, coord, http)  # thinks DP is 24
    assert [p.wait_exit(30) for p in (head, other)] == [1, 1]
    assert "data_parallel_size=24 but the group has data_parallel_size=16" in head.log()


def test_dep_internal_lb_secondary_is_headless(procs: Procs) -> None:
    coord, http = (NODES[0], free_port()), free_port()
    common = ["--tensor-parallel-size", "1", "--data-parallel-size", "16", "--data-parallel-size-local", "8",
              "--data-parallel-address", coord[0], "--data-parallel-rpc-port", str(coord[1]), "--port", str(http)]
    head = procs.sim(common, {"VLLM_HOST_IP": NODES[0]}, "head")
    sec = procs.sim([*common, "--data-parallel-start-rank", "8", "--headless"], {"VLLM_HOST_IP": NODES[1]}, "secondary")
    wait_healthy(NODES[0], http, head)
    sec.wait_log("Headless node ready")
    assert not port_open(NODES[1], http)
    assert json.loads(get(f"http://{NODES[0]}:{http}/v1/models")[1])["data"][0]["id"]
