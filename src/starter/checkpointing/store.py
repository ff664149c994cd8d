"""`checkpoint_store=s3://bucket/prefix` (or gs://, az://): a run's checkpoints and record kept in an object store
beside its run directory, so that a job rescheduled onto a fresh machine continues from them (`ckpt_path=auto`).

The run writes its files locally as always; a thread of rank 0 uploads each checkpoint once it is saved (the step
never waits on the network), under a name of its own (`checkpoints/<file>.versions/<step>-<token>`), then points
`checkpoints/<file>.json` at it in one PUT. A sharded checkpoint (fsdp, tp, pp: a directory of one file per rank) is
uploaded by every rank, each its own files (so nodes that share no disk each send theirs), with a list of them
(`part-<rank>.json`); rank 0 points at the version once every rank's list is there, naming each file's size and
sha256. A checkpoint counts as written only once all of it is there: a kill or a stop mid-upload leaves the previous
one named. Once pointed away from, what this run uploaded before is deleted; nothing else is (the checkpoint the run
resumed from, another run's, anything outside the prefix). What the store
holds is read as any file of someone else's: the pointer supplies values only (an object inside the prefix, a size,
a sha256), the object is checked against both and then loaded weights-only, as a local checkpoint is. `run/config.json`
records the config (as nodes compare theirs: launch/nodes.meeting_config): a prefix holding another config's run is
refused. Credentials come from the store's standard chain, never written (checkpointing/buckets.py: AWS's, an
endpoint of one's own from AWS_ENDPOINT_URL; Google's default credentials; Azure's variables)."""

import hashlib
import json
import logging
import re
import secrets
import shutil
import tempfile
import threading
import time
from pathlib import Path

from starter.atomic_write import replacing
from starter.errors import UserError, first_line

log = logging.getLogger(__name__)

UPLOADED = ("last.ckpt", "best.ckpt", "model.pt")  # under checkpoints/, pointed at
RECORD = ("config.yaml", "metrics.csv", "metrics.json")  # the run's record, under run/
OBJECT = re.compile(r"checkpoints/(last\.ckpt|best\.ckpt|model\.pt)\.versions/[0-9]+-[0-9a-f]{16}")
SHARD = re.compile(r"__([0-9]+)_[0-9]+\.distcp|\.metadata|meta\.pt")  # a sharded checkpoint's: DCP's, meta.pt
PART_WAIT_S = 300.0  # how long rank 0 waits for the other ranks' parts of a sharded checkpoint before giving it up


