"""Slurm's commands, from the login node: the one place k3launch calls sbatch/squeue/scancel/sacct.

Like dask-jobqueue's ``_call``, every command goes through :meth:`SlurmClient.call` (argv, each
word quoted, run by a :class:`~k3launch.transport.runners.CommandRunner`), so tests can fake the seam. Parsing of
the commands' output is done by small pure functions of this module.

Accounting is optional: without slurmdbd, ``sacct`` fails ("accounting storage is disabled"),
and a job the controller has already forgotten (``MinJobAge``, 300 s by default) is reported as
``GONE`` instead of its final state.
"""

from __future__ import annotations

import fnmatch
import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from k3launch.errors import K3Error
from k3launch.models.identity import ANY, JOB_COMMENT, Owned
from k3launch.models.selection import SECRET_NAMES
from k3launch.transport.runners import CommandRunner, LocalRunner, Result, Target
from k3launch.util.hosts import expand_hostlist

LOGIN = Target("login", "localhost", local=True)
ACTIVE = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "RESIZING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD",
                    "REQUEUE_FED", "SIGNALING", "STAGE_OUT"})
# Pending reasons that no amount of waiting fixes (Slurm accepts such jobs unless EnforcePartLimits).
NEVER_RUNS = frozenset({"PartitionNodeLimit", "PartitionTimeLimit", "BadConstraints", "InvalidAccount", "InvalidQOS",
                        "AccountNotAllowed", "QOSNotAllowed", "AssocMaxNodesPerJobLimit",
                        "AssocMaxWallDurationPerJobLimit", "QOSMaxNodePerJobLimit", "QOSMaxWallDurationPerJobLimit"})
SECRET_VARS = SECRET_NAMES | {"HF_API_TOKEN"}
SBATCH_TIMEOUT_S = 60.0
SLURM_HINT = "check that Slurm's commands are on PATH and SLURM_CONF points at the cluster"


@dataclass(frozen=True)
class JobInfo:
    job_id: str
    state: str  # Slurm's state (RUNNING, PENDING, FAILED, ...) or GONE when nobody remembers the job
    nodes: list[str] = field(default_factory=list)  # allocated hosts, expanded, in Slurm's order
    reason: str = ""
    exit_code: str = ""

    @property
    def active(self) -> bool:
        return self.state in ACTIVE


def expand(hostlist: str) -> list[str]:
    """Hosts of a host list Slurm printed (``(null)`` or garbage: none)."""
    return expand_hostlist(hostlist, lenient=True)


def parse_squeue(job_id: str, text: str) -> JobInfo | None:
    """``%T|%N|%r`` lines of ``squeue -j`` (one per array task; only the first is used)."""
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 3 and parts[0]:
            return JobInfo(job_id, parts[0], expand(parts[1]), parts[2] if parts[2] != "None" else "")
    return None


def parse_sacct(job_id: str, text: str) -> JobInfo | None:
    """``sacct -X -n -P -o State,ExitCode,NodeList``: ``CANCELLED by 0`` → ``CANCELLED``."""
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 3 and parts[0]:
            return JobInfo(job_id, parts[0].split()[0], expand(parts[2]), "", parts[1])
    return None


