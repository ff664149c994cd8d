"""The GPU tier: what only a CUDA device can show, run where one is (skipped elsewhere; part of `make test`).

Each strategy x precision trains on one GPU and lands where strategy=auto lands at that precision (a mode that
trained differently, like ddp_spawn without TF32 once did, shows as another accuracy); the extras that broke on a
GPU before (fsdp with BatchNorm at bf16-mixed, tp with CUDA's foreach optimizer kernels) and compile,
channels_last, fsdp's options, tp/pp/2D at one device train; a training step that is not a logging step makes no
host-device synchronisation (torch.cuda.set_sync_debug_mode counts each one); code written for Lightning (tests/foreign)
trains under ddp and fsdp, and modules that parallelize themselves under fsdp and tp; a run stopped by SIGTERM and
resumed ends bit for bit where the straight run ends, dropout drawing from CUDA's generator. The runs are
`python train.py` processes, four at a time on the one GPU, started once for the whole module.
"""

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from conftest import PROBES, ROOT, host_syncs, model_weights, on_bed, train, trained_weights, with_env

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU tier needs CUDA")]  # fmt: skip

ONE_GPU = ["accelerator=gpu", "devices=1", "debug=limit", "trainer.max_epochs=1", "trainer.enable_progress_bar=false"]
SMALL_IMAGES = ["data=bed_images", "data.image_shape=[3,64,64]", "data.num_classes=10", "data.train_size=256",
                "data.eval_size=64", "data.batch_size=32"]  # fmt: skip
CNN = [*SMALL_IMAGES, "model=bed_cnn"]
R18 = [*SMALL_IMAGES, "model=resnet18"]  # full examples
STRATEGIES = ("auto", "dp", "ddp", "ddp_spawn", "fsdp")
PRECISIONS = ("32", "16-mixed", "bf16-mixed", "bf16-true")
MATRIX = {f"{s}-{p}": [f"strategy={s}", f"precision={p}"] for s in STRATEGIES for p in PRECISIONS}
EXTRAS = {
    "cnn-compile-channels_last-bf16": [*CNN, "compile=true", "channels_last=true", "precision=bf16-mixed"],
    "cnn-fsdp-checkpointing-bf16": [
        *CNN,
        "strategy=fsdp",
        "precision=bf16-mixed",
        "strategy.activation_checkpointing=true",
    ],
    "cnn-fsdp-cpu_offload": [*CNN, "strategy=fsdp", "strategy.cpu_offload=true"],
    "cnn-ema-bf16": [*CNN, "callbacks.weight_averaging.decay=0.99", "precision=bf16-mixed"],
    "vit-tp-foreach-bf16": ["model=bed_vit", "strategy=tp", "precision=bf16-mixed", "+model.optimizer.foreach=true"],
    "vit-pp-bf16": ["model=bed_vit", "strategy=pp", "precision=bf16-mixed"],
    "vit-tp-fp16": ["model=bed_vit", "strategy=tp", "precision=16-mixed"],
    "vit-pp-fp16-clipped": ["model=bed_vit", "strategy=pp", "precision=16-mixed", "trainer.gradient_clip_val=1.0"],
    "vit-2d-bf16": ["model=bed_vit", "strategy=fsdp", "strategy.tensor_parallel_size=1", "precision=bf16-mixed"],
    "vit-compile-bf16": ["model=bed_vit", "compile=true", "precision=bf16-mixed"],
    "resnet18-fsdp-batchnorm-bf16": [*R18, "strategy=fsdp", "precision=bf16-mixed"],  # full examples
}
# Code written for Lightning (tests/foreign), 2 epochs on the digits: the peer template's module and DataModule, and
# modules that apply FSDP2 or tensor parallel themselves in configure_model() (the last owning its loaders)
FOREIGN = [f"hydra.searchpath=[file://{ROOT / 'tests' / 'foreign' / 'conf'}]", "trainer.max_epochs=2"]
TEMPLATE = [*FOREIGN, "experiment=template"]
CODE_FOR_LIGHTNING = {
    "template-auto-32": TEMPLATE,
    "template-ddp-32": [*TEMPLATE, "strategy=ddp"],
    "template-auto-16": [*TEMPLATE, "precision=16-mixed"],
    "template-fsdp-16": [*TEMPLATE, "strategy=fsdp", "precision=16-mixed"],
    "fsdp_layers-fsdp-bf16": [
        *FOREIGN,
        "model=fsdp_layers",
        "data=template_digits",
        "strategy=fsdp",
        "precision=bf16-mixed",
    ],
    "tp_feedforward-tp-bf16": [
        *FOREIGN,
        "model=tp_feedforward",
        "data=none",
        "monitor=val_acc",
        "test=false",
        "strategy=tp",
        "precision=bf16-mixed",
    ],
}


