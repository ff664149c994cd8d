"""make_shards.py: a data set's train/val/test splits written once as litdata shards (a directory or an S3 prefix),
each record the image as it was encoded (a file's bytes untouched; an in-memory uint8 image as PNG, lossless) held
in a 1-D uint8 tensor, its label and its index, in the split's order. (As a tensor, litdata reads one record by its
offset; as bytes, it would store the rows as an Arrow table and convert a batch of up to 256 rows to read one,
0.5 ms a record at random for 60 KB images.) shards.json, written last, says what training needs: class names,
normalisation, image shape, recipe. A local set is written under `<out>.partial` and renamed into place when whole;
a remote one is whole once shards.json is there. A finished set is never written twice."""

import json
import os
import shutil
import threading
from functools import partial
from pathlib import Path

from omegaconf import DictConfig

from starter.config_schema import check_given
from starter.data.shard_set import DESCRIPTION, FORMAT, SPLITS, bucket_and_key, is_remote, join, read_text, s3_client
from starter.errors import USER_ERROR_EXIT_CODE, UserError, to_stderr


class FileRecords:
    """Record i of an image folder's split: its file's bytes (checked to decode, where asked) and label. A file that
    cannot be read is flagged in shared memory (the writer's workers are forked) and written as one byte: the set is
    then never finished, and this process names the files."""

    def __init__(self, samples: list[tuple[str, int]], mode: str, check: bool):
        import torch

        self.samples, self.mode, self.check = samples, mode, check
        self.unreadable = torch.zeros(len(samples), dtype=torch.bool).share_memory_()

    def __call__(self, index: int) -> dict:
        import torch

        from starter.data.image_files import load_image

        path, label = self.samples[index]
        try:
            if self.check:
                load_image(path, self.mode)
            data = Path(path).read_bytes()
        except (UserError, OSError):
            self.unreadable[index], data = True, b"\0"  # a placeholder (litdata refuses an empty field)
        return {"index": index, "image": torch.frombuffer(bytearray(data), dtype=torch.uint8), "label": int(label)}

    def check_all_read(self) -> None:
        from starter.data.image_files import load_image

        bad = [self.samples[int(i)][0] for i in self.unreadable.nonzero()]
        if bad:
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            try:
                load_image(bad[0], self.mode)
                reason = f"cannot read image {bad[0]}"
            except (UserError, OSError) as err:
                reason = str(err)
            raise UserError(f"{reason}{more}: fix or remove it; no shard set was made")


class TensorRecords:
    """Record i of an in-memory split: its uint8 image as PNG and its label."""

    def __init__(self, images, labels):
        self.images, self.labels = images, labels

    def __call__(self, index: int) -> dict:
        from torchvision.io import encode_png

        image = encode_png(self.images[index % len(self.images)])
        return {"index": index, "image": image, "label": int(self.labels[index])}


class Counted:
    """records(i), each one marked made in memory that the writer's forked workers share: the progress bar's count
    (litdata's own bar moves only as a whole worker finishes)."""

    def __init__(self, records, count: int):
        import torch

        self.records, self.made = records, torch.zeros(count, dtype=torch.bool).share_memory_()

    def __call__(self, index: int) -> dict:
        record = self.records(index)
        self.made[index] = True
        return record

    def shown_while(self, write, name: str) -> None:
        from tqdm import tqdm

        done = threading.Event()

        def show() -> None:
            with tqdm(total=len(self.made), desc=name, unit=" records", dynamic_ncols=True) as bar:
                while not done.wait(0.5):
                    bar.update(int(self.made.sum()) - bar.n)
                bar.update(int(self.made.sum()) - bar.n)

        shower = threading.Thread(target=show, daemon=True)
        shower.start()
        try:
            write()
        finally:
            done.set()
            shower.join()


def records_of(dataset, mode: str, check: bool):
    if hasattr(dataset, "samples"):  # torchvision's ImageFolder and those built like it
        return FileRecords([(str(p), int(y)) for p, y in dataset.samples], mode, check), "imagenet"
    if hasattr(dataset, "images") and hasattr(dataset, "labels"):  # data/in_memory.py's TensorPairs
        return TensorRecords(dataset.images, dataset.labels), "as_is"
    raise UserError(
        f"make_shards.py reads splits that are image folders (.samples) or uint8 tensors (.images,"
        f" .labels); {type(dataset).__name__} is neither: write its records with litdata.optimize"
        " (docs/data.md)"
    )


