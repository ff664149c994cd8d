"""What a user brings fits as the README's "Adapt it" table says, with code this starter does not ship: a
LightningModule of one's own (its own keys and metrics, no accuracy) under one process, ddp and fsdp, its monitored
metric followed by the best checkpoint, metrics.json, the table and the sweep's objective; a net of one's own
qualified for tensor parallel by its structure (tp, 2D) and cut into a pipeline (pp); a DataModule, a logger, a
callback and a strategy preset of one's own. Each lives in a package and a config folder outside this repository
(`hydra.searchpath`)."""

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import compose_config, model_weights, read_metrics, run_dirs, sweep_jobs, train

TASK = '''
import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanSquaredError


class Regressor(L.LightningModule):
    """How bright an image is: a task with its own keys and metric, and nothing of the starter's Classifier."""

    def __init__(self, in_features: int, hidden: int = 32, learning_rate: float = 0.05):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.learning_rate = learning_rate
        self.val_mse, self.test_mse = MeanSquaredError(), MeanSquaredError()

    def forward(self, images):
        return self.body(images).squeeze(-1)

    def training_step(self, batch, batch_idx):
        images, targets = batch
        return F.mse_loss(self(images), targets)

    def validation_step(self, batch, batch_idx):
        self.val_mse.update(self(batch[0]), batch[1])
        self.log("val/mse", self.val_mse)

    def test_step(self, batch, batch_idx):
        self.test_mse.update(self(batch[0]), batch[1])
        self.log("test/mse", self.test_mse)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.learning_rate)
'''
DATA = '''
import torch

from starter.data.base import ShardedDataModule
from bed.data import TensorPairs


class Brightness(ShardedDataModule):
    """Random 1x4x4 images and their mean brightness in [0, 1]."""

    def __init__(self, size: int = 512, **kwargs):
        super().__init__(**kwargs)
        self.size = size

    def setup(self, stage=None):
        if self.train_set is not None:
            return
        images = torch.randint(0, 256, (self.size, *self.image_shape), dtype=torch.uint8,
                               generator=torch.Generator().manual_seed(self.seed))
        targets = images.float().mean(dim=(1, 2, 3)) / 255
        self.mean, self.std = (127.5,), (73.9,)
        self.value_range = 1.0
        parts = torch.arange(self.size).tensor_split(4)
        train = torch.cat(parts[:2])
        self.train_set, self.val_set, self.test_set = (TensorPairs(images[p], targets[p]) for p in (train, *parts[2:]))
'''
NETS = '''
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(self.fc1(x).relu())


class Residual(nn.Sequential):
    """A net of one's own: an MLP of residual blocks whose children are named fc1 and fc2."""

    def __init__(self, in_shape, num_classes: int, width: int = 32, depth: int = 2):
        super().__init__(nn.Flatten(), nn.Linear(in_shape[0] * in_shape[1] * in_shape[2], width),
                         *(Block(width) for _ in range(depth)), nn.Linear(width, num_classes))
'''
LOGGER = """
import json
from pathlib import Path

from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only


class JsonLines(Logger):
    def __init__(self, path: str):
        super().__init__()
        self.path = Path(path)

    name, version = "jsonl", 0

    @rank_zero_only
    def log_metrics(self, metrics, step=None):
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **{k: float(v) for k, v in metrics.items()}}) + "\\n")

    @rank_zero_only
    def log_hyperparams(self, params, *args, **kwargs):
        pass
"""
CALLBACK = '''
import json
from pathlib import Path

import lightning as L


class Placements(L.Callback):
    """At the end of fit, each rank writes how it holds each parameter: whole, or its DTensor placements."""

    def __init__(self, output: str):
        self.output = Path(output)

    def on_fit_end(self, trainer, pl_module):
        held = {name: str(getattr(p, "placements", "whole")) for name, p in pl_module.named_parameters()}
        self.output.mkdir(parents=True, exist_ok=True)
        (self.output / f"rank{trainer.global_rank}.json").write_text(json.dumps(held))
'''
CONFIGS = {
    "model/regressor.yaml": """
        _target_: mine.task.Regressor
        in_features: 16
        hidden: 32
        learning_rate: 0.5
    """,
    "data/brightness.yaml": """
        _target_: mine.data.Brightness
        batch_size: 32
        image_shape: [1, 4, 4]
        num_classes: 1
        seed: ${seed}
    """,
    "logger/jsonl.yaml": """
        defaults:
          - csv
          - _self_
        jsonl:
          _target_: mine.logger.JsonLines
          path: ${paths.output_dir}/own_metrics.jsonl
    """,
    "callbacks/placements.yaml": """
        defaults:
          - default
          - _self_
        placements:
          _target_: mine.callback.Placements
          output: ${paths.output_dir}/placements
    """,
    "experiment/brightness.yaml": """
        # @package _global_
        defaults:
          - override /data: brightness
          - override /model: regressor
          - override /logger: jsonl
          - override /callbacks: placements
        monitor: val/mse
        monitor_mode: min
        trainer:
          max_epochs: 3
    """,
    "model/residual.yaml": """
        defaults:
          - base/classifier@_here_
          - _self_
        net:
          _target_: mine.nets.Residual
          in_shape: ${data.image_shape}
          num_classes: ${data.num_classes}
    """,
    "strategy/fsdp_2d.yaml": """
        defaults:
          - fsdp
          - _self_
        tensor_parallel_size: 2
    """,
}


