"""torchvision's reference-recipe knobs of the engine that work on any data (mixing, weight averaging, repeated
augmentation, sync_batchnorm), each doing what it says on a fixed batch or a composed config. The image-folder ones,
crops and auto-augment, are in test_image_folder.py; the example task's (label smoothing, norm weight decay, the
warm-up) in tests/examples/test_example_task.py."""

import math

import pytest
import torch
from torch import nn

from bed.data import RandomImages
from bed.task import Classifier
from conftest import compose_config, max_difference, model_weights, read_metrics, run_dirs, train
from starter.data.base import batch_mixing
from starter.errors import UserError
from starter.preflight import prepare


@pytest.mark.parametrize("mixup,cutmix", [(0.2, 0.0), (0.0, 1.0), (0.2, 1.0)])
def test_mixup_and_cutmix_give_soft_targets_whose_rows_sum_to_1_and_a_finite_loss(mixup, cutmix):
    torch.manual_seed(0)
    images, labels = torch.rand(8, 3, 16, 16), torch.arange(8) % 10
    mixed, targets = batch_mixing(mixup, cutmix, 10)(images, labels)
    assert targets.shape == (8, 10) and torch.allclose(targets.sum(dim=1), torch.ones(8))
    assert (targets > 0).sum(dim=1).max() == 2 and not torch.equal(mixed, images)  # two classes mixed per row
    model = Classifier(nn.Sequential(nn.Flatten(), nn.Linear(768, 10)), 10, optimizer=torch.optim.SGD)
    assert math.isfinite(model.criterion(model(mixed), targets).item())
    assert batch_mixing(0.0, 0.0, 10) is None  # off by default


@pytest.mark.parametrize("overrides,message", [
    (["strategy=ddp", "devices=2"], "sync_batchnorm=true needs GPUs: torch's SyncBatchNorm does not run on CPU"),
    (["strategy=fsdp", "devices=2"], "sync_batchnorm=true is for strategy=ddp or ddp_spawn, not strategy=fsdp"),
])  # fmt: skip
def test_sync_batchnorm_is_refused_where_it_cannot_run(overrides, message, tmp_path):
    cfg = compose_config(["sync_batchnorm=true", "accelerator=cpu", *overrides], tmp_path)
    with pytest.raises(UserError, match=message):
        prepare(cfg)
    prepare(compose_config(["sync_batchnorm=true", "accelerator=cpu"], tmp_path))  # one process: nothing to sync


def test_ema_weights_are_the_ones_validated_tested_and_exported(tmp_path):
    train(tmp_path, "debug=limit", "trainer.max_epochs=2", "callbacks.weight_averaging.decay=0.9")
    run_dir = run_dirs(tmp_path)[0]
    last = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    averaged, raw = last["state_dict"], last["current_model_state"]  # Lightning's EMAWeightAveraging layout
    assert max_difference(averaged, raw) > 1e-4  # the average lags the raw weights
    assert max_difference(model_weights(run_dir), averaged) == 0.0
    # evaluating best.ckpt (the averaged weights) gives the run's test metrics: it is what the run tested
    best = run_dir / "checkpoints" / "best.ckpt"
    evaluated = train(
        tmp_path / "eval", "debug=limit", "train=false", f"ckpt_path={best}", "callbacks.weight_averaging.decay=0.9"
    )
    assert evaluated.returncode == 0
    assert read_metrics(run_dirs(tmp_path / "eval")[0])["test/acc"] == read_metrics(run_dir)["test/acc"]
    with pytest.raises(UserError, match="callbacks.weight_averaging.decay .* strategy=fsdp shards them"):
        prepare(
            compose_config(
                ["callbacks.weight_averaging.decay=0.9", "strategy=fsdp", "devices=2", "accelerator=cpu"], tmp_path
            )
        )


def test_the_weight_average_updates_without_reading_the_device_and_restarts_during_warm_up(monkeypatch):
    from types import SimpleNamespace

    import lightning as L

    from starter.callbacks.weight_averaging import AveragedWeights

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer, self.norm = torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2)  # float and integer buffers

    module, trainer = Tiny(), SimpleNamespace(current_epoch=0)
    module.trainer = trainer  # the update reads the epoch from the module it averages
    ema = AveragedWeights(decay=0.9, warmup_epochs=1)
    ema.setup(trainer, module, "fit")
    update, expected = ema._average_model.update_parameters, None

    def host_read(*args, **kwargs):
        raise AssertionError("the update read a tensor on the host")

    for step in range(5):
        trainer.current_epoch = step // 2  # 2 steps of warm-up epoch 0, then epoch 1
        with torch.no_grad():
            module.layer.weight.add_(1.0)
            module.norm.num_batches_tracked.add_(1)
        current = module.layer.weight.detach().clone()
        expected = current if trainer.current_epoch < 1 else expected + 0.1 * (current - expected)
        with monkeypatch.context() as patched:
            if step > 0:  # the first update reads the count once (a resumed average continues it)
                for name in ("__bool__", "item", "tolist", "__int__", "__float__", "__index__"):
                    patched.setattr(torch.Tensor, name, host_read)
            update(module)
        averaged = ema._average_model.module
        assert torch.allclose(averaged.layer.weight, expected, atol=1e-6)
    assert averaged.norm.num_batches_tracked.item() == 5 and ema._average_model.n_averaged.item() == 5
    assert not torch.allclose(averaged.layer.weight, module.layer.weight)  # it lags after the warm-up


def test_repeated_augmentation_puts_each_images_copies_on_consecutive_ranks_and_keeps_the_epoch_length():
    from starter.data.repeated_augmentation import RepeatedAugmentationSampler

    data = list(range(12))
    ranks = [RepeatedAugmentationSampler(data, num_replicas=2, rank=r, repetitions=3, seed=7) for r in (0, 1)]
    for epoch in (0, 1):
        for sampler in ranks:
            sampler.set_epoch(epoch)
        order = torch.randperm(12, generator=torch.Generator().manual_seed(7 + epoch)).tolist()
        stream = [i for i in order for _ in range(3)]  # each image 3 times in a row, dealt to the ranks in turn
        assert [list(s) for s in ranks] == [stream[0::2][:6], stream[1::2][:6]]
        assert len(ranks[0]) == len(ranks[1]) == 6  # 12 images // 2 ranks: as many steps as without it
        assert list(ranks[0])[0] == list(ranks[1])[0]  # the first image on both ranks, augmented twice
    dm = RandomImages(batch_size=4, image_shape=[3, 8, 8], num_classes=4, train_size=16, eval_size=8, ra_reps=2)
    dm.setup()
    assert isinstance(dm.train_dataloader().batch_sampler.sampler, RepeatedAugmentationSampler)