def parse_steps(text: str) -> dict[str, str]:
    """``%i|%j|%N`` of ``squeue -s``: running step name → its node (the batch step excluded)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 3 and not parts[0].endswith((".batch", ".extern")):
            out[parts[1]] = parts[2]
    return out


def submit_env(environ: Mapping[str, str]) -> dict[str, str]:
    """sbatch's environment: the caller's, minus secrets — Slurm stores a job's environment in its
    state files (and accounting, with ``AccountingStoreFlags=job_env``), so tokens never go there;
    jobs read them from ``hf_token_file``."""
    return {k: v for k, v in environ.items() if k not in SECRET_VARS}


@dataclass
class SlurmClient:
    runner: CommandRunner = field(default_factory=LocalRunner)  # Slurm's commands run on the login node (k3launch.testing.FakeSlurm fakes them)
    timeout: float = 30.0

    def call(self, argv: Sequence[str], *, timeout: float | None = None, cwd: str | None = None, env: Mapping[str, str] | None = None) -> Result:
        cmd = shlex.join(argv)
        if cwd:
            cmd = f"cd {shlex.quote(cwd)} && {cmd}"
        # env goes to the process as its environment, never onto a command line (ps would show it)
        return self.runner.run(LOGIN, cmd, timeout=timeout or self.timeout, env=env)

    def sbatch(self, script_path: str, cwd: str, job_name: str | None = None) -> str:
        """Submit; the job id, or K3Error with Slurm's own reason (first error line). When sbatch
        times out the job may still have been queued: it is looked up by name (and adopted)."""
        r = self.call(["sbatch", "--parsable", script_path], cwd=cwd, env=submit_env(os.environ), timeout=SBATCH_TIMEOUT_S)
        if r.exit_code == 124:
            found = self.call(["squeue", "-h", "--me", "-n", job_name, "-o", "%i"]) if job_name else None
            ids = found.stdout.split() if found is not None and found.ok else []
            if len(ids) == 1:
                return ids[0]
            raise K3Error("sbatch-timeout", f"sbatch did not answer within {SBATCH_TIMEOUT_S:g}s; the job may or may not be queued",
                          f"check `squeue --me -n {job_name}` and scancel what you do not want" if job_name else "check `squeue --me`")
        if r.exit_code == 127:
            raise K3Error("slurm-missing", "sbatch not found on this machine", SLURM_HINT)
        if not r.ok:
            why = next((ln for ln in r.stderr.splitlines() if "error" in ln.lower()), r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.exit_code}")
            raise K3Error("sbatch-refused", f"Slurm refused the job: {why.strip()}",
                          "check the inventory's slurm section (partition, account, GPUs per node) against `sinfo`; nothing was started")
        return r.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> JobInfo:
        """The job's state now: squeue, else sacct, else GONE."""
        r = self.call(["squeue", "-h", "-j", job_id, "-t", "all", "-o", "%T|%N|%r"])
        if r.exit_code == 127:
            raise K3Error("slurm-missing", "squeue not found on this machine", SLURM_HINT)
        info = parse_squeue(job_id, r.stdout) if r.ok else None
        if info is None:
            a = self.call(["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "State,ExitCode,NodeList"])
            info = parse_sacct(job_id, a.stdout) if a.ok else None
        if info is None and not r.ok and "Invalid job id" not in r.stderr:
            raise K3Error("slurm-unavailable", f"squeue failed: {r.stderr.strip()[:200]}", SLURM_HINT)
        return info or JobInfo(job_id, "GONE")

    def outside(self, partition: str | None, nodelist: str | None) -> list[str]:
        """The partition's nodes not in ``nodelist``: with them excluded, the nodelist is the
        candidate set (sbatch --nodelist would demand every one of its nodes)."""
        if not nodelist:
            return []
        r = self.call(["sinfo", "-h", "-N", "-o", "%N", *(["-p", partition] if partition else [])])
        if not r.ok:
            raise K3Error("slurm-unavailable", f"sinfo failed: {r.stderr.strip()[:200]}", SLURM_HINT)
        allowed = set(expand_hostlist(nodelist))  # the user's nodelist: refused, not emptied, when malformed
        return sorted({h for h in r.stdout.split() if h not in allowed})

    def partition_nodes(self, partition: str | None) -> int | None:
        """How many nodes a job of ``partition`` (default: the default one) may ever have:
        min(TotalNodes, MaxNodes); None when Slurm does not say."""
        r = self.call(["scontrol", "show", "partition", "-o", *([partition] if partition else [])])
        if not r.ok:
            return None
        for line in r.stdout.splitlines():
            kv = dict(w.split("=", 1) for w in line.split() if "=" in w)
            if partition is None and kv.get("Default") != "YES":
                continue
            total = kv.get("TotalNodes", "")
            cap = kv.get("MaxNodes", "UNLIMITED")
            if total.isdigit():
                return min(int(total), int(cap)) if cap.isdigit() else int(total)
        return None

    def jobs_named(self, job_name: str, owned: Owned = ANY) -> list[str]:
        """The ids of this user's queued or running jobs named ``job_name``: only those whose
        ``--comment`` carries a deployment id ``owned`` matches (:mod:`k3launch.models.identity`),
        unless it matches anyone's."""
        r = self.call(["squeue", "-h", "--me", "-n", job_name, "-o", "%i" if owned.anyone else "%i %k"])
        if r.exit_code == 127:
            raise K3Error("slurm-missing", "squeue not found on this machine", SLURM_HINT)
        if not r.ok:
            raise K3Error("slurm-unavailable", f"squeue failed: {r.stderr.strip()[:200]}", SLURM_HINT)
        if owned.anyone:
            return r.stdout.split()
        out = []
        for line in r.stdout.splitlines():
            job, _, comment = line.strip().partition(" ")
            ident = comment.strip().removeprefix(JOB_COMMENT) if comment.strip().startswith(JOB_COMMENT) else ""
            if job and ident and fnmatch.fnmatchcase(ident, owned.glob()):
                out.append(job)
        return out

    def steps(self, job_id: str) -> dict[str, str]:
        r = self.call(["squeue", "-h", "-s", "-j", job_id, "-o", "%i|%j|%N"])
        return parse_steps(r.stdout) if r.ok else {}

    def cancel(self, job_id: str, signal: str | None = None) -> Result:
        """``scancel`` (Slurm's own TERM, KillWait, KILL); with ``signal`` (e.g. TERM) only that
        signal, to the batch script alone (``--batch``: the job script stops its steps itself)."""
        argv = ["scancel", *(["--batch", f"--signal={signal}"] if signal else []), job_id]
        return self.call(argv)


__all__ = ["ACTIVE", "JobInfo", "SlurmClient", "expand", "parse_sacct", "parse_squeue", "parse_steps", "submit_env"]
