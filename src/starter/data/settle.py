"""What the data config leaves to the data itself, read before anything starts: a shard set's image shape and class
count (its shards.json), an image folder's class count (its class folders), and whether the DataModule shards its
data itself (then `data.batch_size` is the global batch, shared equally over the data-parallel processes)."""

from pathlib import Path

from omegaconf import DictConfig, open_dict

from starter.declared import declared
from starter.errors import UserError


def settle_data(cfg: DictConfig) -> int | None:
    """Settle `cfg.data` in place; the global batch where the DataModule declares that it shards its data itself
    (`shards_itself = True`, as ShardedDataModule does: its share per process is checked with the layout). Any other
    is sharded as Lightning shards it (its DistributedSampler), with the batch size its DataLoaders give: None. Read
    off its class's source (declared.py); what the source does not say is decided by the class itself in each
    process (run.py), and checked there."""
    with open_dict(cfg):  # data=none, '~data': no DataModule, the module's own loaders (run.py)
        cfg.data = cfg.get("data") or {}
    settle_num_classes(cfg)
    if "source" in cfg.data:  # a shard set: its shards.json says what the config leaves out
        from starter.data.shard_set import settle_shards

        settle_shards(cfg)
    target = cfg.data.get("_target_")
    shards_itself = target is not None and declared(str(target), "shards_itself", key="data._target_")
    return cfg.data.batch_size if shards_itself else None


def settle_num_classes(cfg: DictConfig) -> None:
    """An image folder's class count, when the config leaves it out (null): its class folders under train/."""
    if cfg.data.get("num_classes", 0) is not None or "root" not in cfg.data:
        return
    train = Path(cfg.data.root) / "train"
    if not train.is_dir():
        raise UserError(
            f"no directory {train}: data.num_classes is read from its class folders; point data.root"
            " at a tree of <root>/train/<class>/* and <root>/val/<class>/*, or give"
            " data.num_classes"
        )
    cfg.data.num_classes = sum(1 for entry in train.iterdir() if entry.is_dir())
