"""Who starts the processes of a run: torch's elastic agent in train.py and our oversight of its workers, what the
environment (torchrun, SLURM, nodes) says, the run name."""
