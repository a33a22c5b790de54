"""The engine side of vLLM 0.33.0's fault tolerance, simulated for one external-LB DP rank.

vLLM (vllm/v1/fault_tolerance/engine_core_sentinel.py, vllm/v1/engine/core_client.py):

* An exception in the engine's busy loop — with DP + EP, the EP all-to-all timing out on a peer
  that died or stalled (gpu_model_runner.py:356-361) — does not kill the engine: every request in
  its scheduler is aborted (finish reason ``abort``), its status becomes ``unhealthy`` with
  ``fault_info`` the exception's type, and the loop waits up to ``engine_recovery_timeout_sec``
  for a recovery instruction (engine_core_sentinel.py:82-107, 207-229). Requests arriving
  meanwhile sit in the engine's input queue: they stall, neither answered nor refused. ``/health``
  stays 200: the engine process is alive.
* ``retry`` is refused unless the engine is ``unhealthy`` (:53-66). It re-creates the DP group:
  DP rank 0 publishes fresh ports in its TCP store and every one of the ``data_parallel_size``
  ranks joins a new gloo group, which completes only once all have (:172-204), then the workers do
  the same for their own DP group (gpu_worker_sentinel.py:52-69). So every rank must get ``retry``
  while its engine is alive and unhealthy; a lost rank cannot take part (a restarted process is
  ``healthy`` and refuses it), and with DP rank 0 gone its store is unreachable.
* A failed instruction leaves the engine unhealthy and adds ``last_ft_request_id`` and
  ``ft_error`` to its status entry (core_client.py:1449-1459). No recovery within the timeout:
  the loop re-raises, the engine core dies (``EngineDeadError``), ``/health`` turns 503, waiting
  requests get 500 and the API server exits (launcher.py:314-337).

The sim's stand-ins: a lost DP peer or an injected stalled collective makes every rank of the
group ``unhealthy`` ``K3LAUNCH_SIM_FT_DETECT_S`` later (the all-to-all timeout; about 100 s in
vLLM's own demo); the re-created group is a barrier over the DP group's links
(:mod:`k3launch.sim.ftgroup`), after which the retry takes ``K3LAUNCH_SIM_FT_RETRY_S``. The
``dead`` status (this engine's own worker process died, :93-99) is not simulated.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from k3launch.sim.apierror import ApiError
from k3launch.sim.logs import Logger
from k3launch.sim.wire import Json

HEALTHY, UNHEALTHY = "healthy", "unhealthy"
FAULT_TYPE = "RuntimeError"  # what the EP all-to-all fault raises (gpu_model_runner.py:358)
ENGINE_DEAD = "The server had an error while processing your request."  # EngineDeadError.CLIENT_MESSAGE
_SRC = "engine_core_sentinel.py"


class RetryFailed(Exception):
    """The retry's new DP group could not be formed; the message becomes ``ft_error``."""


class GroupLink(Protocol):
    """This rank's view of its DP group, for fault tolerance (:mod:`k3launch.sim.ftgroup`)."""

    def announce(self, reason: str) -> None:
        """Tell every other rank that a collective of the group stalled."""

    def reinit(self, epoch: int, deadline: float, stop: threading.Event) -> None:
        """Join retry ``epoch``'s new DP group; return once every rank has, or raise :class:`RetryFailed`."""


@dataclass(frozen=True)
class FTSettings:
    rank: int  # this engine's global DP rank (its ``id`` in the status)
    recovery_timeout_s: float  # engine_recovery_timeout_sec
    detect_s: float  # K3LAUNCH_SIM_FT_DETECT_S
    retry_s: float  # K3LAUNCH_SIM_FT_RETRY_S
    cpu_timeout_s: float  # --cpu-distributed-timeout-seconds: how long the new group waits for a rank


def engine_dead() -> ApiError:
    """What a request gets from an engine that died (error_response.py: EngineDeadError)."""
    return ApiError(500, ENGINE_DEAD, "InternalServerError")


