"""CPU engines that share a machine get cores of their own (k3launch.planning.cpusets), passed to
vLLM's CPU backend as VLLM_CPU_OMP_THREADS_BIND and held for the whole process by its runtime
(taskset, --cpuset-cpus); the simulated engine takes and echoes the same variable."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from inventory_helpers import example, write_yaml

from k3launch import api
from k3launch.errors import K3Error
from k3launch.models.plan import Plan, Process
from k3launch.models.selection import Notice
from k3launch.planning import cpusets
from k3launch.planning.inventory import SlurmSection
from k3launch.planning.placement import NodeSpec
from k3launch.planning.schema import load_schema
from k3launch.render.sbatch import step_words
from k3launch.render.scripts import start_command
from k3launch.sim import cpubind
from k3launch.sim.cli import parse_serve
from k3launch.sim.logs import Logger
from k3launch.sim.options import SimConfigError

TINY = "k3launch/tiny-llama"
BIND = "VLLM_CPU_OMP_THREADS_BIND"
LOCAL_CPU = example("local-cpu")


def _inv(tmp: Path, cpus: str | None, backend: str = "local", nodes: str = "", env: str = "", hardware: str = "cpu-x86") -> Path:
    """local-cpu's four loopback nodes (or ``nodes``), with ``cpus`` in defaults."""
    nodes = nodes or "".join(f"  - {{name: cpu-{i}, address: 127.0.0.2{i}}}\n" for i in range(1, 5))
    return write_yaml(tmp, f"name: cpus\nbackend: {backend}\nhardware: {hardware}\nengine: vllm\nvllm_version: '0.32.0'\n"
                           f"defaults: {{runtime: bare{', cpus: ' + cpus if cpus else ''}{env}}}\n"
                           f"router: {{node: login, address: 127.0.0.20}}\nnodes:\n{nodes}")


def _bound(plan: Plan) -> dict[str, tuple[str | None, str | None]]:
    return {p.id: (p.cpus, p.env.get(BIND)) for p in plan.processes if p.role != "router"}


def _codes(plan: Plan) -> dict[str, str]:
    return {n.code: n.message for n in plan.notices if n.code.startswith("cpus")}


def test_two_copies_on_local_cpu_get_a_core_each() -> None:
    """The shipped inventory (a 2-core machine, four loopback nodes): each copy's worker and the
    whole process on a core of its own, where vLLM's auto binding put both on core 0."""
    plan = api.plan(LOCAL_CPU, recipe=TINY, replicas=2)
    assert _bound(plan) == {"r0-serve-0": ("0", "0"), "r1-serve-0": ("1", "1")}
    assert not _codes(plan)
    prov = plan.processes[0].provenance[BIND][-1]
    assert prov.value == "0" and "cpu-1's share of 0-1" in prov.origin


def test_a_node_keeps_its_share_whatever_the_number_of_copies(tmp_path: Path) -> None:
    """Nodes divide the machine's cores in inventory order: a copy's cores do not move when the
    deployment scales; one core of each share is left to the process's other threads."""
    inv = _inv(tmp_path, '"0-7"')
    one, two, four = (_bound(api.plan(inv, recipe=TINY, replicas=n)) for n in (1, 2, 4))
    assert one == {"serve-0": ("0-1", "0")}
    assert two == {"r0-serve-0": ("0-1", "0"), "r1-serve-0": ("2-3", "2")}
    assert four == {**two, "r2-serve-0": ("4-5", "4"), "r3-serve-0": ("6-7", "6")}


def test_fewer_cores_than_copies_is_said_in_the_plan(tmp_path: Path) -> None:
    plan = api.plan(LOCAL_CPU, recipe=TINY, replicas=3)
    assert _bound(plan)["r2-serve-0"] == ("0", "0")  # cpu-3's share wraps around to core 0
    assert "r0-serve-0 and r2-serve-0 (core 0)" in _codes(plan)["cpus-shared"]


def test_copies_sharing_a_machine_without_cpus_are_warned_of(tmp_path: Path) -> None:
    inv = _inv(tmp_path, None)
    plan = api.plan(inv, recipe=TINY, replicas=2)
    assert _bound(plan) == {"r0-serve-0": (None, None), "r1-serve-0": (None, None)}
    assert "r0-serve-0, r1-serve-0 have no cpus" in _codes(plan)["cpus-unknown"]
    assert not _codes(api.plan(inv, recipe=TINY))  # one engine alone on the machine: nothing to share


def test_over_ssh_each_node_is_a_machine_of_its_own(tmp_path: Path) -> None:
    nodes = "  - {name: a, address: 10.0.0.1}\n  - {name: b, address: 10.0.0.2}\n"
    plan = api.plan(_inv(tmp_path, "4", backend="ssh", nodes=nodes), recipe=TINY, replicas=2)
    assert _bound(plan) == {"r0-serve-0": ("0-3", "0-2"), "r1-serve-0": ("0-3", "0-2")} and not _codes(plan)


def test_a_node_naming_its_own_cores_keeps_them(tmp_path: Path) -> None:
    nodes = "  - {name: cpu-1, address: 127.0.0.21, cpus: '4,6'}\n  - {name: cpu-2, address: 127.0.0.22}\n"
    plan = api.plan(_inv(tmp_path, '"0-1"', nodes=nodes), recipe=TINY, replicas=2)
    assert _bound(plan) == {"r0-serve-0": ("4,6", "4"), "r1-serve-0": ("0-1", "0")}


