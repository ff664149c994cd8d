"""A sharded checkpoint (fsdp, tp, pp: a directory of `.metadata`, shard files and meta.pt) read as data only.
torch.distributed.checkpoint unpickles `.metadata` with plain `pickle.load` and non-tensor entries with
`torch.load(weights_only=False)`: a directory from someone else would run what it names. Here `.metadata` is unpickled
with an allowlist of torch's checkpoint metadata classes, every shard it points at is a plain file name of the
directory, and non-tensor entries load weights-only; anything else is refused in one line naming the file."""

import io
import pickle
import re
from pathlib import Path

from starter.errors import UserError, first_line
from starter.untrusted import MALFORMED

METADATA = ".metadata"
SHARD_NAME = re.compile(r"__\d+_\d+\.distcp")  # what torch's FileSystemWriter names each rank's file
# the classes a `.metadata` that torch wrote holds (torch.dtype values are allowed besides, by type)
ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
}  # fmt: skip


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        import torch

        if name in ALLOWED.get(module, ()) or module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which is no checkpoint metadata")


def read_metadata(directory: Path):
    """The checkpoint's Metadata, unpickled through the allowlist and checked to point only at its own shard files."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(directory) / METADATA
    try:
        with open(path, "rb") as file:
            metadata = _MetadataUnpickler(file).load()
    except FileNotFoundError:
        raise UserError(f"{path}: missing; a sharded checkpoint holds one (use one this starter saved)") from None
    except Exception as err:  # the allowlist's refusal, or no pickle at all
        raise UserError(f"{path}: refused, not a checkpoint's metadata ({err}); loading it could run code") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise UserError(f"{path}: refused, it holds {type(metadata).__name__}, not a checkpoint's metadata")
    for info in metadata.storage_data.values():
        shard = getattr(info, "relative_path", info)  # a str, exactly: a Path's text need not be the path it joins as
        if not isinstance(info, _StorageInfo) or type(shard) is not str or not SHARD_NAME.fullmatch(shard):
            where = repr(shard) if type(shard) is str else f"a {type(shard).__name__}"
            raise UserError(f"{path}: refused, it points at {where}, not a shard file of its directory")
        if info.transform_descriptors:
            raise UserError(f"{path}: refused, its shards are transformed ({info.transform_descriptors})")
    return metadata


def read_sharded(state: dict, directory: Path) -> None:
    """torch.distributed.checkpoint.load(state, directory) through the checks above. The metadata is read and checked
    here, where a refusal is the UserError itself (torch folds a reader's error into an AssertionError or its report
    from every rank), and what torch's load reads is that very object: the file is unpickled once."""
    from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader, load

    metadata = read_metadata(directory)

    class DataOnlyReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            from torch.distributed.checkpoint.metadata import StorageMeta

            if metadata.storage_meta is None:  # as FileSystemReader.read_metadata does
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class WeightsOnlyPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            import torch

            try:
                torch.load(value, weights_only=True)  # refuses pickled objects besides tensors and plain values
            except pickle.UnpicklingError as err:
                entry = read_item.dest_index.fqn
                raise UserError(f"{directory}: refused, {entry} holds a pickled object ({first_line(err)})") from None
            value.seek(0)
            super().load_bytes(read_item, value)

    try:
        load(state, storage_reader=DataOnlyReader(directory), planner=WeightsOnlyPlanner())
    except CheckpointException as err:  # a refusal, or what a malformed file broke: the first, as it is
        refusals = [failure[0] for failure in err.failures.values() if isinstance(failure[0], (UserError, *MALFORMED))]
        if refusals:
            raise refusals[0] from None
        raise
