"""dp: the wrapper logic and checkpoints on CPU, the refusal without GPUs, and real splitting when CUDA has 2+ GPUs."""

import pytest
import torch
from lightning.pytorch import Trainer
from torch import nn

from bed.data import Digits
from bed.nets import MLP
from bed.task import Classifier
from conftest import compose_config, read_metrics, run_dirs, train
from starter.errors import UserError
from starter.preflight import prepare
from starter.strategies.dp import DataParallelStrategy, _ClassForward

GPUS = torch.cuda.device_count()


def classifier() -> Classifier:
    return Classifier(MLP([1, 8, 8], 10), 10, optimizer=lambda params: torch.optim.SGD(params, lr=0.1))


def test_dp_routes_every_step_forward_through_data_parallel_and_leaves_the_module_plain(monkeypatch, tmp_path):
    calls = []
    original = _ClassForward.forward
    monkeypatch.setattr(
        _ClassForward, "forward", lambda self, *a, **k: calls.append(len(a[0])) or original(self, *a, **k)
    )
    model = classifier()
    trainer = Trainer(strategy=DataParallelStrategy(), accelerator="cpu", devices=1, max_steps=3, limit_val_batches=1,
                      limit_test_batches=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, use_distributed_sampler=False, default_root_dir=tmp_path)  # fmt: skip
    datamodule = Digits(batch_size=32, image_shape=[1, 8, 8], num_classes=10)
    trainer.fit(model, datamodule=datamodule)
    trainer.test(model, datamodule=datamodule, verbose=False)
    assert trainer.strategy._data_parallel is None  # released at teardown
    assert calls[:3] == [32, 32, 32] and len(calls) >= 5  # 3 training steps, then validation and test batches
    assert "forward" not in model.__dict__  # the override lives only while the strategy runs
    assert trainer.model is model and all(k.startswith("net.") for k in model.state_dict())


def test_dp_on_one_cpu_device_trains_exactly_like_single_device(default_run, tmp_path):
    proc = train(tmp_path, "strategy=dp", "accelerator=cpu")
    (run_dir,) = run_dirs(tmp_path)
    dp, single = read_metrics(run_dir), read_metrics(default_run[1])
    clocks = {"train/epoch_time", "train/images_per_s"}
    assert dp.keys() == single.keys()
    assert {k: dp[k] for k in dp.keys() - clocks} == {k: single[k] for k in single.keys() - clocks}  # identical
    assert "strategy=dp with devices=1 is single-device training" in proc.stdout + proc.stderr
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert not any(k.startswith("module.") or "._data_parallel" in k for k in state)


@pytest.mark.skipif(GPUS > 0, reason="checks the refusal on a machine without CUDA")
def test_dp_with_several_devices_is_refused_without_gpus(tmp_path):
    with pytest.raises(UserError, match="strategy=dp splits each batch over CUDA GPUs .* use strategy=ddp devices=2"):
        prepare(compose_config(["strategy=dp", "devices=2"], tmp_path))


def test_dp_on_several_nodes_is_refused(tmp_path):
    with pytest.raises(UserError, match="use strategy=ddp for several nodes"):
        prepare(compose_config(["strategy=dp", "num_nodes=2", "accelerator=cpu"], tmp_path))


@pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")
def test_dp_on_two_gpus_matches_one_gpu(tmp_path):
    common = ["accelerator=gpu", "debug=limit", "trainer.deterministic=true", "trainer.benchmark=false", "tf32=false"]
    train(tmp_path / "one", "strategy=auto", "devices=1", *common)
    train(tmp_path / "two", "strategy=dp", "devices=2", *common)
    one, two = (read_metrics(run_dirs(tmp_path / name)[0]) for name in ("one", "two"))
    assert abs(one["test/acc"] - two["test/acc"]) <= 1 / 271 + 1e-9  # float summation order only


@pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")
def test_dp_replicas_use_the_callers_bf16_autocast():
    net = nn.Linear(8, 4).cuda()
    wrapped = nn.DataParallel(_ClassForward(net), device_ids=[0, 1])
    wrapped.module.autocast = (True, torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = wrapped(torch.randn(16, 8, device="cuda"))
    assert out.dtype == torch.bfloat16  # torch's own replica threads would have used fp16
