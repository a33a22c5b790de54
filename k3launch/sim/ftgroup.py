"""Fault tolerance across one DP group: stalls seen by every rank, and the retry's new group.

The DP head (rank 0's process, which holds the coordinator) is the hub, as DP rank 0's TCP store
is in vLLM (vllm/v1/engine/core.py:2346-2347; engine_core_sentinel.py:183-190):

* ``{"kind": "ft", "op": "stall", "reason"}``: a collective stalled (an injected fault, or a
  lost peer); the head relays it to every member, and each rank turns unhealthy on its own
  clock (:meth:`FaultTolerance.stall`), as every rank's all-to-all times out in vLLM.
* ``{"op": "join" | "leave", "epoch", "ranks"}``: a rank enters (or gives up on) retry number
  ``epoch``'s new group; once every DP rank has joined the same epoch the head sends
  ``{"op": "done", "epoch"}`` and each retry goes on. An epoch counts attempts per engine, as
  vLLM's ``_dp_reinit_epoch`` does, so a rank that retried twice waits on another group than a
  rank that retried once. Ranks of a peer that died leave every epoch: the group cannot form
  without them.
"""

from __future__ import annotations

import threading
import time

from k3launch.sim.ft import FaultTolerance, RetryFailed
from k3launch.sim.rendezvous import Coordinator, Links, Member
from k3launch.sim.wire import Json


def _ranks(msg: Json) -> set[int]:
    raw = msg.get("ranks")
    return {int(r) for r in raw if isinstance(r, int)} if isinstance(raw, list) else set()


def _epoch(msg: Json) -> int:
    raw = msg.get("epoch")
    return raw if isinstance(raw, int) else -1


class HeadLink:
    """DP rank 0's side: relays stalls and counts the ranks that joined each retry."""

    def __init__(self, ft: FaultTolerance, expected: range, own: tuple[int, ...]) -> None:
        self.ft = ft
        self.expected = set(expected)
        self.own = set(own)
        self.coord: Coordinator | None = None  # set once the coordinator exists (it needs links first)
        self._cond = threading.Condition()
        self._joined: dict[int, set[int]] = {}
        self._done: set[int] = set()
        self.links = Links(self._lost, self._message)

    def _lost(self, reason: str, ranks: tuple[int, ...]) -> None:
        with self._cond:
            for joined in self._joined.values():
                joined.difference_update(ranks)
        self.ft.stall(reason)
        self.announce(reason)

    def _message(self, msg: Json) -> None:
        op = msg.get("op")
        if op == "stall":
            reason = str(msg.get("reason"))
            self.ft.stall(reason)
            self.announce(reason)
        elif op in ("join", "leave"):
            with self._cond:
                joined = self._joined.setdefault(_epoch(msg), set())
                if op == "join":
                    joined.update(_ranks(msg))
                else:
                    joined.difference_update(_ranks(msg))
                self._complete_locked(_epoch(msg))

    def _complete_locked(self, epoch: int) -> None:
        if epoch not in self._done and self._joined.get(epoch, set()) >= self.expected:
            self._done.add(epoch)
            if self.coord is not None:
                self.coord.broadcast({"kind": "ft", "op": "done", "epoch": epoch})
            self._cond.notify_all()

    def announce(self, reason: str) -> None:
        if self.coord is not None:
            self.coord.broadcast({"kind": "ft", "op": "stall", "reason": reason})

    def reinit(self, epoch: int, deadline: float, stop: threading.Event) -> None:
        with self._cond:
            self._joined.setdefault(epoch, set()).update(self.own)
            self._complete_locked(epoch)
            while epoch not in self._done:
                if stop.is_set():
                    raise RetryFailed("the engine shut down during the retry")
                if time.monotonic() >= deadline:
                    missing = sorted(self.expected - self._joined[epoch])
                    self._joined[epoch].difference_update(self.own)  # gave up: this rank no longer waits in it
                    n = len(self.expected)
                    raise RetryFailed(f"Timed out waiting for the new DP group (epoch {epoch}): {n - len(missing)}/{n} "
                                      f"DP ranks joined; missing DP ranks: {', '.join(map(str, missing))}")
                self._cond.wait(min(0.1, max(0.0, deadline - time.monotonic())))


class MemberLink:
    """Any other rank's side: stalls go to the head, and the retry waits for its "done"."""

    def __init__(self, ft: FaultTolerance, own: tuple[int, ...], head: str) -> None:
        self.ft = ft
        self.own = list(own)
        self.head = head  # host:port of the DP head, for messages
        self.member: Member | None = None  # set once the member exists (it needs links first)
        self._cond = threading.Condition()
        self._done: set[int] = set()
        self._lost_reason: str | None = None
        self.links = Links(self._lost, self._message)

    def _lost(self, reason: str, ranks: tuple[int, ...]) -> None:
        with self._cond:
            self._lost_reason = reason
            self._cond.notify_all()
        self.ft.stall(reason)

    def _message(self, msg: Json) -> None:
        op = msg.get("op")
        if op == "stall":
            self.ft.stall(str(msg.get("reason")))
        elif op == "done":
            with self._cond:
                self._done.add(_epoch(msg))
                self._cond.notify_all()

    def _send(self, msg: Json) -> bool:
        return self.member is not None and self.member.send(msg)

    def announce(self, reason: str) -> None:
        self._send({"kind": "ft", "op": "stall", "reason": reason})

    def _unreachable(self) -> RetryFailed:
        # vLLM: dp_store.get() on a store whose server (DP rank 0) is gone
        return RetryFailed(f"the DP store of DP rank 0 at {self.head} is unreachable "
                           f"(Connection reset by peer): {self._lost_reason or 'the DP head is gone'}")

    def reinit(self, epoch: int, deadline: float, stop: threading.Event) -> None:
        with self._cond:
            if self._lost_reason is not None:
                raise self._unreachable()
        if not self._send({"kind": "ft", "op": "join", "epoch": epoch, "ranks": self.own}):
            raise self._unreachable()
        with self._cond:
            while epoch not in self._done and time.monotonic() < deadline:
                if self._lost_reason is not None:
                    raise self._unreachable()
                if stop.is_set():
                    raise RetryFailed("the engine shut down during the retry")
                self._cond.wait(min(0.1, max(0.0, deadline - time.monotonic())))
            if epoch in self._done:
                return
        self._send({"kind": "ft", "op": "leave", "epoch": epoch, "ranks": self.own})
        raise RetryFailed(f"Timed out waiting for the new DP group (epoch {epoch}) at {self.head}: "
                          "not every DP rank joined it")
