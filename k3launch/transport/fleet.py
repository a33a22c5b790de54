"""How to reach each host of a plan: a :class:`~k3launch.transport.runners.Target` per node, and the runner.

``local`` backend and the login node (the router's default home) run through the local runner;
``ssh`` nodes through one shared :class:`~k3launch.transport.runners.SshRunner`. :class:`Fleet` hides the
difference, so executors just say "run this on node X" or "run these on their nodes".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from k3launch.models.backends import spec
from k3launch.models.plan import Host, Plan
from k3launch.transport.runners import DEFAULT_CONCURRENCY, DEFAULT_TIMEOUT_S, CommandRunner, LocalRunner, Outcome, Result, Target, run_many


def target_for(backend: str, host: Host) -> Target:
    if backend == "none" or spec(backend).this_machine or host.name == "login":
        return Target(host.name, "localhost", local=True)
    return Target(host.name, host.ssh_host or host.address, host.user, host.ssh_port, host.identity_file, local=False)


@dataclass
class Fleet:
    backend: str  # the plan's (or inventory's): "local" runs every host's commands here
    hosts: Sequence[Host]
    remote: CommandRunner
    local: CommandRunner
    concurrency: int = DEFAULT_CONCURRENCY
    plan: Plan | None = None  # the plan it was made for (None: an inventory's machines, for a record-less `down`)
    _targets: dict[str, Target] = field(default_factory=dict, repr=False)

    @classmethod
    def for_plan(cls, plan: Plan, remote: CommandRunner | None = None, local: CommandRunner | None = None, concurrency: int = DEFAULT_CONCURRENCY) -> Fleet:
        return cls.for_hosts(plan.backend, plan.hosts, remote, local, concurrency, plan)

    @classmethod
    def for_hosts(cls, backend: str, hosts: Sequence[Host], remote: CommandRunner | None = None, local: CommandRunner | None = None,
                  concurrency: int = DEFAULT_CONCURRENCY, plan: Plan | None = None) -> Fleet:
        loc = local or LocalRunner()
        return cls(backend, tuple(hosts), remote or loc, loc, concurrency, plan)

    def target(self, node: str) -> Target:
        t = self._targets.get(node)
        if t is None:
            t = self._targets[node] = target_for(self.backend, self.host(node))
        return t

    def host(self, node: str) -> Host:
        return next(h for h in self.hosts if h.name == node)

    def nodes(self) -> list[str]:
        seen: dict[str, None] = {}
        for h in self.hosts:
            seen.setdefault(h.name, None)
        return list(seen)

    def run(self, node: str, command: str, timeout: float = DEFAULT_TIMEOUT_S) -> Result:
        t = self.target(node)
        return (self.local if t.local else self.remote).run(t, command, timeout=timeout)

    def run_many(self, commands: Mapping[str, str] | Iterable[tuple[str, str]], timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, Outcome]:
        """One command per node, in parallel (bounded); one outcome per node, errors included."""
        items = list(commands.items()) if isinstance(commands, Mapping) else list(commands)
        jobs = [(self.target(n), c) for n, c in items]
        loc = [(t, c) for t, c in jobs if t.local]
        rem = [(t, c) for t, c in jobs if not t.local]
        if not loc or not rem:
            return run_many(self.local if loc else self.remote, loc or rem, timeout=timeout, concurrency=self.concurrency)
        # the login node's commands (router) run alongside the remote fan-out, not after it
        with ThreadPoolExecutor(max_workers=1) as pool:
            local_future = pool.submit(run_many, self.local, loc, timeout=timeout, concurrency=self.concurrency)
            out = run_many(self.remote, rem, timeout=timeout, concurrency=self.concurrency)
            out.update(local_future.result())
        return out

    def close(self) -> None:
        self.remote.close()
        if self.local is not self.remote:
            self.local.close()

    # A fleet holds connections: ``with connect(...) as fleet:`` closes them whatever happens.
    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
