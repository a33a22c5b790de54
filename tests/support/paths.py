"""Where the checkout and the suite's data are, for a test module in any tier folder.

The test modules sit one or two folders below ``tests/`` (``tests/fast``, ``tests/e2e/ssh``, ...);
the data they read stays in one place whatever folder a test moves to: goldens in
``tests/golden``, recorded logs in ``tests/data``, the infrastructure scripts and stand-in tools
in ``tests/infra``. Name them from here (``TESTS / "golden"``), never from a module's own
``__file__``.
"""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent  # the checkout: k3launch/, inventories/, recipes/, docs/
SUPPORT = TESTS / "support"  # these helper modules (on sys.path: tests import them by their bare names)
VLLM_DATA = ROOT / "k3launch" / "data" / "vllm"  # the vendored vLLM flag schemas, one directory per version