class FaultTolerance:
    """One engine's fault-tolerance state: its status entry, the recovery deadline, and ``retry``."""

    def __init__(self, settings: FTSettings, log: Logger, die: Callable[[str], None]) -> None:
        self.settings = settings
        self.log = log
        self._die = die  # called once the recovery timeout passed: the engine core is dead
        self._lock = threading.Lock()
        self._retry_lock = threading.Lock()  # vLLM runs FT commands one at a time, on the engine's input thread
        self.status = HEALTHY
        self.entry: Json = {"id": settings.rank, "status": HEALTHY}
        self.epoch = 0  # faults so far: a request admitted under an older epoch was aborted
        self.resumed = threading.Event()
        self.resumed.set()
        self.dead = threading.Event()
        self.group: GroupLink | None = None
        self._pending: threading.Timer | None = None
        self._reinit_epoch = 0  # vLLM's _dp_reinit_epoch: one per retry attempt

    # -- what the API server reads ------------------------------------------------------------
    def status_body(self) -> Json:
        """``GET /fault_tolerance/status`` (core_client.py:1461-1466): one engine per external-LB server."""
        with self._lock:
            return {"schema_version": 1, "total_engines": 1, "engines": [dict(self.entry)]}

    def admit(self) -> int:
        """Wait while the engine is unhealthy; the fault epoch the request runs in. Raises 500 once it died."""
        while not self.resumed.wait(0.1):
            if self.dead.is_set():
                raise engine_dead()
        return self.epoch

    # -- faults -----------------------------------------------------------------------------
    def stall(self, reason: str) -> None:
        """A collective of this rank's group can no longer complete: unhealthy ``detect_s`` from now."""
        with self._lock:
            if self.status != HEALTHY or self._pending is not None or self.dead.is_set():
                return  # already noticed, or about to be
            timer = threading.Timer(self.settings.detect_s, self._fault, args=(reason,))
            timer.daemon = True
            self._pending = timer
        self.log.info(f"DP group collective stalled ({reason}); the EP all-to-all will time out", src="all2all.py")
        timer.start()

    def inject(self, reason: str) -> None:
        """This rank's own collective stalls (K3LAUNCH_SIM_FAIL=collective-timeout): the whole group notices."""
        self.stall(reason)
        if self.group is not None:
            self.group.announce(reason)

    def _fault(self, reason: str) -> None:
        with self._lock:
            self._pending = None
            if self.status != HEALTHY or self.dead.is_set():
                return
            self.status = UNHEALTHY
            self.epoch += 1
            self.resumed.clear()
            self.entry = {"id": self.settings.rank, "status": UNHEALTHY, "fault_info": FAULT_TYPE}
            epoch = self.epoch
        self.log.warning(f"[FT] Busy loop raised {FAULT_TYPE}. Waiting for recovery.", src=_SRC)
        self.log.info(f"[FT] Engine {self.settings.rank} status -> UNHEALTHY: {FAULT_TYPE}: Fault detected in EP all2all "
                      f"communication: one or more ranks timed out during dispatch/combine ({reason})", src=_SRC)
        timer = threading.Timer(self.settings.recovery_timeout_s, self._expire, args=(epoch,))
        timer.daemon = True
        timer.start()

    def _expire(self, epoch: int) -> None:
        with self._lock:
            if self.resumed.is_set() or self.epoch != epoch or self.dead.is_set():
                return  # recovered in time (a later fault has its own timer)
            self.dead.set()
        self.log.error(f"[FT] No recovery within {self.settings.recovery_timeout_s:g}s timeout.", src=_SRC)
        self._die(f"{FAULT_TYPE}: Fault detected in EP all2all communication: one or more ranks timed out "
                  "during dispatch/combine (no recovery instruction within engine_recovery_timeout_sec)")

    # -- instructions -----------------------------------------------------------------------
    def apply(self, instruction: str, request_id: str) -> None:
        """Run an accepted instruction in the background, as vLLM's ``BackgroundTasks`` does."""
        t = threading.Thread(target=self._handle, args=(instruction, request_id), name="ft-apply", daemon=True)
        t.start()

    def _handle(self, instruction: str, request_id: str) -> None:
        with self._retry_lock:
            with self._lock:
                status = self.status
            if status != UNHEALTHY:
                reason = f"[FT] Rejecting {instruction} on engine {self.settings.rank}: status is {status.upper()}"
                self.log.warning(reason, src=_SRC)
                self._failed(request_id, reason)
                return
            self._retry(request_id)

    def _retry(self, request_id: str) -> None:
        epoch = self._reinit_epoch
        self._reinit_epoch += 1
        try:
            if self.group is not None:
                self.group.reinit(epoch, time.monotonic() + self.settings.cpu_timeout_s, self.dead)
        except RetryFailed as exc:
            if self.dead.is_set():
                return
            self.log.error("[FT] Instruction 'retry' failed", src=_SRC)
            self._failed(request_id, str(exc))
            return
        if self.dead.wait(self.settings.retry_s):  # the workers' buffers and groups are rebuilt
            return
        with self._lock:
            if self.dead.is_set():
                return
            self.status = HEALTHY
            self.entry = {"id": self.settings.rank, "status": HEALTHY}
            self.resumed.set()
        self.log.info(f"[FT] Engine {self.settings.rank} status -> HEALTHY", src=_SRC)

    def _failed(self, request_id: str, reason: str) -> None:
        with self._lock:
            self.entry["last_ft_request_id"] = request_id
            self.entry["ft_error"] = reason
        self.log.error(f"[FT] Recovery failed for request {request_id}: {reason}", src="api_router.py")
