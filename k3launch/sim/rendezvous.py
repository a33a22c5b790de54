"""Group rendezvous over TCP: the TP/PP master (torch's TCPStore) and the DP coordinator.

Both have one shape. A *coordinator* binds exactly the address the flags name and expects a
fixed set of member ids (node ranks 1..nnodes-1, or DP ranks 0..DP-1); each *member* connects,
retrying until a deadline, and claims its ids together with the parallel sizes it was given.
A size mismatch, an id out of range or claimed twice, a member leaving early, or ids still
missing at the deadline fail the whole group: every waiting process is told why and exits 1,
as a torch/NCCL group does. After "go" the connections stay open as a liveness link, so a rank
that dies takes its group down (a NCCL peer loss); a graceful stop sends "bye" first. With
fault tolerance (:class:`Links`) a lost peer is reported instead of failing the group, and the
links carry the group's ``ft`` messages (:mod:`k3launch.sim.ftgroup`). A process that connects
once the group has formed gets no answer and times out at its own deadline: vLLM has no way to
add a rank to a running group (a restarted rank hangs in its start-up the same way).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from k3launch.sim.logs import Logger
from k3launch.sim.wire import Json, Peer, Stopped, close_socket, connect_retry, listen, serve_accepts


class RendezvousError(Exception):
    """The group cannot form; the message is what vLLM/torch would log."""

    def __init__(self, group: Group, message: str) -> None:
        super().__init__(message)
        # torch's TCPStore raises DistStoreError; vLLM's DP engine handshake (ZMQ) a RuntimeError
        self.exc_type = "torch.distributed.DistStoreError" if group.kind == "tp" else "RuntimeError"


@dataclass(frozen=True)
class Group:
    """What every member of one group must agree on."""

    kind: str  # "tp" | "dp" (also the protocol tag, so a DP rank cannot join a TP master)
    noun: str  # "node rank" | "DP rank", for messages
    expected: range
    params: dict[str, int]  # e.g. {"nnodes": 3, "tensor_parallel_size": 24}


Callback = Callable[[str], None]
_MEMBER_GRACE_S = 2.0


@dataclass(frozen=True)
class Links:
    """What a formed group reports when the process runs with fault tolerance."""

    on_lost: Callable[[str, tuple[int, ...]], None]  # a peer died (why, its ids): not fatal
    on_message: Callable[[Json], None]  # a message of kind "ft"


class Coordinator:
    """The listening side: node rank 0's TP master, or the DP head's coordinator."""

    def __init__(self, group: Group, own: tuple[int, ...], log: Logger, on_fail: Callback, on_bye: Callback,
                 links: Links | None = None) -> None:
        self.group = group
        self.log = log
        self._on_fail = on_fail
        self._on_bye = on_bye
        self._links = links
        self._cond = threading.Condition()
        self._claims: dict[int, str] = dict.fromkeys(own, "this node")
        self._peers: list[Peer] = []
        self._late: list[Peer] = []  # connected after the group formed: never answered
        self._failed: str | None = None
        self._complete = False
        self._closing = False
        self._sock: socket.socket | None = None

    def start(self, host: str, port: int) -> None:
        self._sock = listen(host, port)  # OSError goes to the caller: a bind failure is fatal
        serve_accepts(self._sock, self._handle, f"{self.group.kind}-coordinator")

    def missing(self) -> list[int]:
        return [i for i in self.group.expected if i not in self._claims]

    def wait(self, deadline: float, stop: threading.Event) -> None:
        """Block until every expected id joined; raise :class:`RendezvousError` otherwise."""
        with self._cond:
            while not self._complete and self._failed is None:
                if stop.is_set():
                    raise Stopped
                if time.monotonic() >= deadline:
                    self._fail_locked(self._timeout_message())
                    break
                self._cond.wait(min(0.1, max(0.0, deadline - time.monotonic())))
            if self._failed is not None:
                raise RendezvousError(self.group, self._failed)

    def _timeout_message(self) -> str:
        n = len(self.group.expected)
        joined = n - len(self.missing())
        what = ", ".join(str(i) for i in self.missing())
        return (f"Timed out waiting for {self.group.kind.upper()} group members: {joined}/{n} {self.group.noun}s joined; "
                f"missing {self.group.noun}s: {what}")

    def _handle(self, conn: socket.socket) -> None:
        peer = Peer(conn)
        try:
            hello = peer.recv(timeout=10.0)
        except TimeoutError:
            hello = None
        if hello is None or hello.get("kind") != self.group.kind:
            peer.send({"kind": "abort", "reason": f"expected a {self.group.kind} join message"})
            peer.close()
            return
        with self._cond:
            if self._complete and self._failed is None:
                self._late.append(peer)
                self.log.warning(f"{hello.get('label', peer.address)} tried to join the {self.group.kind.upper()} group after it "
                                 "formed; a running group takes no new rank, so it gets no answer", src="parallel_state.py")
                return
            self._peers.append(peer)
            if self._failed is not None:
                peer.send({"kind": "abort", "reason": self._failed})
                return
            problem = self._fail_reason(hello)
            if problem is not None:
                self._fail_locked(problem)
                return
            label = str(hello.get("label", peer.address))
            for i in _claims(hello):
                self._claims[i] = label
            n = len(self.group.expected)
            self.log.info(f"{label} joined the {self.group.kind.upper()} group ({n - len(self.missing())}/{n} {self.group.noun}s)",
                          src="parallel_state.py")
            if not self.missing():
                self._complete = True
                for p in self._peers:
                    p.send({"kind": "go"})
            self._cond.notify_all()
        self._watch(peer, label, tuple(_claims(hello)))

    def _fail_reason(self, hello: Json) -> str | None:
        label = str(hello.get("label", "?"))
        theirs = hello.get("params")
        if not isinstance(theirs, dict):
            return f"{label} sent no parallel sizes"
        for key, mine in self.group.params.items():
            if theirs.get(key) != mine:
                return (f"{label} was started with {key}={theirs.get(key)} but the group "
                        f"has {key}={mine}: every node must get the same parallel sizes")
        for i in _claims(hello):
            if i not in self.group.expected:
                return (f"{label} claims {self.group.noun} {i}, out of range "
                        f"[{self.group.expected.start}, {self.group.expected.stop})")
            if i in self._claims:
                return f"{self.group.noun} {i} joined twice: by {self._claims[i]} and by {label}"
        return None

    def _fail_locked(self, reason: str) -> None:
        if self._failed is not None:
            return
        self._failed = reason
        for p in self._peers:
            p.send({"kind": "abort", "reason": reason})
        self._cond.notify_all()

    def _watch(self, peer: Peer, label: str, claims: tuple[int, ...]) -> None:
        """After joining, the connection is the member's liveness: EOF means it died."""
        while True:
            msg = peer.recv(timeout=None)
            if msg is not None and msg.get("kind") == "bye":
                if not self._closing:
                    self._on_bye(f"{label} shut down")
                return
            if msg is None:
                break
            if msg.get("kind") == "ft" and self._links is not None and self._complete:
                self._links.on_message(msg)
        with self._cond:
            if self._closing or self._failed is not None:
                return
            if not self._complete:
                self._fail_locked(f"{label} disconnected before the group was complete")
                return
            self._peers.remove(peer)  # no more broadcasts to a dead peer
        peer.close()
        reason = f"{label} disconnected: the {self.group.kind.upper()} group lost a member (peer process died)"
        if self._links is not None:
            self._links.on_lost(reason, claims)
        else:
            self._on_fail(reason)

    def broadcast(self, msg: Json) -> None:
        """Send ``msg`` to every member still connected."""
        with self._cond:
            peers = list(self._peers)
        for p in peers:
            p.send(msg)

    def close(self, graceful: bool) -> None:
        with self._cond:
            self._closing = True
            peers = list(self._peers)
            late = list(self._late)
        for p in late:
            p.close()
        for p in peers:
            if graceful:
                p.send({"kind": "bye"})
            p.close()
        if self._sock is not None:
            close_socket(self._sock)


