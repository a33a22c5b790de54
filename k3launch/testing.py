"""Test doubles of k3launch's seams, shipped so that the project's tests (and a library user's)
share one copy: :class:`FakeRunner` for :class:`~k3launch.transport.runners.CommandRunner` (every command
k3launch runs on a node or the login node), :class:`FakeSlurm` for
:class:`~k3launch.deploy.slurm.client.SlurmClient` (every Slurm command) and :class:`FakeWatcher` for
:class:`~k3launch.deploy.base.Watcher` (a supervisor's looks and actions).

Neither does any I/O of its own beyond what a test asks for (FakeSlurm writes a job's output file
when told to). ``FakeRunner`` answers from scripted rules and records every call::

    runner = FakeRunner(respond=[(r"^kill ", (0, "", "")), (r"cat /proc", lambda t, c: (0, f"{t.name}\\n", ""))],
                        fail_on=["node-3"])            # node-3 does not answer: Unreachable
    ...
    runner.assert_ran(r"kill -s TERM", node="node-1", times=1)

``FakeSlurm`` *is* a ``SlurmClient``: its runner answers ``sbatch``/``squeue``/``sacct``/``scancel``/
``sinfo``/``scontrol`` in Slurm's own output formats, so the client's real parsers run::

    slurm = FakeSlurm([JobInfo("42", "PENDING", [], "Resources"), JobInfo("42", "RUNNING", ["n1"])],
                      steps={"serve-0": "n1"})
    SlurmLaunch(plan, inv, store, client=slurm).up()
    assert ["scancel", "42"] in slurm.calls
"""

from __future__ import annotations

import re
import shlex
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

from k3launch.deploy.slurm.client import JobInfo, SlurmClient
from k3launch.models.control.observation import Observation
from k3launch.models.phases import Timeline
from k3launch.models.plan import Plan
from k3launch.models.record import DeploymentRecord
from k3launch.models.reports import LaunchFailed, TeardownReport
from k3launch.models.supervise import Unit
from k3launch.transport.runners import DEFAULT_TIMEOUT_S, Result, Target, Unreachable

Answer = tuple[int, str, str]  # (exit code, stdout, stderr)
Handler = Callable[[Target, str], Answer]  # (target, command) -> answer
Reply = Answer | Handler


@dataclass(frozen=True)
class Call:
    """One command a :class:`FakeRunner` was asked to run."""

    node: str  # the target's name
    command: str
    timeout: float
    env: dict[str, str] | None = None


