"""A simulated engine's API server in this process: the fast-tier way to talk to the sim over HTTP.

No subprocess and no load time, a zero-latency engine: a test gets a real listening server (vLLM's
OpenAI API as the sim answers it) in milliseconds. Each test module passes its own loopback address
(all of 127/8 is loopback on Linux), so modules never share a listener.
"""

from __future__ import annotations

import contextlib
import io
import threading
from collections.abc import Iterator

from k3launch.planning.schema import load_schema
from k3launch.sim.cli import parse_serve
from k3launch.sim.engine import Engine
from k3launch.sim.logs import Logger
from k3launch.sim.options import Knobs
from k3launch.sim.server import App, SimHTTPServer, start


@contextlib.contextmanager
def sim_server(host: str, max_model_len: int = 64) -> Iterator[SimHTTPServer]:
    """A simulated engine's API server in this process, zero latency, serving "k3"; port: ``.server_address[1]``."""
    env = {"K3LAUNCH_SIM_TTFT_MS": "0", "K3LAUNCH_SIM_ITL_MS": "0"}
    knobs = Knobs.from_env(env)
    opts = parse_serve(
        load_schema(knobs.version), ["moonshotai/Kimi-K3", "--served-model-name", "k3", "--max-model-len", str(max_model_len)], env
    )
    log = Logger(stream=io.StringIO())
    httpd = start(host, 0, App(opts, Engine(opts, knobs, log, None), log, knobs.version))
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()
