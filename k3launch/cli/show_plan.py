"""Rich renderings for people (the ``--json`` forms are the plan/recipe models themselves)."""

from __future__ import annotations

import shlex
from collections.abc import Mapping

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from k3launch.cli.common import rule
from k3launch.models.findings import Finding, FlagHistory
from k3launch.models.plan import Plan, Process
from k3launch.models.recipe import Recipe, Taxonomy
from k3launch.models.weights import LoadPrediction


def command_lines(proc: Process) -> str:
    """The process as a copy-pasteable shell command: ``NAME=value ... \\`` then argv, one flag a line."""
    lines = [f"{k}={shlex.quote(v)} \\" for k, v in proc.env.items()]
    argv = proc.argv
    head = shlex.join(argv[:3]) if argv[:2] == ["vllm", "serve"] else shlex.quote(argv[0])
    rest = argv[3:] if argv[:2] == ["vllm", "serve"] else argv[1:]
    parts: list[str] = []
    for tok in rest:
        if tok.startswith("-") or not parts:
            parts.append(shlex.quote(tok))
        else:
            parts[-1] += " " + shlex.quote(tok)
    body = [head] + ["  " + p for p in parts]
    lines += [line + " \\" for line in body[:-1]] + [body[-1]]
    return "\n".join(lines)


def load_lines(pred: LoadPrediction) -> list[str]:
    """The predicted weight load in plain lines (``plan``, ``doctor``): the total, how the engines
    read, then each engine process; or why there is no figure."""
    rates = ", ".join(f"{'all nodes' if n == '*' else n} {g:,.2f} GB/s" for n, g in pred.gbps.items())
    source = f"{'one shared filesystem: ' if pred.shared else ''}{rates}; from {pred.basis}"
    if pred.unmodelled:
        lines = [f"weights load: not predicted: {pred.unmodelled} ({source})"]
    else:
        staged = f" (the staged copy first, then its read at {', '.join(f'{g:,.2f}' for g in dict.fromkeys(pred.stage_gbps.values()))} GB/s)" if pred.stage_gbps else ""
        lines = [f"weights load (predicted, cold): {pred.total_s:,.0f} s until the last rank has its weights{staged}; {source}"]
    lines += [f"  read as {pred.reading}"] if pred.reading else []
    lines += [f"  checkpoint {pred.checkpoint.gb:,.0f} GB: {pred.checkpoint.source}"] if pred.checkpoint else []
    for r in pred.ranks:
        copy = f" after a {r.copy_s:,.0f} s copy" if pred.stage_gbps else ""
        lines.append(f"  {r.process} on {r.node}: {r.ranks} rank(s) x {r.gb_per_rank:,.1f} GB, {r.seconds:,.0f} s{copy}")
    return lines + [f"  note: {n}" for n in pred.notes]


def plan(console: Console, p: Plan, load: LoadPrediction | None = None) -> None:
    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_column()
    summary.add_row("recipe", f"{p.recipe} ({p.variant})  model {p.model}")
    cpu = p.platform == "cpu"
    ranks = f"{p.gpus_per_node} engine rank(s) each (CPU)" if cpu else f"{p.gpus_per_node} GPUs each"
    summary.add_row("hardware", f"{p.hardware} x {p.nodes} nodes, {ranks}" + ("  [green]verified[/]" if p.verified else "  [yellow]unverified[/]"))
    summary.add_row("strategy", p.strategy + (f" x {p.replicas} copies" if p.replicas > 1 else "") + "".join(f"  {c.role}: {c.parallelism} on {c.nodes} (TP {c.tp} DP {c.dp}{f' PP {c.pp}' if c.pp > 1 else ''})" for c in p.capacity.pools))
    fit = "[green]fits[/]" if p.capacity.fits else "[red]does not fit[/]"
    summary.add_row("capacity", f"weights {p.capacity.weights_gb:g} GB ({p.capacity.formula}) vs {p.capacity.gpu_memory_gb:g} GB {'host' if cpu else 'GPU'} memory per pool: {fit}")
    if p.capacity.kv_offload:
        kv = p.capacity.kv_offload
        summary.add_row("kv offload", f"{kv.option}: {kv.host_gib_per_rank:g} GiB host RAM per rank x {kv.ranks_per_node} = {kv.host_gib_per_node:g} GiB per node")
    if load is not None:
        summary.add_row("weights load", f"not predicted: {load.unmodelled}" if load.unmodelled
                        else f"{load.total_s:,.0f} s predicted (cold, until the last rank), from {load.basis}")
    summary.add_row("features", ", ".join(p.features) or "none")
    summary.add_row("endpoint", p.endpoint)
    console.print(Panel(summary, title="k3launch plan", expand=False))
    if p.notices:
        notes = Table(show_header=True, header_style="bold", box=None)
        notes.add_column("notice")
        notes.add_column("what changed")
        for n in p.notices:
            notes.add_row(n.code, n.message)
        console.print(notes)
    table = Table(title="processes", show_lines=False)
    for col in ("id", "node", "address", "role", "head", "port", "GPUs", "image"):
        table.add_column(col, overflow="fold")  # at 80 columns an image or address wraps, never ends in '…'
    for proc in p.processes:
        table.add_row(proc.id, proc.node, proc.address, proc.role, "yes" if proc.head else "headless" if proc.role != "router" and proc.http_port is None else "",
                      str(proc.http_port or ""), str(proc.gpus or ""), proc.image or "")
    console.print(table)
    if load is not None:
        console.print(Text("\n".join(load_lines(load))), soft_wrap=True)
    for proc in p.processes:
        # Plain text (no box) so a command can be copied straight into a shell.
        rule(console, f"{proc.id} on {proc.node} ({proc.address})", align="left")
        console.print(Text(command_lines(proc)), soft_wrap=True)


