"""Who starts the processes of a run: our launcher, what the environment (torchrun, SLURM, nodes) says, the run name."""
