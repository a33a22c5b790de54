"""The bad-value corpus: bad inputs x commands, each refused in one ``error:`` and one ``hint:`` line.

Every row runs the real command line in-process (Typer's CliRunner: the code path of
``k3launch``) from an empty working directory with its own HOME and state dir, and checks: exit
2, one ``error:`` line saying what is wrong and one ``hint:`` line and nothing else on stderr,
no traceback and no ``internal error``, the same refusal as one JSON object under ``--json``,
and no file created anywhere but the state dir. Add a row for every bug of this kind.

Below the table: the pieces a row cannot show (the bounds themselves, campaign counts, a
failing filesystem, paramiko's logging). Ctrl-C at several moments of a real ``up``:
test_faults_values_e2e.py.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from paths import ROOT
from pydantic import BaseModel
from typer.testing import CliRunner

from k3launch.campaign.file import Campaign, load_campaign
from k3launch.campaign.matrix import expand, group
from k3launch.cli import app
from k3launch.errors import K3Error
from k3launch.util import bounds
from k3launch.util.yamlio import load_yaml_model


@dataclass(frozen=True)
class Row:
    args: str  # the command line; {name} fields are the paths of the `where` fixture
    code: str  # the error code --json reports
    says: str  # words the error line must contain (what is wrong, in the user's terms)
    json: bool = True  # the command takes --json


ROWS = [
    # numbers on the command line: not numbers, NaN, infinities, negatives, out of range
    Row("plan --nodes two", "bad-value", "--nodes 'two': not a whole number"),
    Row("plan --nodes 99999999999999999999999", "bad-value", "--nodes 99999999999999999999999: above the maximum"),
    Row("plan --strategy multi_node_tp --nodes 100000", "bad-value", "--nodes 100000: above the maximum"),
    Row("plan --nodes 0", "bad-value", "--nodes 0: below the minimum"),
    Row("plan --nodes -3", "bad-value", "--nodes -3: negative"),
    Row("plan --nodes 2.5", "bad-value", "--nodes '2.5'"),
    Row("plan --strategy pd_cluster --prefill-nodes -1", "bad-value", "--prefill-nodes -1: negative"),
    Row("plan --strategy pd_cluster --decode-nodes 99999", "bad-value", "--decode-nodes 99999: above the maximum"),
    Row("explain max-num-seqs --nodes nan", "bad-value", "--nodes 'nan'"),
    Row("render -o {tmp}/r --nodes 0", "bad-value", "--nodes 0"),
    Row("up --dry-run --state-dir {state} --ready-timeout nan", "bad-value", "--ready-timeout nan: not a number"),
    Row("up --dry-run --state-dir {state} --ready-timeout -5", "bad-value", "--ready-timeout -5: negative"),
    Row("up --dry-run --state-dir {state} --ready-timeout 0", "bad-value", "--ready-timeout 0: below the minimum"),
    Row("up --dry-run --state-dir {state} --ready-timeout inf", "bad-value", "--ready-timeout inf: not a finite number"),
    Row("up --dry-run --state-dir {state} --ready-timeout 1e400", "bad-value", "--ready-timeout 1e400: not a finite number"),
    Row("up --dry-run --state-dir {state} --connect-timeout -1", "bad-value", "--connect-timeout -1: negative"),
    Row("up --dry-run --state-dir {state} --queue-timeout nan", "bad-value", "--queue-timeout nan"),
    Row("up --dry-run --state-dir {state} --nodes 99999999999999999999999", "bad-value", "--nodes 99999999999999999999999"),
    Row("status k3-x --state-dir {state} --connect-timeout -1", "bad-value", "--connect-timeout -1: negative"),
    Row("status k3-x --state-dir {state} --connect-timeout nan", "bad-value", "--connect-timeout nan"),
    Row("logs k3-x --state-dir {state} --lines -5", "bad-value", "--lines -5: negative", json=False),
    Row("logs k3-x --state-dir {state} -n lots", "bad-value", "--lines 'lots'", json=False),
    Row("logs k3-x --state-dir {state} --connect-timeout 0", "bad-value", "--connect-timeout 0", json=False),
    Row("down k3-x --state-dir {state} --grace nan", "bad-value", "--grace nan: not a number"),
    Row("down k3-x --state-dir {state} --grace -1", "bad-value", "--grace -1: negative"),
    Row("down k3-x --state-dir {state} --grace inf", "bad-value", "--grace inf"),
    Row("down k3-x --state-dir {state} --connect-timeout -0.5", "bad-value", "--connect-timeout -0.5"),
    Row("chat k3-x hi --state-dir {state} --max-tokens 0", "bad-value", "--max-tokens 0"),
    Row("bench k3-x --state-dir {state} --num-prompts 0", "bad-value", "--num-prompts 0"),
    Row("bench k3-x --state-dir {state} --seed -1", "bad-value", "--seed -1: negative"),
    Row("bench k3-x --state-dir {state} --max-concurrency 1000000000000", "bad-value", "--max-concurrency 1000000000000"),
    Row("bench k3-x --state-dir {state} --random-input-len 99999999999", "bad-value", "--random-input-len 99999999999"),
    Row("bench k3-x --state-dir {state} --random-output-len nan", "bad-value", "--random-output-len 'nan'"),
    Row("bench k3-x --state-dir {state} --request-rate nan", "bad-rate", "--request-rate nan: not a number"),
    Row("bench k3-x --state-dir {state} --request-rate -4", "bad-rate", "--request-rate -4: negative"),
    Row("bench k3-x --state-dir {state} --request-rate 1e300", "bad-rate", "--request-rate 1e300: above the maximum"),
    Row("campaign run local-demo --out {tmp}/o --dry-run --group -1", "bad-value", "--group -1"),
    Row("campaign run local-demo --out {tmp}/o --dry-run --group x", "bad-value", "--group 'x'"),
    Row("campaign run local-demo --out {tmp}/o --slurm-array --array-limit 0", "bad-value", "--array-limit 0"),
    Row("campaign run local-demo --out {tmp}/o --dry-run --port-base 99999999999999", "bad-port-base", "leaves 1024-65535"),
    Row("campaign run local-demo --out {tmp}/o --dry-run --port-base 8000", "bad-port-base", "overlaps the default ports"),
    Row("campaign run local-demo --out {tmp}/o --dry-run --port-base nine", "bad-value", "--port-base 'nine': not a whole number"),
    # usage: unknown options and commands, missing values and arguments
    Row("plan --nods 2", "bad-usage", "no such option: --nods"),
    Row("plan --nodes", "bad-usage", "'--nodes' requires an argument"),
    Row("down k3-x --state-dir {state} --grace", "bad-usage", "'--grace' requires an argument"),
    Row("status", "bad-usage", "missing argument"),
    Row("nosuchcmd", "bad-usage", "no such command 'nosuchcmd'", json=False),
    Row("campaign nosuch", "bad-usage", "no such command 'nosuch'", json=False),
    Row("--bogus plan", "bad-usage", "no such option: --bogus", json=False),
    # numbers in files, and files that are not what they should be
    Row("plan -i {inv_mem_inf}", "bad-inventory", "defaults.cpu_memory_gb: Input should be a finite number"),
    Row("plan -i {inv_mem_nan}", "bad-inventory", "defaults.cpu_memory_gb: Input should be a finite number"),
    Row("up --dry-run --state-dir {state} -i {inv_mem_huge}", "bad-inventory", "cpu_memory_gb: Input should be less than or equal to"),
    Row("plan -i {inv_dup_top}", "duplicate-key", "inv_dup_top.yaml:6: duplicate key 'nodes' (first at line 4)"),
    Row("render -o {tmp}/r -i {inv_dup_node}", "duplicate-key", "inv_dup_node.yaml:4: duplicate key 'address' (first at line 4)"),
    Row("plan -i {inv_latin1}", "bad-encoding", "inv_latin1.yaml:2: not UTF-8 text (byte 0xe9)"),
    Row("up --dry-run --state-dir {state} -i {inv_binary}", "bad-encoding", "inv_binary.yaml:2: not UTF-8 text (byte 0x80)"),
    Row("plan -i {inv_nul}", "bad-yaml", "inv_nul.yaml:2: malformed YAML"),
    Row("plan -i {inv_deep}", "bad-yaml", "nested more than 100 levels deep"),
    Row("plan -i {tmp}", "unreadable-file", "is a directory, not an inventory file"),
    Row("plan --recipes-dir {recipes_dup}", "duplicate-key", "duplicate key 'meta' (first at line 7)"),
    Row("campaign run {camp_dup} --out {tmp}/o --dry-run", "duplicate-key", "camp_dup.yaml:4: duplicate key 'load' (first at line 2)"),
    Row("campaign report {camp_dup} --out {tmp}/o", "duplicate-key", "duplicate key 'load'"),
    Row("campaign run {camp_latin1} --out {tmp}/o --dry-run", "bad-encoding", "not UTF-8 text"),
    Row(
        "campaign run {camp_ready_nan} --out {tmp}/o --dry-run",
        "bad-campaign",
        "camp_ready_nan.yaml:2: ready_timeout: Input should be a finite number",
    ),
    Row("campaign run {camp_nodes0} --out {tmp}/o --dry-run", "bad-campaign", "deployments.nodes.1"),
    Row("campaign run {camp_nodes_huge} --out {tmp}/o --dry-run", "bad-campaign", "deployments.nodes.0"),
    Row("campaign run {camp_rate} --out {tmp}/o --dry-run", "bad-campaign", "request rate 1e+300"),
    Row("campaign run {camp_conc} --out {tmp}/o --dry-run", "bad-campaign", "max_concurrency"),
    Row("campaign run {camp_seed} --out {tmp}/o --dry-run", "bad-campaign", "bench.seed"),
    Row("campaign run {camp_ports} --out {tmp}/o --dry-run", "bad-campaign", "camp_ports.yaml:2: port_base: 70000: its block"),
    Row("campaign run {camp_big} --out {tmp}/o --dry-run", "campaign-too-large", "20200 cells (101 deployment points x 200 load points)"),
    Row("campaign run {camp_huge} --out {tmp}/o --dry-run", "campaign-too-large", "6400000 cells"),
]

INVENTORY = "name: bad\nbackend: ssh\nhardware: b300\nnodes:\n  - {name: n1, address: 10.9.0.1}\n"


def _campaign(**body: object) -> str:
    return yaml.safe_dump({"name": "bad", **body}, sort_keys=False)


def _write_files(tmp: Path) -> dict[str, str]:
    """The bad files of the corpus, by placeholder name."""
    files: dict[str, bytes] = {
        "inv_mem_inf": INVENTORY.replace("nodes:", "defaults: {cpu_memory_gb: 1e400}\nnodes:").encode(),
        "inv_mem_nan": INVENTORY.replace("nodes:", "defaults: {cpu_memory_gb: .nan}\nnodes:").encode(),
        "inv_mem_huge": INVENTORY.replace("nodes:", "defaults: {cpu_memory_gb: 1e12}\nnodes:").encode(),
        "inv_dup_top": (INVENTORY + "nodes:\n  - {name: n2, address: 10.9.0.2}\n").encode(),
        "inv_dup_node": b"name: bad\nbackend: ssh\nnodes:\n  - {name: n1, address: 10.9.0.1, address: 10.9.0.2}\n",
        "inv_latin1": "name: bad\ndescription: Caf\u00e9 cluster\nbackend: ssh\n".encode("latin-1"),
        "inv_binary": b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 4,
        "inv_nul": b"name: bad\nbackend: s\x00sh\n",
        "inv_deep": ("name: bad\nbackend: ssh\ndescription: " + "[" * 20_000 + "]" * 20_000 + "\n").encode(),
        "camp_dup": b"name: bad\nload:\n  max_concurrency: [1, 2]\nload:\n  max_concurrency: [4]\n",
        "camp_latin1": "name: bad\ndescription: d\u00e9j\u00e0 vu\n".encode("latin-1"),
        "camp_ready_nan": b"name: bad\nready_timeout: .nan\n",
        "camp_nodes0": _campaign(base={"strategy": "multi_node_tp"}, deployments={"nodes": [2, 0]}).encode(),
        "camp_nodes_huge": _campaign(deployments={"nodes": [99999999999999999999999]}).encode(),
        "camp_rate": _campaign(load={"request_rate": [4, 1e300]}).encode(),
        "camp_conc": _campaign(load={"max_concurrency": [1, 10**12]}).encode(),
        "camp_seed": _campaign(bench={"seed": -1}).encode(),
        "camp_ports": _campaign(port_base=70000).encode(),
        # 101 x 200 = 20,200 cells: past the limit, and small enough that main expands it in seconds
        "camp_big": _campaign(
            deployments={"set": {"max-num-seqs": list(range(1, 102))}}, load={"max_concurrency": list(range(1, 201))}
        ).encode(),
        # 80 x 80 x 1000 = 6.4 million cells: the size that once ran out of memory after 49 s
        "camp_huge": _campaign(
            deployments={"set": {"max-num-seqs": list(range(1, 81))}},
            load={"max_concurrency": list(range(1, 81)), "input_len": list(range(1, 1001))},
        ).encode(),
    }
    out = {"tmp": str(tmp)}
    for name, data in files.items():
        path = tmp / "files" / f"{name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        out[name] = str(path)
    recipes = tmp / "files" / "recipes_dup"
    shutil.copytree(ROOT / "recipes", recipes)
    model = recipes / "models" / "moonshotai" / "Kimi-K3.yaml"
    model.write_text(model.read_text(encoding="utf-8") + "\nmeta:\n  title: again\n", encoding="utf-8")
    out["recipes_dup"] = str(recipes)
    return out


@dataclass
class Where:
    tmp: Path
    state: Path
    cwd: Path
    home: Path
    paths: dict[str, str]

    def files(self) -> set[Path]:
        """Every path under the test's directory except the state dir's."""
        return {p for p in self.tmp.rglob("*") if self.state not in (p, *p.parents)}


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return _write_files(tmp_path_factory.mktemp("corpus"))


@pytest.fixture
def where(tmp_path: Path, bad_files: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Where:
    state, cwd, home = tmp_path / "state", tmp_path / "cwd", tmp_path / "home"
    for d in (cwd, home):
        d.mkdir()
    monkeypatch.chdir(cwd)  # a command that writes into the current directory would show here
    return Where(tmp_path, state, cwd, home, {**bad_files, "tmp": str(tmp_path), "state": str(state)})


def _run(where: Where, args: list[str]) -> tuple[int, str, str]:
    env = {"HOME": str(where.home), "K3LAUNCH_STATE_DIR": str(where.state), "COLUMNS": "250", "NO_COLOR": "1"}
    res = CliRunner().invoke(app, args, env=env, catch_exceptions=False)
    return res.exit_code, res.stdout, res.stderr


def _refused_in_one_line(code: int, out: str, err: str) -> tuple[str, str]:
    """(error line, hint line) of a refusal; asserts its shape."""
    assert code == 2, (code, out, err)
    for text in (out, err):
        assert "Traceback" not in text and "internal error" not in text, text
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("hint: "), err
    assert len(lines[1]) > len("hint: ") + 3, err
    return lines[0], lines[1]


@pytest.mark.parametrize("row", ROWS, ids=[r.args.replace("{", "").replace("}", "") for r in ROWS])
def test_a_bad_value_is_refused_in_one_line_and_creates_nothing(row: Row, where: Where) -> None:
    before = where.files()
    args = row.args.format(**where.paths).split()
    error, _ = _refused_in_one_line(*_run(where, args))
    assert row.says in error, error
    if row.json:
        at = 2 if args[0] == "campaign" else 1  # right after the command: never taken as an option's value
        code, out, err = _run(where, [*args[:at], "--json", *args[at:]])
        assert code == 2 and not err.strip(), (code, out, err)
        assert json.loads(out)["error"]["code"] == row.code, out
    assert where.files() == before, "created outside the state dir: " + ", ".join(str(p) for p in where.files() - before)
    assert not any(where.cwd.iterdir()) and not any(where.home.iterdir())


# ---- the bounds themselves -------------------------------------------------------------------
@pytest.mark.parametrize("raw", ["nan", "NaN", "inf", "-inf", "1e400", "-1", "0", "604801", "", "  ", "1_000_000", "0x10"])
def test_a_timeout_takes_only_finite_positive_seconds_up_to_its_bound(raw: str) -> None:
    with pytest.raises(K3Error) as info:
        bounds.READY_TIMEOUT.parse("--ready-timeout", raw)
    assert info.value.code == "bad-value" and info.value.message.startswith("--ready-timeout")
    assert "604800" in info.value.hint


def test_the_bounds_hold_their_ends_and_give_back_numbers() -> None:
    assert bounds.NODES.parse("--nodes", "4096") == 4096 and bounds.NODES.parse("--nodes", " 1 ") == 1
    assert bounds.GRACE.parse("--grace", "0") == 0.0 and bounds.READY_TIMEOUT.parse("--ready-timeout", "0.5") == 0.5
    assert bounds.SEED.parse("--seed", str(2**32 - 1)) == 2**32 - 1
    assert isinstance(bounds.NODES.parse("--nodes", 3.0), int)
    for bad in (4097, 0, True):
        with pytest.raises(K3Error):
            bounds.NODES.parse("--nodes", bad)


def test_the_api_refuses_a_node_count_past_the_bound() -> None:
    from k3launch import api

    with pytest.raises(K3Error) as info:
        api.plan(strategy="multi_node_tp", nodes=100_000)
    assert info.value.code == "bad-value" and "--nodes" in info.value.message  # the code and words the CLI gives


def test_the_api_refuses_an_unknown_selection_field() -> None:
    from k3launch import api

    with pytest.raises(K3Error) as info:
        api.plan(strategy="multi_node_tp", nodez=2)
    assert info.value.code == "bad-selection" and "nodez" in info.value.message


# ---- campaign matrices: counted, never built past the limit -----------------------------------
def test_a_matrix_of_millions_of_cells_is_refused_from_its_counts(bad_files: dict[str, str]) -> None:
    path = Path(bad_files["camp_huge"])
    huge = Campaign.model_validate(yaml.safe_load(path.read_text(encoding="utf-8")))
    assert (huge.deployment_points(), huge.load_points()) == (80, 80_000)
    with pytest.raises(K3Error) as info:
        expand(huge)  # a Campaign built in code, not read from a file, is checked here too
    assert info.value.code == "campaign-too-large" and "6400000 cells" in info.value.message
    with pytest.raises(K3Error) as info:
        load_campaign(path)
    assert info.value.message.startswith(f"{path}: 6400000 cells")


def test_a_matrix_at_the_limit_is_expanded_and_grouped_in_full() -> None:
    c = Campaign.model_validate(
        {
            "name": "edge",
            "deployments": {"set": {"max-num-seqs": list(range(1, 11))}},
            "load": {"max_concurrency": list(range(1, 101)), "input_len": list(range(1, 11))},
        }
    )
    assert c.deployment_points() * c.load_points() == bounds.MAX_CELLS
    cells = expand(c)
    assert len(cells) == bounds.MAX_CELLS
    groups = group(cells, {s.key: "h" + s.key for s in {cell.spec for cell in cells}})
    assert [len(g.loads) for g in groups] == [1000] * 10 and [len(g.specs) for g in groups] == [1] * 10
    assert [ld.max_concurrency for ld in groups[0].loads][:3] == [1, 1, 1]  # first-seen order kept


def test_too_many_deployment_points_are_refused_even_with_one_load_point() -> None:
    c = Campaign.model_validate({"name": "wide", "deployments": {"set": {"max-num-seqs": list(range(1, 1002))}}})
    with pytest.raises(K3Error) as info:
        c.check_size("wide.yaml")
    assert "1001 deployment points" in info.value.message and "1000 deployment points" in info.value.message


# ---- YAML: one loader, unique keys ------------------------------------------------------------
class _Doc(BaseModel):
    name: str
    base: dict[str, object] = {}
    bench: dict[str, object] = {}


def test_a_merge_key_may_be_overridden_but_a_written_key_may_not_repeat(tmp_path: Path) -> None:
    doc = tmp_path / "merge.yaml"
    doc.write_text("name: m\nbase: &b {client: local, seed: 3}\nbench: {<<: *b, seed: 4}\n", encoding="utf-8")
    assert load_yaml_model(doc, _Doc).bench == {"client": "local", "seed": 4}  # YAML's merge: own keys win
    doc.write_text("name: m\nbase: {client: local, seed: 3, seed: 4}\n", encoding="utf-8")
    with pytest.raises(K3Error) as info:
        load_yaml_model(doc, _Doc)
    assert info.value.code == "duplicate-key" and ":2: duplicate key 'seed' (first at line 2)" in info.value.message


def _pyyaml_refuses_nesting_past_1000(monkeypatch: pytest.MonkeyPatch) -> None:
    """What PyYAML 6.0.4 and later do on any machine: their libyaml refuses nesting past 1000
    levels while it scans, ahead of the events a reader gets, as a ScannerError of its own words."""
    deep = "[" * 1001

    def refusing(real: Any) -> Any:
        def call(stream: str, *args: Any, **kwargs: Any) -> Any:
            if isinstance(stream, str) and deep in stream:
                mark = yaml.Mark("<unicode string>", 0, stream[: stream.index(deep)].count("\n"), 1003, None, None)
                raise yaml.scanner.ScannerError("while increasing flow level", mark, "exceeded maximum nesting depth", mark)
            return real(stream, *args, **kwargs)

        return call

    for name in ("parse", "compose", "load"):
        monkeypatch.setattr(yaml, name, refusing(getattr(yaml, name)))


@pytest.mark.parametrize("pyyaml", ["installed", "6.0.4 and later"])
def test_deep_yaml_is_refused_in_k3launchs_words_whatever_pyyaml_does(
    pyyaml: str, where: Where, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if pyyaml != "installed":
        _pyyaml_refuses_nesting_past_1000(monkeypatch)
    error, _ = _refused_in_one_line(*_run(where, ["plan", "-i", where.paths["inv_deep"]]))
    assert f"{where.paths['inv_deep']}:3: nested more than 100 levels deep" in error, error
    code, out, _ = _run(where, ["plan", "--json", "-i", where.paths["inv_deep"]])
    assert code == 2 and json.loads(out)["error"]["code"] == "bad-yaml", out
    if pyyaml != "installed":  # a file too small to be scanned for depth meets PyYAML's limit alone
        small = tmp_path / "small.yaml"
        small.write_text("name: n\nbase:\n  x: " + "[" * 1500 + "]" * 1500 + "\n", encoding="utf-8")
        with pytest.raises(K3Error) as info:
            load_yaml_model(small, _Doc)
        assert (info.value.code, info.value.message) == ("bad-yaml", f"{small}:3: nested more than 100 levels deep")


def test_an_ssh_config_that_is_not_utf8_is_one_line(where: Where) -> None:
    cfg = where.tmp / "ssh_config"
    cfg.write_bytes(b"Host n1\n  HostName caf\xe9\n")
    inv = where.tmp / "inv.yaml"
    inv.write_text(INVENTORY + f"ssh_config: {cfg}\n", encoding="utf-8")
    error, _ = _refused_in_one_line(*_run(where, ["plan", "-i", str(inv)]))
    assert f"{cfg}: not UTF-8 text" in error


# ---- files that cannot be written --------------------------------------------------------------
@pytest.mark.parametrize(
    ("err", "words"),
    [(errno.ENOSPC, "No space left on device"), (errno.EROFS, "Read-only file system"), (errno.EACCES, "Permission denied")],
)
def test_an_io_error_with_a_path_is_one_line_naming_it(err: int, words: str, where: Where, monkeypatch: pytest.MonkeyPatch) -> None:
    import k3launch.cli.writeout as writeout

    def fails(*a: object, **kw: object) -> list[str]:
        raise OSError(err, os.strerror(err), str(where.tmp / "r" / "plan.json"))

    monkeypatch.setattr(writeout, "write_render", fails)
    error, _ = _refused_in_one_line(*_run(where, ["render", "-o", str(where.tmp / "r")]))
    code_word = "io-error" if err == errno.EACCES else "write-failed"
    assert error == f"error: {where.tmp / 'r' / 'plan.json'}: {words} [{code_word}]", error
    code, out, _ = _run(where, ["render", "-o", str(where.tmp / "r"), "--json"])
    assert code == 2 and json.loads(out)["error"]["code"] == ("io-error" if err == errno.EACCES else "write-failed")


def test_a_full_disk_found_at_a_flush_is_one_line_too(where: Where, monkeypatch: pytest.MonkeyPatch) -> None:
    import k3launch.cli.writeout as writeout

    def fails(*a: object, **kw: object) -> list[str]:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # a flush or close names no file

    monkeypatch.setattr(writeout, "write_render", fails)
    error, hint = _refused_in_one_line(*_run(where, ["render", "-o", str(where.tmp / "r")]))
    assert "No space left on device" in error and "free space" in hint


def _unshare_ok() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


needs_mounts = pytest.mark.skipif(not _unshare_ok(), reason="needs root and unshare (a private tmpfs mount)")


@needs_mounts
@pytest.mark.parametrize(("opts", "words"), [("size=4k", "No space left on device"), ("size=1m,ro", "Read-only file system")])
def test_a_real_full_or_read_only_filesystem_is_one_line(tmp_path: Path, opts: str, words: str) -> None:
    """The real thing, in a mount namespace of its own (nothing is mounted on this machine)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = (
        f"mount -t tmpfs -o {opts} tmpfs {mnt} && exec {sys.executable} -m k3launch render -o {mnt}/out; "
        f"exec {sys.executable} -m k3launch campaign run local-demo --out {mnt}/camp --dry-run"
    )
    env = {**os.environ, "K3LAUNCH_STATE_DIR": str(tmp_path / "state"), "HOME": str(tmp_path), "COLUMNS": "250"}
    r = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=120, env=env)
    error, _ = _refused_in_one_line(r.returncode, r.stdout, r.stderr)
    assert str(mnt / "out") in error and words in error


