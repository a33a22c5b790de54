"""``k3launch canary NAME``: replay the recorded greedy answers on every target and compare.

Exit 0: every target gave the recorded answers; 1: a target answered differently, or did not
answer (each is printed: target, prompt, expected, got); 2: refused (unknown deployment, not
ready, no baseline).
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Annotated

import typer

from k3launch.cli.common import INTERRUPTED, STATE, JsonOut, StateDir, app, console, number_option
from k3launch.util import bounds

if TYPE_CHECKING:
    from rich.console import Console

    from k3launch.models.canary import CanaryReport, Mismatch


@app.command()
def canary(
    name: Annotated[str, typer.Argument(help="Deployment name.")],
    rebaseline: Annotated[bool, typer.Option("--rebaseline", help="Record the answers anew first (after a model or sampling change), then compare every other target with them.")] = False,
    match_prefix: Annotated[int | None, number_option("--match-prefix", bounds.CANARY_PREFIX,
                                                      "Only the first N tokens of each answer must match: for engines not deterministic at temperature 0 (kept with --rebaseline).")] = None,
    timeout: Annotated[float, number_option("--timeout", bounds.CANARY_TIMEOUT, "Seconds for one request.")] = 30.0,
    state_dir: StateDir = None, json_out: JsonOut = False,
) -> None:
    """Replay the deployment's recorded greedy answers on every engine, P/D pairing and the router, and compare (exit 1 on a difference).

    `up` records them once the deployment serves; --rebaseline records them again on purpose."""
    STATE.json = json_out
    from k3launch.api.canaries import canary as run

    try:
        report = run(name, rebaseline=rebaseline, match_prefix=match_prefix, timeout=timeout, state_dir=state_dir)
    except KeyboardInterrupt:
        raise typer.Exit(INTERRUPTED) from None
    if json_out:
        typer.echo(json.dumps({"ok": report.ok, **report.model_dump(mode="json")}))
    else:
        show(console(), report)
    if not report.ok:
        raise typer.Exit(1)


def _ids(ids: list[int] | None, text: str) -> str:
    return f"{ids if ids is not None else '(no token ids)'} {json.dumps(text)}"


def mismatch(con: Console, m: Mismatch) -> None:
    unit = "token" if m.basis == "token_ids" else "word"
    con.print(f"{m.target}: {m.request} ({m.kind}): the answer differs from {unit} {m.first_difference} on", markup=False)
    con.print(f"  prompt:   {json.dumps(m.prompt)}", markup=False)
    con.print(f"  expected: {_ids(m.expected, m.expected_text)}", markup=False)
    con.print(f"  got:      {_ids(m.got, m.got_text)}", markup=False)


def show(con: Console, r: CanaryReport) -> None:
    b = r.baseline
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(b.recorded))
    version = b.engine_version or b.vllm_version
    con.print(f"{r.deployment}: {'recorded now' if r.recorded else 'baseline of ' + when} from {b.source} "
              f"({b.engine} {version}, {b.model}); {b.tolerance.describe()} must match", markup=False)
    width = max(len(t.target) for t in r.targets) if r.targets else 0
    for t in r.targets:
        what = {"ok": "ok", "mismatch": f"MISMATCH ({len(t.mismatches)} of {len(b.requests)} answers differ)"}.get(t.outcome, t.outcome.upper())
        con.print(f"  {t.target:<{width}}  {what}  {t.seconds:.2f}s" + (f"  {t.reason}" if t.reason else ""), markup=False)
    for m in r.mismatches:
        mismatch(con, m)
    if r.rebaseline and not r.ok:
        con.print("the plan changed since the baseline was recorded, so answers may differ legitimately: " + "; ".join(r.rebaseline),
                  markup=False)
        con.print(f"`k3launch canary {r.deployment} --rebaseline` records new answers", markup=False)
    ok = sum(1 for t in r.targets if t.outcome == "ok")
    con.print(f"{ok} of {len(r.targets)} target(s) gave the recorded answers", markup=False)
