"""The sim's tokens: what it generates (text and token ids), and the ids of a prompt.

The sim has no tokenizer and no model. It answers every request with the same filler words, one
word per token, each choice starting one word further; a word's token id is fixed (the same
word always has the same id), so answers are deterministic as a greedy engine's are, and a
client that compares token ids (``return_token_ids``, as vLLM returns them) sees exactly what a
client comparing texts sees. Prompt ids are a stand-in tokenization (a word's CRC), with the
prompt's own ids for token-id prompts, so their count is the ``prompt_tokens`` the sim reports.

``corrupt``: the tokens of a decode whose KV cache was pulled over the P/D path under the
``corrupt-pd`` fault (:mod:`k3launch.sim.engine`): every token after the first is another filler
word — wrong output with a 200, the failure only a correctness canary catches.
"""

from __future__ import annotations

import zlib

FILLER = (
    " Kimi",
    " is",
    " a",
    " simulated",
    " mixture",
    " of",
    " experts",
    " answering",
    " with",
    " filler",
    " words",
    " while",
    " the",
    " real",
    " engine",
    " sleeps.",
)
OUTPUT_ID_BASE = 1000  # a filler word's id: base + its index; the bare first word (no space): base + len(FILLER) + index
PROMPT_VOCAB = 1000  # prompt words hash below the output ids
CHAT_TEMPLATE_IDS = (1, 2, 3)  # per message: the role markers a chat template adds (openai.CHAT_TEMPLATE_TOKENS of them)
CORRUPT_SHIFT = 7  # a corrupted token is this many filler words off (never 0 mod len(FILLER): always another word)


def token(i: int, choice: int, corrupt: bool = False) -> tuple[str, int]:
    """Token ``i`` of a choice: (text, id). Words keep their leading space except the very first."""
    k = (i + choice + (CORRUPT_SHIFT if corrupt and i > 0 else 0)) % len(FILLER)
    if i == 0:
        return FILLER[k].lstrip(), OUTPUT_ID_BASE + len(FILLER) + k
    return FILLER[k], OUTPUT_ID_BASE + k


def _word_ids(text: str) -> list[int]:
    return [zlib.crc32(w.encode()) % PROMPT_VOCAB for w in text.split()]


def prompt_ids(prompt: object) -> list[int]:
    """A completion prompt's ids, as many as ``openai`` counts (a batch: its first prompt)."""
    if isinstance(prompt, str):
        return _word_ids(prompt) or [0]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [int(t) for t in prompt]
        first = prompt[0]
        if isinstance(first, str):
            return _word_ids(first) or [0]
        if isinstance(first, list):
            return [int(t) for t in first if isinstance(t, int)]
    return []


def chat_ids(messages: object) -> list[int]:
    """A chat's ids: each message's template markers, then its words."""
    out: list[int] = []
    for m in messages if isinstance(messages, list) else []:
        content = m.get("content") if isinstance(m, dict) else None
        out += CHAT_TEMPLATE_IDS
        if isinstance(content, str):
            out += _word_ids(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict):
                    out += _word_ids(str(part.get("text", "")))
    return out
