"""Inventories: loading the examples, validation with file:line, hostile values, ssh config aliases.

Every refusal goes through the real CLI (``plan --json``): exit code 2, one JSON object
``{"error": {code, message, hint}}``, no traceback.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from inventory_helpers import EXAMPLES, ROOT, example, inventory_addresses, load_example, plan_json, q, run_cli, write_yaml
from plan_checks import check_plan

from k3launch.errors import K3Error
from k3launch.models.plan import Plan
from k3launch.planning.inventory import Inventory, apply_ssh_config, load_inventory
from k3launch.planning.schema import load_schema

HEAD = "name: t\nbackend: ssh\nhardware: b300\n"
HOSTILE = ("a;b", "$(x)", "a b", "a'b", 'a"b', "`id`", "a|b", "a&&b", "-oProxyCommand=x", "a..b", "a\nb", "")


# ------------------------------------------------------------------ the examples
@pytest.mark.parametrize("name", EXAMPLES)
def test_example_inventories_load(name: str) -> None:
    inv = load_example(name)
    assert inv.name == name
    assert inv.backend in ("ssh", "slurm", "local")
    if inv.backend == "slurm":
        assert inv.slurm is not None
    else:
        assert inv.nodes, name
        addrs = list(inventory_addresses(inv).values())
        assert len(addrs) == len(set(addrs)), addrs


def test_example_inventory_settings_are_the_files() -> None:
    local = load_example("local")
    assert (local.backend, local.engine, local.hardware, local.defaults.runtime) == ("local", "sim", "b300", "bare")
    assert [n.address for n in local.nodes] == ["127.0.0.11", "127.0.0.12", "127.0.0.13", "127.0.0.14"]
    mi = load_example("mi355x-pair")
    assert (mi.defaults.runtime, mi.router.node) == ("podman", "mi355x-01")
    gb = load_example("gb300-nvl4x4")
    assert [n.address for n in gb.nodes] == [None] * 4  # names are ssh aliases / DNS names
    slurm = load_example("slurm-b200")
    assert slurm.slurm is not None and slurm.slurm.nodelist == "gpu-[01-16]" and not slurm.nodes


def test_node_settings_override_defaults(tmp_path: Path) -> None:
    inv = write_yaml(tmp_path, HEAD + """defaults: {user: root, iface: eth0, cpu_memory_gb: 1000, hf_cache: /d/hf, shm_size: 16g}
nodes:
  - {name: n1, address: 10.0.0.1}
  - {name: n2, address: 10.0.0.2, iface: ib3, cpu_memory_gb: 3000, user: svc, shm_size: 32g}
