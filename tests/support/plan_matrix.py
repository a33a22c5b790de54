"""A broad matrix of plans, each one's ``plan --json`` (or its refusal) as text: the proof that a
change to planning leaves every plan byte for byte as it was.

Every case is a selection (every strategy x hardware x a few options, P/D pool layouts, copies,
fault tolerance, Advanced, ``--set``, KV offload, an older vLLM) on the bundled recipe tree, on the
example inventories, and on the upstream trees beside the checkout (``../shared/upstream-recipes``,
when present). ``tests/e2e/local/test_plan_matrix_e2e.py`` compares a digest of each part against
``tests/golden/plan_matrix/<part>.txt``; by hand, dump every plan and compare two trees:

    python tests/support/plan_matrix.py dump /tmp/before [--part bundled] ...   # on the old code
    python tests/support/plan_matrix.py dump /tmp/after ...                     # on the new code
    diff -r /tmp/before /tmp/after

``python tests/support/plan_matrix.py digest`` prints the digest lines the test stores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout that is not installed

from k3launch.errors import K3Error  # noqa: E402
from k3launch.models.selection import Selection  # noqa: E402
from k3launch.planning.build import build_plan  # noqa: E402
from k3launch.planning.inventory import Inventory, load_inventory  # noqa: E402
from k3launch.planning.placement import Cordoned  # noqa: E402
from k3launch.planning.recipes import RecipeTree  # noqa: E402

UPSTREAM = ROOT.parent / "shared" / "upstream-recipes"
INVENTORIES = ROOT / "inventories"
PARTS = ("bundled", "inventory", "upstream", "upstream-full")

Case = tuple[str, str, Callable[[], str]]  # (group, case, its text)

# Options tried on every (hardware, strategy) of the bundled tree, besides the bare selection.
OPTIONS: dict[str, dict[str, Any]] = {
    "features": {"features": ("tool_calling", "reasoning", "spec_decoding", "text_only")},
    "no-features": {"no_features": ("tool_calling", "reasoning")},
    "ep-weight-filter": {"features": ("ep_weight_filter",)},
    "kv-simple": {"kv_offload": "simple"},
    "kv-lmcache": {"kv_offload": "lmcache"},
    "advanced-all": {"advanced": ("max-num-batched-tokens", "max-num-seqs", "gpu-memory-utilization", "max-model-len")},
    "sets": {"sets": ("max-num-seqs=64", "kv-cache-dtype=fp8", "no-enable-prefix-caching", "compilation-config.max_cudagraph_capture_size=256")},
    "env-image": {"env": ("FOO=bar",), "image": "registry.example/vllm:test"},
    "replicas-2": {"replicas": 2},
    "fault-tolerance": {"fault_tolerance": True},
    "vllm-0.32": {"vllm_version": "0.32.0"},
}
POOL_LAYOUTS = (None, "tp", "tep", "dep")
POOL_NODES = (None, 1, 2, 3)


def _text(make: Callable[[], Any]) -> str:
    """A plan's ``plan --json``, or its refusal as ``k3launch plan --json`` prints it."""
    try:
        return str(make().to_json()) + "\n"
    except K3Error as err:
        return json.dumps({"error": {"code": err.code, "message": err.message, "hint": err.hint}}, indent=2) + "\n"
    except Exception as exc:  # a crash is a case's outcome too: the matrix records it and goes on
        return json.dumps({"crash": {"type": type(exc).__name__, "message": str(exc).splitlines()[0]}}, indent=2) + "\n"


IN_GROUP = ("recipe", "variant", "hardware", "strategy")  # a bundled case's group names these fields


def _sel_case(group: str, tree: RecipeTree, fields: dict[str, Any], in_group: tuple[str, ...] = ("recipe",), **kw: Any) -> Case:
    """The case of one selection (``in_group``: the fields its group's name says, left out of its own)."""
    def make() -> Any:
        return build_plan(tree, Selection(**fields), **kw)

    words = "_".join(f"{k}={'+'.join(v) if isinstance(v, tuple) else v}" for k, v in fields.items() if v is not None and k not in in_group)
    return group, f"{group}/{words or 'default'}", lambda: _text(make)


def _named(what: str, case: Case) -> Case:
    return case[0], f"{case[1]}/{what}", case[2]


