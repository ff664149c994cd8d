"""The template's example data modules (src/mynet/data): digits, MNIST from IDX files, synthetic images. They go
with the examples: delete this file with them."""

import pytest
import torch

from conftest import as_rank, train
from mynet.data.digits import DigitsDataModule
from mynet.data.mnist import MNISTDataModule
from mynet.data.synthetic import SyntheticDataModule
from starter.errors import UserError

DIGITS = dict(image_shape=[1, 8, 8], num_classes=10)


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


def test_synthetic_data_is_imagenet_shaped_and_repeatable():
    dm = SyntheticDataModule(batch_size=4, train_size=8, eval_size=4, image_shape=[3, 224, 224], num_classes=1000)
    dm.setup()
    (x1, y1), (x2, y2) = dm.train_set[5], dm.train_set[5]
    assert x1.shape == (3, 224, 224) and torch.equal(x1, x2) and int(y1) == int(y2) and 0 <= int(y1) < 1000
    x, _ = next(iter(as_rank(dm, 1, 0).train_dataloader()))
    assert x.shape == (4, 3, 224, 224) and x.dtype == torch.uint8  # made once, not per item


def test_an_empty_digits_split_is_refused_before_training(tmp_path):
    proc = train(tmp_path, "model=mlp", "data=digits", "data.split=[0.85,0.15,0.0]", expect_ok=False)
    assert proc.returncode == 2 and "error: data.split=[0.85, 0.15, 0.0]: every split needs samples" in proc.stderr
