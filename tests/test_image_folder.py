"""ImageNet-style image folders (data=imagenet): the folder and archive layouts, decoding, unreadable images,
torchvision's reference-recipe transforms, and training on a folder. Part of the larger examples: a project made
with `examples=minimal` has neither this file nor data=imagenet."""

import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import (
    ROOT,
    as_rank,
    compose_config,
    predict,
    predictions,
    read_metrics,
    run_dirs,
    train,
)
from starter.data.image_files import load_image
from starter.data.imagenet import ImageFolderDataModule, imagenet_transforms
from starter.data.imagenet_archives import prepare as prepare_archives
from starter.errors import UserError
from starter.preflight import prepare

README = ROOT / "README.md"


@pytest.fixture
def image_folder(tmp_path: Path) -> Path:
    return make_image_folder(tmp_path)


def make_image_folder(tmp_path: Path) -> Path:
    """An ImageFolder tree of 3 classes, 6 train and 2 val JPEGs each, whose colour gives the class."""
    root = tmp_path / "images"
    colours = {"cat": (200, 30, 30), "dog": (30, 200, 30), "fox": (30, 30, 200)}
    rng = np.random.default_rng(0)
    for split, count in (("train", 6), ("val", 2)):
        for name, colour in colours.items():
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                pixels = np.clip(np.array(colour) + rng.integers(-20, 20, (40, 48, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.JPEG", quality=90)
    return root


def folder(root, **kw):
    args = dict(batch_size=6, num_workers=0, image_shape=[3, 32, 32], num_classes=3) | kw
    return ImageFolderDataModule(root=str(root), **args)


def test_image_folder_applies_imagenet_transforms(image_folder):
    dm = folder(image_folder)
    dm.setup()
    assert dm.train_set.classes == ["cat", "dog", "fox"] and len(dm.train_set) == 18 and len(dm.val_set) == 6
    x, y = next(iter(as_rank(dm, 1, 0).val_dataloader()))
    assert x.dtype == torch.uint8  # through the loader's queues as bytes
    x = dm.normalise(x)
    assert x.shape == (6, 3, 32, 32) and x.dtype == torch.float32
    # val is deterministic (resize + centre crop): the red class has a high normalised red channel
    assert float(x[y == 0][:, 0].mean()) > 1.0 and float(x[y == 0][:, 2].mean()) < -1.0
    x_train, _ = next(iter(as_rank(dm, 1, 0).train_dataloader()))
    assert x_train.shape == (6, 3, 32, 32)


def test_image_folder_missing_root_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="expects .*/train/<class>/"):
        folder(tmp_path / "missing").setup()


def test_image_folder_class_mismatch_names_the_classes(image_folder):
    (image_folder / "train" / "fox").rename(image_folder / "train" / "wolf")
    with pytest.raises(UserError, match=r"only in train \['wolf'\], only in val \['fox'\]"):
        folder(image_folder).setup()


def test_image_folder_class_count_must_match_config(image_folder):
    with pytest.raises(UserError, match="has 3 class folders but data.num_classes=1000; set data.num_classes=3"):
        folder(image_folder, num_classes=1000).setup()


def test_corrupt_image_error_names_the_file(image_folder):
    bad = image_folder / "val" / "dog" / "0.JPEG"
    bad.write_bytes(b"not a jpeg")
    dm = folder(image_folder)
    dm.setup()
    with pytest.raises(UserError, match=f"cannot read image {bad}"):
        list(as_rank(dm, 1, 0).val_dataloader())


def test_skip_unreadable_leaves_the_image_out_and_counts_it_across_worker_processes(image_folder):
    bad = image_folder / "val" / "dog" / "0.JPEG"
    bad.write_bytes(b"not a jpeg")
    dm = folder(image_folder, skip_unreadable=True, num_workers=2, batch_size=2)
    dm.setup()
    for _ in range(2):  # two epochs: counted once
        labels = torch.cat([y for _, y in as_rank(dm, 1, 0).val_dataloader()])
        assert labels.tolist() == [0, 0, 1, 2, 2]  # 6 images, dog 0 left out
    assert dm.unreadable_images() == [str(bad)]


def imagenet_archives(root, classes=("n01440764", "n01443537"), train_per_class=3, val_images=4):
    """ILSVRC2012 as downloaded, in miniature: the devkit (meta.mat with one non-leaf synset, validation
    ground truth), a train tar of one tar per class, a flat val tar; returns each validation image's wnid."""
    from scipy.io import savemat

    def jpeg(colour) -> bytes:
        buffer = io.BytesIO()
        Image.new("RGB", (40, 30), colour).save(buffer, "JPEG")
        return buffer.getvalue()

    def add(archive, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))

    root.mkdir(parents=True)
    fields = ["ILSVRC2012_ID", "WNID", "words", "gloss", "num_children"]
    synsets = np.array([(i + 1, wnid, f"class {wnid}", "", 0) for i, wnid in enumerate(classes)]
                       + [(len(classes) + 1, "n00000001", "an inner node", "", 2)],
                       dtype=[(f, object) for f in fields])  # fmt: skip
    meta = io.BytesIO()
    savemat(meta, {"synsets": synsets})
    truth = [1 + i % len(classes) for i in range(val_images)]
    with tarfile.open(root / "ILSVRC2012_devkit_t12.tar.gz", "w:gz") as devkit:
        add(devkit, "ILSVRC2012_devkit_t12/data/meta.mat", meta.getvalue())
        add(devkit, "ILSVRC2012_devkit_t12/data/ILSVRC2012_validation_ground_truth.txt",
            "".join(f"{t}\n" for t in truth).encode())  # fmt: skip
    with tarfile.open(root / "ILSVRC2012_img_train.tar", "w") as train:
        for c, wnid in enumerate(classes):
            inner = io.BytesIO()
            with tarfile.open(fileobj=inner, mode="w") as class_tar:
                for i in range(train_per_class):
                    add(class_tar, f"{wnid}_{i}.JPEG", jpeg((200 * c, 50, 50)))
            add(train, f"{wnid}.tar", inner.getvalue())
    with tarfile.open(root / "ILSVRC2012_img_val.tar", "w") as val:
        for i in range(val_images):
            add(val, f"ILSVRC2012_val_{i + 1:08d}.JPEG", jpeg((0, 0, 200)))
    return [classes[t - 1] for t in truth]


def test_imagenet_archives_are_refused_naming_the_command_that_prepares_them_once(tmp_path):
    root = tmp_path / "imagenet"
    val_wnids = imagenet_archives(root)
    with pytest.raises(UserError, match=f"holds ILSVRC2012_img_train.tar but no train/ folder; prepare it once with:"
                                        f" python -m starter.data.imagenet_archives {root}"):  # fmt: skip
        folder(root, num_classes=2).setup()
    proc = subprocess.run([sys.executable, "-m", "starter.data.imagenet_archives", str(root)], capture_output=True,
                          text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    dm = folder(root, num_classes=2)
    dm.setup()  # now an ImageFolder tree, as torchvision.datasets.ImageNet lays it out
    assert dm.train_set.classes == dm.val_set.classes == ["n01440764", "n01443537"] and len(dm.train_set) == 6
    by_name = sorted(dm.val_set.samples, key=lambda sample: Path(sample[0]).name)  # the devkit's order
    assert [dm.val_set.classes[label] for _, label in by_name] == val_wnids
    assert json.loads((root / "synset_names.json").read_text())["n01440764"] == "class n01440764"


def test_a_flat_imagenet_val_folder_is_sorted_into_classes_by_the_devkit(tmp_path):
    from starter.data.imagenet_archives import extract_train

    root = tmp_path / "imagenet"
    val_wnids = imagenet_archives(root)
    extract_train(root / "ILSVRC2012_img_train.tar", root / "train")  # a train/ tree of class folders
    with tarfile.open(root / "ILSVRC2012_img_val.tar") as archive:  # next to val/ extracted by hand, flat
        archive.extractall(root / "val", filter="data")
    with pytest.raises(UserError, match=f"{root / 'val'} holds images without class folders; prepare it once"):
        folder(root, num_classes=2).setup()
    prepare_archives(root)
    labelled = sorted((p.name, p.parent.name) for p in (root / "val").rglob("*.JPEG"))
    assert [wnid for _, wnid in labelled] == val_wnids


def test_images_decode_to_their_exact_pixels_by_torchvision_or_pil(tmp_path):
    pixels = np.random.default_rng(0).integers(0, 256, (6, 5, 3), dtype=np.uint8)
    for suffix in ("png", "bmp"):  # lossless: PNG decoded by torchvision, BMP (which it cannot read) by PIL
        Image.fromarray(pixels).save(tmp_path / f"x.{suffix}")
        decoded = load_image(str(tmp_path / f"x.{suffix}"))
        assert decoded.dtype == torch.uint8 and torch.equal(decoded, torch.from_numpy(pixels).permute(2, 0, 1))
    truncated = tmp_path / "t.jpg"
    Image.fromarray(pixels).save(tmp_path / "x.jpg")
    truncated.write_bytes((tmp_path / "x.jpg").read_bytes()[:200])
    with pytest.raises(UserError, match=f"cannot read image {truncated}: Image is incomplete or truncated"):
        load_image(str(truncated))


@pytest.mark.parametrize("policy", ["ta_wide", "ra", "imagenet"])
def test_auto_augment_and_random_erasing_keep_uint8_crops_of_the_train_crop_size(policy):
    transform = imagenet_transforms(True, 24, 36, 32, auto_augment=policy, random_erase=1.0)
    crop = transform(torch.randint(0, 256, (3, 40, 48), dtype=torch.uint8))
    assert crop.dtype == torch.uint8 and crop.shape == (3, 24, 24)
    assert imagenet_transforms(False, 24, 36, 32)(torch.zeros(3, 40, 48, dtype=torch.uint8)).shape == (3, 32, 32)
    with pytest.raises(UserError, match="data.auto_augment=autoaug: choose one of ta_wide, ra, imagenet"):
        imagenet_transforms(True, 24, 36, 32, auto_augment="autoaug")


def test_val_resize_defaults_to_256_224_of_the_val_crop(image_folder):
    dm = ImageFolderDataModule(str(image_folder), image_shape=[3, 32, 32], num_classes=3, train_crop_size=24)
    assert (dm.train_crop_size, dm.val_resize_size, dm.val_crop_size) == (24, 37, 32)


def test_the_class_count_is_read_from_the_folder_unless_given(image_folder, tmp_path):
    cfg = compose_config(["data=imagenet", f"data.root={image_folder}", "accelerator=cpu"], tmp_path)
    prepare(cfg)
    assert cfg.data.num_classes == 3 and cfg.model.num_classes == 3  # the model's follows the data's
    cfg = compose_config(["data=imagenet", f"data.root={tmp_path / 'none'}", "accelerator=cpu"], tmp_path)
    with pytest.raises(UserError, match="no directory .*none/train: data.num_classes is read from its class folders"):
        prepare(cfg)


FOLDER = [
    "data=imagenet",
    "data.image_shape=[3,32,32]",
    "data.num_classes=3",
    "data.num_workers=0",
    "data.batch_size=6",
]


@pytest.fixture(scope="module")
def folder_run(tmp_path_factory):
    """The small MLP trained on an image folder (3 classes of coloured images, 32x32 crops)."""
    tmp_path = tmp_path_factory.mktemp("folder")
    root = make_image_folder(tmp_path)
    train(tmp_path, *FOLDER, f"data.root={root}", "trainer.max_epochs=3")
    return root, run_dirs(tmp_path)[0]


@pytest.mark.parametrize("processes", [["strategy=auto"], ["strategy=ddp", "devices=2", "num_workers=1"]])
def test_predicting_a_folders_val_split_gives_the_runs_test_accuracy(folder_run, processes, tmp_path):
    root, run_dir = folder_run
    rows = predictions(predict(tmp_path, f"ckpt_path={run_dir}", f"inputs={root / 'val'}", *processes))
    assert [r["path"] for r in rows] == sorted(str(p) for p in (root / "val").rglob("*.JPEG"))
    right = sum(r["class"] == Path(r["path"]).parent.name for r in rows)
    assert right == round(read_metrics(run_dir)["test/acc"] * 6)  # val is the test split: the same 6 images


def test_a_grayscale_image_of_any_size_is_converted_and_resized_as_at_test_time(folder_run, tmp_path):
    root, run_dir = folder_run
    Image.fromarray(np.full((50, 70), 120, dtype=np.uint8)).save(tmp_path / "gray.png")
    (row,) = predictions(predict(tmp_path, f"ckpt_path={run_dir}", f"inputs={tmp_path / 'gray.png'}"))
    assert row["class"] in ("cat", "dog", "fox") and 0 < float(row["probability"]) <= 1


def test_image_folder_without_val_is_one_clear_error(image_folder, tmp_path):
    shutil.rmtree(image_folder / "val")
    proc = train(tmp_path, "data=imagenet", f"data.root={image_folder}", "data.num_classes=3", expect_ok=False)
    assert proc.returncode == 2 and f"error: no directory {image_folder / 'val'}" in proc.stderr


def test_corrupt_image_stops_the_run_naming_the_file(image_folder, tmp_path):
    bad = image_folder / "train" / "dog" / "3.JPEG"
    bad.write_bytes(b"not a jpeg")  # read in a DataLoader worker process: its error must still be one line
    proc = train(tmp_path, "data=imagenet", f"data.root={image_folder}", "data.image_shape=[3,32,32]",
                 "data.num_classes=3", "data.num_workers=2", "data.batch_size=6", expect_ok=False)  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: cannot read image {bad}: cannot identify")
    (run_dir,) = run_dirs(tmp_path)
    assert not (run_dir / "metrics.json").exists() and not list(run_dir.rglob("*.ckpt"))


def test_skip_unreadable_trains_past_a_corrupt_image_naming_and_counting_it(image_folder, tmp_path):
    bad = image_folder / "train" / "dog" / "3.JPEG"
    bad.write_bytes(b"not a jpeg")
    proc = train(tmp_path, "data=imagenet", f"data.root={image_folder}", "data.image_shape=[3,32,32]",
                 "data.num_classes=3", "data.num_workers=2", "data.batch_size=6", "data.skip_unreadable=true",
                 "trainer.max_epochs=2")  # fmt: skip
    out = proc.stdout + proc.stderr
    assert out.count(f"skipping it (data.skip_unreadable=true): cannot read image {bad}") == 1  # once, 2 epochs
    assert "1 unreadable image(s) skipped (data.skip_unreadable=true)" in out
    assert "test/acc" in read_metrics(run_dirs(tmp_path)[0])
