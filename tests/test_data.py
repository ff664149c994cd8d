"""Each DataModule against small data written here; sharding and batch-size semantics."""

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from starter.data.digits import DigitsDataModule
from starter.data.imagenet import ImageFolderDataModule
from starter.data.mnist import MNISTDataModule
from starter.data.synthetic import SyntheticDataModule
from starter.errors import UserError

DIGITS = dict(image_shape=[1, 8, 8], num_classes=10)


def as_rank(datamodule, world: int, rank: int):
    strategy = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": world, "rank": rank})
    datamodule.trainer = SimpleNamespace(world_size=world, global_rank=rank, strategy=strategy)
    return datamodule


def batches(loader, epoch: int = 0):
    sampler = loader.batch_sampler.sampler
    sampler.set_epoch(epoch)  # what Lightning's fit loop does each epoch
    return list(loader)


def test_digits_split_is_deterministic_disjoint_and_normalised():
    first, second = DigitsDataModule(seed=3, **DIGITS), DigitsDataModule(seed=3, **DIGITS)
    first.setup(), second.setup()
    sizes = [len(s) for s in (first.train_set, first.val_set, first.test_set)]
    assert sizes == [1257, 269, 271] and sum(sizes) == 1797
    assert torch.equal(first.test_set.images, second.test_set.images) and first.test_set.images.dtype == torch.uint8
    train = first.normalise(first.train_set.images)  # on the device, after the transfer
    assert abs(float(train.mean())) < 1e-5 and abs(float(train.std()) - 1) < 1e-4
    other = DigitsDataModule(seed=4, **DIGITS)
    other.setup()
    assert not torch.equal(first.test_set.labels, other.test_set.labels)


def test_two_ranks_together_load_exactly_the_single_process_global_batches():
    single, ranks = (
        DigitsDataModule(batch_size=64, **DIGITS),
        [DigitsDataModule(batch_size=64, **DIGITS) for _ in range(2)],
    )
    for dm in (single, *ranks):
        dm.setup()
    for epoch in (0, 1):
        full = batches(as_rank(single, 1, 0).train_dataloader(), epoch)
        shards = [batches(as_rank(dm, 2, r).train_dataloader(), epoch) for r, dm in enumerate(ranks)]
        assert len(full) == len(shards[0]) == len(shards[1]) == 1257 // 64
        for step, (x, _) in enumerate(full):
            assert x.shape == (64, 1, 8, 8) and shards[0][step][0].shape == (32, 1, 8, 8)
            together = torch.cat([shards[0][step][0], shards[1][step][0]])
            assert sorted(map(tuple, together.flatten(1).tolist())) == sorted(map(tuple, x.flatten(1).tolist()))
    first_epoch, second_epoch = (batches(single.train_dataloader(), e)[0][1] for e in (0, 1))
    assert not torch.equal(first_epoch, second_epoch)  # reshuffled each epoch


def test_evaluation_shards_cover_an_odd_split_exactly_once():
    dm = DigitsDataModule(batch_size=64, **DIGITS)
    dm.setup()
    assert len(dm.test_set) % 2 == 1
    seen = [y for r in range(2) for _, y in as_rank(dm, 2, r).test_dataloader()]
    assert sum(len(y) for y in seen) == len(dm.test_set)
    assert torch.equal(torch.cat(seen).sort().values, dm.test_set.labels.sort().values)


def test_global_batch_that_does_not_divide_is_refused():
    dm = as_rank(DigitsDataModule(batch_size=63, **DIGITS), 2, 0)
    dm.setup()
    with pytest.raises(UserError, match="data.batch_size=63 is the global batch and does not divide by the 2"):
        dm.train_dataloader()


def test_shape_mismatch_with_config_is_a_clear_error():
    with pytest.raises(UserError, match=r"digits has images of shape \[1, 8, 8\].*data.image_shape=\[1, 28, 28\]"):
        DigitsDataModule(image_shape=[1, 28, 28], num_classes=10).setup()