""")
    plan = plan_json(inv, ["--strategy", "multi_node_tp"], tmp_path)
    hosts = {h["name"]: h for h in plan["hosts"]}
    assert (hosts["n1"]["iface"], hosts["n1"]["cpu_memory_gb"], hosts["n1"]["user"], hosts["n1"]["shm_size"]) == ("eth0", 1000, "root", "16g")
    assert (hosts["n2"]["iface"], hosts["n2"]["cpu_memory_gb"], hosts["n2"]["user"], hosts["n2"]["shm_size"]) == ("ib3", 3000, "svc", "32g")
    assert hosts["n2"]["hf_cache"] == "/d/hf"
    env = {p["node"]: p["env"] for p in plan["processes"]}
    assert env["n1"]["NCCL_SOCKET_IFNAME"] == "eth0" and env["n2"]["GLOO_SOCKET_IFNAME"] == "ib3"


# ------------------------------------------------------------------ validation refusals
def _line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


UNKNOWN_KEYS = {
    "top-level": (HEAD + "colour: blue\nnodes:\n  - {name: n1}\n", "colour"),
    "defaults": (HEAD + "defaults:\n  user: root\n  gpus: 8\nnodes:\n  - {name: n1}\n", "gpus"),
    "node-flow": (HEAD + "nodes:\n  - {name: n1}\n  - {name: n2, adress: 10.0.0.2}\n", "adress"),
    "node-block": (HEAD + "nodes:\n  - name: n1\n    address: 10.0.0.1\n    drained: true\n", "drained"),
    "router": (HEAD + "nodes:\n  - {name: n1}\nrouter:\n  node: login\n  listen: 0.0.0.0\n", "listen"),
    "slurm": ("name: s\nbackend: slurm\nslurm:\n  partition: gpu\n  partitoin: gpu2\n", "partitoin"),
}


@pytest.mark.parametrize("case", sorted(UNKNOWN_KEYS))
def test_unknown_key_is_refused_with_file_and_line(tmp_path: Path, case: str) -> None:
    text, key = UNKNOWN_KEYS[case]
    path = write_yaml(tmp_path, text)
    err = run_cli(["plan", "--json", "-i", str(path)], tmp_path).error()
    assert f"{path}:{_line_of(text, key + ':')}:" in err["message"], err
    assert key in err["message"] and "unknown key" in err["message"]
    assert err["code"] == "bad-inventory" and err["hint"]


def _hostile_yaml(field: str, value: str) -> str:
    if field == "name":
        return HEAD + f"nodes:\n  - {{name: {q(value)}, address: 10.0.0.1}}\n"
    if field == "router.address":
        return HEAD + f"nodes:\n  - {{name: n1}}\nrouter:\n  address: {q(value)}\n"
    if field.startswith("defaults."):
        return HEAD + f"defaults:\n  {field.split('.')[1]}: {q(value)}\nnodes:\n  - {{name: n1}}\n"
    return HEAD + f"nodes:\n  - {{name: n1, {field}: {q(value)}}}\n"


# (field, value) pairs; a few values are valid for NICs/users ("a..b", a dash-led NIC name) and are left out.
HOSTILE_CASES = [(f, v) for f in ("name", "address", "ssh_host", "router.address", "iface", "defaults.iface", "defaults.user")
                 for v in HOSTILE if not (f.endswith("iface") and v in ("a..b", "-oProxyCommand=x")) and not (f.endswith("user") and v == "a..b")]


@pytest.mark.parametrize(("field", "value"), HOSTILE_CASES)
def test_hostile_host_values_are_refused(tmp_path: Path, field: str, value: str) -> None:
    """Names, addresses, NICs and users reach ssh/shell command lines: anything but a plain name is refused."""
    text = _hostile_yaml(field, value)
    path = write_yaml(tmp_path, text)
    err = run_cli(["plan", "--json", "-i", str(path)], tmp_path).error()
    assert err["code"] == "bad-inventory" and str(path) in err["message"] and err["message"].count(":") >= 2, err
    line = _line_of(text, field.split(".")[-1] + ": " + q(value))
    assert f":{line}:" in err["message"], err


def test_hostile_node_name_exits_2_from_the_real_command(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, HEAD + "nodes:\n  - {name: \"$(touch pwned)\"}\n")
    out = subprocess.run([sys.executable, "-m", "k3launch", "plan", "-i", str(path)], capture_output=True, text=True,
                         cwd=tmp_path, env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}, timeout=60)
    assert out.returncode == 2, out
    assert out.stderr.startswith("error: ") and "hint: " in out.stderr and "Traceback" not in out.stderr
    assert "$(touch pwned)" in out.stderr
    assert not (tmp_path / "pwned").exists()


BAD_INVENTORIES = {
    "duplicate-names": (HEAD + "nodes:\n  - {name: n1, address: 10.0.0.1}\n  - {name: n1, address: 10.0.0.2}\n", "n1"),
    "duplicate-addresses": (HEAD + "nodes:\n  - {name: n1, address: 10.0.0.1}\n  - {name: n2, address: 10.0.0.1}\n", "10.0.0.1"),
    "address-is-another-nodes-name": (HEAD + "nodes:\n  - {name: n1}\n  - {name: n2, address: n1}\n", "n1"),
    "slurm-without-section": ("name: s\nbackend: slurm\nhardware: b200\n", "slurm"),
    "router-node-unknown": (HEAD + "nodes:\n  - {name: n1}\nrouter: {node: n9}\n", "n9"),
    "ssh-without-nodes": (HEAD + "nodes: []\n", "node"),
    "ssh-port-out-of-range": (HEAD + "defaults: {port: 70000}\nnodes:\n  - {name: n1}\n", "port"),
    "router-port-out-of-range": (HEAD + "nodes:\n  - {name: n1}\nrouter: {port: 0}\n", "port"),
    "cpu-memory-not-positive": (HEAD + "nodes:\n  - {name: n1, cpu_memory_gb: 0}\n", "cpu_memory_gb"),
    "unknown-runtime": (HEAD + "defaults: {runtime: kubernetes}\nnodes:\n  - {name: n1}\n", "runtime"),
    "unknown-backend": ("name: t\nbackend: k8s\nnodes:\n  - {name: n1}\n", "backend"),
    "malformed-yaml": (HEAD + "nodes:\n  - {name: n1\n", "malformed YAML"),
    "not-a-mapping": ("- just\n- a list\n", "mapping"),
    "image-not-a-reference": (HEAD + "defaults: {image: \"--privileged\"}\nnodes:\n  - {name: n1}\n", "image"),
    "env-name-not-a-variable": (HEAD + "nodes:\n  - {name: n1, env: {A-B: x}}\n", "A-B"),
    "env-secret": (HEAD + "defaults: {env: {HF_TOKEN: x}}\nnodes:\n  - {name: n1}\n", "HF_TOKEN"),
}


@pytest.mark.parametrize("case", sorted(BAD_INVENTORIES))
def test_bad_inventory_is_refused(tmp_path: Path, case: str) -> None:
    text, needle = BAD_INVENTORIES[case]
    path = write_yaml(tmp_path, text)
    err = run_cli(["plan", "--json", "-i", str(path)], tmp_path).error()
    assert err["code"] == ("bad-yaml" if case == "malformed-yaml" else "bad-inventory"), err  # never bad-recipe
    assert needle in err["message"], err
    assert err["message"].startswith(str(path)), err
    assert "\n" not in err["message"]


def test_missing_inventory_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    err = run_cli(["plan", "--json", "-i", str(missing)], tmp_path).error()
    assert err["code"] == "missing-inventory" and str(missing) in err["message"] and err["hint"]
    with pytest.raises(K3Error) as exc:
        load_inventory(missing)
    assert exc.value.code == "missing-inventory"


def test_human_refusal_is_two_lines_on_stderr(tmp_path: Path) -> None:
    res = run_cli(["plan", "-i", str(tmp_path / "nope.yaml")], tmp_path)
    assert res.code == 2 and res.stdout == ""
    assert res.stderr.splitlines()[0].startswith("error: ") and res.stderr.splitlines()[1].startswith("hint: ")


def test_bad_slurm_nodelist_is_refused(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "name: s\nbackend: slurm\nhardware: b200\nslurm: {nodelist: \"gpu-[01-\"}\n")
    assert run_cli(["plan", "--json", "-i", str(path)], tmp_path).error()["code"] == "bad-nodelist"
    path = write_yaml(tmp_path, "name: s\nbackend: slurm\nhardware: b200\nslurm: {nodelist: \"gpu-[01-02],a;b\"}\n")
    assert run_cli(["plan", "--json", "-i", str(path)], tmp_path).error()["code"] == "bad-nodelist"


# ------------------------------------------------------------------ ~/.ssh/config aliases
SSH_CONFIG = """
Host tray-1
  HostName 10.4.0.1
  User ubuntu
