"""The template's larger examples in runs: torchvision's ResNet-50 recipe, ResNets from torchvision's weights, timm
by name. Part of the larger examples: a project made with `examples=minimal` has not this file."""

import json
import subprocess
import sys

import pytest
import torch
from test_image_folder import FOLDER, README, make_image_folder
from test_trained_model import ZERO_EPOCHS

from conftest import CONF, model_weights, run_dirs, train, trained_weights
from starter.data.image_files import load_image


@pytest.fixture
def image_folder(tmp_path):
    return make_image_folder(tmp_path)


def test_the_published_resnet50_recipe_composes_and_runs_a_batch(image_folder, tmp_path):
    # the recipe as it is, made small only where a 2-core CPU needs it (a ResNet-18, 32x32 images)
    proc = train(
        tmp_path,
        "experiment=imagenet_resnet50_recipe",
        f"data.root={image_folder}",
        "debug=fdr",
        "accelerator=cpu",
        "devices=1",
        "strategy=auto",
        "model=resnet18",
        "data.image_shape=[3,32,32]",
        "data.train_crop_size=24",
        "data.val_resize_size=36",
        "data.batch_size=6",
        "data.num_workers=0",
    )
    cfg = (run_dirs(tmp_path, "imagenet_resnet50_recipe")[0] / "config.yaml").read_text()
    for key in ("auto_augment: ta_wide", "mixup_alpha: 0.2", "cutmix_alpha: 1.0", "label_smoothing: 0.1",
                "lr_warmup_epochs: 5", "decay: 0.999966", "warmup_epochs: 5", "norm_weight_decay: 0.0",
                "num_classes: 3"):  # fmt: skip
        assert key in cfg, key
    assert proc.returncode == 0


def test_resnet18_starts_from_torchvision_weights_fetched_by_torchvision_with_a_new_head(image_folder, tmp_path,
                                                                                         monkeypatch):  # fmt: skip
    # Nothing downloads here: torchvision's own code finds the file where its download would have put it.
    from torchvision.models import get_model, get_model_weights

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    url = get_model_weights("resnet18")["IMAGENET1K_V1"].url
    (tmp_path / "torch" / "hub" / "checkpoints").mkdir(parents=True)
    published = get_model("resnet18").state_dict()  # 1000 classes, as the published file
    torch.save(published, tmp_path / "torch" / "hub" / "checkpoints" / url.rsplit("/", 1)[1])
    proc = train(tmp_path, *FOLDER, f"data.root={image_folder}", "model=resnet18", "model.net.weights=IMAGENET1K_V1",
                 "trainer.max_epochs=0", "test=false")  # fmt: skip
    assert "resnet18's IMAGENET1K_V1 weights are for 1000 classes: its head (fc) starts freshly initialised for 3" in (
        proc.stdout
    )
    started = model_weights(run_dirs(tmp_path)[0])
    assert all(torch.equal(published[k], started[f"net.{k}"]) for k in published if not k.startswith("fc."))
    assert started["net.fc.weight"].shape == (3, 512)
    snippet = README.read_text().split("<!-- the torch-only snippet -->\n```python\n")[1].split("```")[0]
    image = image_folder / "val" / "dog" / "0.JPEG"
    code = snippet.replace('"model.pt"', repr(str(run_dirs(tmp_path)[0] / "checkpoints" / "model.pt")))
    code = code.replace('"cat.jpg"', repr(str(image))) + "\nprint(json.dumps(logits.tolist()))"
    assert len([line for line in snippet.splitlines() if line]) <= 11  # the README's, with torch and torchvision alone
    out = subprocess.run([sys.executable, "-c", "import json, sys; sys.modules['starter'] = None\n" + code],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    from starter.checkpointing.inference import load_for_inference
    from starter.data.image_files import evaluation_transform

    model, record = load_for_inference(run_dirs(tmp_path)[0] / "checkpoints" / "model.pt", [CONF])
    pixels = evaluation_transform(record["resize"], record["crop"])(load_image(str(image)))[None]
    mean, std = (torch.tensor(record[k]).view(1, -1, 1, 1) for k in ("mean", "std"))
    with torch.no_grad():
        expected = model((pixels.float() / 255 - mean) / std)[0]
    assert torch.allclose(torch.tensor(json.loads(out.splitlines()[-1])), expected, atol=1e-5)


def test_the_model_summary_leaves_the_weights_it_describes_as_they_were_loaded(tmp_path):
    # a resnet18 started from weights whose BatchNorm statistics are 2.0 and 5.0, trained 0 steps, with its summary
    data = ["model=resnet18", "data=synthetic", "data.image_shape=[3,32,32]", "data.num_classes=4", "test=false"]
    start = trained_weights(tmp_path / "start", *data, "trainer.max_epochs=0")
    stats = {k: torch.full_like(v, 2.0 if k.endswith("running_mean") else 5.0) for k, v in start.items()
             if k.endswith(("running_mean", "running_var"))}  # fmt: skip
    torch.save({**start, **stats}, tmp_path / "loaded.pt")
    summarised = [
        "trainer.enable_model_summary=true",
        "trainer.limit_train_batches=0",
        f"init_from={tmp_path / 'loaded.pt'}",
    ]
    after = trained_weights(tmp_path / "run", *data, *summarised)
    assert all(torch.equal(after[k], v) for k, v in stats.items())
    assert all(int(v) == 0 for k, v in after.items() if k.endswith("num_batches_tracked"))


def test_a_timm_model_by_name_starts_from_a_local_weights_file(tmp_path):
    timm = pytest.importorskip("timm", reason="the timm extra: pip install -e '.[timm]'")
    published = timm.create_model("mobilenetv3_small_100").state_dict()  # 1000 classes, as a downloaded file
    torch.save(published, tmp_path / "weights.pth")
    train(tmp_path, *ZERO_EPOCHS, "model=timm", "model.net.pretrained=true",
          f"+model.net.pretrained_cfg_overlay.file={tmp_path / 'weights.pth'}", "data=synthetic",
          "data.image_shape=[3,32,32]", "data.num_classes=5", "data.train_size=64")  # fmt: skip
    started = model_weights(run_dirs(tmp_path)[0])
    kept = [k for k in published if not k.startswith("classifier.")]  # timm gives 5 classes a new head itself
    assert (
        all(torch.equal(published[k], started[f"net.{k}"]) for k in kept)
        and started["net.classifier.weight"].shape[0] == 5
    )
