"""The doctor's rows for the directories a node's engines need before they start, which ``up``
makes there first: the containers' Hugging Face cache (their bind source) and each engine's
compile-cache directory (bind-mounted into a container, the caches' variables of a bare process).

Every bind source a container gets is one of these two. ``up`` creates them (``mkdir -p``: the
hf_cache for podman and apptainer, which refuse a missing bind source — docker makes one itself —,
the compile cache before every start), so each must be a writable directory, or one ``up`` can
create: its nearest existing ancestor a writable directory. A file on the way, or a directory
nothing may write to, is one row with the inventory setting that fixes it.
"""

from __future__ import annotations

from k3launch.deploy.ssh.gpus import FAIL, PASS, WARN
from k3launch.deploy.ssh.preflight import section
from k3launch.models.caches import cache_root
from k3launch.models.plan import Host, Plan, is_container
from k3launch.models.reports import Check
from k3launch.render.words import DEFAULT_HF_CACHE, cache_dir, path_word

# One directory: ok (a writable directory), creatable (its nearest existing ancestor is a writable
# directory: `up` runs mkdir -p), unwritable, or "uncreatable P" (P, the nearest existing ancestor,
# is a file or not writable). A file written and removed, not `test -w`: root's test -w is true even
# on a read-only file system.
PROBE = (
    'd={dir}; if [ -d "$d" ]; then t="$d/.k3launch-w.$$"; (: >"$t") 2>/dev/null && rm -f "$t" && echo ok || echo unwritable; '
    'else p=$d; while [ ! -e "$p" ] && [ "$p" != / ]; do p=$(dirname "$p"); done; '
    't="$p/.k3launch-w.$$"; if [ -d "$p" ] && (: >"$t") 2>/dev/null; then rm -f "$t"; echo creatable; else echo "uncreatable $p"; fi; fi'
)


def _probe(path: str) -> str:
    return PROBE.format(dir=path_word(path))


def compile_dirs(plan: Plan, host: Host) -> list[str]:
    """The compile-cache directories of the node's engines (``<root>/<key>``), each once."""
    dirs = (cache_dir(plan, p, host) for p in plan.processes if p.node == host.name)
    return list(dict.fromkeys(d for d in dirs if d is not None))


def sections(plan: Plan, host: Host) -> str:
    """The probe's sections for an engine node: ``hfcache`` (containers), ``compilecache`` (one line per directory)."""
    out = ""
    if is_container(host.runtime) or host.runtime == "apptainer":
        out += section("hfcache", _probe(host.hf_cache or DEFAULT_HF_CACHE))
    if dirs := compile_dirs(plan, host):
        out += section("compilecache", "\n".join(_probe(d) for d in dirs))
    return out


def judge(plan: Plan, host: Host, sec: dict[str, list[str]]) -> list[Check]:
    n = host.name
    checks = []
    if "hfcache" in sec:
        d = host.hf_cache or DEFAULT_HF_CACHE
        fix = f"set `hf_cache:` in the inventory to a directory {n} can write, or create {d} there writable"
        # apptainer binds it as it is: read-only is enough for weights that are complete there
        checks.append(_row(n, "hf-cache", f"hf_cache {d}", sec["hfcache"][:1], fix,
                           "the engine's model cache (bind-mounted) would be read-only",
                           FAIL if is_container(host.runtime) else WARN))
    if "compilecache" in sec:
        dirs = compile_dirs(plan, host)
        root = cache_root(host, plan.engine) or ""
        fix = f"set `compile_cache:` in the inventory to a directory {n} can write (or `off`: no compile caches), or make {root} a writable directory there"
        rows = [_row(n, "compile-cache", f"compile_cache {d}", sec["compilecache"][i:i + 1], fix,
                     "the engines keep their compile caches there (warm restarts)", FAIL) for i, d in enumerate(dirs)]
        checks.append(next((c for c in rows if c.status != PASS), next((c for c in rows if "`up` creates" in c.detail), rows[0])))
    return checks


def _row(n: str, name: str, what: str, status: list[str], fix: str, why: str, unwritable: str) -> Check:
    """One directory's row from its probe line (``what``: the setting and the directory)."""
    word = status[0].split() if status else ["?"]
    if word[0] == "ok":
        return Check(n, name, PASS, f"{what} writable")
    if word[0] == "creatable":
        return Check(n, name, PASS, f"{what} does not exist yet; `up` creates it")
    if word[0] == "unwritable":
        return Check(n, name, unwritable, f"{what} is not writable: {why}", hint=fix)
    blocker = word[1] if len(word) > 1 else "?"
    return Check(n, name, FAIL, f"{what} does not exist and cannot be created ({blocker} is not a writable directory)", hint=fix)
