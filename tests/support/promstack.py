"""A real Prometheus and Alertmanager on loopback, and a webhook that records what Alertmanager sends.

Debian's ``prometheus`` and ``prometheus-alertmanager`` (``.ci/run`` installs them), each on a
free port with its data in a directory of the test's own; Prometheus scrapes every second and
evaluates the rules every second, Alertmanager sends each group at once and again on every
change (``send_resolved``). ``skip_or_fail`` skips a test without them, unless
``K3LAUNCH_TEST_PROMETHEUS_REQUIRED=1``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from simproc import free_port

PROMETHEUS, ALERTMANAGER = shutil.which("prometheus"), shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")


def skip_or_fail() -> None:
    if PROMETHEUS and ALERTMANAGER:
        return
    why = "Prometheus and Alertmanager are not installed (apt install prometheus prometheus-alertmanager)"
    if os.environ.get("K3LAUNCH_TEST_PROMETHEUS_REQUIRED") == "1":
        pytest.fail(why, pytrace=False)
    pytest.skip(why)


class Webhook:
    """Alertmanager's webhook receiver: every notification, with when it arrived."""

    def __init__(self) -> None:
        self.got: list[tuple[float, dict[str, Any]]] = []
        lock = self.lock = threading.Lock()
        got = self.got

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with lock:
                    got.append((time.time(), json.loads(body)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def alerts(self) -> list[tuple[float, dict[str, Any]]]:
        """(arrival, alert) for every alert of every notification so far."""
        with self.lock:
            return [(t, a) for t, n in self.got for a in n.get("alerts", [])]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Stack:
    def __init__(self, root: Path, scrape: str, rules: str) -> None:
        """``scrape``: the ``scrape_configs`` YAML k3launch printed; ``rules``: its rule file."""
        assert PROMETHEUS and ALERTMANAGER
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.webhook = Webhook()
        self.am_port, self.prom_port = free_port(), free_port()
        (root / "am.yml").write_text(yaml.safe_dump({
            "route": {"receiver": "hook", "group_by": ["alertname", "deployment", "process"], "group_wait": "0s",
                      "group_interval": "1s", "repeat_interval": "1h"},
            "receivers": [{"name": "hook", "webhook_configs": [{"url": self.webhook.url, "send_resolved": True}]}],
        }))
        (root / "rules.yml").write_text(rules)
        conf = yaml.safe_load(scrape)
        conf["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"}
        for job in conf["scrape_configs"]:
            job["scrape_interval"], job["scrape_timeout"] = "1s", "1s"
        conf["rule_files"] = [str(root / "rules.yml")]
        conf["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{self.am_port}"]}]}]}
        (root / "prometheus.yml").write_text(yaml.safe_dump(conf))
        self.procs: list[subprocess.Popen[bytes]] = []
        self._start([ALERTMANAGER, f"--config.file={root / 'am.yml'}", f"--storage.path={root / 'am-data'}",
                     f"--web.listen-address=127.0.0.1:{self.am_port}", "--cluster.listen-address="], "alertmanager")
        self._start([PROMETHEUS, f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'tsdb'}",
                     f"--web.listen-address=127.0.0.1:{self.prom_port}", "--rules.alert.resend-delay=1s"], "prometheus")
        self.wait(lambda: self._ready(self.prom_port) and self._ready(self.am_port), 60, "Prometheus and Alertmanager ready")

    def _start(self, argv: list[str], name: str) -> None:
        log = open(self.root / f"{name}.log", "wb")  # kept open for the process's life
        self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True))

    @staticmethod
    def _ready(port: int) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def api(self, path: str) -> Any:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.prom_port}/api/v1/{path}", timeout=5) as r:
            return json.loads(r.read())["data"]

    def targets(self) -> list[dict[str, Any]]:
        return list(self.api("targets")["activeTargets"])

    def alerts(self, name: str | None = None) -> list[dict[str, Any]]:
        return [a for a in self.api("alerts")["alerts"] if name is None or a["labels"]["alertname"] == name]

    def wait(self, cond: Callable[[], Any], within: float, what: str) -> Any:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            got = cond()
            if got:
                return got
            time.sleep(0.25)
        logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in sorted(self.root.glob("*.log")))
        raise AssertionError(f"not within {within:g}s: {what}\n{logs}")

    def close(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        self.webhook.close()
