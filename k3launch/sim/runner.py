"""One sim process from start to exit: rendezvous, load, serve, faults, and shutdown.

Stages, in vLLM's order: join the TP/PP group and the DP group (torch/ZMQ rendezvous, before
any weights move), "load" for ``K3LAUNCH_SIM_LOAD_S``, open the NIXL side channel, and only
then bind the API port — so a probe sees connection refused until the engine is really up,
as with vLLM, whose API server binds after engine init. Every blocking step waits on one
event that SIGTERM/SIGINT, a fault timer or a peer's death sets; the main thread then closes
every listener, so the ports are free when the process has exited (within a second). With
``--enable-fault-tolerance`` a DP peer's death does not end the process: its engine turns
unhealthy and waits for ``retry`` (:mod:`k3launch.sim.ft`), and only exits once the recovery
timeout has passed.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from types import FrameType

from k3launch.sim import cpubind, startup
from k3launch.sim.engine import Engine
from k3launch.sim.ft import FaultTolerance, FTSettings
from k3launch.sim.ftgroup import HeadLink, MemberLink
from k3launch.sim.logs import Logger
from k3launch.sim.nixl import SideChannel
from k3launch.sim.options import Knobs, ServeOptions
from k3launch.sim.power import PowerFile, power_dir
from k3launch.sim.rendezvous import Coordinator, Group, Member, RendezvousError
from k3launch.sim.server import App, SimHTTPServer
from k3launch.sim.wire import Stopped, can_bind

Closer = Callable[[bool], None]  # called with graceful=True on a clean stop (peers get "bye")
_ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."
_DEAD_EXIT_S = 1.0  # from a dead engine core to the API server's exit (vLLM's watchdog polls every 5 s)


class StartupError(Exception):
    """A failure before ready, with the exception type a real vLLM/torch would print."""

    def __init__(self, exc_type: str, message: str) -> None:
        super().__init__(message)
        self.exc_type = exc_type


class SimProcess:
    def __init__(self, opts: ServeOptions, knobs: Knobs, log: Logger) -> None:
        self.opts = opts
        self.knobs = knobs
        self.log = log
        self.done = threading.Event()
        self.ready = threading.Event()
        self.code = 0
        self._lock = threading.Lock()
        self._closers: list[Closer] = []
        self._signal: int | None = None
        self._closed = False
        self.ft: FaultTolerance | None = None
        if opts.ft.enabled:
            self.ft = FaultTolerance(FTSettings(opts.dp_start, opts.ft.recovery_timeout_s, knobs.ft_detect_s, knobs.ft_retry_s,
                                                opts.ft.cpu_timeout_s), log, self._engine_died)

    # -- outcome ------------------------------------------------------------------------------
    def finish(self, code: int, reason: str, exc_type: str = "RuntimeError") -> None:
        """End the process with ``code``; the first caller wins (later ones are echoes)."""
        with self._lock:
            if self.done.is_set():
                return
            self.code = code
            # Log before waking the main thread, so the reason is written before the exit.
            if code:
                self.log.error(reason, src="core.py")
                self.log.fatal(exc_type, reason)
            else:
                self.log.info(f"Shutting down: {reason}")
            self.done.set()

    def fail(self, reason: str) -> None:
        self.finish(1, reason)

    def peer_left(self, reason: str) -> None:
        # A peer stopping cleanly (k3launch down stops all of them) ends this rank cleanly too.
        self.finish(0, f"{reason}; the group cannot continue without it")

    def _closer(self, close: Closer) -> None:
        with self._lock:
            late = self._closed
            if not late:
                self._closers.append(close)
        if late:  # opened while the main thread was already closing: close it here
            close(False)

    # -- main thread ------------------------------------------------------------------------
    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        self.log.info(f"vLLM API server version {self.knobs.version} (k3launch simulated engine, process "
                      f"{self.knobs.process or '-'})")
        o = self.opts
        args = {"model": o.model, "tensor_parallel_size": o.tp, "pipeline_parallel_size": o.pp, "data_parallel_size": o.dp,
                "data_parallel_size_local": o.dp_local, "data_parallel_start_rank": o.dp_start, "nnodes": o.nnodes,
                "node_rank": o.node_rank, "headless": o.headless}
        self.log.info(f"non-default args: {args}", src="api_utils.py")  # vLLM's own line (its values: what the sim acts on)
        if self.knobs.fault == "exit-during-load":
            self._timer(self.knobs.fail_after_s, self._die_loading)
        threading.Thread(target=self._startup, name="startup", daemon=True).start()
        while not self.done.wait(0.1):
            if self._signal is not None:
                self.finish(0, f"received {signal.Signals(self._signal).name}")
        with self._lock:
            self._closed = True
            closers = list(reversed(self._closers))
        for close in closers:
            close(self.code == 0)
        return self.code

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only record it: a handler that took a lock (logging, finish) could deadlock against
        # the main thread it interrupted while that thread held the same lock.
        self._signal = signum

    def _timer(self, delay: float, fn: Callable[[], None]) -> None:
        t = threading.Timer(delay, fn)
        t.daemon = True
        t.start()

    def _die_loading(self) -> None:
        if self.ready.is_set() or self.done.is_set():
            return
        self.log.error("EngineCore failed to start.", src="core.py")
        self.log.error("RuntimeError: CUDA error: uncorrectable ECC error encountered "
                       "(simulated: K3LAUNCH_SIM_FAIL=exit-during-load)", src="core.py")
        self.finish(1, "Engine core initialization failed. See root cause above. Failed core proc(s): {}")

    def _die_running(self) -> None:
        if self.done.is_set():
            return
        self.log.error("EngineCore encountered a fatal error.", src="core.py")
        self.log.error("RuntimeError: CUDA error: an illegal memory access was encountered "
                       "(simulated: K3LAUNCH_SIM_FAIL=crash-after-ready)", src="core.py")
        self.finish(1, _ENGINE_DEAD, "vllm.v1.engine.exceptions.EngineDeadError")

    def _collective_timeout(self) -> None:
        """K3LAUNCH_SIM_FAIL=collective-timeout: this rank's EP all-to-all stops completing."""
        if self.done.is_set():
            return
        reason = f"DP rank {self.opts.dp_start}'s all-to-all timed out (simulated: K3LAUNCH_SIM_FAIL=collective-timeout)"
        if self.ft is not None:
            self.ft.inject(reason)
            return
        # Without fault tolerance the busy loop's exception kills the engine (engine_core_sentinel.py:217-218).
        self.log.error("EngineCore encountered a fatal error.", src="core.py")
        self.log.error(f"RuntimeError: Fault detected in EP all2all communication: {reason}", src="core.py")
        self.finish(1, _ENGINE_DEAD, "vllm.v1.engine.exceptions.EngineDeadError")

    def _engine_died(self, reason: str) -> None:
        """The recovery timeout passed: the engine core re-raised and died; the API server follows."""
        self.log.error("EngineCore encountered a fatal error.", src="core.py")
        self.log.error(reason, src="core.py")
        self._timer(_DEAD_EXIT_S, lambda: self.finish(1, _ENGINE_DEAD, "vllm.v1.engine.exceptions.EngineDeadError"))

    # -- startup thread ---------------------------------------------------------------------
    def _startup(self) -> None:
        t0 = time.monotonic()
        try:
            cpubind.log_binding(self.log, self.opts)  # the engine core's first lines, before the workers start
            startup.distributed_init(self.log, self.opts)
            self._rendezvous(t0 + self.knobs.rendezvous_timeout_s)
            self._load(t0)
            side = self._side_channel()
            if self.knobs.fault in ("exit-during-load", "hang"):
                if self.knobs.fault == "hang":
                    self.log.info("Capturing CUDA graphs (simulated hang: this engine never becomes ready)", src="gpu_model_runner.py")
                self.done.wait()
                return
            if self.opts.headless:
                o = self.opts
                where = f"node rank {o.node_rank}" if o.multi_node_tp else f"DP ranks {o.dp_start}-{o.dp_start + o.dp_local - 1}"
                self.log.info(f"Headless node ready ({where}); no API server on this node", src="launcher.py")
                self._power(None)
            else:
                self._power(self._serve(side))
            self.ready.set()
            if self.knobs.fault == "crash-after-ready":
                self._timer(self.knobs.fail_after_s, self._die_running)
            if self.knobs.fault == "collective-timeout":
                self._timer(self.knobs.fail_after_s, self._collective_timeout)
        except Stopped:
            return
        except (RendezvousError, StartupError) as exc:
            self.finish(1, str(exc), exc.exc_type)

    def _label(self, what: str) -> str:
        return f"{what} ({self.opts.host_ip or '?'}, process {self.knobs.process or '-'})"

    def _rendezvous(self, deadline: float) -> None:
        o = self.opts
        sizes = {"tensor_parallel_size": o.tp, "pipeline_parallel_size": o.pp}
        if o.multi_node_tp:
            group = Group("tp", "node rank", range(o.nnodes), {"nnodes": o.nnodes, **sizes})
            if o.node_rank == 0:
                self._coordinate(group, (0,), o.master_addr, o.master_port, deadline)
            else:
                self._join(group, (o.node_rank,), self._label(f"node rank {o.node_rank}"), o.master_addr, o.master_port, deadline)
        if o.multi_node_dp:
            group = Group("dp", "DP rank", range(o.dp), {"data_parallel_size": o.dp, **sizes})
            ranks = tuple(o.local_dp_ranks)
            if o.dp_head:
                head = HeadLink(self.ft, group.expected, ranks) if self.ft is not None else None
                self._coordinate(group, ranks, o.dp_address, o.dp_rpc_port, deadline, head)
            else:
                label = self._label(f"DP rank {ranks[0]}" if len(ranks) == 1 else f"DP ranks {ranks[0]}-{ranks[-1]}")
                link = MemberLink(self.ft, ranks, f"{o.dp_address}:{o.dp_rpc_port}") if self.ft is not None else None
                self._join(group, ranks, label, o.dp_address, o.dp_rpc_port, deadline, link)

    def _coordinate(self, group: Group, own: tuple[int, ...], host: str, port: int, deadline: float,
                    ft_link: HeadLink | None = None) -> None:
        coord = Coordinator(group, own, self.log, self.fail, self.peer_left, ft_link.links if ft_link else None)
        if ft_link is not None and self.ft is not None:  # before anyone joins: the links may speak from "go" on
            ft_link.coord, self.ft.group = coord, ft_link
        try:
            coord.start(host, port)
        except OSError as exc:
            if group.kind == "tp":
                raise StartupError("torch.distributed.DistNetworkError",
                                   f"The server socket has failed to bind to {host}:{port} (errno: {exc.errno} - {exc.strerror}).") from None
            raise StartupError("zmq.error.ZMQError", f"{exc.strerror} (addr='tcp://{host}:{port}')") from None
        self._closer(coord.close)
        n = len(group.expected)
        self.log.info(f"{group.kind.upper()} group head listening on {host}:{port}; waiting for {n - len(own)} of {n} "
                      f"{group.noun}s to join", src="parallel_state.py")
        coord.wait(deadline, self.done)
        self.log.info(f"All {n} {group.noun}s joined the {group.kind.upper()} group at {host}:{port}", src="parallel_state.py")

    def _join(self, group: Group, claims: tuple[int, ...], label: str, host: str, port: int, deadline: float,
              ft_link: MemberLink | None = None) -> None:
        member = Member(group, claims, label, self.log, self.fail, self.peer_left, ft_link.links if ft_link else None)
        if ft_link is not None and self.ft is not None:
            ft_link.member, self.ft.group = member, ft_link
        self._closer(member.close)
        self.log.info(f"Joining the {group.kind.upper()} group at {host}:{port} as {label}", src="parallel_state.py")
        member.join(host, port, deadline, self.done)
        self.log.info(f"Joined the {group.kind.upper()} group at {host}:{port} as {label}; all "
                      f"{len(group.expected)} {group.noun}s present", src="parallel_state.py")

    def _load(self, t0: float) -> None:
        startup.load(self.log, self.opts, self.knobs, self.done, t0)  # vLLM's lines for each phase

    def _side_channel(self) -> SideChannel | None:
        kv = self.opts.kv
        if kv is None or not kv.nixl:
            return None
        o = self.opts
        side = SideChannel(o.nixl_host, o.nixl_port, o.local_dp_ranks, o.dp, o.tp, self.log)
        try:
            side.start()
        except OSError as exc:
            raise StartupError("zmq.error.ZMQError", str(exc.strerror)) from None
        self._closer(lambda graceful: side.close())
        return side

    def _bind_host(self) -> str:
        if self.opts.host:
            return self.opts.host
        # Without --host vLLM binds every interface. A simulated node of a local inventory is one
        # loopback address and shares ports with its siblings, so bind that node's own address
        # (VLLM_HOST_IP) when this machine has it; on a real node that is its reachable address.
        ip = self.opts.host_ip
        return ip if ip and can_bind(ip) else "0.0.0.0"

    def _power(self, engine: Engine | None) -> None:
        """Publish what this process's simulated GPUs draw (the stand-in ``nvidia-smi`` reads it)."""
        k = self.knobs
        pf = PowerFile(power_dir(k.power_dir), self.opts.host_ip or "-", self.opts.gpus_needed, k.idle_w, k.per_seq_w,
                       engine.batch if engine is not None else lambda: 0.0)
        pf.start()
        self._closer(pf.close)

    def _serve(self, side: SideChannel | None) -> Engine:
        host, port = self._bind_host(), self.opts.port
        engine = Engine(self.opts, self.knobs, self.log, side, self.ft)
        try:
            httpd = SimHTTPServer(host, port, App(self.opts, engine, self.log, self.knobs.version))
        except OSError as exc:
            raise StartupError("OSError", f"[Errno {exc.errno}] could not bind the API server to {host}:{port}: {exc.strerror}") from None
        thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="http", daemon=True)
        thread.start()

        def close(graceful: bool) -> None:
            httpd.shutdown()  # returns within one poll interval: serve_forever is already running
            httpd.server_close()

        self._closer(close)
        self.log.info(f"Starting vLLM server on http://{host}:{port}", src="entry.py")
        self.log.uvicorn("Application startup complete.")
        return engine
