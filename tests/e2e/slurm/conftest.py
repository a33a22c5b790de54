"""tests/e2e/slurm: end-to-end tests on the local Slurm cluster of fake-GPU nodes (markers ``e2e``,
``slurm``; root). Its fixtures (``slurm_cluster``, ``cluster``, ``state``, ``jobs``) are
tests/support/slurmcluster.py's, registered once for the session by the root conftest (the engine
tier uses them too); what the Slurm tests share beyond them is tests/support/slurmdeploy.py.
"""
