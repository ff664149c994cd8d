"""The template's example task (src/mynet/models/classifier.py): torchvision's recipe knobs it implements, each
doing what it says on a fixed batch or a run. They go with the example: delete this file with it."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import ROOT, train
from mynet.models.classifier import Classifier


def classifier(**knobs) -> Classifier:
    net = nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.LayerNorm(8), nn.Linear(8, 10))
    return Classifier(net, 10, optimizer=lambda params: torch.optim.SGD(params, lr=0.1, weight_decay=0.5), **knobs)


def test_label_smoothing_moves_the_loss_by_its_known_amount():
    logits, labels = torch.randn(6, 10, generator=torch.Generator().manual_seed(0)), torch.arange(6)
    plain = classifier().criterion(logits, labels)
    smoothed = classifier(label_smoothing=0.1).criterion(logits, labels)
    uniform = -F.log_softmax(logits, dim=-1).mean(dim=-1).mean()  # cross-entropy against the uniform target
    assert smoothed.item() == pytest.approx(0.9 * plain.item() + 0.1 * uniform.item(), rel=1e-6)


def test_norm_weight_decay_puts_norm_layers_in_their_own_group():
    groups = classifier(norm_weight_decay=0.0).configure_optimizers().param_groups
    assert [len(g["params"]) for g in groups] == [4, 2] and [g["weight_decay"] for g in groups] == [0.5, 0.0]
    assert len(classifier().configure_optimizers().param_groups) == 1  # null: one group, as before


def test_lr_warmup_rises_linearly_over_its_steps_then_follows_the_schedule(tmp_path, monkeypatch):
    # 3 epochs of 5 steps, a cosine schedule over 3 epochs, 2 warm-up epochs: 10 steps from 0.01x to 1x
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    rates = tmp_path / "rates.json"
    train(tmp_path, "model=mlp", "data=digits", "debug=limit", "test=false", "trainer.max_epochs=3",
          "model.lr_warmup_epochs=2", "+callbacks.lr._target_=probes.RecordLearningRates",
          f"+callbacks.lr.output={rates}")  # fmt: skip
    scheduled = [0.002 * (1 + math.cos(math.pi * (step // 5) / 3)) / 2 for step in range(15)]
    factors = [0.01 + 0.99 * step / 10 if step < 10 else 1.0 for step in range(15)]
    assert json.loads(rates.read_text()) == pytest.approx([s * f for s, f in zip(scheduled, factors)], rel=1e-6)