Host tray-2
  HostName 10.4.0.2
Host tray-*
  HostName %h.fabric.example
"""


def test_apply_ssh_config_maps_aliases_to_hostnames() -> None:
    inv = Inventory.model_validate({"name": "t", "backend": "ssh", "hardware": "gb300", "nodes": [
        {"name": "tray-1"}, {"name": "tray-2"}, {"name": "tray-3"}, {"name": "other"},
        {"name": "tray-4", "address": "10.9.9.9"}]})
    out = apply_ssh_config(inv, SSH_CONFIG)
    got = {n.name: (n.address, n.ssh_host) for n in out.nodes}
    assert got == {
        "tray-1": ("10.4.0.1", "tray-1"),
        "tray-2": ("10.4.0.2", "tray-2"),
        "tray-3": ("tray-3.fabric.example", "tray-3"),  # %h expanded by the ssh config
        "other": (None, None),  # no HostName for it: the name is the address
        "tray-4": ("10.9.9.9", None),  # an explicit address wins over the ssh config
    }
    assert apply_ssh_config(inv, None) == inv and apply_ssh_config(inv, "") == inv


@pytest.mark.parametrize("hostname", ["10.0.0.1;touch x", "$(id)", "-oProxyCommand=sh"])
def test_hostile_ssh_config_hostname_is_refused(hostname: str) -> None:
    inv = Inventory.model_validate({"name": "t", "backend": "ssh", "nodes": [{"name": "tray-1"}]})
    with pytest.raises(K3Error) as exc:
        apply_ssh_config(inv, f"Host tray-1\n  HostName {hostname}\n")
    assert exc.value.code == "bad-ssh-config" and "tray-1" in exc.value.message and exc.value.hint


def _gb300_with_ssh_config(tmp_path: Path, key: bool) -> Path:
    text = example("gb300-nvl4x4").read_text()
    if key:
        (tmp_path / "cfg").write_text(SSH_CONFIG.replace("Host tray-*\n  HostName %h.fabric.example\n", "Host tray-3\n  HostName 10.4.0.3\nHost tray-4\n  HostName 10.4.0.4\n"))
        text += f"ssh_config: {tmp_path / 'cfg'}\n"
    return write_yaml(tmp_path, text)


@pytest.mark.parametrize("via", ["inventory-key", "home-ssh-config"])
def test_plan_uses_ssh_config_hostnames_as_addresses(tmp_path: Path, via: str) -> None:
    home = tmp_path / "home"
    home.mkdir()
    inv = _gb300_with_ssh_config(tmp_path, key=via == "inventory-key")
    if via == "home-ssh-config":
        (home / ".ssh").mkdir()
        (home / ".ssh" / "config").write_text("Host tray-*\n  HostName %h.fabric.example\n")
    plan = plan_json(inv, ["--strategy", "multi_node_dep"], home)
    want = {f"tray-{i}": (f"10.4.0.{i}" if via == "inventory-key" else f"tray-{i}.fabric.example") for i in range(1, 5)}
    engines = [p for p in plan["processes"] if p["role"] != "router"]
    assert {p["node"]: p["address"] for p in engines} == want
    for p in engines:
        assert p["env"]["VLLM_HOST_IP"] == want[p["node"]]
        assert p["argv"][p["argv"].index("--data-parallel-address") + 1] == want["tray-1"]
    hosts = {h["name"]: h for h in plan["hosts"] if h["name"].startswith("tray-")}
    assert {n: (h["address"], h["ssh_host"]) for n, h in hosts.items()} == {n: (a, n) for n, a in want.items()}
    router = next(p for p in plan["processes"] if p["role"] == "router")
    urls = router["argv"][router["argv"].index("--worker-urls") + 1:router["argv"].index("--policy")]
    assert urls == [f"http://{want[f'tray-{i}']}:8000" for i in range(1, 5)]


def test_without_ssh_config_the_names_are_the_addresses(tmp_path: Path) -> None:
    plan = plan_json(example("gb300-nvl4x4"), [], tmp_path)
    assert {p["node"]: p["address"] for p in plan["processes"]} == {"tray-1": "tray-1", "tray-2": "tray-2"}
    assert all(h["ssh_host"] is None for h in plan["hosts"])


def test_missing_ssh_config_file_is_refused(tmp_path: Path) -> None:
    inv = write_yaml(tmp_path, example("gb300-nvl4x4").read_text() + f"ssh_config: {tmp_path / 'nope'}\n")
    err = run_cli(["plan", "--json", "-i", str(inv)], tmp_path).error()
    assert err["code"] == "missing-file" and "nope" in err["message"]


@pytest.mark.parametrize(("config", "shared"), [
    ("Host tray-1 tray-2\n  HostName 10.0.0.1\n", "10.0.0.1"),  # two aliases, one HostName
    ("Host tray-1\n  HostName tray-2\n", "tray-2"),  # an alias resolving to another node's name
])
def test_ssh_aliases_resolving_to_one_address_are_refused(config: str, shared: str, tmp_path: Path) -> None:
    """Ports are planned per address: two nodes on one address would be planned onto one machine's ports."""
    inv = load_inventory(ROOT / "inventories" / "gb300-nvl4x4.yaml")
    with pytest.raises(K3Error) as exc:
        apply_ssh_config(inv, config)
    assert exc.value.code == "bad-inventory" and shared in exc.value.message and exc.value.hint, exc.value.as_dict()
    # The same from the CLI, with the config named by the inventory.
    (tmp_path / "cfg").write_text(config)
    path = write_yaml(tmp_path, example("gb300-nvl4x4").read_text() + f"ssh_config: {tmp_path / 'cfg'}\n")
    err = run_cli(["plan", "--json", "-i", str(path)], tmp_path).error()
    assert err["code"] == "bad-inventory" and shared in err["message"] and "gb300-nvl4x4" in err["message"], err


