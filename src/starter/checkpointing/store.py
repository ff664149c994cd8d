"""`checkpoint_store=s3://bucket/prefix`: a run's checkpoints and record kept in an object store beside its run
directory, so that a job rescheduled onto a fresh machine continues from them (`ckpt_path=auto`).

The run writes its files locally as always; a thread of rank 0 uploads each checkpoint once it is saved (the step
never waits on the network), under a name of its own (`checkpoints/<file>.versions/<step>-<token>`), then points
`checkpoints/<file>.json` at it in one PUT. A checkpoint counts as written only once all of it is there: a kill or a
stop mid-upload leaves the previous one named. Once pointed away from, what this process uploaded before is deleted;
nothing else is (the checkpoint the run resumed from, another run's, anything outside the prefix). What the store
holds is read as any file of someone else's: the pointer supplies values only (an object inside the prefix, a size,
a sha256), the object is checked against both and then loaded weights-only, as a local checkpoint is. `run/config.json`
records the config (as nodes compare theirs: launch/nodes.meeting_config): a prefix holding another config's run is
refused. Credentials come from the standard AWS chain (AWS_* variables, ~/.aws, an instance role), never written; an
endpoint of one's own from AWS_ENDPOINT_URL."""

import hashlib
import json
import logging
import re
import secrets
import tempfile
import threading
import time
from pathlib import Path

from starter.atomic_write import replacing
from starter.errors import UserError, first_line

log = logging.getLogger(__name__)

UPLOADED = ("last.ckpt", "best.ckpt", "model.pt")  # under checkpoints/, pointed at
RECORD = ("config.yaml", "metrics.csv", "metrics.json")  # the run's record, under run/
REFUSED = ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch")  # the store's "not you"
OBJECT = re.compile(r"checkpoints/(last\.ckpt|best\.ckpt|model\.pt)\.versions/[0-9]+-[0-9a-f]{16}")


