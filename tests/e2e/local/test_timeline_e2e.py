"""The bring-up timeline end to end: ``up`` of a simulated deployment with a 25 s load, not on a
terminal (as in CI, nohup or a Slurm job's output), on its own loopback addresses (127.0.80.x) and
state dir, shows its progress and records the timeline (the timeline itself: test_timeline.py).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_helpers import CLI, local_leftovers
from paths import ROOT

from k3launch.models.phases import Phase

# ---------------------------------------------------------------------- end to end (simulated engine)
LOAD_S = 25.0


STAMP = re.compile(r"^\s*(\d+\.\d)s (\S+)")


def _inventory(tmp: Path) -> Path:
    """The bundled local inventory on this test's own loopback addresses, with a 25 s load."""
    inv = yaml.safe_load((ROOT / "inventories" / "local.yaml").read_text())
    inv["nodes"] = [{"name": f"tl-{i}", "address": f"127.0.80.{i}"} for i in (1, 2)]
    inv["router"] = {"node": "login", "address": "127.0.80.10"}
    inv["defaults"]["env"] = {"K3LAUNCH_SIM_LOAD_S": str(LOAD_S), "K3LAUNCH_SIM_TTFT_MS": "1", "K3LAUNCH_SIM_ITL_MS": "1"}
    path = tmp / "inv.yaml"
    path.write_text(yaml.safe_dump(inv))
    return path


def _cli(state: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "K3LAUNCH_STATE_DIR": str(state), "NO_COLOR": "1"}
    env.pop("COLUMNS", None)  # not a terminal: rich would assume 80 columns
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)


@pytest.mark.e2e
def test_up_not_on_a_terminal_shows_progress_and_records_the_timeline(tmp_path: Path) -> None:
    inv, state, name = _inventory(tmp_path), tmp_path / "state", "tl-e2e"
    rec: dict[str, Any] = {}
    t0 = time.monotonic()
    r = _cli(state, "up", "-i", str(inv), "--name", name, "--port-base", "23800", "--strategy", "multi_node_tp", "--nodes", "2")
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        assert time.monotonic() - t0 >= LOAD_S  # the load really took its 25 s
        lines = r.stdout.splitlines()
        stamped = [(float(m.group(1)), m.group(2), ln) for ln in lines if (m := STAMP.match(ln))]
        progress = [(t, ln) for t, kind, ln in stamped if kind == "progress"]
        assert progress, r.stdout
        # during the load: a line at least every 10 s (a phase change or the summary)
        t_alive = next(t for t, kind, _ in stamped if kind == "alive")
        t_ready = next(t for t, kind, _ in stamped if kind == "ready")
        times = [t_alive] + [t for t, _ in progress if t_alive <= t <= t_ready] + [t_ready]
        assert max(b - a for a, b in itertools.pairwise(times)) <= 10.0 + 1.0, progress  # one poll of slack
        text = r.stdout
        # the phases that last (a phase shorter than a poll is in the timeline below, not always on screen)
        for label in ("loading weights", "compiling / CUDA graphs", "healthy"):
            assert label in text, (label, text)
        assert re.search(r"loading weights \d+% \| Loading safetensors checkpoint shards:", text), text
        assert any(len(ln) > 80 for _, ln in progress)  # a line with the last log line is not cut or wrapped at 80 columns

        tl = _cli(state, "timeline", name, "--json")
        assert tl.returncode == 0, tl.stdout + tl.stderr
        data: dict[str, Any] = json.loads(tl.stdout)
        assert data["ready"] is True and data["slowest"] is not None
        procs = {p["id"]: p for p in data["processes"]}
        rec = json.loads((state / "deployments" / f"{name}.json").read_text())
        assert set(procs) == {p["id"] for p in rec["plan"]["processes"]}
        order = [ph.value for ph in Phase]
        for p in procs.values():
            spans = p["phases"]
            assert spans and spans[0]["phase"] == "starting", p
            assert all(s["start"] <= s["end"] for s in spans), p
            assert all(a["end"] == b["start"] for a, b in itertools.pairwise(spans)), p
            ranks = [order.index(s["phase"]) for s in spans]
            assert ranks == sorted(ranks) or "kv_cache" in [s["phase"] for s in spans], p  # compiling / KV cache may alternate
        engines = [p for p in procs.values() if p["role"] != "router"]
        for p in engines:
            seen = [s["phase"] for s in p["phases"]]
            assert {"waiting_for_peers", "loading_weights", "compiling", "kv_cache"} <= set(seen), seen
        loads = [s["seconds"] for p in engines for s in p["phases"] if s["phase"] == "loading_weights"]
        assert max(loads) >= 0.5 * LOAD_S  # most of the simulated load is the weights
        assert data["slowest"]["process"] in procs and data["slowest"]["waited_for"] in order

        # bench: requests done of total, elapsed and ETA on stderr, read from the client's own bar
        b = _cli(
            state,
            "bench",
            name,
            "--num-prompts",
            "40",
            "--max-concurrency",
            "2",
            "--random-input-len",
            "16",
            "--random-output-len",
            "4",
            "--out",
            str(tmp_path / "bench"),
        )
        assert b.returncode == 0, b.stdout + b.stderr
        said = [ln for ln in b.stderr.splitlines() if ln.startswith("bench ")]
        done = re.fullmatch(r"bench (bench-tl-e2e-\S+): 40/40 requests, \d+s elapsed, done", said[-1]) if said else None
        assert done, b.stderr
        assert "40/40 [" in (tmp_path / "bench" / f"{done.group(1)}.log").read_text()  # the client's bar, in its log
    finally:
        down = _cli(state, "down", name)
    assert down.returncode == 0, down.stdout + down.stderr
    if rec:
        assert local_leftovers({"name": name, "plan": rec["plan"]}) == ({}, [])