# ------------------------------------------------------------------ container images
BAD_IMAGES = ("--privileged", "-v/:/host", "img;touch x", "img $(id)", "$(id)", "img`id`", "a b", "img|x", "img&&x", "img'x",
              'img"x', "img\nx", "", "/abs/path")


@pytest.mark.parametrize("where", ["defaults", "node"])
@pytest.mark.parametrize("image", BAD_IMAGES)
def test_an_image_that_is_not_an_image_reference_is_refused(tmp_path: Path, image: str, where: str) -> None:
    """An image reaches docker/podman/apptainer where options are parsed: only image references load."""
    node = f"  - {{name: n1, image: {q(image)}}}\n" if where == "node" else "  - {name: n1}\n"
    text = HEAD + (f"defaults: {{image: {q(image)}}}\n" if where == "defaults" else "") + "nodes:\n" + node
    path = write_yaml(tmp_path, text)
    err = run_cli(["plan", "--json", "-i", str(path)], tmp_path).error()
    assert err["code"] == "bad-inventory" and "image" in err["message"], err
    assert f"{path}:{_line_of(text, 'image: ' + q(image))}:" in err["message"], err


@pytest.mark.parametrize("image", ["vllm/vllm-openai:v0.33.0", "nvcr.io/nvidia/vllm:25.01-py3", "rocm/vllm-dev:nightly_main_20250101",
                                   "localhost:5000/team/img@sha256:" + "ab" * 32, "img"])
