"""From a trained run to answers: predict.py on the images of the run's test split gives its test accuracy (one
process and ddp), the weights carry what inference needs, export.py writes files that give the model's logits from
uint8 pixels for every shipped net, fine-tuning starts from weights only (a new head said in one line, a backbone
frozen at first), and bad input is one line."""

import copy
import re
from pathlib import Path

import pytest
import torch

from bed.data import Digits
from conftest import (
    CONFIG_DIRS,
    compose_config,
    correct,
    model_weights,
    predict,
    predictions,
    read_metrics,
    run_dirs,
    train,
    trained_weights,
)


def test_predicting_the_test_split_gives_the_runs_test_accuracy(default_run, digit_files, tmp_path):
    _, run_dir, _ = default_run
    proc = predict(tmp_path, f"ckpt_path={run_dir}", f"inputs={digit_files}")
    rows = predictions(proc)
    assert [r["path"] for r in rows] == sorted(str(p) for p in digit_files.iterdir())  # each once, in input order
    record = torch.load(run_dir / "checkpoints" / "model.pt", weights_only=True)["inference"]
    digits = Digits(image_shape=[1, 8, 8], num_classes=10)  # the run's data: its training split's statistics
    digits.setup()
    images = digits.train_set.images.float() / 255
    assert record["mean"] == [pytest.approx(float(images.mean()))]
    assert record["std"] == [pytest.approx(float(images.std()))]
    assert record["value_range"] == 255.0 and record["classes"] == [str(i) for i in range(10)]
    assert correct(rows) == round(read_metrics(run_dir)["test/acc"] * 271)  # best.ckpt: what the run tested
    assert all(f"{r['path']},{r['class']}," in proc.stdout for r in rows[:5])  # the first rows shown
    assert rows[0].keys() == {"path", "class", "probability", "top5"}  # more than 5 classes: the top 5
    best = run_dir / "checkpoints" / "best.ckpt"
    assert f"ckpt_path={run_dir}: {best}, trained in {run_dir}\n" in proc.stdout  # which weights, from which run
    fp16 = predict(tmp_path / "fp16", f"ckpt_path={run_dir}", f"inputs={digit_files}", "precision=16-mixed")
    half = predictions(fp16)
    assert len(half) == 271 and abs(correct(half) - correct(rows)) <= 2  # fp16 autocast, as in training


@pytest.mark.slow
def test_predicting_under_ddp_gives_every_file_once_in_input_order(default_run, digit_files, tmp_path):
    _, run_dir, _ = default_run
    rows = predictions(predict(tmp_path, f"ckpt_path={run_dir}", f"inputs={digit_files}/*.png", "strategy=ddp",
                               "devices=2", "num_workers=1"))  # fmt: skip
    assert [r["path"] for r in rows] == sorted(str(p) for p in digit_files.iterdir())
    assert correct(rows) == round(read_metrics(run_dir)["test/acc"] * 271)


NETS = ["bed_mlp", "bed_cnn", "bed_vit"]  # the test bed's (the examples' nets: tests/examples/test_example_nets.py)
IMAGES_224 = ["data=bed_images", "data.num_classes=10"]  # 3 x 224 x 224