def _bundled() -> Iterator[Case]:
    tree = RecipeTree()
    for rid in tree.model_ids():
        rec = tree.model(rid)
        for vname in rec.variants:
            for hw in [None, *tree.taxonomy.hardware_profiles]:
                for strategy in [None, *tree.strategies]:
                    base = {"recipe": rid, "variant": vname, "hardware": hw, "strategy": strategy}
                    group = f"bundled/{rid}/{vname}/{hw}/{strategy}"
                    if strategy == "pd_cluster":
                        for pl in POOL_LAYOUTS:
                            for pn in POOL_NODES:
                                for dl in POOL_LAYOUTS:
                                    for dn in POOL_NODES:
                                        yield _sel_case(group, tree, {**base, "prefill_strategy": pl, "prefill_nodes": pn,
                                                                      "decode_strategy": dl, "decode_nodes": dn}, IN_GROUP)
                    else:
                        for nodes in (None, 1, 2, 3, 4):
                            yield _sel_case(group, tree, {**base, "nodes": nodes}, IN_GROUP)
                    for opts in OPTIONS.values():
                        yield _sel_case(group, tree, {**base, **opts}, IN_GROUP)
    yield _sel_case("bundled/named", tree, {"strategy": "multi_node_dep"}, name="k3-dep", port_base=20000)


INVENTORY_SELECTIONS: list[dict[str, Any]] = [
    {}, *({"strategy": s} for s in ("single_node_tp", "multi_node_tp", "multi_node_tep", "multi_node_dep", "multi_node_tp_pp", "pd_cluster")),
    {"strategy": "pd_cluster", "prefill_nodes": 1, "decode_strategy": "tep", "decode_nodes": 1},
    {"strategy": "pd_cluster", "prefill_strategy": "dep", "decode_strategy": "dep"},
    {"strategy": "multi_node_tp", "replicas": 2}, {"strategy": "multi_node_dep", "replicas": 2},
    {"strategy": "multi_node_dep", "fault_tolerance": True}, {"strategy": "multi_node_dep", "fault_tolerance": False},
    {"kv_offload": "simple"}, {"strategy": "multi_node_tep", "nodes": 3},
]


def _inventory() -> Iterator[Case]:
    tree = RecipeTree()
    for path in sorted(INVENTORIES.glob("*.yaml")):
        inv: Inventory = load_inventory(path)
        extra = {"recipe": "k3launch/tiny-llama"} if path.stem == "local-cpu" else {}
        last = inv.nodes[-1].name if inv.nodes else None  # a spare, where the inventory has one
        for fields in INVENTORY_SELECTIONS:
            group = f"inventory/{path.stem}"
            yield _sel_case(group, tree, {**extra, **fields}, inventory=inv)
            if last is not None:
                yield _named(f"exclude-{last}", _sel_case(group, tree, {**extra, **fields}, inventory=inv, exclude=(last,)))
                yield _named(f"cordon-{last}", _sel_case(group, tree, {**extra, **fields}, inventory=inv,
                                                          cordoned=Cordoned({last: "cordoned since then (test)"}, f"inventories/{path.name}")))
        yield _named("port-base", _sel_case(f"inventory/{path.stem}", tree, extra, inventory=inv, port_base=30000))


def _upstream(era: str, strategies: bool) -> Iterator[Case]:
    """Every recipe of an upstream tree: each variant x listed hardware x offered strategy (at the
    default size, and at two and three nodes), P/D with each pool layout; the full tree: each
    recipe's default and each listed hardware x offered strategy."""
    tree = RecipeTree(UPSTREAM / era)
    profiles = tree.taxonomy.hardware_profiles
    for rid in tree.model_ids():
        group = f"{era}/{rid}"
        yield _sel_case(group, tree, {"recipe": rid})
        try:
            rec = tree.model(rid)
        except K3Error:
            continue  # its refusal is the default case's
        hardware = list(rec.meta.hardware) or ([rec.meta.default_hardware] if rec.meta.default_hardware else
                                               [h for h, p in profiles.items() if not p.restricted])
        names = [s for s in (rec.compatible_strategies or sorted(tree.strategies)) if s in tree.strategies]
        variants = list(rec.variants) if strategies else [None]
        for vname in variants:
            for hw in hardware:
                for s in names:
                    base = {"recipe": rid, "variant": vname, "hardware": hw, "strategy": s}
                    yield _sel_case(group, tree, base)
                    if not strategies:
                        continue
                    if s == "pd_cluster":
                        for layout in POOL_LAYOUTS[1:]:
                            yield _sel_case(group, tree, {**base, "prefill_strategy": layout, "decode_strategy": layout})
                    elif s.startswith("multi_node_"):
                        for nodes in (2, 3):
                            yield _sel_case(group, tree, {**base, "nodes": nodes})


