"""tests/e2e/ssh: end-to-end tests over real OpenSSH hosts in network namespaces (markers ``e2e``,
``ssh``; root). The ``ssh_hosts`` fixture is tests/support/sshhosts.py's, registered once for the
session by the root conftest (the engine tier uses it too).
"""
