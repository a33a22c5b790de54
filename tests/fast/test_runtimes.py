"""One runtime table (k3launch.render.runtimes) for the SSH launch scripts and the Slurm job scripts.

Both renderers take a runtime's words from the same entry: a changed entry shows up in an SSH
start command and in a Slurm step alike. The goldens (test_render.py, test_slurm_render.py,
test_slurm_supervise.py) pin the words themselves.
"""

from __future__ import annotations

import dataclasses
from typing import get_args

import pytest
from paths import ROOT

from k3launch.models.plan import Plan, Runtime, is_container
from k3launch.models.selection import Selection
from k3launch.planning.build import build_plan
from k3launch.planning.inventory import SlurmSection, load_inventory
from k3launch.planning.recipes import RecipeTree
from k3launch.render import runtimes
from k3launch.render.sbatch import make_sbatch_string, step_words
from k3launch.render.scripts import script, start_command
from k3launch.render.snippets import stop_containers

INVENTORIES = ROOT / "inventories"


def _plan(runtime: str, engine: str = "vllm") -> Plan:
    inv = load_inventory(INVENTORIES / "h200-pair.yaml")
    inv = inv.model_copy(update={"engine": engine, "defaults": inv.defaults.model_copy(update={"runtime": runtime, "venv": "/opt/venv"})})
    return build_plan(RecipeTree(), Selection(strategy="multi_node_tp", nodes=2), inventory=inv)


def _engine(words: list[str]) -> list[str]:
    """The engine command at the end of ``words`` (a Slurm step's node addresses are ``$K3_ADDR_i``)."""
    return words[words.index("serve") - 1:]


def _both(plan: Plan, container: str) -> tuple[list[str], list[str]]:
    """The first engine's words as an SSH start command and as its Slurm step."""
    proc = next(p for p in plan.processes if p.role != "router")
    host = next(h for h in plan.hosts if h.name == proc.node)
    return start_command(plan, proc, host), step_words(plan, proc, SlurmSection(container=container))[1]  # type: ignore[arg-type]


CHANGES = {
    "apptainer": {"run": ("apptainer", "run"), "gpus": {"cuda": ("--nvccli",)}, "isolate": ("--containall",), "bind": "--mount",
                  "setenv": "--env-x", "image": "oras://{image}"},
    "bare": {"run": ("nice", "-n", "5"), "venv": False},
}
OLD = {"apptainer": ["exec", "--nv", "--cleanenv", "--bind", "--env"], "bare": ["PATH=/opt/venv/bin:\"$PATH\""]}


@pytest.mark.parametrize("runtime", sorted(CHANGES))
def test_a_changed_table_entry_shows_up_in_ssh_scripts_and_slurm_steps_alike(runtime: str, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = _plan(runtime)
    ssh, slurm = _both(plan, runtime)
    for word in OLD[runtime]:  # today's words, in both
        assert word in ssh and word in slurm, word
    changed = dataclasses.replace(runtimes.RUNTIMES[runtime], **CHANGES[runtime])  # type: ignore[arg-type]
    monkeypatch.setitem(runtimes.RUNTIMES, runtime, changed)
    ssh, slurm = _both(plan, runtime)
    for out in (ssh, slurm):
        assert len(_engine(out)) == len(plan.processes[0].argv) and _engine(out)[0] == "vllm"  # the engine's argv as planned
        for word in OLD[runtime]:
            assert word not in out, word
    if runtime == "apptainer":
        for out in (ssh, slurm):
            i = out.index("apptainer")
            assert out[i:i + 4] == ["apptainer", "run", "--nvccli", "--containall"], out
            assert out[i + 4] == "--mount" and "--env-x" in out and any(w.startswith("oras://") for w in out)
    else:
        assert ssh[ssh.index("nice"):ssh.index("nice") + 4] == ["nice", "-n", "5", "env"]
        assert slurm[:4] == ["nice", "-n", "5", "env"]


def test_the_runtime_decides_whether_the_simulated_engine_comes_from_the_image() -> None:
    """A node whose own runtime is bare, in a Slurm job that runs apptainer or pyxis: the image's
    ``vllm`` is the simulated engine there, as in a container over SSH; a bare step runs
    ``python3 -m k3launch.sim`` (the node's interpreter)."""
    plan = _plan("bare", engine="sim")
    proc = next(p for p in plan.processes if p.role != "router")
    for container in ("apptainer", "pyxis"):
        words = step_words(plan, proc, SlurmSection(container=container))[1]  # type: ignore[arg-type]
        assert _engine(words)[0] == "vllm" and len(_engine(words)) == len(proc.argv) and "k3launch.sim" not in words, container
    bare = step_words(plan, proc, SlurmSection(container="bare"))[1]
    assert bare[bare.index("serve") - 3:bare.index("serve")] == ["python3", "-m", "k3launch.sim"]


def test_every_runtime_has_an_entry_that_agrees_with_how_ssh_treats_it() -> None:
    ssh = set(get_args(Runtime))
    slurm = set(get_args(SlurmSection.model_fields["container"].annotation))
    assert ssh | slurm == set(runtimes.RUNTIMES)
    for name in ssh:
        rt = runtimes.RUNTIMES[name]
        assert rt.name == name
        # a container k3launch manages: started detached, stopped by name; the rest in the background, by session
        assert (rt.detached, rt.stop == "container", rt.named) == (is_container(name),) * 3, name
    assert [n for n, rt in runtimes.RUNTIMES.items() if rt.needs_bind_source] == ["podman", "apptainer", "pyxis"]


def test_the_apptainer_token_variable_follows_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where HF_TOKEN comes from is the table's too: the APPTAINERENV_ export only for a runtime whose entry reads it."""
    plan = _plan("apptainer")
    node = plan.processes[0].node
    slurm = SlurmSection(container="apptainer")
    assert "APPTAINERENV_HF_TOKEN" in script(plan, node) and "APPTAINERENV_HF_TOKEN" in make_sbatch_string(plan, slurm, "/logs")
    monkeypatch.setitem(runtimes.RUNTIMES, "apptainer", dataclasses.replace(runtimes.RUNTIMES["apptainer"], secret="inherited"))
    assert "APPTAINERENV_HF_TOKEN" not in script(plan, node) and "APPTAINERENV_HF_TOKEN" not in make_sbatch_string(plan, slurm, "/logs")


def test_stopping_a_container_drops_the_token_secret_where_the_table_keeps_one(monkeypatch: pytest.MonkeyPatch) -> None:
    assert 'secret rm "$c-hf-token"' in stop_containers("podman", ["k3-x-serve-0"], 5)
    assert "secret rm" not in stop_containers("docker", ["k3-x-serve-0"], 5)
    monkeypatch.setitem(runtimes.RUNTIMES, "docker", dataclasses.replace(runtimes.RUNTIMES["docker"], secret="podman-secret"))
    assert "docker secret rm" in stop_containers("docker", ["k3-x-serve-0"], 5)