class FakeRunner:
    """A :class:`~k3launch.transport.runners.CommandRunner` that records every call and answers from a script.

    * ``respond``: ``(pattern, reply)`` rules, tried in order; the first whose regex is found in
      the command answers. A reply is ``(exit_code, stdout, stderr)`` or a callable
      ``(target, command) -> (exit_code, stdout, stderr)``.
    * ``default``: the reply when no rule matches (first positional argument, so
      ``FakeRunner(handler)`` answers everything with ``handler``); ``(0, "", "")`` if not given.
    * ``fail_on``: node names and patterns: a call on a node of that name (target name or host),
      or whose command the pattern is found in, raises
      :class:`~k3launch.transport.runners.Unreachable`, like a node that does not answer. Every
      entry is tried both ways: ``"n2"`` also fails a command of another node that mentions n2.

    Calls are recorded (``calls``) before they are answered, failed ones included.
    """

    def __init__(self, default: Reply = (0, "", ""), *, respond: Iterable[tuple[str, Reply]] | Mapping[str, Reply] = (),
                 fail_on: Iterable[str] = ()) -> None:
        self.default = default
        rules = respond.items() if isinstance(respond, Mapping) else respond
        self.rules: list[tuple[re.Pattern[str], Reply]] = [(re.compile(p), r) for p, r in rules]
        self.fail_on = list(fail_on)
        self.calls: list[Call] = []
        self.closed = False
        self._lock = threading.Lock()  # Fleet.run_many calls from several threads

    def run(self, target: Target, command: str, *, timeout: float = DEFAULT_TIMEOUT_S, env: Mapping[str, str] | None = None) -> Result:
        with self._lock:
            self.calls.append(Call(target.name, command, timeout, None if env is None else dict(env)))
        if any(f in (target.name, target.host) or re.search(f, command) for f in self.fail_on):
            raise Unreachable(target.name, "timed out (no answer)")
        reply = next((r for p, r in self.rules if p.search(command)), self.default)
        code, out, err = reply(target, command) if callable(reply) else reply
        return Result(target.name, command, code, out, err, 0.0)

    def close(self) -> None:
        self.closed = True

    # ------------------------------------------------------------------ checks
    def commands(self, node: str | None = None) -> list[str]:
        """The commands run (on ``node``, or anywhere), in order."""
        with self._lock:
            return [c.command for c in self.calls if node is None or c.node == node]

    def matching(self, pattern: str, node: str | None = None) -> list[str]:
        """The commands run (on ``node``) in which ``pattern`` is found."""
        rx = re.compile(pattern)
        return [c for c in self.commands(node) if rx.search(c)]

    def assert_ran(self, pattern: str, node: str | None = None, times: int | None = None) -> list[str]:
        """At least one command (exactly ``times``, if given) matched ``pattern``; returns them."""
        got = self.matching(pattern, node)
        if (not got) if times is None else len(got) != times:
            want = "at least once" if times is None else f"{times} time(s)"
            raise AssertionError(f"expected a command matching {pattern!r}{_on(node)} {want}, matched {len(got)}; "
                                 f"{self._ran(node)}")
        return got

    def assert_not_ran(self, pattern: str, node: str | None = None) -> None:
        got = self.matching(pattern, node)
        if got:
            raise AssertionError(f"expected no command matching {pattern!r}{_on(node)}, matched {len(got)}; {self._ran(node)}")

    def _ran(self, node: str | None) -> str:
        with self._lock:
            calls = [c for c in self.calls if node is None or c.node == node]
        if not calls:
            return f"nothing ran{_on(node)}"
        return f"ran{_on(node)}:\n" + "\n".join(f"  {c.node}: {_short(c.command)}" for c in calls)


def _on(node: str | None) -> str:
    return "" if node is None else f" on {node}"


def _short(cmd: str, n: int = 300) -> str:
    one = " ".join(cmd.split())
    return one if len(one) <= n else one[: n - 3] + "..."


# ---------------------------------------------------------------------------------- Slurm
@dataclass(frozen=True)
class Fails:
    """A scripted failure of a Slurm query: the command exits ``exit_code`` and says ``stderr``."""

    stderr: str = "slurm_load_jobs error: Socket timed out on send/recv operation"
    exit_code: int = 1


BUSY = Fails()  # slurmctld too busy to answer: the poll says nothing
INVALID_JOB_ID = Fails("slurm_load_jobs error: Invalid job id specified")  # Slurm forgot the job
JobPoll = JobInfo | Fails | Callable[[], JobInfo | Fails]
TaskPoll = Mapping[int, str] | Fails | Callable[[], Mapping[int, str] | Fails]
T = TypeVar("T")
NO_ACCOUNTING = "sacct: error: Slurm accounting storage is disabled"