def test_an_inventory_binding_of_its_own_is_left_alone(tmp_path: Path) -> None:
    plan = api.plan(_inv(tmp_path, '"0-1"', env=", env: {VLLM_CPU_OMP_THREADS_BIND: '1'}"), recipe=TINY, replicas=2)
    assert _bound(plan) == {"r0-serve-0": (None, "1"), "r1-serve-0": (None, "1")}


def test_ranks_of_one_process_divide_its_share() -> None:
    """A process with two local ranks gets one list per rank, separated by ``|``, as vLLM reads them."""
    plan = api.plan(LOCAL_CPU, recipe=TINY)
    two = [p.model_copy(update={"gpus": 2, "env": {}, "cpus": None}) for p in plan.processes]
    notices: list[Notice] = []
    (proc,) = cpusets.bind(two, [NodeSpec("cpu-1", "127.0.0.21", cpus="0-15")], None, "cpu", notices)
    assert (proc.cpus, proc.env[BIND], notices) == ("0-15", "0-6|8-14", [])


def test_gpu_engines_ignore_cpus_and_say_so(tmp_path: Path) -> None:
    nodes = "  - {name: g1, address: 10.0.0.1}\n  - {name: g2, address: 10.0.0.2}\n"
    plan = api.plan(_inv(tmp_path, '"0-7"', backend="ssh", nodes=nodes, hardware="h200"), strategy="multi_node_tp", nodes=2)
    assert all(p.cpus is None and BIND not in p.env for p in plan.processes)
    assert "cpus of g1, g2 are for vLLM's CPU backend" in _codes(plan)["cpus-ignored"]


@pytest.mark.parametrize("bad", ['"0-x"', '"3-1"', "0", "true"])
def test_cpus_must_be_a_cpu_list_or_a_count(tmp_path: Path, bad: str) -> None:
    with pytest.raises(K3Error) as e:
        api.plan(_inv(tmp_path, bad), recipe=TINY)
    assert "cpus" in e.value.message


def test_every_runtime_holds_the_process_to_its_cpus(tmp_path: Path) -> None:
    """taskset before a bare or apptainer command (the mask is inherited by all it starts),
    --cpuset-cpus for docker and podman; a Slurm step's bare and apptainer commands alike."""
    plan = api.plan(LOCAL_CPU, recipe=TINY, replicas=2)
    proc = plan.processes[1]
    assert (proc.id, proc.cpus) == ("r1-serve-0", "1")
    for runtime, words in (("bare", ["taskset", "-c", "1", "env"]), ("apptainer", ["taskset", "-c", "1", "apptainer", "exec"])):
        host = plan.hosts[1].model_copy(update={"runtime": runtime})
        got = start_command(plan.model_copy(update={"hosts": [plan.hosts[0], host]}), proc.model_copy(update={"image": "img:1"}), host)
        assert got[2:2 + len(words)] == words, got  # after k3launch_background LOG
    for runtime in ("docker", "podman"):
        host = plan.hosts[1].model_copy(update={"runtime": runtime})
        got = start_command(plan, proc.model_copy(update={"image": "img:1"}), host)
        assert got[got.index("--cpuset-cpus") + 1] == "1" and "taskset" not in got
    assert step_words(plan, proc, SlurmSection(container="bare"))[1][:4] == ["taskset", "-c", "1", "env"]
    unbound = proc.model_copy(update={"cpus": None})
    assert "taskset" not in start_command(plan, unbound, plan.hosts[1])


def _sim(env: dict[str, str], *flags: str) -> object:
    return parse_serve(load_schema("0.32.0"), ["m", *flags], env)


def test_the_simulated_engine_echoes_its_binding_as_vllm_logs_it() -> None:
    opts = _sim({BIND: "1"})
    out = io.StringIO()
    cpubind.log_binding(Logger("EngineCore", out), opts)  # type: ignore[arg-type]
    assert "OpenMP thread binding info" in out.getvalue() and "\tlocal_rank=0, core ids=[1]\n" in out.getvalue()
    quiet = io.StringIO()
    cpubind.log_binding(Logger("EngineCore", quiet), _sim({}))  # type: ignore[arg-type]
    assert quiet.getvalue() == ""  # auto: vLLM picks (and the sim has no cores to name)


def test_the_simulated_engine_refuses_what_vllm_refuses() -> None:
    with pytest.raises(SimConfigError, match="doesn't match local world size 2"):
        cpubind.core_lists(_sim({BIND: "0-3"}, "--tensor-parallel-size", "2"))  # type: ignore[arg-type]
    assert cpubind.core_lists(_sim({BIND: "0-1|2-3"}, "--tensor-parallel-size", "2")) == [[[0, 1], [2, 3]]]  # type: ignore[arg-type]
    with pytest.raises(SimConfigError, match="invalid literal for int"):
        cpubind.core_lists(_sim({BIND: "0-"}))  # type: ignore[arg-type]


def test_the_plan_json_has_cpus_only_where_set() -> None:
    plan = api.plan(LOCAL_CPU, recipe=TINY, replicas=2)
    data = plan.model_dump(mode="json")
    assert [p.get("cpus") for p in data["processes"]] == ["0", "1", None] and "cpus" not in data["processes"][2]
    assert Process.model_validate(data["processes"][0]).cpus == "0"