@pytest.fixture(scope="module")
def own(tmp_path_factory) -> Path:
    """A package `mine` and a config folder of one's own, outside the repository."""
    root = tmp_path_factory.mktemp("own")
    (root / "mine").mkdir()
    for name, text in {"__init__": "", "task": TASK, "data": DATA, "nets": NETS, "logger": LOGGER,
                       "callback": CALLBACK}.items():  # fmt: skip
        (root / "mine" / f"{name}.py").write_text(text)
    for name, text in CONFIGS.items():
        (root / "conf" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "conf" / name).write_text(textwrap.dedent(text).lstrip())
    sys.path.insert(0, str(root))  # the runs made in this process import it as the workers do, from PYTHONPATH
    return root


def searchpath(own: Path) -> str:
    return f"hydra.searchpath=[file://{own / 'conf'}]"


@pytest.fixture(scope="module")
def single(own, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("single")
    proc = train(tmp_path, "experiment=brightness", searchpath(own))
    return run_dirs(tmp_path, "train")[0], proc


def test_a_task_of_ones_own_trains_and_reports_its_own_metric(single):
    run_dir, proc = single
    metrics = read_metrics(run_dir)
    assert {"val/mse", "test/mse", "val/mse_best"} <= metrics.keys() and not any("acc" in k for k in metrics)
    logged = [json.loads(line) for line in (run_dir / "own_metrics.jsonl").read_text().splitlines()]  # its logger
    val = [row["val/mse"] for row in logged if "val/mse" in row]
    assert len(val) == 3 and metrics["val/mse_best"] == pytest.approx(min(val))
    best = torch.load(run_dir / "checkpoints" / "best.ckpt", weights_only=True)
    (state,) = [s for k, s in best["callbacks"].items() if "'monitor': 'val/mse'" in k]
    assert float(state["best_model_score"]) == pytest.approx(min(val))  # the lowest, not the highest
    assert any(line.split()[:1] == ["test/mse"] for line in proc.stdout.splitlines())  # a row of the table
    assert (run_dir / "placements" / "rank0.json").is_file()  # its callback


def test_the_sweep_objective_is_the_tasks_monitored_metric(own, tmp_path):
    from starter.main import main

    cfg = compose_config(["experiment=brightness", searchpath(own), "trainer.max_epochs=1",
                          "trainer.enable_progress_bar=false", "accelerator=cpu"], tmp_path / "run")  # fmt: skip
    assert main(cfg) == read_metrics(tmp_path / "run")["val/mse"]


@pytest.mark.slow
def test_a_task_of_ones_own_trains_under_ddp_and_fsdp_as_in_one_process(own, single, tmp_path):
    train(tmp_path, "-m", "experiment=brightness", searchpath(own), "strategy=ddp,fsdp", "devices=2",
          env={"PYTHONPATH": str(own)})  # fmt: skip
    for job in sweep_jobs(tmp_path):
        parallel, one = read_metrics(job), read_metrics(single[0])
        assert parallel["test/mse"] == pytest.approx(one["test/mse"], rel=1e-4)  # float summation order only
        assert (job / "checkpoints" / "best.ckpt").exists()


@pytest.fixture(scope="module")
def own_net_single(own, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("own_net")
    train(tmp_path, "model=residual", searchpath(own), "debug=limit")
    return run_dirs(tmp_path)[0]


@pytest.mark.slow
def test_a_net_of_ones_own_is_split_by_its_structure_under_tp_and_2d_and_cut_into_a_pipeline(own, own_net_single,
                                                                                            tmp_path):  # fmt: skip
    train(tmp_path, "-m", "model=residual", searchpath(own), "strategy=tp,fsdp_2d,pp", "devices=2", "debug=limit",
          "callbacks=placements", env={"PYTHONPATH": str(own)})  # fmt: skip
    tp, two_d, pp = sweep_jobs(tmp_path)
    single = model_weights(own_net_single)
    for job in (tp, two_d, pp):
        weights = model_weights(job)
        assert max((weights[k] - single[k]).abs().max().item() for k in single) <= 1e-5
    for job in (tp, two_d):
        held = json.loads((job / "placements" / "rank1.json").read_text())
        assert "Shard(dim=0)" in held["net.2.fc1.weight"] and "Shard(dim=1)" in held["net.2.fc2.weight"]
    held = [json.loads((pp / "placements" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(v == "whole" for h in held for v in h.values())


def test_the_tensor_parallel_plan_is_read_off_the_structure_or_declared_and_a_net_without_one_is_refused(own):
    from hydra.utils import instantiate
    from mine.nets import Residual
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from starter.errors import UserError
    from starter.strategies.tp import apply_tensor_parallel, check_splits, tensor_parallel_plan

    plan = tensor_parallel_plan(Residual([1, 4, 4], num_classes=10))  # its blocks' fc1, fc2; not the stem and head
    styles = {"fc1": ColwiseParallel, "fc2": RowwiseParallel}
    assert {k: type(v) for k, v in plan.items()} == {f"{i}.{fc}": style for i in (2, 3) for fc, style in styles.items()}

    class Declares(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)

        def tensor_parallel_plan(self):
            return {"up": ColwiseParallel(), "down": RowwiseParallel()}

    assert set(tensor_parallel_plan(Declares())) == {"up", "down"}

    class Convolutions(torch.nn.Sequential):  # no Linear layer at all
        def __init__(self):
            super().__init__(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Conv2d(4, 10, 6), torch.nn.Flatten())

    lacks = "nothing to split in Convolutions: it needs attention blocks with Linear children q, k, v and proj"
    with pytest.raises(UserError, match=f"tensor parallel found {lacks}, MLP blocks with fc1 and fc2"):
        apply_tensor_parallel(torch.nn.Sequential(Convolutions()), mesh=None)
    vit = instantiate(compose_config(["model=bed_vit"], own / "run").model.net)  # 4 heads of 24 features
    with pytest.raises(UserError, match="has 4 attention heads, which do not split over 3 tensor-parallel processes"):
        check_splits(vit, tensor_parallel_plan(vit), 3)