class CheckpointStore:
    def __init__(self, url: str):
        from starter.checkpointing.buckets import SCHEMES

        scheme, _, rest = url.partition("://")
        if scheme not in SCHEMES:
            raise UserError(
                f"checkpoint_store={url}: give s3://bucket/prefix (AWS, or an S3-compatible store through"
                " AWS_ENDPOINT_URL), gs://bucket/prefix (Google Cloud Storage) or az://container/prefix (Azure Blob)"
            )
        self.bucket, _, prefix = rest.partition("/")
        if not self.bucket:
            raise UserError(f"checkpoint_store={url}: name a bucket, {scheme}://bucket/prefix")
        self.url, self.prefix = url, prefix.strip("/")
        self.objects = SCHEMES[scheme](self.bucket, url)

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def said(self, err: Exception, what: str) -> UserError:
        """One line for what the store answered: unreachable, credentials."""
        return UserError(f"checkpoint_store={self.url}: {what}: {self.objects.why(err)}")

    def check(self, config: str) -> None:
        """Before training: the store answers, these credentials may read and write the bucket, and the prefix holds
        no run of another config (else this run's config is recorded there)."""
        try:
            if not self.objects.exists():
                raise UserError(
                    f"checkpoint_store={self.url}: no {self.objects.kind} {self.bucket} at {self.objects.where}; create"
                    " it, or name another"
                )
            recorded = self.read(self.key("run/config.json"), limit=1 << 20)
            if recorded is None:
                self.objects.put(self.key("run/config.json"), config.encode())
        except self.objects.errors as err:
            raise self.said(err, "cannot reach it") from None
        if recorded is not None and recorded != config.encode():
            from starter.config_choices import differences, leaves

            try:
                theirs, ours = leaves(json.loads(recorded)), leaves(json.loads(config))
            except (ValueError, AttributeError):
                theirs, ours = {"(unreadable)": 1}, {}
            shown = differences(ours, theirs, "there")
            raise UserError(
                f"checkpoint_store={self.url} holds a run of another config: {shown}; give this run a prefix of its"
                " own, or the config that run had"
            )

    def read(self, key: str, limit: int) -> bytes | None:
        """An object's bytes (None where there is none), at most `limit` of them."""
        got = self.objects.get(key)
        if got is None:
            return None
        size, chunks = got
        if size > limit:
            raise UserError(f"{self.url}: {key} is {size} bytes, not a record of this starter")
        return b"".join(chunks)

    def pointed(self, name: str) -> dict | None:
        """What `checkpoints/<name>.json` names, checked as values (None: no such): {"object", "size", "sha256"} for a
        file, {"object", "files": {file: {"size", "sha256"}}} for a sharded checkpoint (files under `object`/)."""
        text = self.read(self.key(f"checkpoints/{name}.json"), limit=1 << 20)
        if text is None:
            return None
        try:
            pointer = json.loads(text)
            object_ = pointer["object"]
            valid = isinstance(object_, str) and OBJECT.fullmatch(object_) and object_.startswith(f"checkpoints/{name}")
            if "files" in pointer:
                files = {file: digest_of(entry) for file, entry in pointer["files"].items()}
                valid = valid and {".metadata", "meta.pt"} <= files.keys() and None not in map(owner, files)
                valid = valid and all(files.values())
                pointer = {"object": object_, "files": files}
            else:
                entry = digest_of(pointer)
                valid = valid and entry is not None
                pointer = {"object": object_, **(entry or {})}
        except (ValueError, KeyError, TypeError, AttributeError):
            valid = False
        if not valid:
            raise UserError(f"{self.url}/checkpoints/{name}.json is no pointer this starter writes; refused")
        return pointer

    def fetch(self, name: str, path: Path) -> bool:
        """The checkpoint `checkpoints/<name>.json` names, into `path` once each file's size and sha256 are what the
        pointer says (a file there replaced in one rename; a sharded one written to a new directory that `path` then
        points at, as a local save does); False where the store has none."""
        from starter.checkpointing.sharded import point_atomically

        try:
            pointer = self.pointed(name)
            if pointer is None:
                return False
            path.parent.mkdir(parents=True, exist_ok=True)
            if "files" not in pointer:
                self.download(pointer["object"], path, pointer)
                return True
            version = f"{path.name}.{pointer['object'].rsplit('-', 1)[1]}"
            try:
                for file, expected in pointer["files"].items():
                    self.download(f"{pointer['object']}/{file}", path.parent / version / file, expected)
            except BaseException:
                shutil.rmtree(path.parent / version, ignore_errors=True)
                raise
            point_atomically(path, version)
        except self.objects.errors as err:
            raise self.said(err, f"cannot fetch its {name}") from None
        return True

    def download(self, object_: str, path: Path, expected: dict) -> None:
        """`object_` into `path` (replaced in one rename) once its size and sha256 are `expected`'s."""
        digest, size = hashlib.sha256(), 0
        got = self.objects.get(self.key(object_))
        if got is None:
            raise UserError(f"{self.url}/{object_}, which its pointer names, is not there: nothing was loaded from it")
        with replacing(path, "wb") as file:
            for chunk in got[1]:
                digest.update(chunk)
                size += len(chunk)
                if size > expected["size"]:
                    break
                file.write(chunk)
            if (size, digest.hexdigest()) != (expected["size"], expected["sha256"]):
                raise UserError(
                    f"{self.url}/{object_} is not the checkpoint its pointer names (its size or sha256 differs):"
                    " spoiled or replaced; nothing was loaded from it"
                )


