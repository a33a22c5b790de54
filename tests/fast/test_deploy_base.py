"""The shared lifecycle pieces of deploy.base: how a dead engine's own error line reaches the failure."""

from __future__ import annotations

import pytest

from k3launch.models.reports import error_line

# what vLLM 0.32.0 (CPU build) printed last, quoted from real runs
VLLM_MAX_MODEL_LEN = """(APIServer pid=9) INFO 12-01 15:06:22 [model.py:733] Resolved architecture: LlamaForCausalLM
Traceback (most recent call last):
pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
  Value error, User-specified max_model_len (100000) is greater than the derived max_model_len (max_position_embeddings=2048.0)
    For further information visit https://errors.pydantic.dev/2.14/v/value_error
"""
VLLM_UNKNOWN_FLAG = "usage: vllm [-h] [-v]\nvllm: error: unrecognized arguments: --no-such-flag\n"
VLLM_ENGINE_DEAD = ("(APIServer pid=1) ERROR 12-01 15:21:51 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: "
                    "EngineCore encountered an issue. See stack trace (above) for the root cause.\nINFO:     Shutting down\n")


@pytest.mark.parametrize(("tail", "said"), [
    (VLLM_MAX_MODEL_LEN, "Value error, User-specified max_model_len (100000) is greater than the derived max_model_len"),
    (VLLM_UNKNOWN_FLAG, "vllm: error: unrecognized arguments: --no-such-flag"),
    (VLLM_ENGINE_DEAD, "EngineDeadError: EngineCore encountered an issue"),
])
def test_the_engines_own_error_line_is_found(tail: str, said: str) -> None:
    line = error_line(tail)
    assert line is not None and said in line and len(line) <= 300


def test_no_error_line_in_a_clean_tail() -> None:
    assert error_line("(APIServer pid=1) INFO [launcher.py:186] Available routes are:\nINFO:     Application startup complete.\n") is None
    assert error_line("x" * 10 + " ValueError: " + "y" * 400).endswith("...")  # type: ignore[union-attr]


def test_a_node_lost_while_the_completion_is_in_flight_fails_at_the_next_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    """The readiness completion may take a minute; the nodes are still polled meanwhile, so a
    node that stops answering then fails `up` at once instead of after the request's timeout."""
    import threading
    from dataclasses import dataclass, field

    from k3launch.deploy import base
    from k3launch.models.plan import Process
    from k3launch.transport import http

    in_flight = threading.Event()
    polled_meanwhile = threading.Event()

    def slow_completion(endpoint: str, model: str, max_tokens: int = 8, timeout: float = 60.0) -> http.Completion:
        in_flight.set()
        polled_meanwhile.wait(5)  # without concurrent polls: 5 s, then a good answer
        return http.Completion(True, "ok", 8, "x", 5.0)

    monkeypatch.setattr(http, "completion", slow_completion)
    monkeypatch.setattr(http, "probe_all", lambda todo: dict.fromkeys(todo, True))
    head = Process.model_construct(id="serve-0", node="n1", role="serve", address="127.0.0.1", http_port=8000)

    @dataclass
    class FakeLaunch:
        polls: int = 0
        stages: list[str] = field(default_factory=list)

        def poll(self, stage: object) -> base.Progress:
            self.polls += 1
            if in_flight.is_set():
                polled_meanwhile.set()
                raise base.LaunchFailed("n1: connection lost: keepalives unanswered for 2s", "check the node", code="unreachable")
            return base.Progress(running=True, serving=[head], endpoint="http://127.0.0.1:8000")

        def poll_interval(self, elapsed_s: float) -> float:
            return 0.05

        @property
        def plan(self) -> object:
            return type("P", (), {"model": "m", "processes": [head]})()

        @property
        def on_stage(self):  # type: ignore[no-untyped-def]
            return lambda stage, msg: self.stages.append(str(stage))

    launch = FakeLaunch()
    with pytest.raises(base.LaunchFailed) as exc:
        base.wait_ready(launch, 60)  # type: ignore[arg-type]
    assert exc.value.code == "unreachable" and launch.polls >= 2
