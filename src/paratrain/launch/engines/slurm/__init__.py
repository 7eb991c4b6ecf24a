"""The slurm engine."""
