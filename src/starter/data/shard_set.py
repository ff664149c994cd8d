"""Where a shard set lives and what it holds, read without torch (the checks before launch read it): a local directory
or an `s3://bucket/prefix`, holding one litdata directory per split and `shards.json`, written last by make_shards.py,
so a set without it is not finished. S3 is reached with boto3 and the standard AWS variables (`AWS_ENDPOINT_URL` for
a server of one's own, plain HTTP included)."""

import importlib.util
import json
import re
from pathlib import Path

from starter.errors import UserError
from starter.untrusted import check_image_record, reading

DESCRIPTION = "shards.json"
SPLITS = ("train", "val", "test")
FORMAT = 2  # 2: each image's bytes in a uint8 tensor (1: Python bytes)
INDEX = "index.json"  # litdata's description of a split: how its records are serialized, its chunk files
# what make_shards.py's records are to litdata: {"index": int, "image": uint8 tensor (dtype 11), "label": int}
RECORD_FORMAT = ["int", "no_header_tensor:11", "int"]
RECORD_KEYS = ["index", "image", "label"]
CHUNK_NAME = re.compile(r"chunk-\d+-\d+\.bin")  # litdata's name of each chunk file, beside index.json


def is_remote(source: str) -> bool:
    return "://" in str(source)


def join(source: str, *names: str) -> str:
    return "/".join([str(source).rstrip("/"), *names])


def bucket_and_key(url: str) -> tuple[str, str]:
    scheme, _, rest = url.partition("://")
    if scheme != "s3":
        raise UserError(f"{url}: a shard set lives in a directory or under s3://bucket/prefix, not {scheme}://")
    bucket, _, key = rest.partition("/")
    return bucket, key


def s3_client():
    import boto3

    return boto3.client("s3")  # AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ... as every AWS tool reads them


def read_text(url: str) -> str | None:
    """The text of a file of a shard set, or None where there is none. A store that refuses (credentials, a missing
    bucket, no server at the endpoint) is one line naming the source."""
    if not is_remote(url):
        path = Path(url)
        return path.read_text() if path.is_file() else None
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, key = bucket_and_key(url)
    try:
        return s3_client().get_object(Bucket=bucket, Key=key)["Body"].read().decode()
    except ClientError as err:
        if err.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
            return None
        raise UserError(f"{url}: {err.response.get('Error', {}).get('Message') or err}") from err
    except BotoCoreError as err:
        raise UserError(f"{url}: {err}") from err


def describe(source: str) -> dict:
    """The finished shard set's description: split sizes, image shape, classes, normalisation, recipe."""
    text = read_text(join(source, DESCRIPTION))
    if text is None:
        raise UserError(
            f"data.source={source}: no finished shard set there (no {DESCRIPTION}); make one with"
            f" python make_shards.py data=<digits | mnist | imagenet | yours> out={source}"
        )
    with reading(join(source, DESCRIPTION), "data.source", "description"):
        description = json.loads(text)
        if description.get("format") != FORMAT:
            raise UserError(
                f"data.source={source}: a shard set of format {description.get('format')}; this starter"
                f" reads format {FORMAT}: make it again with make_shards.py"
            )
        for split in SPLITS:
            if (size := description["splits"][split]) != "val" or split != "test":  # test may be val
                records = check_index(join(source, split, INDEX))
                if not (type(size) is int and 0 < size <= records):
                    raise ValueError(f"its {split} split of {size!r} records, where its index holds {records}")
    check_image_record(description, f"data.source={join(source, DESCRIPTION)}")
    return description


def check_index(url: str, text: str | None = None) -> int:
    """A split's index.json (`text`, else read at `url`) as make_shards.py writes it, or one line naming it: records
    of the format make_shards.py writes (litdata would unpickle a `pickle` field, run a `file` one, ...), uncompressed
    and unencrypted, chunks named as litdata names them (a name is joined into a path of the cache)."""
    text = read_text(url) if text is None else text
    if text is None:
        raise UserError(f"{url}: missing; the shard set is not whole: make it again with make_shards.py")
    with reading(url, "data.source", "index"):
        index = json.loads(text)
        config, chunks = index["config"], index["chunks"]
        spec = json.loads(config["data_spec"])[1]
        keys = json.loads(spec["context"]) if spec.get("type") == "builtins.dict" else None
        chunk_names = [chunk["filename"] for chunk in chunks]
        sizes = [chunk["chunk_size"] for chunk in chunks]
    if config.get("data_format") != RECORD_FORMAT or keys != RECORD_KEYS:
        theirs, ours = dict(zip(keys or [], config.get("data_format") or [])), dict(zip(RECORD_KEYS, RECORD_FORMAT))
        raise UserError(f"{url}: refused, its records are {theirs}; this starter reads make_shards.py's ({ours})")
    if any(config.get(key) for key in ("compression", "encryption")) or config.get("item_loader") != "PyTreeLoader":
        raise UserError(f"{url}: refused, its chunks are compressed, encrypted or for another loader than ours")
    if bad := [name for name in chunk_names if not (isinstance(name, str) and CHUNK_NAME.fullmatch(name))]:
        raise UserError(f"{url}: refused, it names a chunk {bad[0]!r}: a chunk is a file beside it (chunk-<n>-<m>.bin)")
    if not all(isinstance(size, int) and size > 0 for size in sizes):
        raise UserError(f"{url}: refused, its chunk sizes are not counts of records")
    return sum(sizes)


def settle_shards(cfg) -> None:
    """A shard set's image shape and class count, when the config leaves them out (null): its shards.json."""
    if importlib.util.find_spec("litdata") is None:
        raise UserError("data=shards needs litdata: pip install -e '.[shards]'")
    described = describe(cfg.data.source)
    for key in ("image_shape", "num_classes"):
        if cfg.data.get(key) is None:
            cfg.data[key] = described[key]