class CheckpointStore:
    def __init__(self, url: str):
        scheme, _, rest = url.partition("://")
        if scheme != "s3":
            raise UserError(
                f"checkpoint_store={url}: give s3://bucket/prefix (AWS, or an S3-compatible store through"
                " AWS_ENDPOINT_URL); gs:// and az:// are not supported yet"
            )
        self.bucket, _, prefix = rest.partition("/")
        if not self.bucket:
            raise UserError(f"checkpoint_store={url}: name a bucket, s3://bucket/prefix")
        self.url, self.prefix = url, prefix.strip("/")
        try:
            import boto3
        except ImportError:
            raise UserError(f"checkpoint_store={url} needs boto3: pip install -e '.[store]'") from None
        self.client = boto3.session.Session().client("s3")  # the environment as it is now

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def said(self, err: Exception, what: str) -> UserError:
        """One line for what the store answered: unreachable, credentials, a bucket that does not exist."""
        from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

        where = self.client.meta.endpoint_url
        if isinstance(err, EndpointConnectionError):
            why = f"its endpoint {where} does not answer; check AWS_ENDPOINT_URL and the network"
        elif isinstance(err, NoCredentialsError):
            why = "no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, an instance role)"
        elif isinstance(err, ClientError) and err.response["Error"]["Code"] in ("NoSuchBucket", "404"):
            why = f"no bucket {self.bucket} at {where}; create it, or name another"
        elif isinstance(err, ClientError) and err.response["Error"]["Code"] in REFUSED:
            why = f"{where} refuses these credentials ({err.response['Error']['Code']}); check AWS_ACCESS_KEY_ID"
        else:
            why = first_line(err)
        return UserError(f"checkpoint_store={self.url}: {what}: {why}")

    def check(self, config: str) -> None:
        """Before training: the store answers, these credentials may read and write the bucket, and the prefix holds
        no run of another config (else this run's config is recorded there)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.head_bucket(Bucket=self.bucket)
            recorded = self.read(self.key("run/config.json"), limit=1 << 20)
            if recorded is None:
                self.client.put_object(Bucket=self.bucket, Key=self.key("run/config.json"), Body=config.encode())
        except (BotoCoreError, ClientError) as err:
            raise self.said(err, "cannot reach it") from None
        if recorded is not None and recorded != config.encode():
            from starter.config_choices import leaves

            try:
                theirs, ours = leaves(json.loads(recorded)), leaves(json.loads(config))
            except (ValueError, AttributeError):
                theirs, ours = {"(unreadable)": 1}, {}
            differ = sorted(k for k in theirs.keys() | ours.keys() if theirs.get(k, "-") != ours.get(k, "-"))
            shown = ", ".join(f"{k}={ours.get(k, '(none)')} (there: {theirs.get(k, '(none)')})" for k in differ[:3])
            raise UserError(
                f"checkpoint_store={self.url} holds a run of another config: {shown}; give this run a prefix of its"
                " own, or the config that run had"
            )

    def read(self, key: str, limit: int) -> bytes | None:
        """An object's bytes (None where there is none), at most `limit` of them."""
        from botocore.exceptions import ClientError

        try:
            answer = self.client.get_object(Bucket=self.bucket, Key=key)
        except ClientError as err:
            if err.response["Error"]["Code"] in ("NoSuchKey", "404"):
                return None
            raise
        if answer["ContentLength"] > limit:
            raise UserError(f"{self.url}: {key} is {answer['ContentLength']} bytes, not a record of this starter")
        return answer["Body"].read()

    def pointed(self, name: str) -> dict | None:
        """What `checkpoints/<name>.json` names: {"object", "size", "sha256"}, checked as values (None: no such)."""
        text = self.read(self.key(f"checkpoints/{name}.json"), limit=4096)
        if text is None:
            return None
        try:
            pointer = json.loads(text)
            object_, size, digest = pointer["object"], pointer["size"], pointer["sha256"]
            valid = (
                isinstance(object_, str)
                and OBJECT.fullmatch(object_)
                and object_.startswith(f"checkpoints/{name}.")
                and type(size) is int
                and size >= 0
                and isinstance(digest, str)
                and re.fullmatch(r"[0-9a-f]{64}", digest)
            )
        except (ValueError, KeyError, TypeError):
            valid = False
        if not valid:
            raise UserError(f"{self.url}/checkpoints/{name}.json is no pointer this starter writes; refused")
        return {"object": object_, "size": size, "sha256": digest}

    def fetch(self, name: str, path: Path) -> bool:
        """The checkpoint `checkpoints/<name>.json` names, into `path` once its size and sha256 are what the pointer
        says (a file there replaced in one rename); False where the store has none."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            pointer = self.pointed(name)
            if pointer is None:
                return False
            path.parent.mkdir(parents=True, exist_ok=True)
            digest, size = hashlib.sha256(), 0
            with replacing(path, "wb") as file:
                body = self.client.get_object(Bucket=self.bucket, Key=self.key(pointer["object"]))["Body"]
                for chunk in body.iter_chunks(1 << 20):
                    digest.update(chunk)
                    size += len(chunk)
                    if size > pointer["size"]:
                        break
                    file.write(chunk)
                if (size, digest.hexdigest()) != (pointer["size"], pointer["sha256"]):
                    raise UserError(
                        f"{self.url}/{pointer['object']} is not the checkpoint its pointer names (its size or sha256"
                        " differs): spoiled or replaced; nothing was loaded from it"
                    )
        except (BotoCoreError, ClientError) as err:
            raise self.said(err, f"cannot fetch its {name}") from None
        return True


class Uploads:
    """Rank 0's uploads, one at a time in a thread of their own: a newer save of a file replaces an older one still
    waiting. `flush` waits for what is queued."""

    def __init__(self, store: CheckpointStore):
        self.store = store
        self.waiting: dict[str, tuple[Path, int]] = {}  # key under the prefix -> (local file, its step), in order
        self.ours: dict[str, str] = {}  # a pointed file -> the object this process uploaded for it
        self.condition = threading.Condition()
        self.busy = False
        self.failed: str | None = None
        self.thread = threading.Thread(target=self._run, name="checkpoint-store", daemon=True)
        self.thread.start()

    def put(self, path: Path, step: int = 0) -> None:
        """Upload the run's file `path` (a checkpoint of UPLOADED saved at global step `step`, or a record of RECORD)
        as it is when its turn comes."""
        name = path.name
        key = f"checkpoints/{name}" if name in UPLOADED else f"run/{name}"
        with self.condition:
            self.waiting.pop(key, None)
            self.waiting[key] = (path, step)
            self.condition.notify_all()

    def put_record(self, run_dir: Path) -> None:
        """The run's record (RECORD) as it is now."""
        for name in RECORD:
            if (run_dir / name).is_file():
                self.put(run_dir / name)

    def flush(self, timeout: float | None = None) -> bool:
        """Until every queued upload is done (True), or `timeout` seconds (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.condition:
            while self.waiting or self.busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.condition.wait(left)
        if self.failed:
            log.warning("checkpoint_store: an upload failed: %s", self.failed)
        return True

    def _run(self) -> None:
        while True:
            with self.condition:
                while not self.waiting:
                    self.condition.wait()
                key = next(iter(self.waiting))
                path, step = self.waiting.pop(key)
                self.busy = True
            try:
                self._upload(key, path, step)
            except Exception as err:  # the run goes on: its local files are whole; said at the flush
                self.failed = f"{key}: {first_line(err)}"
                log.warning("checkpoint_store: uploading %s failed: %s", key, first_line(err))
            finally:
                with self.condition:
                    self.busy = False
                    self.condition.notify_all()

    def _upload(self, key: str, path: Path, step: int) -> None:
        store = self.store
        with open(path, "rb") as file:  # this version, whatever replaces the file meanwhile
            if not key.startswith("checkpoints/"):
                store.client.upload_fileobj(file, store.bucket, store.key(key))
                return
            digest, size = hashlib.sha256(), 0
            while chunk := file.read(1 << 20):
                digest.update(chunk)
                size += len(chunk)
            file.seek(0)
            name = f"{key}.versions/{step:09d}-{secrets.token_hex(8)}"
            store.client.upload_fileobj(file, store.bucket, store.key(name))
        pointer = json.dumps({"object": name, "size": size, "sha256": digest.hexdigest()})
        store.client.put_object(Bucket=store.bucket, Key=store.key(f"{key}.json"), Body=pointer.encode())
        if (before := self.ours.get(key)) is not None:
            store.client.delete_object(Bucket=store.bucket, Key=store.key(before))
        self.ours[key] = name


def fetch_for_resume(store: CheckpointStore, checkpoints: Path) -> bool:
    """`ckpt_path=auto` on a machine whose run directory has no last.ckpt: the store's last.ckpt and best.ckpt
    there (best.ckpt: so the best so far is the uninterrupted run's). Whether the store had a last.ckpt."""
    if not store.fetch("last.ckpt", checkpoints / "last.ckpt"):
        return False
    store.fetch("best.ckpt", checkpoints / "best.ckpt")
    log.info("ckpt_path=auto: %s/checkpoints/last.ckpt fetched into %s", store.url, checkpoints)
    return True


def fetched_for_reading(url: str) -> Path:
    """predict.py, export.py, `train=false`: the checkpoint a store's prefix holds (best.ckpt, else model.pt, else
    last.ckpt), fetched into a temporary folder of this process (removed as it exits)."""
    import atexit
    import shutil

    store = CheckpointStore(url)
    folder = Path(tempfile.mkdtemp(prefix="checkpoint-store-"))
    atexit.register(shutil.rmtree, folder, True)
    for name in ("best.ckpt", "model.pt", "last.ckpt"):
        if store.fetch(name, folder / name):
            return folder / name
    raise UserError(f"{url}: no checkpoint there (checkpoints/best.ckpt.json, model.pt.json, last.ckpt.json)")