def history(console: Console, items: list[FlagHistory], key: str) -> None:
    if not items:
        console.print(f"{key} is not set by any layer in this selection (vLLM's default applies)")
        return
    for h in items:
        t = Table(title=f"{key}  ({', '.join(h.processes)})", show_header=True, header_style="bold")
        for col in ("#", "layer", "value", "from"):
            t.add_column(col)
        for i, e in enumerate(h.entries, 1):
            mark = " <- runs" if i == len(h.entries) and h.final is not None else ""  # final None: a later step removed it
            t.add_row(str(i), e.layer, e.value + mark, e.origin)
        console.print(t)


def findings(console: Console, items: list[Finding]) -> None:
    if not items:
        console.print("[green]clean[/]: no findings")
        return
    for f in items:
        color = "red" if f.severity == "error" else "yellow"
        console.print(f"[{color}]{f.severity}[/] {f.code}: {f.message}" + (f"\n  hint: {f.hint}" if f.hint else ""))


def recipes_list(console: Console, rows: list[tuple[str, str, str]], taxonomy: Taxonomy, strategies: list[str]) -> None:
    t = Table(title="recipes")
    for col in ("id", "title", "verified hardware"):
        t.add_column(col)
    for row in rows:
        t.add_row(*row)
    console.print(t)
    hw = Table(title="hardware (per node)")
    for col in ("id", "GPUs", "GPU memory", "brand", "generation", "platform"):
        hw.add_column(col)
    for hid, prof in taxonomy.hardware_profiles.items():
        if not prof.restricted:
            hw.add_row(hid, str(prof.gpu_count), f"{prof.vram_gb} GB", prof.brand, prof.generation, prof.vendor_platform)
    console.print(hw)
    console.print("strategies: " + ", ".join(strategies))


def recipe_detail(console: Console, rid: str, rec: Recipe, taxonomy: Taxonomy, kv: dict[str, dict[str, bool]], kv_hw: str,
                  default: Mapping[str, object], one_node: Mapping[str, bool | None]) -> None:
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("model", rec.model.model_id)
    head.add_row("parameters", f"{rec.model.parameter_count or '?'} ({rec.model.architecture})")
    if "refused" in default:
        head.add_row("default", f"not planned ({default['refused']}): {default['message']}")
    else:
        head.add_row("default", f"{default['variant']} on {default['nodes']} x {default['hardware']}, {default['strategy']}")
    head.add_row("strategies", ", ".join(rec.compatible_strategies) or "any")
    head.add_row("floors (GPUs)", ", ".join(f"{k} {v}" for k, v in rec.strategy_min_gpus.items()) or "-")
    head.add_row("variants", ", ".join(f"{k} ({v.precision or '?'}, {v.vram_minimum_gb or '?'} GB)" for k, v in rec.variants.items()))
    head.add_row("features", ", ".join(f"{k}{' (opt-in)' if k in rec.opt_in_features else ''}" for k in rec.features))
    console.print(Panel(head, title=rid, expand=False))
    hw = Table(title="hardware")
    for col in ("id", "GPUs x memory", "verified", "one node holds the weights"):
        hw.add_column(col)
    for hid, prof in taxonomy.hardware_profiles.items():
        if prof.restricted and hid not in rec.meta.hardware:
            continue
        holds = one_node.get(hid)
        hw.add_row(hid, f"{prof.gpu_count} x {prof.gpu_memory_gb:g} GB = {prof.vram_gb} GB", rec.meta.hardware.get(hid, "no"),
                   "?" if holds is None else "yes" if holds else "no")
    console.print(Group(hw))
    if kv:
        opts = list(next(iter(kv.values())))
        t = Table(title=f"KV offload on {kv_hw}")
        t.add_column("strategy")
        for o in opts:
            t.add_column(o)
        for sname, row in kv.items():
            t.add_row(sname, *("yes" if row[o] else "-" for o in opts))
        console.print(t)