def _claims(hello: Json) -> list[int]:
    raw = hello.get("claims")
    return [int(i) for i in raw if isinstance(i, int)] if isinstance(raw, list) else []


class Member:
    """The connecting side: a headless TP rank, or a DP node other than the head."""

    def __init__(self, group: Group, claims: tuple[int, ...], label: str, log: Logger,
                 on_fail: Callback, on_bye: Callback, links: Links | None = None) -> None:
        self.group = group
        self.claims = claims
        self.label = label
        self.log = log
        self._on_fail = on_fail
        self._on_bye = on_bye
        self._links = links
        self._peer: Peer | None = None
        self._closing = False

    def join(self, host: str, port: int, deadline: float, stop: threading.Event) -> None:
        """Connect, claim, and wait for "go"; raise :class:`RendezvousError` on any failure."""
        where = f"{host}:{port}"
        try:
            sock = connect_retry(host, port, deadline, stop)
        except TimeoutError as exc:
            raise RendezvousError(self.group,
                f"The client socket has timed out while trying to connect to ({host}, {port}): {exc}. "
                f"Is the {self.group.kind.upper()} head running at {where}?") from None
        self._peer = Peer(sock)
        self._peer.send({"kind": self.group.kind, "claims": list(self.claims), "params": self.group.params, "label": self.label})
        # Outwait the head by a little: its timeout names the missing ranks, which a member
        # giving up at the same instant would replace with a vaguer "disconnected" failure.
        deadline += _MEMBER_GRACE_S
        while True:
            if stop.is_set():
                raise Stopped
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RendezvousError(self.group, f"Timed out waiting for the {self.group.kind.upper()} group at {where} to complete")
            try:
                msg = self._peer.recv(timeout=min(0.2, remaining))
            except TimeoutError:
                continue
            if msg is None:
                raise RendezvousError(self.group, f"connection to the {self.group.kind.upper()} head at {where} closed during rendezvous")
            if msg.get("kind") == "abort":
                raise RendezvousError(self.group, f"rendezvous at {where} failed: {msg.get('reason')}")
            if msg.get("kind") == "go":
                break
        threading.Thread(target=self._watch, args=(where,), name=f"{self.group.kind}-member", daemon=True).start()

    def _watch(self, where: str) -> None:
        assert self._peer is not None
        while True:
            msg = self._peer.recv(timeout=None)
            if self._closing:
                return
            if msg is None:
                reason = f"lost the connection to the {self.group.kind.upper()} head at {where} (peer process died)"
                if self._links is not None:
                    self._links.on_lost(reason, tuple(self.group.expected[:1]))
                else:
                    self._on_fail(reason)
                return
            if msg.get("kind") == "ft" and self._links is not None:
                self._links.on_message(msg)
                continue
            if msg.get("kind") == "bye":
                self._on_bye(f"the {self.group.kind.upper()} head at {where} shut down")
                return
            if msg.get("kind") == "abort":
                self._on_fail(f"the {self.group.kind.upper()} head at {where} aborted: {msg.get('reason')}")
                return

    def send(self, msg: Json) -> bool:
        """Send ``msg`` to the head; False once the head is gone."""
        return self._peer is not None and self._peer.send(msg)

    def close(self, graceful: bool) -> None:
        self._closing = True
        if self._peer is not None:
            if graceful:
                self._peer.send({"kind": "bye"})
            self._peer.close()