def make_shards(cfg: DictConfig) -> str:
    from hydra.utils import instantiate

    from starter.data.settle import settle_num_classes

    out = str(cfg.out).rstrip("/")
    if read_text(join(out, DESCRIPTION)) is not None:
        return f"{out} already holds a finished shard set ({DESCRIPTION}): nothing written; remove it to write it again"
    if not is_remote(out) and Path(out).exists():
        raise UserError(f"out={out} exists and is no finished shard set: name a new directory (or remove it)")
    settle_num_classes(cfg)  # an image folder's, from its class folders, as train.py reads it
    datamodule = instantiate(cfg.data)
    datamodule.prepare_data()
    datamodule.setup("fit")
    staging = out if is_remote(out) else f"{out}.partial"
    if not is_remote(out):
        shutil.rmtree(staging, ignore_errors=True)  # what an interrupted run left
    try:
        sizes, recipe = _write_splits(datamodule, cfg, staging, out)
    except BaseException:  # an interrupted or refused set leaves nothing behind here (a remote one: no shards.json)
        if not is_remote(out):
            shutil.rmtree(staging, ignore_errors=True)
        raise
    description = {
        "format": FORMAT,
        "splits": sizes,
        "image_shape": list(datamodule.image_shape),
        "num_classes": int(datamodule.num_classes),
        "classes": list(datamodule.classes),
        "value_range": float(datamodule.value_range),
        "mean": list(datamodule.mean),
        "std": list(datamodule.std),
        "recipe": recipe,
        "made_from": str(cfg.data._target_),
        "seed": int(cfg.seed),
    }
    _write_last(staging, out, json.dumps(description, indent=1))
    return f"shards of {sizes} records -> {out}; train from them: python train.py data=shards data.source={out}"


def _write_splits(datamodule, cfg: DictConfig, staging: str, out: str) -> tuple[dict, str]:
    from litdata import optimize

    from starter.data.object_store import use_plain_http_endpoints

    use_plain_http_endpoints()
    mode = "RGB" if datamodule.image_shape[0] == 3 else "L"
    sizes, recipes = {}, set()
    for split in SPLITS:
        dataset = getattr(datamodule, f"{split}_set")
        if split == "test" and dataset is datamodule.val_set:  # an image folder's val is also its test split
            sizes[split] = "val"
            continue
        records, recipe = records_of(dataset, mode, bool(cfg.check_images))
        recipes.add(recipe)
        print(f"{split}: {len(dataset)} records -> {join(out, split)}", flush=True)
        counted = Counted(records, len(dataset))
        write = partial(
            optimize,
            fn=counted,
            inputs=list(range(len(dataset))),
            output_dir=join(staging, split),
            chunk_bytes=cfg.chunk_bytes,
            num_workers=int(cfg.num_workers),
            keep_data_ordered=True,
            reorder_files=False,
            mode="overwrite" if is_remote(out) else None,
            start_method="fork",  # the workers start with what is imported here (spawn: 4x the time for digits)
            verbose=False,  # its lines say what the bar and the line above say
        )
        counted.shown_while(write, split)
        if isinstance(records, FileRecords):
            records.check_all_read()
        sizes[split] = len(dataset)
    return sizes, recipes.pop()


def _write_last(staging: str, out: str, description: str) -> None:
    if is_remote(out):
        bucket, key = bucket_and_key(join(out, DESCRIPTION))
        s3_client().put_object(Bucket=bucket, Key=key, Body=description.encode())
        return
    Path(staging, DESCRIPTION).write_text(description)
    if Path(out).exists():
        raise UserError(f"{out} appeared while the shards were written; they are in {staging}")
    os.replace(staging, out)


def run(cfg: DictConfig) -> None:
    try:
        check_given(cfg)
        print(make_shards(cfg), flush=True)
    except UserError as err:
        to_stderr(f"error: {err}")
        raise SystemExit(USER_ERROR_EXIT_CODE) from None
