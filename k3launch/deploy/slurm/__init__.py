"""The Slurm backend: one sbatch job per deployment, job arrays, the in-task runner."""