def weights_file(tmp_path, model: str, *overrides: str):
    """A model.pt as training writes it (random weights), for `model` on the default data or 224x224 images."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cfg = compose_config([f"model={model}", *overrides], tmp_path / "run")
    config = OmegaConf.to_container(cfg.model, resolve=True)
    shape = list(cfg.data.image_shape)
    record = {"model": config, "image_shape": shape, "value_range": 255.0, "mean": [0.4] * shape[0],
              "std": [0.25] * shape[0], "classes": [f"c{i}" for i in range(10)], "resize": None,
              "crop": None}  # fmt: skip
    path = tmp_path / f"{model}.pt"
    torch.save({"state_dict": instantiate(config).state_dict(), "inference": record}, path)
    return path


def export(tmp_path, path, fmt: str, config_dirs=CONFIG_DIRS):
    from omegaconf import OmegaConf

    from starter.export import export

    out = tmp_path / fmt
    out.mkdir()
    dirs = [str(d) for d in config_dirs]  # what export.py's prepare() records: the folders whose model/ configs count
    cfg = OmegaConf.create({"ckpt_path": str(path), "format": fmt, "tolerance": 1e-4, "seed": 0, "accelerator": "cpu",
                            "paths": {"output_dir": str(out)}, "model_config_dirs": dirs})  # fmt: skip
    export(cfg)
    return next(out.glob("model.*"))


@pytest.mark.parametrize("fmt", ["onnx", "torch_export"])
@pytest.mark.parametrize("model", NETS)
def test_every_net_exports_to_a_file_that_takes_pixels_and_gives_the_models_logits(model, fmt, tmp_path, capsys):
    exports_the_models_logits(tmp_path, capsys, model, fmt)


def exports_the_models_logits(tmp_path, capsys, model: str, fmt: str, *overrides: str, large: bool = False) -> None:
    """`model` (on the default data, or `large`: 224x224 images) exported as `fmt` takes pixels and gives its logits."""
    path = weights_file(tmp_path, model, *(IMAGES_224 if large else []), *overrides)
    exported = export(tmp_path, path, fmt)
    said = capsys.readouterr().out  # checked before it is called done, on a batch of 3 (traced with 2)
    assert re.search(r"checked on a batch of 3 against the model: largest difference \S+", said), said
    shape = (5, 3, 224, 224) if large else (5, 1, 8, 8)
    pixels = torch.randint(0, 256, shape, dtype=torch.uint8)
    if fmt == "torch_export":  # torch alone runs it
        got = torch.export.load(exported).module()(pixels)
    else:  # one file: moved alone to another directory, it loads
        import onnxruntime

        assert sorted(p.name for p in exported.parent.iterdir()) == ["model.onnx"]
        alone = tmp_path / "elsewhere" / "model.onnx"
        alone.parent.mkdir()
        exported.rename(alone)
        session = onnxruntime.InferenceSession(str(alone), providers=["CPUExecutionProvider"])
        got = torch.from_numpy(session.run(None, {"images": pixels.numpy()})[0])
    from starter.checkpointing.inference import load_for_inference

    model_, record = load_for_inference(path, list(CONFIG_DIRS))
    mean, std = (torch.tensor(record[k]).view(1, -1, 1, 1) for k in ("mean", "std"))
    with torch.no_grad():
        expected = model_((pixels.float() / 255 - mean) / std)
    assert (got - expected).abs().max() <= 1e-4


def test_an_onnx_model_past_the_limit_keeps_its_weights_beside_it_and_says_so(tmp_path, capsys, monkeypatch):
    import starter.export

    monkeypatch.setattr(starter.export, "ONNX_INSIDE_LIMIT", 1)  # as if the MLP's weights passed ONNX's 2 GB
    exported = export(tmp_path, weights_file(tmp_path, "bed_mlp"), "onnx")
    assert sorted(p.name for p in exported.parent.iterdir()) == ["model.onnx", "model.onnx.data"]
    assert "GB of weights in model.onnx.data: move the two together)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "net,fmt,refused",
    [
        ("TakesBranches", "torch_export", "TakesBranches does not export to torch_export: "),
        # traced, but its logits are not the model's: the check against the model keeps nothing
        ("DiffersWhenTraced", "onnx", "the onnx model's logits differ from the model's by [0-9.e+]+ \\(more than"),
        ("DiffersWhenTraced", "torch_export", "the torch_export model's logits differ from the model's by"),
    ],
)
def test_a_net_that_cannot_be_exported_as_it_is_is_refused_in_one_line(net, fmt, refused, tmp_path):
    from starter.errors import UserError

    path = weights_file(
        tmp_path,
        "bed_mlp",
        f"model.net._target_=probes.{net}",
        "~model.net.width",
        "~model.net.depth",
        "~model.net.dropout",
    )
    own = tmp_path / "conf"  # a config folder of one's own naming the net (hydra.searchpath)
    (own / "model").mkdir(parents=True)
    (own / "model" / "probe.yaml").write_text(f"net:\n  _target_: probes.{net}\n")
    with pytest.raises(UserError, match=refused):
        export(tmp_path, path, fmt, (*CONFIG_DIRS, own))
    assert not list((tmp_path / fmt).iterdir())  # nothing half-made is left


ZERO_EPOCHS = ["trainer.max_epochs=0", "test=false"]  # model.pt: the weights a run starts from


def test_init_from_starts_from_weights_only_a_head_of_another_class_count_fresh_and_said(default_run, tmp_path):
    _, run_dir, _ = default_run
    five = ["data=bed_images", "data.image_shape=[1,8,8]", "data.num_classes=5", "data.train_size=64"]
    proc = train(tmp_path / "run", *ZERO_EPOCHS, *five, f"init_from={run_dir / 'checkpoints' / 'model.pt'}")
    assert "its head (net.5) has 10 outputs, this model 5 classes: the head starts freshly initialised" in proc.stdout
    source, started = model_weights(run_dir), model_weights(run_dirs(tmp_path / "run")[0])
    assert all(torch.equal(source[k], started[k]) for k in source if not k.startswith("net.5."))
    fresh = trained_weights(tmp_path / "fresh", *ZERO_EPOCHS, *five)  # the same model, seed and data, from scratch
    assert all(torch.equal(started[k], fresh[k]) for k in ("net.5.weight", "net.5.bias"))  # initialised, not copied
    net_only = {k.removeprefix("net."): v for k, v in source.items()}  # a plain state dict of the net
    torch.save(net_only, tmp_path / "net.pt")
    train(tmp_path / "plain", *ZERO_EPOCHS, f"init_from={tmp_path / 'net.pt'}")
    assert all(torch.equal(source[k], v) for k, v in model_weights(run_dirs(tmp_path / "plain")[0]).items())
    other = train(
        tmp_path / "other", *ZERO_EPOCHS, "model=bed_cnn", f"init_from={tmp_path / 'net.pt'}", expect_ok=False
    )
    assert other.returncode == 2 and "holds weights of another model (missing ['net.0.bias'" in other.stderr


def crafted(record: dict, depth: str, written: Path) -> dict:
    """`record` whose model config names torch.save (which would write `written`) at `depth`."""
    call = {"_target_": "torch.save", "obj": {}, "f": str(written)}
    model = copy.deepcopy(record["model"])
    if depth == "model":
        model = call
    elif depth == "net":
        model["net"] = call
    elif depth == "inside the net":
        model["net"]["norm"] = call
    elif depth == "in a list":
        model["net"]["_args_"] = [call]
    else:  # a value to resolve: an interpolation
        model["net"]["width"] = "${oc.env:HOME}"
    return {**record, "model": model}


@pytest.mark.parametrize("depth", ["model", "net", "inside the net", "in a list", "an interpolation"])
def test_nothing_a_checkpoint_names_is_called_by_predict_export_or_init_from(default_run, digit_files, depth, tmp_path):
    saved = torch.load(default_run[1] / "checkpoints" / "model.pt", weights_only=True)
    written = tmp_path / "written-by-the-checkpoint"
    path = tmp_path / "crafted.pt"
    torch.save({**saved, "inference": crafted(saved["inference"], depth, written)}, path)
    runs = [
        ("ckpt_path", predict(tmp_path / "p", f"ckpt_path={path}", f"inputs={digit_files}", expect_ok=False)),
        ("ckpt_path", train(tmp_path / "e", f"ckpt_path={path}", "format=onnx", script="export.py", expect_ok=False)),
        ("init_from", train(tmp_path / "i", f"init_from={path}", *ZERO_EPOCHS, expect_ok=False)),
    ]
    refused = "holds an interpolation" if depth == "an interpolation" else "names 'torch.save', which no model config"
    for key, proc in runs:
        (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
        assert proc.returncode == 2 and line.startswith(f"error: {key}={path}: its inference record {refused}")
    assert not written.exists()


@pytest.fixture
def web_server():
    """A local HTTP server that answers nothing and keeps the path of every request it gets."""
    import http.server
    import threading

    asked = []

    class Recording(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            asked.append(self.path)
            self.send_error(404)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recording)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", asked
    server.shutdown()


def test_a_record_whose_arguments_fetch_or_read_rebuilds_the_model_without_them(web_server, tmp_path, capsys):
    pytest.importorskip("timm", reason="the timm extra: pip install -e '.[timm]'")
    from starter import load_module

    url, asked = web_server
    path = weights_file(tmp_path, "bed_timm")
    saved = torch.load(path, weights_only=True)
    net = saved["inference"]["model"]["net"]  # the author's folder and URL; any file of this machine to read
    net |= {"pretrained": True, "pretrained_cfg_overlay": {"url": f"{url}/weights.pth", "hf_hub_id": ""},
            "cache_dir": str(tmp_path / "author"), "checkpoint_path": "/etc/passwd"}  # fmt: skip
    torch.save(saved, path)
    exported = export(tmp_path, path, "torch_export")  # built from the local config, then the checkpoint's weights
    pixels = torch.randint(0, 256, (2, 1, 8, 8), dtype=torch.uint8)
    module = load_module(path, CONFIG_DIRS)
    assert torch.allclose(torch.export.load(exported).module()(pixels), module.net(pixels.float() / 255 - 0.4) / 0.25,
                          atol=1e-4)  # fmt: skip
    assert asked == [] and not (tmp_path / "author").exists()


def test_a_record_key_no_model_config_declares_is_left_out_and_said(tmp_path, caplog):
    from starter import load_module

    path = weights_file(tmp_path, "bed_mlp")  # trained with +model.optimizer.foreach=true, say: inference needs it not
    saved = torch.load(path, weights_only=True)
    saved["inference"]["model"]["optimizer"]["foreach"] = True
    torch.save(saved, path)
    with caplog.at_level("INFO"):
        load_module(path, CONFIG_DIRS)
    assert f"ckpt_path={path}: its inference record's model.optimizer.foreach is declared by no model config here" \
        in caplog.text  # fmt: skip


@pytest.mark.parametrize(
    "where,value,said",
    [
        ("model_name", "hf-hub:author/model", "sets model.net.model_name='hf-hub:author/model', which is no plain"),
        ("model_name", "hf-hub:name", "sets model.net.model_name='hf-hub:name', which is no plain value"),
        ("model_name", 5, "sets model.net.model_name=5, which is no plain value of the type declared there"),
        ("num_classes", {"_target_": "builtins.int"}, "names 'builtins.int', which no model config here names"),
        ("_args_", [1], "sets model.net._args_, which no model config here declares"),
        ("_recursive_", False, "sets model.net._recursive_, which no model config here declares"),
    ],
)
def test_a_record_supplies_only_plain_values_for_what_the_model_configs_here_declare(where, value, said, tmp_path):
    from starter import load_module
    from starter.errors import UserError

    path = weights_file(tmp_path, "bed_timm")
    saved = torch.load(path, weights_only=True)
    saved["inference"]["model"]["net"][where] = value
    torch.save(saved, path)
    with pytest.raises(UserError) as refused:
        load_module(path, CONFIG_DIRS)
    assert f"ckpt_path={path}: its inference record {said}" in str(refused.value)


@pytest.mark.slow
def test_a_backbone_frozen_for_an_epoch_keeps_its_weights_then_trains_alike_under_ddp(tmp_path):
    # SGD: ddp and one process differ by summation order only, which Adam's normalised steps would amplify past 1e-5
    # (1.15e-5 seen with AdamW on CI's machines)
    sgd = ["model.optimizer._target_=torch.optim.SGD", "model.optimizer.lr=0.05"]
    frozen = ["debug=limit", "test=false", "callbacks.freeze_backbone.epochs=1", *sgd]
    start = model_weights(train(tmp_path / "start", *ZERO_EPOCHS) and run_dirs(tmp_path / "start")[0])
    one = model_weights(train(tmp_path / "one", *frozen, "trainer.max_epochs=1") and run_dirs(tmp_path / "one")[0])
    two = model_weights(train(tmp_path / "two", *frozen) and run_dirs(tmp_path / "two")[0])
    ddp = model_weights(train(tmp_path / "ddp", *frozen, "strategy=ddp", "devices=2") and run_dirs(tmp_path / "ddp")[0])
    backbone = [k for k in start if not k.startswith("net.5.")]
    assert all(torch.equal(start[k], one[k]) for k in backbone) and not torch.equal(
        start["net.5.weight"], one["net.5.weight"]
    )
    assert not all(torch.equal(start[k], two[k]) for k in backbone)  # then it trains
    assert max((ddp[k] - two[k]).abs().max().item() for k in two) <= 1e-5  # its gradients averaged over the ranks too


def test_bad_inputs_are_one_line_or_skipped_and_counted(default_run, digit_files, tmp_path):
    _, run_dir, _ = default_run
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for image in sorted(digit_files.iterdir())[:3]:
        (mixed / image.name).write_bytes(image.read_bytes())
    (mixed / "notes.txt").write_text("not an image")
    (mixed / "truncated.png").write_bytes((digit_files / "0000_0.png").read_bytes()[:30])
    weights = f"ckpt_path={run_dir}"
    refused = predict(tmp_path / "a", weights, f"inputs={mixed}", expect_ok=False)
    (line,) = [x for x in refused.stderr.splitlines() if x.startswith("error:")]
    assert refused.returncode == 2 and line.startswith(f"error: cannot read image {mixed / 'notes.txt'}")
    skipped = predict(tmp_path / "b", weights, f"inputs={mixed}", "skip_unreadable=true")
    assert len(predictions(skipped)) == 3 and "2 of 5 inputs unreadable and skipped" in skipped.stderr + skipped.stdout
    (tmp_path / "empty").mkdir()
    for inputs, said in (
        (tmp_path / "empty", "the folder holds no file"),
        (f"{mixed}/*.jpg", "the glob matches no file"),
        (tmp_path / "nowhere", "no such file or folder"),
    ):
        proc = predict(tmp_path / "c", weights, f"inputs={inputs}", expect_ok=False)
        assert proc.returncode == 2 and said in proc.stderr
    proc = predict(tmp_path / "c", f"ckpt_path={tmp_path / 'empty'}", f"inputs={mixed}", expect_ok=False)
    assert proc.returncode == 2 and "no checkpoint there; give a .ckpt, a model.pt or a run directory" in proc.stderr
    proc = predict(tmp_path / "c", weights, f"inputs={mixed}", "batch_size=0", expect_ok=False)
    assert proc.returncode == 2 and proc.stderr == "error: batch_size=0: give a whole number of 1 or more\n"
    torch.save({"net.0.weight": torch.zeros(1)}, tmp_path / "foreign.pt")  # weights without their inference record
    proc = predict(tmp_path / "d", f"ckpt_path={tmp_path / 'foreign.pt'}", f"inputs={mixed}", expect_ok=False)
    assert proc.returncode == 2 and "holds no inference record" in proc.stderr
