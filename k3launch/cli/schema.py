"""``k3launch schema dump``: add the flag schema of an installed vLLM (a command that needs no plan)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from k3launch.cli.common import STATE, JsonOut, app

schema_app = typer.Typer(help="vLLM flag schemas: plans are checked against the schema of the vLLM that runs.", no_args_is_help=True)
app.add_typer(schema_app, name="schema")


@schema_app.command("dump")
def dump(
    python: Annotated[str, typer.Option("--python", help="An interpreter that imports the vLLM to describe (e.g. VENV/bin/python); "
                                        "vLLM runs in that process only.")],
    out: Annotated[Path | None, typer.Option("--out", help="Directory to write <version>/ into (default: $K3LAUNCH_SCHEMA_DIR, "
                                             "else ~/.k3launch/schemas, where plans look before the bundled schemas).")] = None,
    json_out: JsonOut = False,
) -> None:
    """Dump `vllm serve`'s flags and vLLM's env names from an installed vLLM, for --vllm-version."""
    STATE.json = json_out
    from k3launch import api

    res = api.schema_dump(python, out)
    if json_out:
        typer.echo(json.dumps({"version": res.version, "path": str(res.path), "flags": res.flags, "env_vars": res.env_vars,
                               "used": res.used, "bounded_flags": res.bounded, "rules": res.rules,
                               "rules_missing": list(res.rules_missing)}, indent=2))
        return
    typer.echo(f"wrote vLLM {res.version}'s flag schema ({res.flags} flags, {res.env_vars} env names, {res.bounded} flags with "
               f"limits, {res.rules} cross-field checks) to {res.path}")
    if res.rules_missing:
        typer.echo(f"this vLLM did not reproduce these checks, so plans for it do not make them: {', '.join(res.rules_missing)}")
    if res.used:
        typer.echo(f"plans use it with --vllm-version {res.version} (or vllm_version: {res.version} in the inventory)")
    else:
        typer.echo(f"plans look in $K3LAUNCH_SCHEMA_DIR (else ~/.k3launch/schemas): K3LAUNCH_SCHEMA_DIR={res.path.parent} to use this one")