def digest_of(entry) -> dict | None:
    """A file's entry in a pointer or a part list as values, {"size": a count of bytes, "sha256": 64 hex digits}; None
    where it is not one."""
    size, digest = entry["size"], entry["sha256"]
    valid = type(size) is int and size >= 0 and isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)
    return {"size": size, "sha256": digest} if valid else None


def owner(file: str) -> int | None:
    """The rank whose file of a sharded checkpoint `file` is (rank 0's: DCP's metadata and meta.pt); None where it is
    none of a sharded checkpoint's files."""
    match = SHARD.fullmatch(file)
    return None if match is None else int(match[1] or 0)


class Hashing:
    """A file read once, front to back, as it is uploaded: its size and sha256 counted on the way (no `seek`: an
    uploader reads it as a stream, and keeps what it resends)."""

    def __init__(self, file):
        self.file, self.digest, self.size = file, hashlib.sha256(), 0

    def read(self, size: int = -1) -> bytes:
        chunk = self.file.read(size)
        self.digest.update(chunk)
        self.size += len(chunk)
        return chunk

    def entry(self) -> dict:
        return {"size": self.size, "sha256": self.digest.hexdigest()}


class Uploads:
    """A process's uploads, one at a time in a thread of their own: a newer save of a file replaces an older one still
    waiting. Rank 0 uploads whole files and the record; every rank its own files of a sharded checkpoint. `flush`
    waits for what is queued."""

    def __init__(self, store: CheckpointStore, rank: int = 0, world: int = 1):
        self.store, self.rank, self.world = store, rank, world
        self.waiting: dict[str, tuple[Path, int]] = {}  # key under the prefix -> (local file, its step), in order
        self.ours: dict[str, list[str]] = {}  # a pointed name -> the objects this run uploaded for it
        self.condition = threading.Condition()
        self.busy = False
        self.failing: dict[str, str] = {}  # key -> why its newest upload failed (a later one that succeeds clears it)
        self.thread = threading.Thread(target=self._run, name="checkpoint-store", daemon=True)
        self.thread.start()

    @property
    def failed(self) -> str | None:
        """Why the newest upload of each name that failed did; None where the store holds the newest of every one."""
        return "; ".join(self.failing.values()) or None

    def put(self, path: Path, step: int = 0) -> None:
        """Upload the run's file `path` (a checkpoint of UPLOADED saved at global step `step`, or a record of RECORD)
        as it is when its turn comes: rank 0's, where the whole file is."""
        name = path.name
        # not a sharded checkpoint's name (a link; or none yet while its shards are written): each rank's put_shards
        if self.rank == 0 and path.is_file() and not path.is_symlink():
            self._queue(f"checkpoints/{name}" if name in UPLOADED else f"run/{name}", path, step)

    def put_shards(self, directory: Path, name: str, step: int) -> None:
        """This rank's files of the sharded checkpoint `directory` (saved as `name`, UPLOADED, at `step`), once they
        are written (strategies/model_parallel.py tells)."""
        if name in UPLOADED:
            self._queue(f"checkpoints/{name}", directory, step)

    def _queue(self, key: str, path: Path, step: int) -> None:
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
            log.warning("checkpoint_store: an upload failed (the store keeps the version before): %s", self.failed)
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
                if path.is_dir():
                    self._upload_shards(key, path, step)
                else:
                    self._upload(key, path, step)
            except Exception as err:  # the run goes on: its local files are whole; said at the flush
                self.failing[key] = f"{key}: {first_line(err)}"
                log.warning("checkpoint_store: uploading %s failed: %s", key, first_line(err))
            else:
                self.failing.pop(key, None)
            finally:
                with self.condition:
                    self.busy = False
                    self.condition.notify_all()

    def _upload(self, key: str, path: Path, step: int) -> None:
        store = self.store
        with open(path, "rb") as file:  # this version, whatever replaces the file meanwhile
            if not key.startswith("checkpoints/"):
                store.objects.put(store.key(key), file)
                return
            name, read = f"{key}.versions/{step:09d}-{secrets.token_hex(8)}", Hashing(file)
            store.objects.put(store.key(name), read)
        self._point(key, {"object": name, **read.entry()}, [name])

    def _upload_shards(self, key: str, directory: Path, step: int) -> None:
        """This rank's files of `directory`, then the list of them; rank 0 then points at the version once every
        rank's list is there."""
        store = self.store
        mine = [f for f in directory.iterdir() if owner(f.name) == self.rank]
        # opened before anything is sent: a later save deletes this version's directory, never what is open here
        files = {f.name: open(f, "rb") for f in mine}
        token = hashlib.sha256(directory.name.encode()).hexdigest()[:16]  # the same on every rank
        name = f"{key}.versions/{step:09d}-{token}"
        listed = {}
        try:
            for file_name, file in files.items():
                read = Hashing(file)
                store.objects.put(store.key(f"{name}/{file_name}"), read)
                listed[file_name] = read.entry()
        finally:
            for file in files.values():
                file.close()
        store.objects.put(store.key(f"{name}/part-{self.rank}.json"), json.dumps(listed).encode())
        if self.rank != 0:
            return
        every = self._parts(key, name)
        if every is not None:
            objects = [f"{name}/{f}" for f in every] + [f"{name}/part-{r}.json" for r in range(self.world)]
            self._point(key, {"object": name, "files": every}, objects)

    def _parts(self, key: str, name: str) -> dict | None:
        """Every rank's files of the sharded version `name`, once each rank's list is in the store (checked as values);
        None where a newer save of `key` is waiting first, or PART_WAIT_S pass (that version is given up)."""
        every, deadline = {}, time.monotonic() + PART_WAIT_S
        for rank in range(self.world):
            while (text := self.store.read(self.store.key(f"{name}/part-{rank}.json"), limit=1 << 20)) is None:
                with self.condition:
                    superseded = key in self.waiting
                if superseded or time.monotonic() > deadline:
                    why = "a newer save came first" if superseded else f"rank {rank}'s part did not come"
                    log.warning("checkpoint_store: %s given up (%s); the store keeps the one before", name, why)
                    return None
                time.sleep(0.2)
            listed = json.loads(text)
            for file, entry in listed.items():
                every[file] = digest_of(entry)
                if owner(file) != rank or every[file] is None:
                    raise UserError(f"{self.store.url}/{name}/part-{rank}.json names {file!r}: not rank {rank}'s")
        return every

    def _point(self, key: str, pointer: dict, objects: list[str]) -> None:
        """`key`.json at `pointer` in one PUT; then what this run uploaded for the version before, deleted."""
        store = self.store
        store.objects.put(store.key(f"{key}.json"), json.dumps(pointer).encode())
        for before in self.ours.get(key, []):
            store.objects.delete(store.key(before))
        self.ours[key] = objects


def fetch_for_resume(store: CheckpointStore, checkpoints: Path) -> bool:
    """`ckpt_path=auto` on a machine whose run directory has no last.ckpt: the store's last.ckpt and best.ckpt
    there (best.ckpt: so the best so far is the uninterrupted run's), and the run's config.yaml beside them where
    there is none (what a continued run checks against: the strategy of a sharded checkpoint, the data split), read
    as any run's is. Whether the store had a last.ckpt."""
    if not store.fetch("last.ckpt", checkpoints / "last.ckpt"):
        return False
    store.fetch("best.ckpt", checkpoints / "best.ckpt")
    try:
        config = store.read(store.key("run/config.yaml"), limit=1 << 20)
    except store.objects.errors as err:
        raise store.said(err, "cannot fetch its run/config.yaml") from None
    if config is not None and not (checkpoints.parent / "config.yaml").exists():
        with replacing(checkpoints.parent / "config.yaml", "wb") as file:
            file.write(config)
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