def test_image_references_are_accepted_and_used(tmp_path: Path, image: str) -> None:
    path = write_yaml(tmp_path, HEAD + f"defaults: {{image: {q(image)}, cpu_memory_gb: 4096}}\nnodes:\n  - {{name: n1}}\n")
    plan = plan_json(path, [], tmp_path)
    assert [p["image"] for p in plan["processes"] if p["role"] != "router"] == [image]


# ------------------------------------------------------------------ env: extra environment of every engine
ENV_INV = """name: envs
backend: ssh
hardware: b300
defaults:
  iface: eth0
  cpu_memory_gb: 4096
  env: {NCCL_DEBUG: INFO, K3_NOTE: "two words; and 'quotes'"}
nodes:
  - {name: n1, address: 10.0.0.1}
  - {name: n2, address: 10.0.0.2, env: {NCCL_DEBUG: WARN, ONLY_N2: "1"}}
  - {name: n3, address: 10.0.0.3}
"""


@pytest.mark.parametrize("args", [["--strategy", "multi_node_dep"], ["--strategy", "pd_cluster", "--prefill-strategy", "tp",
                                                                       "--prefill-nodes", "2", "--decode-strategy", "tep", "--decode-nodes", "1"]])
def test_inventory_env_reaches_every_engine_process(tmp_path: Path, args: list[str]) -> None:
    """defaults.env on every engine (heads and headless), a node's env over the defaults, never on the router."""
    plan = plan_json(write_yaml(tmp_path, ENV_INV), args, tmp_path)
    engines = [p for p in plan["processes"] if p["role"] != "router"]
    assert len(engines) >= 2 and any(p["http_port"] is None for p in engines) == (args[1] == "pd_cluster")
    want = {"n1": {"NCCL_DEBUG": "INFO"}, "n2": {"NCCL_DEBUG": "WARN", "ONLY_N2": "1"}, "n3": {"NCCL_DEBUG": "INFO"}}
    for p in engines:
        mine = {**want[p["node"]], "K3_NOTE": "two words; and 'quotes'"}
        assert {k: p["env"].get(k) for k in [*mine, "ONLY_N2"]} == {"ONLY_N2": None, **mine}, p["id"]
        for k, v in mine.items():
            assert p["provenance"][k][-1] == {"layer": "strategy", "value": v, "origin": "inventory envs env"}, (p["id"], k)
        assert p["env"]["VLLM_HOST_IP"] == p["address"]
    router = [p for p in plan["processes"] if p["role"] == "router"]
    assert router and all("NCCL_DEBUG" not in p["env"] for p in router)
    check_plan(load_schema(), Plan.model_validate(plan))


