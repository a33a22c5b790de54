"""tests/fast: the fast tier without the linters: unit, golden and property tests, fakes and
in-process servers, short-lived subprocesses; nothing that starts infrastructure or a long-lived
engine (no ``e2e`` marker). ``python -m pytest tests/fast`` (or ``-m "not e2e and not lint"``
anywhere) is the inner loop.

The fixtures of this folder live in the modules that use them (tests/conftest.py explains where a
fixture lives); none is shared by several modules here.
"""