# ---- paramiko's own logging ----------------------------------------------------------------------
@pytest.fixture
def not_sshd() -> Iterator[int]:
    """A port that answers every connection with a line that is not an SSH banner, then hangs up:
    paramiko logs that with a traceback of its transport thread."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.settimeout(0.2)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(b"HTTP/1.0 400 not ssh\r\n")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield int(srv.getsockname()[1])
    done.set()
    t.join(5)
    srv.close()


def test_an_unreachable_host_prints_k3launchs_line_without_paramikos_tracebacks(where: Where, not_sshd: int) -> None:
    inv = where.tmp / "ssh.yaml"
    (where.tmp / "known_hosts").touch()
    inv.write_text(
        f"name: lone\nbackend: ssh\nhardware: b300\nknown_hosts: {where.tmp}/known_hosts\n"
        f"nodes:\n  - {{name: n1, address: 127.0.0.1, port: {not_sshd}}}\n",
        encoding="utf-8",
    )
    code, out, err = _run(where, ["up", "-i", str(inv), "--name", "lone", "--state-dir", str(where.state), "--connect-timeout", "5"])
    assert code == 2, (code, out, err)
    assert "Traceback" not in out + err and "Exception (client)" not in out + err, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    # paramiko appends the socket's own error when the peer reset the connection first
    assert len(errors) == 1 and errors[0].startswith("error: cannot reach n1: n1: cannot connect: Error reading SSH protocol banner"), err
