"""The messages the docs quote are the product's words.

A message is an inline code span or a double-quoted phrase of the docs' prose with four words or
more that is not a command line or a signature, or a line of a fenced block that starts with
``error:``, ``hint:``, ``notice:`` or ``warning:``. Each must be printable by the product: one
of its string literals, f-strings or ``+`` of them prints it (every character of the quote either
the template's own or in one of its fields, the template's own text at least 60% of it), or it is
the joined output of such parts (a field's text printed by another template; the clauses a line
is joined from at ``: `` and ``; ``), or a test's ``assert`` says the product prints it. In the
quote, the docs' placeholders (``NAME``, ``NODE``, ``N``, ``<time>``, ...) and ``...`` stand for
any text.

What the docs quote from others (vLLM, vllm-router, the kernel) or say in their own voice is in
``OTHERS``, each with whose words they are; an entry no page quotes any more fails, so the list
cannot outlive its quotes.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest
from paths import ROOT

from k3launch.cli import COMMANDS

PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
SPAN = re.compile(r"(?<!`)(`{1,2})(?!`)(.+?)(?<!`)\1(?!`)")
QUOTED = re.compile(r'(?<![\w=])"([^"\n`]+)"(?![\w:])')
# A command line (a tool's, or a k3launch command's), a path, a flag, a key or a Python/JSON
# signature is not a message.
COMMAND_WORDS = ["k3launch", "vllm", "vllm-router", "python3?", "PYTHON", "pip", "sbatch", "srun", "scontrol", "squeue", "ssh", "curl",
                 "git", "docker", "podman", "apptainer", "export", "sudo", "bash", "cd", "ls", "cat", "env", "taskset", "ps", "ip", "ruff",
                 "mypy", "promtool", "not e2e", *COMMANDS]
NOT_MESSAGE = re.compile(
    rf"^(?:{'|'.join(COMMAND_WORDS)})\b|^[-/.{{\[(<~$]|\w\(|[{{}}=]|^\w+(?:\.[\w<]+)+"
    r"|^\w+(?:, \w+)+$"  # a list of names
    r"|[≤≥×−]"  # a formula
)
KINDS = {"error", "hint", "notice", "warning"}
PLACEHOLDER = re.compile(r"<[^<>]+>|\.\.\.|…|\b(?:NAME|NODE|INV|ADDR|PORT|PID|FILE|DIR|ID|NN|FLAG|PY|STAGE|IFACE|OTHER|N|K|X|V|M)\b")

# Quoted in the docs, and not k3launch's words; each with whose they are.
OTHERS: dict[str, str] = {
    "User-specified max_model_len (100000) is greater than the derived max_model_len ...": "vLLM",
    "max_num_batched_tokens (32) must be greater than or equal to max_num_seqs (256).": "vLLM",
    "Value error, Number of experts in the model must be greater than 0 when expert parallelism is enabled.": "vLLM",
    "Non-MoE models do not support external data parallel mode": "vLLM",
    "launch independent vLLM instances without --data-parallel-* arguments": "vLLM",
    "Compiling model again due to a load failure from .../torch_aot_compile/... reason: 'function' object has no "
    "attribute 'finalize_loading'": "vLLM",
    "assert self.stats_update_address is not None": "vLLM",
    "Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers": "vLLM",
    "No available workers: 0 prefill, 1 decode": "vllm-router",
    "PD router requires specific add_prefill_server or add_decode_server methods": "vllm-router",
    "no cgroup mount found in mountinfo": "the kernel's cgroup tools",
    "Which of TEP on 2 nodes, DEP on 2 nodes or P/D 1+2 gives the most throughput at my p99 TPOT budget?": "a user's question",
    "every token must match": "the docs' own voice",
}


def _render(node: ast.expr) -> str:
    """The text an expression prints, each part that is not a string literal a wildcard (of a
    conditional, the first branch)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(str(v.value) if isinstance(v, ast.Constant) else WILD for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _render(node.left) + _render(node.right)
    if isinstance(node, ast.IfExp):
        return _render(node.body)
    return WILD


def _is_text(node: ast.AST) -> bool:
    return isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str))


@cache
def templates() -> tuple[str, ...]:
    """What the product prints: each string literal of its source (the simulated engine's too),
    each f-string and each ``+`` of them with a wildcard for every part computed; and each string
    in an ``assert`` of its tests (a message built from parts this cannot follow is still checked
    where a test asserts the product prints it)."""
    out: list[str] = []
    for path in (ROOT / "k3launch").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if _is_text(node) or (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)
                                  and any(_is_text(n) for n in ast.walk(node))):
                out.append(_render(node))  # type: ignore[arg-type]
    for path in (ROOT / "tests").rglob("*.py"):
        if path.name.startswith("test_docs_"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assert):
                out += [_render(n) for n in ast.walk(node) if _is_text(n)]  # type: ignore[arg-type]
    return tuple(_tokens(t, None) for t in out)