SECRET_NAMES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "GITHUB_TOKEN", "WANDB_SECRET", "DB_PASSWORD", "VLLM_API_KEY", "OPENAI_API_KEY")


@pytest.mark.parametrize("where", ["defaults", "node"])
@pytest.mark.parametrize("name", SECRET_NAMES)
def test_inventory_env_refuses_secrets_with_file_and_line(tmp_path: Path, name: str, where: str) -> None:
    value = "s3cr3t-value-9f2"
    env = f"env: {{NCCL_DEBUG: INFO, {name}: {value}}}"
    text = HEAD + (f"defaults: {{{env}}}\nnodes:\n  - {{name: n1}}\n" if where == "defaults" else f"nodes:\n  - {{name: n1, {env}}}\n")
    path = write_yaml(tmp_path, text)
    res = run_cli(["plan", "--json", "-i", str(path)], tmp_path)
    err = res.error()
    assert err["code"] == "bad-inventory" and name in err["message"] and "secret" in err["message"], err
    assert f"{path}:{_line_of(text, name)}:" in err["message"], err
    assert value not in res.stdout + res.stderr  # the refusal does not echo the secret


def test_inventory_env_secret_in_a_block_mapping_points_into_the_env_block(tmp_path: Path) -> None:
    text = HEAD + "defaults:\n  env:\n    NCCL_DEBUG: INFO\n    HF_TOKEN: hf_abc\nnodes:\n  - {name: n1}\n"
    path = write_yaml(tmp_path, text)
    err = run_cli(["plan", "--json", "-i", str(path)], tmp_path).error()
    assert err["code"] == "bad-inventory" and "HF_TOKEN" in err["message"], err
    lines = [f"{path}:{n}:" for n in range(_line_of(text, "env:"), _line_of(text, "HF_TOKEN") + 1)]
    assert any(err["message"].startswith(x) for x in lines), err


@pytest.mark.parametrize("name", ["A-B", "1X", "A B", "", "X=Y", "$(id)"])
def test_inventory_env_names_must_be_variable_names(tmp_path: Path, name: str) -> None:
    path = write_yaml(tmp_path, HEAD + f"nodes:\n  - {{name: n1, env: {{{q(name)}: x}}}}\n")
    err = run_cli(["plan", "--json", "-i", str(path)], tmp_path).error()
    assert err["code"] == "bad-inventory" and "env" in err["message"] and f"{path}:5:" in err["message"], err


@pytest.mark.parametrize("name", ["TOKENIZERS_PARALLELISM", "HF_TOKEN_PATH", "NCCL_DEBUG", "_X1"])
def test_inventory_env_names_that_only_resemble_secrets_are_accepted(tmp_path: Path, name: str) -> None:
    path = write_yaml(tmp_path, HEAD + f"defaults: {{cpu_memory_gb: 4096}}\nnodes:\n  - {{name: n1, env: {{{name}: v}}}}\n")
    plan = plan_json(path, [], tmp_path)
    assert all(p["env"][name] == "v" for p in plan["processes"] if p["role"] != "router")
