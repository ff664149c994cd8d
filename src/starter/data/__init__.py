"""One LightningDataModule per file; all share base.ShardedDataModule (global batch, identical sharding)."""
