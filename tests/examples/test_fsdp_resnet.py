"""fsdp on the ResNets: residual blocks as sharding units, BatchNorm under bf16-mixed with channels_last, and
buffers under CPU offload. Part of the larger examples (`examples=minimal` leaves out the ResNets)."""

import pytest
import torch

from conftest import PROBES, train
from mynet.models.classifier import Classifier
from mynet.models.nets.torchvision import torchvision_net
from starter.strategies.fsdp import move_state_but_parameters, sharding_units

# 2 CPU processes, as in test_fsdp.py
TWO_PROCESSES = ["accelerator=cpu", "devices=2"]


def test_sharding_units_are_the_outermost_matching_modules():
    net = torchvision_net("resnet18", 10)
    units = sharding_units(net, ["BasicBlock", "Linear", "Conv2d"])
    assert sum(type(u).__name__ == "BasicBlock" for u in units) == 8  # 4 stages x 2 blocks
    assert {type(u).__name__ for u in units} == {"BasicBlock", "Conv2d", "Linear"}  # + the stem conv and fc
    assert len(units) == 10  # the convs inside blocks are not split again


@pytest.mark.slow
def test_fsdp_bf16_mixed_with_channels_last_runs_a_batchnorm_net_on_nhwc_activations(tmp_path):
    # FSDP2 refuses non-contiguous (channels_last) parameters: the inputs are made channels_last instead.
    # BatchNorm under bf16-mixed keeps fp32 weights beside its fp32 statistics (a bf16 weight failed on GPU).
    # One step: the recipe's lr 0.1 on 8x8 digits diverges from the second (loss 2.2 -> 6.3, NaN in some runs), which
    # this test is not about.
    probe = tmp_path / "probe"
    train(tmp_path, "strategy=fsdp", "model=resnet18", "precision=bf16-mixed", "channels_last=true", *TWO_PROCESSES,
          "data.batch_size=16", "debug=limit", "trainer.limit_train_batches=1", "trainer.limit_val_batches=1",
          "trainer.max_epochs=1", "test=false", "+callbacks.probe._target_=probes.RecordConvInputLayout",
          f"+callbacks.probe.output={probe}", env=PROBES)  # fmt: skip
    assert [(probe / f"rank{r}.txt").read_text() for r in (0, 1)] == ["channels_last", "channels_last"]


def test_cpu_offload_keeps_metric_states_and_buffers_with_the_batch_and_parameters_where_fsdp_puts_them():
    model = Classifier(torchvision_net("resnet18", 10), 10, optimizer=torch.optim.SGD)
    move_state_but_parameters(model, torch.device("meta"))  # "meta" stands for the GPU of a GPU host
    assert model.val_acc.total.device.type == model.test_loss.total.device.type == "meta"
    assert model.net.bn1.running_mean.device.type == "meta"
    assert all(p.device.type == "cpu" for p in model.parameters())
