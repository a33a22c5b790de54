"""``k3launch lint``: check a pasted ``vllm serve`` command against vLLM's flag schema.

Findings: unknown flags (with a did-you-mean), bad choices and values, legacy boolean spellings
the selected vLLM no longer lists, contradictory booleans (both forms of one setting),
duplicates (one setting given twice: argparse silently keeps the last), fields a config flag's
dataclass does not have (vLLM refuses them at startup), values vLLM's config classes refuse
(:mod:`.ranges`: out of a field's range, or two flags vLLM checks against each other), and dotted config keys written under two
spellings of one flag (vLLM keeps one spelling's). ``VAR=value`` words
before the program are checked as environment: ``VLLM_*`` names vLLM does not read are flagged.
"""

from __future__ import annotations

from k3launch.models.findings import ERROR, WARNING, Finding
from k3launch.planning import ranges
from k3launch.planning.configs import unknown_fields
from k3launch.planning.schema import Arg, FlagSchema, Problem


def _split_command(words: list[str]) -> tuple[list[str], list[str], list[Finding]]:
    """Strip ``ENV=value`` words, ``vllm serve`` and the positional model; return (env, flags, findings)."""
    env: list[str] = []
    findings: list[Finding] = []
    i = 0
    while i < len(words) and "=" in words[i] and not words[i].startswith("-"):
        env.append(words[i])
        i += 1
    rest = words[i:]
    if rest[:1] == ["vllm"]:
        rest = rest[1:]
    if rest[:1] == ["serve"]:
        rest = rest[1:]
    elif rest and not rest[0].startswith("-"):
        findings.append(Finding(ERROR, "not-serve", f"{rest[0]!r} is not `vllm serve`", "paste a `vllm serve MODEL ...` command"))
        return env, [], findings
    if rest and not rest[0].startswith("-"):
        rest = rest[1:]  # the model
    return env, rest, findings


def lint(schema: FlagSchema, words: list[str]) -> list[Finding]:
    env, flags, findings = _split_command(words)
    for word in env:
        name = word.split("=", 1)[0]
        if name.startswith("VLLM_") and name not in schema.env_vars:
            findings.append(Finding(WARNING, "env-unknown", f"env {name} is not read by vLLM {schema.version}", "check the spelling"))
    args, problems = schema.parse(flags)
    findings.extend(_from_problem(p) for p in [*problems, *unknown_fields(schema.version, args)])
    seen: dict[str, Arg] = {}
    for arg in args:
        if arg.legacy:
            findings.append(Finding(ERROR, "legacy-boolean", f"{arg.written} is not a flag of vllm serve {schema.version}",
                                    f"write {' '.join(arg.tokens())}"))
        prior = seen.get(arg.key)
        if prior is not None:
            if arg.polarity is not None and prior.polarity != arg.polarity:
                findings.append(Finding(ERROR, "contradictory-boolean", f"{prior.written} and {arg.written} contradict each other",
                                        f"keep one; vLLM takes the last ({arg.written})"))
            elif prior.value != arg.value or prior.polarity != arg.polarity:
                findings.append(Finding(ERROR, "duplicate-flag", f"{arg.key} given twice ({prior.shown!r} then {arg.shown!r})",
                                        f"keep one; vLLM silently takes the last ({arg.shown!r})"))
            else:
                findings.append(Finding(WARNING, "duplicate-flag", f"{arg.key} given twice with the same value", "drop one"))
        seen[arg.key] = arg
    findings.extend(_from_problem(p) for p in ranges.problems(schema, seen))  # vLLM takes the last of each
    roots: dict[str, set[str]] = {}
    for arg in args:
        if arg.path:
            roots.setdefault(arg.spec.canonical, set()).add(arg.written)
    for canonical, written in roots.items():
        if len(written) > 1:  # vLLM groups dotted keys by the spelling written: one JSON per spelling, the last wins
            findings.append(Finding(ERROR, "dotted-spellings", f"dotted keys of {canonical} under {' and '.join(sorted(written))}",
                                    f"vLLM keeps only the keys of the last spelling; write them all as {canonical}.KEY"))
    for key, arg in seen.items():
        if arg.path and arg.spec.canonical in seen:
            findings.append(Finding(ERROR, "dotted-and-json", f"{key} and a whole {arg.spec.canonical} JSON are both given",
                                    "vLLM applies the dotted keys last and drops the whole JSON; merge them into one JSON"))
    return findings


def _from_problem(p: Problem) -> Finding:
    return Finding(ERROR, p.code, p.message, p.hint)
