"""Code shape checks that need no linter: modules stay under ~400 lines, and the tier check of
tests/support/tiers.py refuses a test that starts infrastructure without its markers (the
linters: test_style.py).
"""

from __future__ import annotations

from paths import ROOT


def test_modules_stay_small() -> None:
    """Modules stay under ~400 lines so each reads in one sitting."""
    big = {p.name: n for p in (ROOT / "k3launch").rglob("*.py") if (n := len(p.read_text().splitlines())) > 420}
    assert not big, big


def test_a_test_starting_infrastructure_must_carry_its_markers() -> None:
    """conftest.py refuses a run in which a test uses an infrastructure fixture (tests/support/tiers.py)
    without its markers: ``-m "not e2e"`` must never start sshd hosts, Slurm or podman; and one in
    which a linter (``lint``) would leave the fast tier."""
    from types import SimpleNamespace

    from tiers import misplaced_lint, missing_markers

    def item(name: str, fixtures: list[str], marks: list[str]) -> SimpleNamespace:
        return SimpleNamespace(nodeid=name, fixturenames=fixtures, iter_markers=lambda: iter(SimpleNamespace(name=m) for m in marks))

    assert missing_markers([item("unit", ["tmp_path"], []), item("ok", ["ssh_hosts", "tmp_path"], ["e2e", "ssh", "parametrize"]),
                            item("closure", ["k3", "podman_env"], ["podman", "e2e"])]) == []
    assert missing_markers([item("t::a", ["cluster", "slurm_cluster"], ["e2e"]), item("t::b", ["procs"], []),
                            item("t::c", ["podman_env", "ssh_hosts"], ["e2e", "ssh"])]) == [
        "t::a: uses slurm_cluster but is not marked slurm", "t::b: uses procs but is not marked e2e",
        "t::c: uses podman_env, ssh_hosts but is not marked podman"]
    assert misplaced_lint([item("ok", ["tmp_path"], ["lint"]), item("e2e", [], ["e2e"])]) == []
    assert misplaced_lint([item("t::d", [], ["lint", "e2e"]), item("t::e", ["procs"], ["lint"])]) == [
        "t::d: is marked lint, so it belongs to the fast tier: not e2e, no infrastructure",
        "t::e: is marked lint, so it belongs to the fast tier: not e2e, no procs"]
