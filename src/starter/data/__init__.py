"""The engine's data: the ShardedDataModule every data module of a project can build on (base.py), image folders,
shard sets on a disk or an object store, decoding on the device, and what is settled before launch."""