class FakeSlurm(SlurmClient):
    """A Slurm cluster of scripted answers behind the real :class:`~k3launch.deploy.slurm.client.SlurmClient`.

    * ``states``: what each poll of a job (``squeue -j``, then ``sacct``) sees, in order; the last
      one repeats (none: the job is GONE). A :class:`~k3launch.deploy.slurm.client.JobInfo` is
      printed as squeue prints it; one with an ``exit_code`` has left squeue and is found by
      ``sacct``; state ``GONE``: neither knows it. :class:`Fails` (e.g. :data:`BUSY`): squeue
      fails (and accounting is off). A callable is called at its poll (something happening on
      the "cluster" just before it) and returns the answer.
    * ``tasks``: the same for the per-task states of an array (``squeue -r``): ``{task: state}``
      lines ``<job>_<task>|<state>``; none: :data:`INVALID_JOB_ID`.
    * ``steps``: the job's running steps (``squeue -s``), step name -> node; gone once a cancel
      ended the job.
    * ``sbatch``: job ids ``first_id``, ``first_id + 1``, ...; ``refuse``: sbatch refuses with
      that reason; ``output``: written to ``<cwd>/slurm-<id>.out`` at submission (None: no
      output ever shows up on this machine). The script must exist, as for the real sbatch.
    * ``named``: this user's active jobs by job name (``squeue --me -n NAME``), name -> job ids,
      each optionally followed by its ``--comment`` (``"42 k3launch-id=<deployment id>"``).
    * ``scancel`` ends the job (CANCELLED) unless ``stuck`` (a job that never ends).
    * ``sinfo -N``: ``nodes``; ``scontrol show partition``: a default partition of
      ``partition_size`` nodes (None: scontrol fails).

    ``calls`` holds the argv of every Slurm command, in order; ``submitted`` the (script, cwd) of
    each accepted sbatch; ``fake_runner`` the raw commands (with their environment).
    """

    def __init__(self, states: Sequence[JobPoll] = (), *, tasks: Sequence[TaskPoll] = (), steps: Mapping[str, str] | None = None,
                 first_id: int = 42, refuse: str | None = None, output: str | None = None, nodes: Sequence[str] = (),
                 partition_size: int | None = None, stuck: bool = False, named: Mapping[str, Sequence[str]] | None = None) -> None:
        self.fake_runner = FakeRunner(self._answer)
        super().__init__(runner=self.fake_runner)
        self.states: list[JobPoll] = list(states)
        self.tasks: list[TaskPoll] = list(tasks)
        self.running_steps: dict[str, str] = dict(steps or {})
        self.next_id = first_id
        self.refuse = refuse
        self.output = output
        self.nodes = list(nodes)
        self.partition_size = partition_size
        self.stuck = stuck
        self.named = {k: list(v) for k, v in (named or {}).items()}
        self.calls: list[list[str]] = []
        self.submitted: list[tuple[str, str | None]] = []
        self._seen: JobInfo | Fails | None = None  # the last job poll's answer (sacct reports from it)

    def calls_to(self, *programs: str) -> list[list[str]]:
        """The argv of the calls of these programs (e.g. ``"sbatch", "scancel"``), in order."""
        return [c for c in self.calls if c[0] in programs]

    # ------------------------------------------------------------------ the "cluster"
    def _answer(self, target: Target, command: str) -> Answer:
        words = shlex.split(command)
        cwd = None
        if words[:1] == ["cd"] and words[2:3] == ["&&"]:
            cwd, words = words[1], words[3:]
        self.calls.append(words)
        prog, args = words[0], words[1:]
        if prog == "sbatch":
            return self._sbatch(args[-1], cwd)
        if prog == "squeue" and "-s" in args:
            return self._steps(_opt(args, "-j"))
        if prog == "squeue" and "-r" in args:
            return self._tasks(_opt(args, "-j"))
        if prog == "squeue" and "-j" in args:
            return self._job()
        if prog == "squeue":  # by name (an sbatch that timed out, a `down` without a record); "%i %k": with the comment
            full = _opt(args, "-o") == "%i %k"
            return 0, "".join(f"{j if full else j.split()[0]}\n" for j in self.named.get(_opt(args, "-n"), [])), ""
        if prog == "sacct":
            return self._sacct()
        if prog == "scancel":
            if not self.stuck:
                job = args[-1]
                self.states, self.running_steps = [JobInfo(job, "CANCELLED")], {}
                self.named = {k: [j for j in v if j.split()[0] != job] for k, v in self.named.items()}
            return 0, "", ""
        if prog == "sinfo":
            return 0, "".join(f"{n}\n" for n in self.nodes), ""
        if prog == "scontrol" and args[:2] == ["show", "partition"]:
            return self._partition(args[3] if len(args) > 3 else None)
        return 127, "", f"bash: line 1: {prog}: command not found\n"

    def _sbatch(self, script: str, cwd: str | None) -> Answer:
        if self.refuse:
            return 1, "", f"sbatch: error: Batch job submission failed: {self.refuse}\n"
        path = Path(cwd or ".") / script
        if not path.is_file():
            return 1, "", f"sbatch: error: Unable to open file {script}\n"
        job = str(self.next_id)
        self.next_id += 1
        self.submitted.append((script, cwd))
        if self.output is not None:
            (path.parent if cwd is None else Path(cwd)).joinpath(f"slurm-{job}.out").write_text(self.output)
        return 0, f"{job}\n", ""

    def _job(self) -> Answer:
        gone: JobInfo | Fails = JobInfo("", "GONE")
        got = _next(self.states, gone)
        self._seen = got
        if isinstance(got, Fails):
            return got.exit_code, "", got.stderr + "\n"
        if got.state == "GONE" or got.exit_code:  # squeue forgot it (MinJobAge)
            return INVALID_JOB_ID.exit_code, "", INVALID_JOB_ID.stderr + "\n"
        return 0, f"{got.state}|{_hostlist(got.nodes)}|{got.reason or 'None'}\n", ""

    def _sacct(self) -> Answer:
        got = self._seen
        if isinstance(got, JobInfo) and got.exit_code and got.state != "GONE":
            return 0, f"{got.state}|{got.exit_code}|{_hostlist(got.nodes)}\n", ""
        return 1, "", NO_ACCOUNTING + "\n"

    def _steps(self, job: str) -> Answer:
        lines = [f"{job}.{i}|{name}|{node}\n" for i, (name, node) in enumerate(self.running_steps.items())]
        if lines:
            lines.append(f"{job}.batch|batch|{next(iter(self.running_steps.values()))}\n")
        return 0, "".join(lines), ""

    def _tasks(self, job: str) -> Answer:
        forgot: Mapping[int, str] | Fails = INVALID_JOB_ID
        got = _next(self.tasks, forgot)
        if isinstance(got, Fails):
            return got.exit_code, "", got.stderr + "\n"
        return 0, "".join(f"{job}_{t}|{s}\n" for t, s in sorted(got.items())), ""

    def _partition(self, name: str | None) -> Answer:
        if self.partition_size is None:
            return 1, "", "slurm_load_partitions error: Invalid partition name specified\n"
        n = self.partition_size
        line = (f"PartitionName={name or 'batch'} AllowGroups=ALL Default=YES MaxNodes=UNLIMITED MaxTime=UNLIMITED "
                f"State=UP TotalCPUs={8 * n} TotalNodes={n}\n")
        return 0, line, ""


