"""Help and tables at 80 columns and in a pipe: nothing cut, no divider as long as the unbounded
width, one style of value label (click's: TEXT, INTEGER, NUMBER, PATH, PORT, ...)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from k3launch.cli import COMMANDS, app


def _run(args: list[str], home: Path, columns: str | None) -> str:
    env = {"HOME": str(home), "COLUMNS": columns, "LINES": None}
    res = CliRunner().invoke(app, args, env=env, prog_name="k3launch", catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res.stdout


def _commands() -> list[list[str]]:
    """Every command and subcommand, as typed."""
    out = []
    for name in COMMANDS:
        cmd = app_command(name)
        subs = getattr(cmd, "commands", None)
        out += [[name, sub] for sub in subs] if subs else [[name]]
    return out


def app_command(name: str) -> object:
    import typer.main

    group = typer.main.get_command(app)
    return group.get_command(None, name)  # type: ignore[attr-defined]


@pytest.mark.parametrize("words", _commands(), ids=" ".join)
def test_every_help_reads_whole_at_80_columns(words: list[str], tmp_path: Path) -> None:
    text = _run([*words, "--help"], tmp_path, "80")
    long = [line for line in text.splitlines() if len(line) > 80]
    assert not long, long
    assert "…" not in text, text
    labels = re.findall(r"<(?:int|str|bool|float|path|file|directory|list\[\w+\]|\w+ range)>", text)  # Typer's own labels
    assert not labels, labels


def test_up_help_names_every_option_whole(tmp_path: Path) -> None:
    text = _run(["up", "--help"], tmp_path, "80")
    for flag in ("--accept-unknown-hosts", "--prefill-strategy", "--fault-tolerance / --no-fault-tolerance", "--connect-timeout"):
        assert flag in text, flag
    assert re.search(r"--nodes INTEGER", text) and re.search(r"--name TEXT", text) and re.search(r"--inventory PATH", text), text
    assert not re.search(r"--dry-run \S", text), "a switch takes no value"


def test_plan_in_a_pipe_has_no_divider_as_long_as_the_unbounded_width(tmp_path: Path) -> None:
    text = _run(["plan", "--strategy", "pd_cluster"], tmp_path, None)
    rules = [line for line in text.splitlines() if "────" in line and line[0] not in "╭╰┏┡└│┃"]
    assert rules and all(len(line) <= 80 for line in rules), [len(line) for line in rules]
    assert max(len(line) for line in text.splitlines()) < 1000
    assert "vllm/vllm-openai:kimi-k3" in text  # the table's values are whole off a terminal


def test_plan_at_80_columns_cuts_no_value(tmp_path: Path) -> None:
    text = _run(["plan", "--strategy", "pd_cluster"], tmp_path, "80")
    drawn = [line for line in text.splitlines() if re.search("[─━│┃]", line)]  # not the commands, kept whole to be copied
    assert drawn and all(len(line) <= 80 for line in drawn)
    assert "…" not in text, text
