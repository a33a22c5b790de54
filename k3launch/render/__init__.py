"""Pure string builders: node launch scripts, shell snippets run on nodes, sbatch scripts."""