def _next(script: list[T | Callable[[], T]], empty: T) -> T:
    """The next scripted answer (the last one repeats), callables called."""
    if not script:
        return empty
    got = script.pop(0) if len(script) > 1 else script[0]
    return got() if callable(got) else got


def _opt(args: Sequence[str], flag: str) -> str:
    return args[args.index(flag) + 1] if flag in args[:-1] else ""


def _hostlist(nodes: Sequence[str]) -> str:
    import hostlist

    return str(hostlist.collect_hostlist(list(nodes))) if nodes else "(null)"


__all__ = ["BUSY", "INVALID_JOB_ID", "Answer", "Call", "Fails", "FakeRunner", "FakeSlurm", "Handler", "JobPoll", "Reply", "TaskPoll"]


class FakeWatcher:
    """A :class:`~k3launch.deploy.base.Watcher` (the supervise seam) that reports scripted looks
    and records what the supervisor asked of it::

        w = FakeWatcher([Observation(0, dead={"serve-0": "exited with code 1"})], stop=stop)
        loop.supervise(name, store, FakeOps(w), policy, on_event=events.append, stop=stop)
        assert w.calls == [("observe",), ("restart", "serve-0"), ("observe",)]

    Each look is an :class:`~k3launch.models.supervise.Observation` (its time replaced by the
    supervisor's clock) or a callable ``now -> Observation``. When the script is over, ``stop`` is
    set and the last look repeats. ``start_fails``: unit name -> how many restarts of it fail to
    start (a start command that exits 1).
    """

    def __init__(self, looks: Iterable[Observation | Callable[[float], Observation]], *, stop: threading.Event | None = None,
                 start_fails: Mapping[str, int] | None = None) -> None:
        self.looks = list(looks)
        self.stop_event = stop
        self.start_fails = dict(start_fails or {})
        self.calls: list[tuple[str, ...]] = []
        self.closed = False
        self.doctor_fails: list[str] = []  # what check() reports for spares
        self.plan: Plan | None = None  # the plan adopted last
        self.rec: DeploymentRecord | None = None  # what note() changes, when a test gives one
        self.timelines: dict[str, Timeline] = {}  # unit -> the restart timeline restart_timeline() hands out
        self._last: Observation | None = None
        self.listed: list[str] | None = None  # the router's worker list workers() reports

    def observe(self, now: float) -> Observation:
        self.calls.append(("observe",))
        if self.looks:
            look = self.looks.pop(0)
            self._last = look(now) if callable(look) else replace(look, now=now)
        elif self.stop_event is not None:
            self.stop_event.set()
        return replace(self._last, now=now) if self._last is not None else Observation(now)

    def restart(self, unit: Unit, grace_s: float, proceed: Callable[[], bool]) -> list[LaunchFailed]:
        self.calls.append(("restart", unit.name))
        if self.start_fails.get(unit.name, 0) > 0:
            self.start_fails[unit.name] -= 1
            return [LaunchFailed(f"could not start {unit.processes[0]}: start command exited 1", "", unit.processes[0], "no such file\n")]
        return []

    def restart_timeline(self, unit: str, ready: bool, now: float) -> Timeline | None:
        """``timelines[unit]`` (set by a test), with ``ready`` as asked; once."""
        tl = self.timelines.pop(unit, None)
        return None if tl is None else tl.model_copy(update={"ready": ready})

    def stop(self, processes: Sequence[str], grace_s: float) -> TeardownReport:
        self.calls.append(("stop", *processes))
        return TeardownReport(stopped=list(processes))

    def stop_all(self, grace_s: float) -> TeardownReport:
        self.calls.append(("stop_all",))
        return TeardownReport()

    def keep_logs(self, ids: Sequence[str]) -> list[Path]:
        self.calls.append(("keep_logs", *ids))
        return []

    def check(self, plan: Plan, nodes: Sequence[str]) -> list[str]:
        self.calls.append(("check", *nodes))
        return list(self.doctor_fails)

    def ft_retry(self, pool: object) -> str | None:
        self.calls.append(("ft_retry", getattr(pool, "pool", "")))
        return None

    def reroute(self, router: object, remove: Sequence[str], add: Sequence[str]) -> str | None:
        self.calls.append(("reroute", *(f"-{u}" for u in remove), *(f"+{u}" for u in add)))
        if self.listed is not None:  # the router's list as a real one keeps it
            self.listed = [u for u in self.listed if u not in remove] + [u for u in add if u not in self.listed]
        return None

    def workers(self, router: object) -> list[str] | None:
        """What the router lists: ``listed`` (set by a test; None: the router does not answer)."""
        return None if self.listed is None else list(self.listed)

    def adopt(self, plan: Plan, lost: str) -> None:
        self.calls.append(("adopt", lost))
        self.plan = plan

    def note(self, change: Callable[[DeploymentRecord], None]) -> None:
        self.calls.append(("note",))
        if self.rec is not None:
            change(self.rec)

    def close(self) -> None:
        self.closed = True


@dataclass
class FakeOps:
    """:class:`~k3launch.deploy.base.SuperviseOps` handing out one :class:`FakeWatcher`."""

    watcher_: FakeWatcher

    def watcher(self, rec: object, store: object) -> FakeWatcher:
        return self.watcher_
