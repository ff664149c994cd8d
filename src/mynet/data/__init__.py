"""This project's data modules, one a file, on the engine's ShardedDataModule (starter/data/base.py: global batch,
identical sharding, exact resume)."""