def messages(page: Path) -> list[str]:
    """The quotes of ``page`` that read as messages."""
    text = page.read_text()
    # in fenced blocks, the lines a command prints as a kind of message (its [code] is checked
    # by test_docs_claims.py)
    lines = [re.sub(r" \[[a-z0-9-]+\]$", "", m.group(1)) for f in FENCE.findall(text)
             for m in re.finditer(r"^\s*((?:error|hint|notice|warning): .+)$", f, re.M)]
    prose = FENCE.sub("", text)
    prose = re.sub(r"(?<!\n)\n(?![\n|])", " ", prose)  # a span may wrap within its paragraph
    found = lines + [m.group(2).strip() for m in SPAN.finditer(prose)]
    found += [m.group(1).strip() for m in QUOTED.finditer(SPAN.sub("", prose))]
    found = [re.sub(r"\s+", " ", q) for q in found]
    return [q for q in found if len(q.split()) >= 4 and re.search(r"[a-z]{3}", q) and not NOT_MESSAGE.search(q)]


WILD = "\0"


def _tokens(text: str, wild: re.Pattern[str] | None) -> str:
    """Whitespace runs made one space; ``wild`` matches (placeholders) made one wildcard."""
    text = re.sub(r"\s+", " ", text)
    return wild.sub(WILD, text) if wild else text


def _overlap(quote: str, template: str) -> int:
    """The most literal characters a string printed by ``template`` (each wildcard any text)
    can share with ``quote`` placed anywhere inside it (each of its wildcards any text), or -1
    when no printed string contains the quote."""
    q, t = WILD + quote + WILD, template
    m, n = len(q), len(t)
    none = -1
    nxt = [0 if all(c == WILD for c in t[j:]) else none for j in range(n + 1)]  # row i = m
    for i in range(m - 1, -1, -1):
        row = [none] * (n + 1)
        row[n] = nxt[n] if q[i] == WILD else none
        for j in range(n - 1, -1, -1):
            best = none
            a, b = q[i], t[j]
            if a != WILD and b != WILD and a == b and nxt[j + 1] >= 0:
                best = 1 + nxt[j + 1]
            if a == WILD:
                best = max(best, nxt[j], row[j + 1])
            if b == WILD:
                best = max(best, row[j + 1], nxt[j])
            row[j] = best
        nxt = row
    return nxt[0]


def _words(text: str) -> set[str]:
    return set(re.findall(r"[A-Za-z][a-z_]{2,}", text))


@cache
def _indexed() -> tuple[tuple[str, frozenset[str]], ...]:
    return tuple((t, frozenset(_words(t))) for t in templates())


def _said(quote: str, depth: int = 2) -> bool:
    q = _tokens(quote, PLACEHOLDER)
    literal = len(q.replace(WILD, ""))
    words = _words(q.replace(WILD, " "))
    for t, w in _indexed():
        if depth and WILD in t and all(p in q for p in t.split(WILD)) and _filled(q, t, depth):
            return True
        # only templates that share 40% of the quote's words are worth the full comparison
        if len(words & w) >= 0.4 * len(words) and _overlap(q, t) >= 0.6 * literal:
            return True
    return False


def _filled(quote: str, template: str, depth: int) -> bool:
    """An f-string prints the whole quote, each field's text short (three words at most), a
    placeholder, or itself printed by the product (the parts a message is built from)."""
    pieces = template.split(WILD)
    if sum(len(p) for p in pieces) < 10:
        return False
    m = re.fullmatch("(.*?)".join(re.escape(p) for p in pieces), quote)
    return m is not None and all(
        len(g.split()) <= 3 or not g.replace(WILD, "").strip() or _said(g.strip(" ;:,"), depth - 1) for g in m.groups()
    )


@cache
def _words_printed() -> frozenset[str]:
    """One-word literals (a state, ``serving``, printed next to its details)."""
    return frozenset(t for t in templates() if re.fullmatch(r"[a-z][a-z-]+", t))


def product_says(quote: str) -> bool:
    """Whether the product can print ``quote``: one literal or f-string prints it (its literal
    text covering at least 60% of the quote's own), or each clause of it (split at ``: `` and
    ``; ``, as the CLI joins a message, its hint and its parts) is printed so; a one-word clause
    is a line's kind (``error``, ``hint``, ...), a one-word literal or a placeholder."""
    if _said(quote):
        return True
    clauses = [c.strip() for c in re.split(r": |; ", quote) if c.strip()]
    return len(clauses) > 1 and all(
        c in KINDS or c in _words_printed() or not PLACEHOLDER.sub("", c).strip() or (len(c.split()) > 1 and _said(c))
        for c in clauses
    )


def test_messages_are_found_at_all() -> None:
    every = [q for p in PAGES for q in messages(p)]
    assert len(every) > 40, every
    assert product_says("left alone on NODE (not started from this state directory): pid N (serve-0)")
    assert not product_says("left alone on NODE (started by someone else): pid N")
    said = "no deployment named 'k3-dmeo' in ~/.k3launch, and nothing of it started from here runs on this machine"
    assert product_says(said) and not product_says(said.replace("runs on", "lives on"))
    assert product_says("serve-1 hung: no CPU time used for 60s while starting; state D in nfs_wait_on_request")
    assert not product_says("serve-1 hung: no GPU time used for 60s while starting")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_quoted_message_is_the_products(page: Path) -> None:
    unknown = [q for q in messages(page) if q not in OTHERS and not product_says(q)]
    assert not unknown, f"{page.name} quotes words the product does not print: {unknown}"


def test_every_other_quote_is_still_quoted() -> None:
    quoted = {q for p in PAGES for q in messages(p)}
    assert not [q for q in OTHERS if q not in quoted]
