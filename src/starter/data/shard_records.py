"""One split of a shard set as a map-style data set: record i is read through litdata's StreamingDataset (opened in
the process that reads it: a loader worker, or this one), its image bytes decoded as the folder path decodes a file
(decode_image_data). torch, torchvision and litdata only: loader workers unpickle it in a fork server without
Lightning."""

from functools import cache

from torch.utils.data import Dataset

from starter.data.device_decode import collate_encoded
from starter.data.image_files import decode_image_data
from starter.data.shard_set import RECORD_FORMAT, is_remote
from starter.errors import UserError, causes, first_line


class ShardRecords(Dataset):
    """Record i: (image, label); `mode` RGB or L decodes the image (then `transform`), `encoded` keeps its bytes (a
    1-D uint8 tensor, for decoding on the device: data.decode=gpu)."""

    def __init__(
        self,
        url: str,
        length: int,
        mode: str,
        transform=None,
        cache_dir: str | None = None,
        max_cache_size: str | None = None,
    ):
        self.url, self.length, self.mode, self.transform = url, int(length), mode, transform
        self.cache_dir, self.max_cache_size = cache_dir, max_cache_size
        self.collate_fn = collate_encoded if mode == "encoded" else None
        self._records = None

    def __len__(self) -> int:
        return self.length

    def __getstate__(self):
        return {**self.__dict__, "_records": None}  # each process opens its own reader

    def records(self):
        if self._records is None:
            from litdata import StreamingDataset

            from starter.data.object_store import use_plain_http_endpoints

            use_plain_http_endpoints()
            options = {"cache_dir": self.cache_dir, "max_cache_size": self.max_cache_size}
            options = {name: value for name, value in options.items() if value is not None}  # else litdata's own
            # read by global index: its own sharding (its len() and slices are a rank's share under a process group)
            # unused. A remote record is read with its chunk, kept in the cache (one download of each chunk a node
            # while the cache holds it), not alone: litdata's on_demand_bytes, settable once its cache exists, is
            # set before it does (litdata is pinned; tests/test_shards.py counts the downloads). A local set's
            # chunks are memory-mapped: one record is deserialized a read (batch_decode=0), not a window of its
            # neighbours, which a random order does not read next (0.011 ms a record, not 0.084). A cached remote
            # chunk is a file litdata reads whole to read one record that way: its window is cheaper there.
            decode = {"batch_decode": 0} if not is_remote(self.url) else {}
            self._records = StreamingDataset(self.url, serializers=record_serializers(), **decode, **options)
            self._records._on_demand_bytes = False
        return self._records

    def __getitem__(self, index: int):
        try:
            record = self._read(index)
        except UserError:  # the index refused where it was read (object_store.py)
            raise
        except RefusedField:
            raise UserError(f"{self.url}: record {index} refused, a field of another kind than ours") from None
        except Exception as err:
            if (reason := unreadable(err)) is None:
                raise  # not the data's fault: a bug, with its traceback
            raise UserError(f"cannot read record {index} of {self.url}: {reason}") from err
        if record.get("index") != index:
            raise UserError(
                f"{self.url}: record {index} holds sample {record.get('index')}; the shard set is out of"
                " order: make it again with make_shards.py"
            )
        if self.mode == "encoded":
            return record["image"].clone(), record["label"]  # litdata's tensor is a view of the chunk it read
        try:
            image = decode_image_data(record["image"], self.mode)
        except ValueError as err:
            raise UserError(f"cannot decode record {index} of {self.url} ({chunk_of(self.url, index)}): {err}") from err
        return (self.transform(image) if self.transform else image), record["label"]

    def _read(self, index: int, tries: int = 3) -> dict:
        """Record `index`. A capped cache (max_cache_size) can evict a chunk between its download and its read, when
        records are read out of chunk order as here, and a remote chunk whose download failed is missing from the
        cache (the store killed mid-epoch: a FileNotFoundError in 1 of 4 suite runs, not the fetch's own error): the
        read then starts again with a reader of its own, which fetches again (the old one's prefetch thread idles
        until the process ends). Seen once in a 20-step run capped at a sixth of its set."""
        for _ in range(tries - 1):
            try:
                return self.records()[index]
            except FileNotFoundError:
                if self.max_cache_size is None and not is_remote(self.url):
                    raise
                self._records = None
        return self.records()[index]


class RefusedField(Exception):
    """A record field that make_shards.py does not write, left unread."""


@cache
def record_serializers() -> dict:
    """litdata's serializers for reading, each refusing but those of make_shards.py's records (shard_set.RECORD_FORMAT):
    a record field of another kind is never deserialized (a `pickle` field would run what it names), whatever the
    index said when it was checked. litdata is pinned: its table of serializers is read by name."""
    from litdata.streaming.serializers import _SERIALIZERS, Serializer

    class Refused(Serializer):
        def serialize(self, item):
            raise TypeError("make_shards.py writes these records")

        def deserialize(self, data):
            raise RefusedField

        def can_serialize(self, item) -> bool:
            return False

    used = {data_format.split(":")[0] for data_format in RECORD_FORMAT}
    return {name: serializer if name in used else Refused() for name, serializer in _SERIALIZERS.items()}


def chunk_of(url: str, index: int) -> str:
    """The chunk file holding record `index` (read from the split's index.json: only when naming a bad record)."""
    import json

    from starter.data.shard_set import join, read_text

    try:
        chunks = json.loads(read_text(join(url, "index.json")) or "{}").get("chunks", [])
    except Exception:  # naming the chunk is a courtesy; the record's index is named anyway
        return "chunk unknown"
    for chunk in chunks:
        if index < chunk["chunk_size"]:
            return chunk["filename"]
        index -= chunk["chunk_size"]
    return "past the last chunk"


def unreadable(err: Exception) -> str | None:
    """Why a record could not be read, where its data is the cause: a chunk the store did not give (after the store
    client's own retries; litdata's reader wraps it), or a file or connection that failed (an OSError); else None."""
    from starter.data.object_store import ChunkUnreadable

    chain = causes(err)
    if chunk := next((c for c in chain if isinstance(c, ChunkUnreadable)), None):
        return str(chunk)
    return first_line(err) if any(isinstance(c, OSError) for c in chain) else None
