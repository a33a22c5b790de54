"""``k3launch top NAME``: a live view of a deployment's engines and router, from their ``/metrics``."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Annotated

import typer

from k3launch.cli.common import STATE, JsonOut, StateDir, app, console, number_option
from k3launch.util.bounds import TOP_INTERVAL, TOP_WINDOW

if TYPE_CHECKING:
    from rich.table import Table

    from k3launch.api.top import TopView


def _num(v: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if v is None else fmt.format(v)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def table(view: TopView, window_s: float) -> Table:
    from rich.table import Table

    t = Table(title=f"{view.name}: {view.state}{', supervised' if view.supervised else ''} "
                    f"(rates and latencies over the last {window_s:g}s; {time.strftime('%H:%M:%S', time.localtime(view.time))})",
              title_justify="left")
    for col in ("process", "role", "copy", "node", "unit", "up", "run", "wait", "KV %", "prompt tok/s", "gen tok/s",
                "TTFT p50/p99 ms", "ITL p50/p99 ms", "router req/s err/s"):
        t.add_column(col, justify="right" if col not in ("process", "role", "copy", "node", "unit") else "left", no_wrap=True)
    for r in view.rows:
        w = r.window
        router = f"{_num(w.requests_ps, '{:.1f}')} {_num(w.errors_ps, '{:.1f}')}" if r.role == "router" else ""
        t.add_row(r.process, r.role, r.copy or "-", r.node, r.unit_state or "-", "yes" if r.up else "[red]no[/]",
                  _num(w.running), _num(w.waiting), _num(None if w.kv_usage is None else w.kv_usage * 100),
                  _num(w.prompt_tps, "{:.1f}"), _num(w.generation_tps, "{:.1f}"),
                  f"{_ms(w.ttft_p50)}/{_ms(w.ttft_p99)}", f"{_ms(w.itl_p50)}/{_ms(w.itl_p99)}", router)
    return t


@app.command()
def top(
    name: Annotated[str, typer.Argument(help="The deployment.")],
    once: Annotated[bool, typer.Option("--once", help="Print one view and exit (two scrapes --interval apart, for the rates).")] = False,
    interval: Annotated[float, number_option("--interval", TOP_INTERVAL, "Seconds between scrapes.")] = 1.0,
    window: Annotated[float, number_option("--window", TOP_WINDOW, "Rates and latency percentiles over this many seconds.")] = 60.0,
    json_out: JsonOut = False,
    state_dir: StateDir = None,
) -> None:
    """Live per engine and router: requests running/waiting, KV cache use, tokens/s, TTFT and ITL p50/p99, the controller's unit states."""
    STATE.json = json_out
    from k3launch import api

    watch = api.Top(name, state_dir, span=window)
    try:
        if once or json_out:
            watch.sample()
            time.sleep(interval)
            view = watch.sample()
            if json_out:
                typer.echo(json.dumps(view.as_dict(), indent=2))
            else:
                console().print(table(view, window))
            return
        from rich.live import Live

        con = console()
        with Live(table(watch.sample(), window), console=con, auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                live.update(table(watch.sample(), window), refresh=True)
    except KeyboardInterrupt:
        return
    finally:
        watch.close()