def cases(part: str) -> Iterator[Case]:
    if part == "bundled":
        yield from _bundled()
    elif part == "inventory":
        yield from _inventory()
    elif part == "upstream":
        for era in ("seed-era", "latest"):
            yield from _upstream(era, True)
    elif part == "upstream-full":
        yield from _upstream("latest-full", False)
    else:
        raise ValueError(part)


def available(part: str) -> bool:
    return not part.startswith("upstream") or (UPSTREAM / ("latest-full" if part == "upstream-full" else "latest")).is_dir()


def _file(name: str) -> str:
    """A file name for a case (a long one cut, with its hash to keep it unique)."""
    plain = re.sub(r"[^A-Za-z0-9_.=+,-]+", "~", name)
    return plain if len(plain) <= 200 else f"{plain[:180]}~{hashlib.sha256(name.encode()).hexdigest()[:12]}"


def run(part: str, sample: int = 1) -> Iterator[tuple[str, str, str]]:
    """(group, case name, its text) for every case of ``part`` (a name seen twice is one case);
    ``sample`` > 1: only the groups :func:`sampled` keeps."""
    seen: set[str] = set()
    for group, name, make in cases(part):
        if name in seen or not sampled(group, sample):
            continue
        seen.add(name)
        yield group, name, make()


def sampled(group: str, sample: int) -> bool:
    """One group in ``sample``, the same ones on every run (by the hash of its name)."""
    return sample <= 1 or int(hashlib.sha256(group.encode()).hexdigest(), 16) % sample == 0


def digest_lines(part: str, sample: int = 1) -> list[str]:
    """``<sha256[:16]> <group> (<n> cases)`` per group of cases (a recipe x variant x hardware x
    strategy of the bundled tree, an inventory, an upstream recipe), in case order: a line changes
    when one of its plans does (``dump`` both sides to see which)."""
    hashes: dict[str, Any] = {}
    counts: dict[str, int] = {}
    for group, name, text in run(part, sample):
        hashes.setdefault(group, hashlib.sha256()).update(f"{name}\0{text}\0".encode())
        counts[group] = counts.get(group, 0) + 1
    return [f"{h.hexdigest()[:16]} {group} ({counts[group]} cases)" for group, h in hashes.items()]



# ---------------------------------------------------------------------- the stored digests (tests/golden/plan_matrix)
GOLDEN = ROOT / "tests" / "golden" / "plan_matrix"
UPDATE = os.environ.get("K3LAUNCH_UPDATE_GOLDEN") == "1"


def stored(part: str) -> list[str]:
    path = GOLDEN / f"{part}.txt"
    assert path.is_file(), f"{path} missing: run K3LAUNCH_UPDATE_GOLDEN=1 pytest tests/e2e/local/test_plan_matrix_e2e.py"
    return path.read_text(encoding="utf-8").splitlines()


def compare(part: str, got: list[str], want: list[str]) -> None:
    import difflib

    import pytest

    if got != want:
        diff = "\n".join(difflib.unified_diff(want, got, f"golden/plan_matrix/{part}.txt", "now", lineterm="", n=0))
        pytest.fail(f"plans of {part} changed (dump both sides with tests/support/plan_matrix.py to see how):\n{diff}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("dump", "digest"))
    ap.add_argument("out", nargs="?", help="dump: the directory written (one file per case)")
    ap.add_argument("--part", action="append", choices=PARTS, help="default: every part available")
    args = ap.parse_args()
    os.environ.setdefault("K3LAUNCH_SCHEMA_DIR", tempfile.mkdtemp())  # the vendored vLLM schemas only, as the tests plan
    parts = [p for p in (args.part or PARTS) if available(p)]
    for part in parts:
        if args.what == "digest":
            print("\n".join(digest_lines(part)))
            continue
        out = Path(args.out) / part
        out.mkdir(parents=True, exist_ok=True)
        n = plans = 0
        written: set[str] = set()
        for _, name, text in run(part):
            file = _file(name) + ".json"
            if file in written:
                raise SystemExit(f"two cases write {file}")
            written.add(file)
            (out / file).write_text(text, encoding="utf-8")
            n += 1
            plans += not text.startswith('{\n  "error"')
        print(f"{part}: {n} cases, {plans} plans, {n - plans} refusals", file=sys.stderr)


if __name__ == "__main__":
    main()
