"""``k3launch-sim`` / ``python -m k3launch.sim``: the ``vllm`` command line of the simulated engine.

``serve MODEL [flags]`` is tokenized by the vendored flag schema of the vLLM version named by
``K3LAUNCH_SIM_VLLM_VERSION``, so a flag the real ``vllm serve`` would reject is rejected here
with argparse's wording and exit code 2. Settings vLLM refuses after parsing (ranks, sizes,
GPUs) print vLLM's ``ValueError`` and exit 1.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Mapping
from typing import NoReturn

from k3launch.defaults import DEFAULT_VLLM_VERSION
from k3launch.errors import K3Error
from k3launch.planning.schema import FlagSchema, FlagSpec, Problem, load_schema
from k3launch.sim import cpubind, options
from k3launch.sim.logs import Logger
from k3launch.sim.runner import SimProcess

_UNRECOGNIZED = ("unknown-flag", "stray-value")
USAGE = "usage: vllm serve [model_tag] [options]"
PROG = "vllm serve"
DEFAULT_MODEL = "Qwen/Qwen3-0.6B"  # vLLM's default when no model is given


class UsageError(Exception):
    """argparse's ``error()``: usage line, ``prog: error: message``, exit 2."""


def main(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    environ = os.environ if env is None else env
    if not args or args[0] in ("-h", "--help"):
        print("usage: vllm [-h] [-v] {serve,bench} ...\n\nk3launch's simulated vLLM engine: `vllm serve MODEL [flags]`, `vllm bench serve [options]`.")
        return 0 if args else 2
    if args[0] in ("-v", "--version"):
        print(environ.get("K3LAUNCH_SIM_VLLM_VERSION") or DEFAULT_VLLM_VERSION)
        return 0
    if args[0] == "bench":  # `vllm bench serve`: the image's own benchmark client
        from k3launch.sim import bench

        return bench.main(args[1:])
    if args[0] != "serve":
        sys.stderr.write(f"usage: vllm [-h] [-v] {{serve,bench}} ...\nvllm: error: argument subparser: invalid choice: {args[0]!r} "
                         "(the simulated engine only implements 'serve' and 'bench serve')\n")
        return 2
    try:
        knobs = options.Knobs.from_env(environ)
        schema = load_schema(knobs.version)
    except (options.KnobError, K3Error) as exc:
        sys.stderr.write(f"k3launch-sim: {exc}\n")
        return 2
    if any(a in ("-h", "--help") for a in args[1:]):
        print(f"{USAGE}\n\nFlags: those of vllm serve {schema.version} (see `vllm serve --help=all`).")
        return 0
    try:
        opts = parse_serve(schema, args[1:], environ)
    except UsageError as exc:
        sys.stderr.write(f"{USAGE}\n{PROG}: error: {exc}\n")
        return 2
    log = Logger("Worker" if opts.headless else "APIServer")
    try:
        options.check(opts, knobs)
        cpubind.core_lists(opts)  # the CPU binding vLLM would refuse
    except options.SimConfigError as exc:
        log.error(f"Error in vllm serve: {exc}", src="arg_utils.py")
        log.fatal("ValueError", str(exc))
        return 1
    _exit(SimProcess(opts, knobs, log).run())


def _exit(code: int) -> NoReturn:
    """End a serving process at once: every listener is closed by now, and skipping interpreter
    teardown avoids daemon request threads dying mid-write to stdout (a crash at exit)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def parse_serve(schema: FlagSchema, tokens: list[str], env: Mapping[str, str]) -> options.ServeOptions:
    """Model and flags of ``vllm serve``; raises :class:`UsageError` (also for a bad JSON config)."""
    model: str | None = None
    if tokens and not tokens[0].startswith("-"):
        model, tokens = tokens[0], tokens[1:]
    args, problems = schema.parse(tokens)
    # argparse reports a bad value as soon as it meets it, and leftover tokens only at the end.
    for p in problems:
        if p.code not in _UNRECOGNIZED:
            raise UsageError(_argparse_message(schema, p))
    unknown = [_token_of(p) for p in problems if p.code in _UNRECOGNIZED]
    unknown += [a.written for a in args if a.legacy]  # vLLM's argparse knows no legacy spelling
    if unknown:
        raise UsageError("unrecognized arguments: " + " ".join(unknown))
    if any(a.spec.dest == "model" for a in args):
        raise UsageError("With `vllm serve`, you should provide the model as a positional argument "
                         "instead of via the `--model` option.")
    try:
        return options.build(model or DEFAULT_MODEL, args, env)
    except options.FlagValueError as exc:
        raise UsageError(f"argument {exc.flag}: {exc}") from None


def _argparse_message(schema: FlagSchema, p: Problem) -> str:
    """The schema's problem worded as vLLM's argparse words it."""
    spec = _spec(schema, p.option) if p.option else None
    name = _name(spec) if spec else p.option
    if p.code == "bad-choice" and spec is not None and spec.choices:
        return f"argument {name}: invalid choice: {p.value!r} (choose from {', '.join(map(repr, spec.choices))})"
    if p.code == "bad-value" and spec is not None and spec.kind in ("bool", "store_true"):
        return f"argument {name}: ignored explicit argument {p.value!r}"
    if p.code == "bad-value":
        return f"argument {name}: invalid {spec.type if spec and spec.type else 'value'} value: {p.value!r}"
    if p.code == "missing-value":
        what = "expected at least one argument" if spec is not None and spec.kind == "multi" else "expected one argument"
        return f"argument {name}: {what}"
    return p.message


def _spec(schema: FlagSchema, option: str) -> FlagSpec | None:
    found = schema.lookup(option)
    return found[0] if found else None


def _name(spec: FlagSpec) -> str:
    return "/".join(spec.options)  # argparse names an action by all its option strings


def _token_of(p: Problem) -> str:
    return p.option or p.message.split(" ", 1)[0]
