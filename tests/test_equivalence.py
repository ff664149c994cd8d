"""Modes are interchangeable: same seed, data and global batch give the same weights and the same metrics."""

import csv

import pytest
import torch

from conftest import read_metrics, run_dirs, train

pytestmark = pytest.mark.slow
# 4 epochs x 5 batches = 20 optimizer steps of the global batch 64, on CPU in fp32.
STEPS = ["accelerator=cpu", "debug=limit", "trainer.max_epochs=4"]


def weights(tmp_path, *overrides):
    train(tmp_path, *STEPS, *overrides)
    (run_dir,) = run_dirs(tmp_path)
    return torch.load(run_dir / "checkpoints" / "model.pt", weights_only=True)


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, global batch 64: what every other mode must reproduce."""
    return weights(tmp_path_factory.mktemp("single"))


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    return weights(tmp_path_factory.mktemp("ddp"), "strategy=ddp", "devices=2")


def test_ddp_on_two_processes_matches_one_process(reference, ddp):
    # Each rank averages the gradient of its 32 samples and all-reduce averages the two: the same mean over 64.
    assert max_difference(reference, ddp) <= 1e-5


def test_ddp_spawn_matches_ddp(ddp, tmp_path):
    assert max_difference(ddp, weights(tmp_path, "strategy=ddp_spawn", "devices=2")) <= 1e-5


def test_gradient_accumulation_of_two_half_batches_matches_the_full_batch(reference, tmp_path):
    # Two micro-batches of 32 are the two halves of each 64-batch (same sampler order); Lightning divides
    # each half's loss by 2, so the summed gradient is the full batch's mean gradient.
    accumulated = weights(tmp_path, "data.batch_size=32", "trainer.accumulate_grad_batches=2",
                          "trainer.limit_train_batches=10")  # fmt: skip
    assert max_difference(reference, accumulated) <= 1e-5


def test_dp_on_one_device_is_identical_to_single_device(reference, tmp_path):
    dp = weights(tmp_path, "strategy=dp")
    assert all(torch.equal(reference[k], dp[k]) for k in reference)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("trained")
    train(tmp_path, "accelerator=cpu", "trainer.max_epochs=3")  # weights good enough that the test split matters
    return run_dirs(tmp_path)[0] / "checkpoints" / "best.ckpt"


@pytest.fixture(scope="module")
def single_eval(trained, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("single_eval")
    train(tmp_path, "train=false", f"ckpt_path={trained}", "accelerator=cpu")
    return read_metrics(run_dirs(tmp_path)[0])


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn", "fsdp"])
def test_evaluation_on_an_odd_test_split_is_exact_under_every_strategy(trained, single_eval, strategy, tmp_path):
    train(tmp_path, "train=false", f"ckpt_path={trained}", f"strategy={strategy}", "devices=2", "accelerator=cpu")
    metrics = read_metrics(run_dirs(tmp_path)[0])
    # 271 test images: 136 + 135 over two ranks, none padded in twice (a padded sample would make the count
    # 272). Accuracy is a ratio of integer counts: equal. The loss is a weighted sum of floats added in
    # another order: equal to 1e-6.
    correct = metrics["test/acc"] * 271
    assert abs(correct - round(correct)) < 1e-4  # a whole number of the 271 images (float32 ratio)
    assert metrics["test/acc"] == single_eval["test/acc"]
    assert abs(metrics["test/loss"] - single_eval["test/loss"]) <= 1e-6


@pytest.mark.parametrize("strategy", ["auto", "ddp"])
def test_resuming_after_one_epoch_gives_the_weights_of_two_straight_epochs(strategy, tmp_path):
    common = [f"strategy={strategy}", f"devices={1 if strategy == 'auto' else 2}", "accelerator=cpu",
              "debug=limit", "model.scheduler.T_max=2", "trainer.log_every_n_steps=1"]  # fmt: skip
    straight = weights(tmp_path / "straight", *common, "trainer.max_epochs=2")
    train(tmp_path / "first", *common, "trainer.max_epochs=1")
    last = run_dirs(tmp_path / "first")[0] / "checkpoints" / "last.ckpt"
    resumed = weights(tmp_path / "resumed", *common, "trainer.max_epochs=2", f"ckpt_path={last}")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)  # bit for bit
    with open(run_dirs(tmp_path / "resumed")[0] / "metrics.csv", newline="") as f:
        assert {row["epoch"] for row in csv.DictReader(f) if row["train/loss"]} == {"1"}
