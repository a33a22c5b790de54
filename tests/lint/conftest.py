"""tests/lint: the linters as tests (marker ``lint``): ruff, ``mypy --strict``, ``lint-imports``,
``mkdocs build --strict``. They need no infrastructure and belong to the fast tier
(``-m "not e2e"`` runs them); ``-m "not e2e and not lint"`` leaves them out.
"""
