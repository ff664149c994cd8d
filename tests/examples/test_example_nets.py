"""The template's example nets and data in runs (src/mynet: the ViT's size check, MNIST from local files, synthetic
images on the device, the mnist_cnn experiment) and every example net's export. They go with the examples: delete
this file with them."""

import pytest
import torch
from test_trained_model import exports_the_models_logits

from conftest import compose_config, max_difference, model_weights, read_metrics, run_dirs, train
from starter.errors import UserError
from starter.preflight import prepare


def test_a_vit_refuses_images_of_another_size_than_it_was_built_for_in_one_line(tmp_path):
    from hydra.utils import instantiate

    vit = instantiate(compose_config(["model=vit", "data=digits", "data.image_shape=[3,32,32]"], tmp_path).model)
    assert vit(torch.zeros(2, 3, 32, 32)).shape == (2, 10)  # the size it takes
    with pytest.raises(UserError, match="the net takes 32x32 images only .* but was given 36x36; crop the data"):
        vit(torch.zeros(2, 3, 36, 36))


def test_mnist_cnn_trains_from_local_files(mnist_dir, tmp_path):
    train(tmp_path, "data=mnist", "model=cnn", f"paths.data_dir={mnist_dir}", "data.download=false",
          "data.val_size=40", "data.batch_size=20", "trainer.max_epochs=3")  # fmt: skip
    (run_dir,) = run_dirs(tmp_path)
    assert read_metrics(run_dir)["test/acc"] >= 0.6  # the label is a bright bar: learnable in 3 short epochs


def test_missing_mnist_is_one_clear_error(tmp_path):
    proc = train(tmp_path, "data=mnist", f"paths.data_dir={tmp_path / 'empty'}", "data.download=false",
                 expect_ok=False)  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: MNIST not found in {tmp_path / 'empty'}")
    assert "Traceback" not in proc.stderr


def test_synthetic_data_trains_the_same_with_its_pool_on_the_device(tmp_path):
    # data.on_device=true: the loader yields pool indices and the batch is gathered on the compute device
    common = ["data=synthetic", "model=cnn", "data.image_shape=[3,32,32]", "data.num_classes=10",
              "data.train_size=32", "data.eval_size=16", "data.batch_size=8", "trainer.max_epochs=1"]  # fmt: skip
    train(tmp_path / "host", *common)
    train(tmp_path / "device", *common, "data.on_device=true")
    host, device = (run_dirs(tmp_path / where)[0] for where in ("host", "device"))
    assert read_metrics(host)["test/acc"] == read_metrics(device)["test/acc"]
    assert max_difference(model_weights(host), model_weights(device)) == 0.0


def test_experiment_overrides_groups_and_keys(tmp_path):
    cfg = compose_config(["experiment=mnist_cnn"], tmp_path)
    assert cfg.data._target_.endswith("MNISTDataModule") and cfg.model.net._target_.endswith("CNN")
    assert cfg.trainer.max_epochs == 5 and cfg.model.net.in_channels == 1


EXAMPLE_NETS = ["mlp", "cnn", "vit"]
EXAMPLE_NETS += ["resnet18", "resnet50", "vit_s16"]  # full examples
EXPORTED_AS = {}  # a net's overrides in the export test
EXPORTED_AS["vit_s16"] = ["model.net.depth=2"]  # 12 copies of one block trace as 2 do, 6x faster  # full examples


@pytest.mark.parametrize("fmt", ["onnx", "torch_export"])
@pytest.mark.parametrize("model", EXAMPLE_NETS)
def test_every_example_net_exports_to_a_file_that_takes_pixels_and_gives_the_models_logits(model, fmt, tmp_path,
                                                                                          capsys):  # fmt: skip
    large = model not in ("mlp", "cnn", "vit")
    exports_the_models_logits(tmp_path, capsys, model, fmt, *EXPORTED_AS.get(model, []), large=large)


@pytest.mark.parametrize(
    "override,said",
    [
        ("data=mnist data.download=maybe", "data.download=maybe: give true or false"),
        ("model.lr_warmup_epochs=-1", "model.lr_warmup_epochs=-1: give a whole number of 0 or more"),
    ],
)
def test_a_mistyped_value_of_an_example_is_refused_before_the_run_in_one_line(override, said, tmp_path):
    with pytest.raises(UserError) as refused:
        prepare(compose_config(["model=mlp", "data=digits", *override.split()], tmp_path / "run"))
    assert str(refused.value) == said