def train_on_gpu(overrides: list[str], scratch: Path, env: dict | None = None) -> dict:
    log_dir = scratch / str(time.time_ns())
    first = ONE_GPU if env is None else [o for o in ONE_GPU if not o.startswith(("debug=", "trainer.max_epochs="))]
    command = [sys.executable, str(ROOT / "train.py"), *on_bed([*first, *overrides, f"paths.log_dir={log_dir}"])]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env=with_env(env))
    metrics = next(log_dir.glob("**/metrics.json"), None)
    return {"code": proc.returncode, "stderr": proc.stderr[-3000:],
            "metrics": json.loads(metrics.read_text()) if proc.returncode == 0 and metrics else {}}  # fmt: skip


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, dict]:
    scratch = tmp_path_factory.mktemp("gpu")
    runs = {**MATRIX, **EXTRAS}
    with ThreadPoolExecutor(4) as pool:
        done = {name: pool.submit(train_on_gpu, overrides, scratch) for name, overrides in runs.items()}
        done |= {name: pool.submit(train_on_gpu, o, scratch, PROBES) for name, o in CODE_FOR_LIGHTNING.items()}
    return {name: future.result() for name, future in done.items()}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_strategy_and_precision_trains_on_one_gpu_like_auto(outcomes, strategy, precision):
    run = outcomes[f"{strategy}-{precision}"]
    assert run["code"] == 0, run["stderr"]
    # the same data, seed and steps: every strategy reaches auto's test accuracy up to float reduction order
    assert run["metrics"]["test/acc"] == pytest.approx(outcomes[f"auto-{precision}"]["metrics"]["test/acc"], abs=0.02)


@pytest.mark.parametrize("name", EXTRAS)
def test_gpu_extras_train(outcomes, name):
    run = outcomes[name]
    assert run["code"] == 0, run["stderr"]
    assert 0.0 <= run["metrics"]["test/acc"] <= 1.0


def test_code_written_for_lightning_trains_on_one_gpu_under_ddp_fsdp_and_tp(outcomes):
    runs = {name: outcomes[name] for name in CODE_FOR_LIGHTNING}
    assert all(run["code"] == 0 for run in runs.values()), {n: r["stderr"] for n, r in runs.items() if r["code"]}
    # under ddp and fsdp the module Lightning's way lands where strategy=auto lands at that precision
    for strategy, precision in (("ddp", "32"), ("fsdp", "16")):
        acc = runs[f"template-{strategy}-{precision}"]["metrics"]["test/acc"]
        assert acc == pytest.approx(runs[f"template-auto-{precision}"]["metrics"]["test/acc"], abs=0.02)
    # the modules that parallelize themselves learn the digits (chance: 0.1; on CPU 0.78 and 0.94 after 2 epochs)
    assert runs["fsdp_layers-fsdp-bf16"]["metrics"]["test/acc"] > 0.6
    assert runs["tp_feedforward-tp-bf16"]["metrics"]["val_acc"] > 0.8


# 3 epochs of 8 batches = 24 steps, stopped by SIGTERM after step 11 and run again in the same directory, as a
# requeued job is: dropout draws from CUDA's generator, the random shift of each batch from the CPU's
RESUME_ON_GPU = [
    "accelerator=gpu",
    "devices=1",
    "trainer.max_epochs=3",
    "trainer.limit_train_batches=8",
    "trainer.limit_val_batches=2",
    "test=false",
    "model.net.dropout=0.3",
    "data._target_=probes.AugmentedDigits",
]


def test_a_run_stopped_on_the_gpu_and_resumed_ends_bit_for_bit_where_the_straight_run_ends(tmp_path):
    straight = trained_weights(tmp_path / "straight", *RESUME_ON_GPU, env=PROBES)
    again = [*RESUME_ON_GPU, f"hydra.run.dir={tmp_path / 'run'}", "ckpt_path=auto"]
    stop = ["+callbacks.stop._target_=probes.SigtermAtStep", "+callbacks.stop.step=11"]
    stopped = train(tmp_path, *again, *stop, env=PROBES, expect_ok=False)
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    said = stopped.stdout + stopped.stderr
    assert "stopped by SIGTERM during training at step 12 after saving checkpoints/last.ckpt" in said, said[-2000:]
    train(tmp_path, *again, env=PROBES)
    resumed = model_weights(tmp_path / "run")
    differences = {k: (straight[k].double() - resumed[k].double()).abs().max().item() for k in resumed}
    assert max(differences.values()) == 0.0, differences  # bit for bit


# full examples: begin
def test_a_resnet50_trains_on_jpegs_decoded_on_the_gpu(tmp_path):
    # nvJPEG writing memory that the previous step's kernels still read made this loss NaN within 6 steps on an H200
    # (pytorch/vision#9606): the decoder now runs on a stream of its own (data/device_decode.py)
    from benchmarks.folder_epoch import CLASSES, write_folder

    write_folder(tmp_path / "images", 128 * 20, CLASSES * 8)
    folder = [
        "data=imagenet",
        f"data.root={tmp_path / 'images'}",
        f"data.num_classes={CLASSES}",
        "model=resnet50",
        "channels_last=true",
        "precision=bf16-mixed",
        "data.batch_size=128",
        "data.num_workers=8",
        "trainer.limit_train_batches=20",
        "trainer.limit_val_batches=1",
        "trainer.limit_test_batches=1",
    ]
    run = train_on_gpu([*folder, "data.decode=gpu"], tmp_path)
    assert run["code"] == 0, run["stderr"]
    assert 0.0 <= run["metrics"]["test/acc"] <= 1.0


# full examples: end
def test_non_logging_training_step_makes_no_host_sync_on_cuda(tmp_path):
    syncs = host_syncs([*CNN, "accelerator=gpu", "devices=1", "precision=bf16-mixed", "channels_last=true",
                   "data.train_size=1024", "trainer.enable_progress_bar=true"], tmp_path)["rank0"]  # fmt: skip
    assert syncs["non_logging_steps"] >= 10
    assert syncs["syncs_per_non_logging_step"] == 0, syncs["non_logging_sites"]
    assert syncs["syncs_per_evaluation_step"] == 0, syncs["evaluation_sites"]
