"""Where a shard set lives and what it holds, read without torch (the checks before launch read it): a local directory
or an `s3://bucket/prefix`, holding one litdata directory per split and `shards.json`, written last by make_shards.py,
so a set without it is not finished. S3 is reached with boto3 and the standard AWS variables (`AWS_ENDPOINT_URL` for
a server of one's own, plain HTTP included)."""

import json
from pathlib import Path

from starter.errors import UserError

DESCRIPTION = "shards.json"
SPLITS = ("train", "val", "test")
FORMAT = 2  # 2: each image's bytes in a uint8 tensor (1: Python bytes)


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
        raise UserError(f"data.source={source}: no finished shard set there (no {DESCRIPTION}); make one with"
                        f" python make_shards.py data=<digits | mnist | imagenet | yours> out={source}")  # fmt: skip
    description = json.loads(text)
    if description.get("format") != FORMAT:
        raise UserError(f"data.source={source}: a shard set of format {description.get('format')}; this starter"
                        f" reads format {FORMAT}: make it again with make_shards.py")  # fmt: skip
    return description
