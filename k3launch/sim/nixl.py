"""The NIXL side channel of P/D disaggregation, over real TCP.

In vLLM every NixlConnector engine listens on ``VLLM_NIXL_SIDE_CHANNEL_HOST`` at
``VLLM_NIXL_SIDE_CHANNEL_PORT + dp_rank``; a decode engine that receives ``kv_transfer_params``
from a prefill connects to ``remote_host:remote_port`` to exchange agent metadata before it
pulls the KV blocks. The sim keeps that topology and makes the exchange prove something: the
decode asks the listener for the blocks of ``remote_request_id`` and checks that the engine id
and block ids match what the prefill's response promised. Reaching the wrong host, port or
engine fails the request (``kv_load_failure_policy: fail``) exactly where a real transfer would.
"""

from __future__ import annotations

import functools
import itertools
import math
import socket
import threading
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

from k3launch.sim.logs import Logger
from k3launch.sim.wire import Json, Peer, close_socket, connect, listen, serve_accepts

BLOCK_SIZE = 16  # tokens per KV block, vLLM's default
_KEEP = 4096  # finished prefills whose blocks a decode may still fetch (vLLM frees them on timeout)
HANDSHAKE_TIMEOUT_S = 5.0


class KVTransferError(Exception):
    """The decode could not load the KV cache from its producer."""


@dataclass(frozen=True)
class Prefilled:
    """What a producer promises a decode: the response's ``kv_transfer_params``."""

    engine_id: str
    request_id: str
    block_ids: list[int]
    host: str
    port: int
    tp_size: int

    def params(self) -> Json:
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_block_ids": self.block_ids,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_request_id": self.request_id,
            "tp_size": self.tp_size,
        }


class SideChannel:
    """The listeners of one process's local DP ranks, and the blocks its prefills hold."""

    def __init__(self, host: str, base_port: int, ranks: range, dp_size: int, tp_size: int, log: Logger) -> None:
        self.host = host
        self.base_port = base_port
        self.ranks = ranks
        self.tp_size = tp_size
        self.log = log
        base_id = str(uuid.uuid4())
        # vLLM suffixes the engine id with the DP rank so each DP engine is its own NIXL agent.
        self.engine_ids = {r: (f"{base_id}_dp{r}" if dp_size > 1 else base_id) for r in ranks}
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._held: OrderedDict[str, tuple[int, list[int]]] = OrderedDict()
        self._next_block = itertools.count(1)

    def start(self) -> None:
        """Bind every local rank's port; an OSError (address not ours, port taken) is fatal."""
        for rank in self.ranks:
            port = self.base_port + rank
            try:
                sock = listen(self.host, port)
            except OSError as exc:
                self.close()
                raise OSError(exc.errno, f"NIXL side channel cannot bind tcp://{self.host}:{port} (DP rank {rank}): {exc.strerror}") from None
            self._socks.append(sock)
            serve_accepts(sock, functools.partial(self._serve, rank=rank), f"nixl-dp{rank}")
        ports = ", ".join(str(self.base_port + r) for r in self.ranks)
        self.log.info(f"NIXL side channel listening on {self.host} port(s) {ports}", src="nixl_connector.py")

    def hold(self, request_id: str, prompt_tokens: int, rank: int) -> Prefilled:
        """A prefill finished on DP ``rank``: keep its blocks and say where to fetch them."""
        n = max(1, math.ceil(prompt_tokens / BLOCK_SIZE))
        with self._lock:
            blocks = [next(self._next_block) for _ in range(n)]
            self._held[request_id] = (rank, blocks)
            while len(self._held) > _KEEP:
                self._held.popitem(last=False)
        return Prefilled(self.engine_ids[rank], request_id, blocks, self.host, self.base_port + rank, self.tp_size)

    def _serve(self, conn: socket.socket, rank: int) -> None:
        peer = Peer(conn)
        try:
            msg = peer.recv(timeout=HANDSHAKE_TIMEOUT_S)
        except TimeoutError:
            msg = None
        if msg is None or msg.get("kind") != "nixl_handshake":
            peer.close()
            return
        reply = self._answer(msg, rank)
        peer.send(reply)
        peer.close()
        if reply.get("ok"):
            self.log.info(f"NIXL side channel (DP rank {rank}, port {self.base_port + rank}): sent {len(msg_blocks(reply))} "
                          f"KV block ids of request {msg.get('request_id')} to {msg.get('consumer')} ({peer.address})",
                          src="nixl_connector.py")
        else:
            self.log.warning(f"NIXL side channel (DP rank {rank}): refused {peer.address}: {reply.get('error')}", src="nixl_connector.py")

    def _answer(self, msg: Json, rank: int) -> Json:
        mine = self.engine_ids[rank]
        if msg.get("engine_id") != mine:
            return {"ok": False, "error": f"remote engine id mismatch: this side channel is engine {mine}, "
                                          f"the request expects {msg.get('engine_id')}"}
        rid = str(msg.get("request_id"))
        with self._lock:
            held = self._held.pop(rid, None)
        if held is None or held[0] != rank:
            return {"ok": False, "error": f"engine {mine} holds no KV blocks for request {rid}"}
        return {"ok": True, "engine_id": mine, "dp_rank": rank, "block_ids": held[1], "tp_size": self.tp_size}

    def close(self) -> None:
        for sock in self._socks:
            close_socket(sock)
        self._socks.clear()


def msg_blocks(msg: Json) -> list[int]:
    raw = msg.get("block_ids")
    return [i for i in raw if isinstance(i, int)] if isinstance(raw, list) else []


def fetch(params: Mapping[str, object], consumer: str, log: Logger) -> str:
    """The decode side: reach the producer named in ``params`` and check its answer.

    Returns a one-line summary for the log; raises :class:`KVTransferError`.
    """
    host, port = params.get("remote_host"), params.get("remote_port")
    engine, rid = params.get("remote_engine_id"), params.get("remote_request_id")
    if not isinstance(host, str) or not isinstance(port, int) or not engine or not rid:
        raise KVTransferError("kv_transfer_params lacks remote_host/remote_port/remote_engine_id/remote_request_id "
                              "(was the request sent to a kv_producer first?)")
    where = f"{host}:{port}"
    try:
        sock = connect(host, port, HANDSHAKE_TIMEOUT_S)
    except OSError as exc:
        raise KVTransferError(f"NIXL handshake with remote engine {engine} at {where} failed: {exc}") from None
    peer = Peer(sock)
    try:
        peer.send({"kind": "nixl_handshake", "engine_id": engine, "request_id": rid, "consumer": consumer})
        reply = peer.recv(timeout=HANDSHAKE_TIMEOUT_S)
    except TimeoutError:
        reply = None
    finally:
        peer.close()
    if reply is None:
        raise KVTransferError(f"NIXL handshake with {where} got no answer (is it a NIXL side channel?)")
    if not reply.get("ok"):
        raise KVTransferError(f"NIXL handshake with {where} refused: {reply.get('error')}")
    promised = params.get("remote_block_ids")
    if isinstance(promised, list) and promised != msg_blocks(reply):
        raise KVTransferError(f"KV blocks of request {rid} at {where} differ from the prefill's remote_block_ids")
    summary = (f"NIXL handshake with remote engine {engine} at {where} succeeded; "
               f"pulled {len(msg_blocks(reply))} KV blocks of request {rid} (remote DP rank {reply.get('dp_rank')})")
    log.info(summary, src="nixl_connector.py")
    return summary
