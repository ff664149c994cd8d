"""`data=shards data.source=<dir | s3://bucket/prefix>`: a shard set made by make_shards.py, trained as the data it
was made from. Its records are read by index (shard_records.py) and sharded, ordered and resumed as every data set
here (data/base.py): the same split, the same order at any number of processes, the same decoding, so a set trains
to the weights its source gives, and a resume at another number of processes sees each remaining sample once.
A set made from an image folder gets torchvision's recipe as data=imagenet does (its keys here too); one made from
images held in memory (digits, MNIST) is used as it is, as there."""

from starter.data.imagenet import ImageFolderDataModule
from starter.data.shard_records import ShardRecords
from starter.data.shard_set import describe, join


class ShardsDataModule(ImageFolderDataModule):
    def __init__(self, source: str, cache_dir: str | None = None, max_cache_size: str | None = None, **kwargs):
        super().__init__(root=source, **kwargs)
        self.source, self.cache_dir, self.max_cache_size = str(source), cache_dir, max_cache_size
        self.description = described = describe(self.source)
        self._check_shape(self.source, tuple(described["image_shape"]), int(described["num_classes"]))
        self.classes, self.value_range = list(described["classes"]), float(described["value_range"])
        self.mean, self.std = tuple(described["mean"]), tuple(described["std"])
        if described["recipe"] != "imagenet":
            self.eval_resize = self.eval_crop = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        splits = self.description["splits"]
        self.train_set, self.val_set = self._split("train", splits["train"]), self._split("val", splits["val"])
        self.test_set = self.val_set if splits["test"] == "val" else self._split("test", splits["test"])

    def recipe(self, train: bool):
        return super().recipe(train) if self.description["recipe"] == "imagenet" else None  # else used as it is

    def _split(self, split: str, length: int) -> ShardRecords:
        mode = "RGB" if self.image_shape[0] == 3 else "L"
        on_host = self.decode == "cpu"  # else records go out encoded, decoded on the device
        return ShardRecords(
            join(self.source, split),
            length,
            mode if on_host else "encoded",
            self.recipe(split == "train") if on_host else None,
            self.cache_dir,
            self.max_cache_size,
        )

    def unreadable_images(self) -> list[str]:
        return []  # a bad record stops the run, naming its shard and index
