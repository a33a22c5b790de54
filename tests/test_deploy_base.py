"""The shared lifecycle pieces of deploy.base: how a dead engine's own error line reaches the failure."""

from __future__ import annotations

import pytest

from k3launch.deploy.base import error_line

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