def mnist(data_dir, **kw):
    return MNISTDataModule(data_dir=str(data_dir), image_shape=[1, 28, 28], num_classes=10, **kw)


def test_mnist_is_read_from_idx_files_into_normalised_tensors(mnist_dir):
    dm = mnist(mnist_dir, download=False, val_size=40, batch_size=20)
    dm.prepare_data()
    dm.setup()
    assert [len(s) for s in (dm.train_set, dm.val_set, dm.test_set)] == [160, 40, 50]
    images = dm.train_set.images
    assert images.dtype == torch.uint8 and images.shape == (160, 1, 28, 28)  # a quarter of float32's bytes
    x, y = next(iter(as_rank(dm, 1, 0).train_dataloader()))
    x = dm.normalise(x)  # what on_after_batch_transfer does on the device
    assert x.shape == (20, 1, 28, 28) and x.dtype == torch.float32 and y.dtype == torch.long
    assert abs(float(x.max()) - (1 - 0.1307) / 0.3081) < 1e-5  # (255/255 - mean) / std


def test_missing_mnist_names_the_directory_and_the_files(tmp_path):
    with pytest.raises(UserError) as err:
        mnist(tmp_path / "nowhere", download=False).prepare_data()
    message = str(err.value)
    assert str(tmp_path / "nowhere" / "MNIST" / "raw") in message and "train-images-idx3-ubyte" in message


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


def test_loaders_pin_host_memory_exactly_when_batches_go_to_a_gpu():
    # a copy from pageable memory waits for the GPU's queued work: pinned memory lets the step run ahead
    def loader_of_process_on(device: str):
        dm = SyntheticDataModule(batch_size=8, image_shape=[3, 8, 8], num_classes=4, train_size=16, eval_size=8)
        dm.trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device(device)))
        dm.setup()
        return dm.train_dataloader()

    assert loader_of_process_on("cuda").pin_memory and not loader_of_process_on("cpu").pin_memory


def test_synthetic_data_is_imagenet_shaped_and_repeatable():
    dm = SyntheticDataModule(batch_size=4, train_size=8, eval_size=4, image_shape=[3, 224, 224], num_classes=1000)
    dm.setup()
    (x1, y1), (x2, y2) = dm.train_set[5], dm.train_set[5]
    assert x1.shape == (3, 224, 224) and torch.equal(x1, x2) and int(y1) == int(y2) and 0 <= int(y1) < 1000
    x, _ = next(iter(as_rank(dm, 1, 0).train_dataloader()))
    assert x.shape == (4, 3, 224, 224) and x.dtype == torch.uint8  # made once, not per item


def imagenet_archives(root, classes=("n01440764", "n01443537"), train_per_class=3, val_images=4):
    """ILSVRC2012 as downloaded, in miniature: the devkit (meta.mat with one non-leaf synset, validation
    ground truth), a train tar of one tar per class, a flat val tar; returns each validation image's wnid."""
    import io
    import tarfile

    import numpy as np
    from PIL import Image
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
    import subprocess
    import sys

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
    import tarfile

    from starter.data.imagenet_archives import extract_train, prepare

    root = tmp_path / "imagenet"
    val_wnids = imagenet_archives(root)
    extract_train(root / "ILSVRC2012_img_train.tar", root / "train")  # a train/ tree of class folders
    with tarfile.open(root / "ILSVRC2012_img_val.tar") as archive:  # next to val/ extracted by hand, flat
        archive.extractall(root / "val", filter="data")
    with pytest.raises(UserError, match=f"{root / 'val'} holds images without class folders; prepare it once"):
        folder(root, num_classes=2).setup()
    prepare(root)
    labelled = sorted((p.name, p.parent.name) for p in (root / "val").rglob("*.JPEG"))
    assert [wnid for _, wnid in labelled] == val_wnids


def test_images_decode_to_their_exact_pixels_by_torchvision_or_pil(tmp_path):
    from PIL import Image

    from starter.data.imagenet import load_image

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
