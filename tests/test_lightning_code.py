"""Code written for Lightning, not for this starter (tests/foreign: a Lightning + Hydra template's module and
DataModule, manual optimization with two optimizers on dict batches that logs no `val/*` metric, a language model on
an IterableDataset), brought in with nothing but config files (`hydra.searchpath`), runs as Lightning runs it: in one
process and under ddp the very weights Lightning's own Trainer gives; under ddp and fsdp Lightning's steps an epoch,
each sample once an epoch across the ranks (Lightning's DistributedSampler, or the data set's own split); stopped by
SIGTERM mid-epoch and resumed, the steps Lightning gives and the line that says what the resumed epoch trains;
checkpoints that load weights-only."""

import json
import math
import shutil
import subprocess
import sys
import textwrap
from collections import Counter

import pytest
import torch

from conftest import PROBES, ROOT, model_weights, predict, read_metrics, run_dirs, train, with_env
from probes import sample_ids

FOREIGN = ROOT / "tests" / "foreign"
SEARCHPATH = f"hydra.searchpath=[file://{FOREIGN / 'conf'}]"
RECORD = ["+callbacks.samples._target_=probes.RecordSamples", "+callbacks.samples.output=${paths.output_dir}/samples"]
# Per experiment (2 epochs): training samples, batches an epoch in one process and per rank of two, the global steps
# a batch makes (manual optimization steps two optimizers), and the global step after which a stop signal is sent
# (the ranks stop within two optimizer steps, in the second epoch; manual logs every 4th batch).
EXPERIMENTS = {
    "template": dict(samples=1197, one=19, two=19, steps_per_batch=1, stop=[25]),  # 64 a step, 32 a rank
    "manual": dict(samples=1000, one=20, two=10, steps_per_batch=2, stop=[22, "trainer.log_every_n_steps=4"]),
    "tokens": dict(samples=256, one=16, two=8, steps_per_batch=1, stop=[9]),  # 16 a process
}


def training_ids(experiment: str) -> Counter:
    """The training split's samples as the DataModule itself makes them, named as probes.RecordSamples names them."""
    from foreign.manual import DictDigits
    from foreign.template import DigitsDataModule
    from foreign.tokens import TokenStream

    datamodule = {"template": DigitsDataModule, "manual": DictDigits, "tokens": TokenStream}[experiment]()
    datamodule.setup("fit")
    loader = datamodule.train_dataloader()
    return Counter(i for batch in loader for i in sample_ids(batch))


def recorded(run_dir) -> list[list[dict]]:
    """Each rank's recorded batches (epoch, step, ids), in order."""
    files = sorted((run_dir / "samples").glob("rank*.jsonl"))
    return [[json.loads(line) for line in f.read_text().splitlines()] for f in files]


def per_epoch(batches: list[dict], epoch: int) -> list[dict]:
    return [b for b in batches if b["epoch"] == epoch]


def run(tmp_path, experiment: str, *overrides: str, **kwargs):
    return train(tmp_path, f"experiment={experiment}", SEARCHPATH, *RECORD, *overrides, env=PROBES, **kwargs)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    runs = {}
    for experiment in EXPERIMENTS:
        tmp_path = tmp_path_factory.mktemp(f"one_{experiment}")
        proc = run(tmp_path, experiment, "trainer.enable_progress_bar=true")  # a pipe: one line an epoch
        runs[experiment] = (run_dirs(tmp_path)[0], proc)
    return runs


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_in_one_process_each_epoch_trains_every_sample_once_and_checkpoints_load_weights_only(one_process, experiment):
    run_dir, proc = one_process[experiment]
    expected = EXPERIMENTS[experiment]
    (batches,) = recorded(run_dir)
    everything = training_ids(experiment)
    for epoch in (0, 1):
        trained = per_epoch(batches, epoch)
        assert len(trained) == expected["one"]
        assert Counter(i for b in trained for i in b["ids"]) == everything
    assert batches[-1]["step"] == (2 * expected["one"] - 1) * expected["steps_per_batch"]
    for checkpoint in (run_dir / "checkpoints").glob("*.ckpt"):
        torch.load(checkpoint, weights_only=True)  # whatever the module saved with save_hyperparameters
    assert any(line.split()[:1] == ["run"] for line in proc.stdout.splitlines())  # the table and the run directory
    epochs = [line for line in proc.stdout.splitlines() if line.startswith("epoch ")]
    assert len(epochs) == 2 and all(line.count(" train/loss ") + line.count(" train_loss ") <= 1 for line in epochs)


def test_the_templates_module_saves_its_net_and_partials_as_their_config_and_trains_what_lightning_trains(
    one_process, tmp_path
):
    run_dir, _ = one_process["template"]
    saved = torch.load(run_dir / "checkpoints" / "best.ckpt", weights_only=True)["hyper_parameters"]
    assert saved["net"]["_target_"] == "foreign.template.SimpleDenseNet" and saved["net"]["lin2_size"] == 128
    assert saved["optimizer"] == {"_target_": "torch.optim.Adam", "_partial_": True, "lr": 0.001, "weight_decay": 0.0}
    assert saved["scheduler"]["_target_"] == "torch.optim.lr_scheduler.ReduceLROnPlateau"
    # Lightning's own Trainer on the same module and DataModule, same seed: the same weights, bit for bit
    script = textwrap.dedent(f"""
        import lightning as L, torch
        from hydra import compose, initialize_config_dir
        from hydra.utils import instantiate
        with initialize_config_dir(config_dir="{ROOT / "conf"}", version_base="1.3"):
            cfg = compose("train", overrides=["experiment=template", "{SEARCHPATH}"])
        L.seed_everything(cfg.seed, workers=True)
        datamodule, model = instantiate(cfg.data), instantiate(cfg.model)
        L.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False).fit(model, datamodule=datamodule)
        torch.save(model.state_dict(), "{tmp_path / "lightning.pt"}")
    """)
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, env=with_env(PROBES))
    lightning = torch.load(tmp_path / "lightning.pt", weights_only=True)
    ours = model_weights(run_dir)
    assert ours.keys() == lightning.keys() and all(torch.equal(ours[k], lightning[k]) for k in ours)


def test_a_module_whose_hyperparameters_hold_code_comes_back_in_one_call_and_the_run_says_which(one_process):
    import starter

    run_dir, proc = one_process["template"]
    said = [line for line in proc.stdout.splitlines() if "load_from_checkpoint cannot rebuild it" in line]
    assert said == [  # once, on the console, the run directory as the run's other lines show it
        "DigitsLitModule's hyperparameters net, optimizer, scheduler are code: DigitsLitModule.load_from_checkpoint"
        f" cannot rebuild it; starter.load_module('{run_dir.relative_to(run_dir.parents[3])}') does"
    ], said
    module = starter.load_module(run_dir, config_dirs=[ROOT / "conf", FOREIGN / "conf"])
    assert type(module).__name__ == "DigitsLitModule" and not module.training
    best = torch.load(run_dir / "checkpoints" / "best.ckpt", weights_only=True)["state_dict"]  # a run's: its best
    assert module.state_dict().keys() == best.keys() and all(torch.equal(module.state_dict()[k], best[k]) for k in best)
    with pytest.raises(Exception, match="no model config here names"):  # only what the config folders name
        starter.load_module(run_dir)


def test_a_task_that_logs_no_monitored_metric_keeps_no_best_checkpoint_says_so_once_and_tests_its_final_weights(
    one_process,
):
    run_dir, proc = one_process["manual"]
    said = [line for line in proc.stdout.splitlines() if line.startswith("monitor=val/acc: the model logs no such")]
    assert len(said) == 1 and "(it logs train_loss, valid_acc)" in said[0]
    assert not (run_dir / "checkpoints" / "best.ckpt").exists() and "test_acc" in read_metrics(run_dir)


def test_predict_on_a_run_whose_datamodule_recorded_no_images_says_what_it_needs_in_one_line(one_process, tmp_path):
    from PIL import Image

    run_dir, _ = one_process["template"]
    Image.new("L", (8, 8)).save(tmp_path / "digit.png")
    proc = predict(tmp_path, f"ckpt_path={run_dir}", f"inputs={tmp_path / 'digit.png'}", expect_ok=False)
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert proc.returncode == 2 and line.endswith(
        "its run's DataModule recorded no image_shape, value_range, mean, std, classes, resize, crop (an image"
        " classifier's inference record, which a ShardedDataModule writes); predict.py and export.py need one"
    )


@pytest.mark.slow
@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_under_ddp_each_rank_trains_lightnings_share_and_every_sample_once_an_epoch(experiment, tmp_path):
    expected = EXPERIMENTS[experiment]
    run(tmp_path, experiment, "strategy=ddp", "devices=2")
    (run_dir,) = run_dirs(tmp_path)
    ranks = recorded(run_dir)
    everything = training_ids(experiment)
    padded = 2 * math.ceil(expected["samples"] / 2)  # Lightning's DistributedSampler repeats samples to even shares
    for epoch in (0, 1):
        assert [len(per_epoch(batches, epoch)) for batches in ranks] == [expected["two"]] * 2
        seen = Counter(i for batches in ranks for b in per_epoch(batches, epoch) for i in b["ids"])
        assert seen.keys() == everything.keys()
        assert sum(seen.values()) == (expected["samples"] if experiment == "tokens" else padded)
    assert (run_dir / "metrics.json").is_file()


@pytest.mark.slow
def test_under_ddp_the_templates_module_trains_what_lightnings_own_ddp_trains(tmp_path):
    run(tmp_path, "template", "strategy=ddp", "devices=2")
    ours = model_weights(run_dirs(tmp_path)[0])
    # Lightning's Trainer(strategy="ddp", devices=2) on the same module, DataModule and seed; its launcher runs this
    # script again for rank 1
    script = tmp_path / "lightning_ddp.py"
    script.write_text(
        textwrap.dedent(f"""
        import lightning as L, torch
        from hydra import compose, initialize_config_dir
        from hydra.utils import instantiate

        if __name__ == "__main__":
            with initialize_config_dir(config_dir="{ROOT / "conf"}", version_base="1.3"):
                cfg = compose("train", overrides=["experiment=template", "{SEARCHPATH}"])
            L.seed_everything(cfg.seed, workers=True)
            datamodule, model = instantiate(cfg.data), instantiate(cfg.model)
            trainer = L.Trainer(max_epochs=2, accelerator="cpu", devices=2, strategy="ddp", logger=False,
                                enable_checkpointing=False, enable_progress_bar=False)
            trainer.fit(model, datamodule=datamodule)
            if trainer.is_global_zero:
                torch.save(model.state_dict(), "{tmp_path / "lightning.pt"}")
            torch.distributed.destroy_process_group()  # gloo aborts a process that leaves it to interpreter exit
    """)
    )
    subprocess.run([sys.executable, str(script)], check=True, capture_output=True, env=with_env(PROBES), timeout=300)
    lightning = torch.load(tmp_path / "lightning.pt", weights_only=True)
    assert ours.keys() == lightning.keys() and all(torch.equal(ours[k], lightning[k]) for k in ours)


@pytest.mark.slow
@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_under_fsdp_stopped_mid_epoch_and_resumed_it_trains_the_steps_lightning_gives_and_says_what_it_trains_again(
    experiment, tmp_path
):
    expected = EXPERIMENTS[experiment]
    again = ["strategy=fsdp", "devices=2", f"hydra.run.dir={tmp_path / 'run'}", "ckpt_path=auto"]
    step, *logging = expected["stop"]
    again += logging
    stop = ["+callbacks.stop._target_=probes.SigtermAtStep", f"+callbacks.stop.step={step}"]
    stopped = run(tmp_path, experiment, *again, *stop, expect_ok=False)
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    before = [len(per_epoch(batches, 1)) for batches in recorded(tmp_path / "run")]
    assert 0 < before[0] == before[1] < expected["two"]  # stopped mid second epoch
    resumed = run(tmp_path, experiment, *again)
    assert (
        f"resumed in epoch 2 after {before[0]} of its batches: {experiment_datamodule(experiment)} does not shard"
        " itself, so Lightning starts this epoch's batches again from its first" in resumed.stdout
    )
    for batches in recorded(tmp_path / "run"):
        second = per_epoch(batches, 1)
        stopped_part, again_from_first = second[: before[0]], second[before[0] :]
        both = min(len(stopped_part), len(again_from_first))  # the epoch's first batches, trained before and again
        assert [b["ids"] for b in again_from_first[:both]] == [b["ids"] for b in stopped_part[:both]]
        # a DataLoader with a length ends the epoch at its count of batches; an IterableDataset when it runs out
        assert len(again_from_first) == (expected["two"] if experiment == "tokens" else expected["two"] - before[0])
    metrics = read_metrics(tmp_path / "run")
    assert any(k.startswith("test") for k in metrics)


@pytest.mark.slow
def test_a_module_with_tied_weights_trains_under_fsdp_to_ddps_weights_and_keeps_its_tie_through_resumes(tmp_path):
    # the language model's output layer shares its embedding's weight (GPT-2's tie): one tensor, one gradient, one
    # FSDP group; 2 epochs under ddp, and under fsdp 1 epoch then resumed from the sharded checkpoint for the second
    from starter import load_module

    tied = ["model.tie=true", "devices=2"]
    run(tmp_path / "ddp", "tokens", *tied, "strategy=ddp")
    fsdp = [*tied, "strategy=fsdp", f"hydra.run.dir={tmp_path / 'fsdp'}", "ckpt_path=auto"]
    run(tmp_path, "tokens", *fsdp, "trainer.max_epochs=1", "test=false")
    first = (tmp_path / "fsdp" / "checkpoints" / "last.ckpt").resolve()
    shutil.copytree(first, tmp_path / "first.ckpt")
    run(tmp_path, "tokens", *fsdp)
    ours, ddp = model_weights(tmp_path / "fsdp"), model_weights(run_dirs(tmp_path / "ddp")[0])
    assert ours.keys() == ddp.keys() and max((ours[k] - ddp[k]).abs().max() for k in ours) < 1e-5
    assert torch.equal(ours["out.weight"], ours["embed.weight"])
    # at another number of processes: the first epoch's sharded checkpoint, resumed by one
    again = run(tmp_path / "one", "tokens", "model.tie=true", "strategy=fsdp", f"ckpt_path={tmp_path / 'first.ckpt'}")
    assert "continuing at 1 process (was 2)" in again.stdout
    for run_dir in (tmp_path / "fsdp", run_dirs(tmp_path / "one")[0]):
        module = load_module(run_dir, config_dirs=[ROOT / "conf", FOREIGN / "conf"])
        assert module.out.weight is module.embed.weight


def experiment_datamodule(experiment: str) -> str:
    return {"template": "DigitsDataModule", "manual": "DictDigits", "tokens": "TokenStream"}[experiment]


LIGHTNING_MODEL_PARALLEL = """
import lightning as L, torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

if __name__ == "__main__":
    with initialize_config_dir(config_dir="{conf}", version_base="1.3"):
        cfg = compose("train", overrides={overrides})
    L.seed_everything(cfg.seed, workers=True)
    model = instantiate(cfg.model)
    datamodule = instantiate(cfg.data) if "_target_" in cfg.data else None
    strategy = ModelParallelStrategy(data_parallel_size={dp}, tensor_parallel_size={tp})
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", devices=2, strategy=strategy, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(model, datamodule=datamodule)
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if trainer.is_global_zero:
        torch.save(weights, "{out}")
    torch.distributed.destroy_process_group()
"""
# a module that applies tensor parallel itself and owns its loaders; one that applies FSDP2 itself, on a DataModule
SELF_PARALLEL = {
    "tp": (["model=tp_feedforward", "data=none", "monitor=val_acc", "test=false"], 1, 2),
    "fsdp": (["model=fsdp_layers", "data=template_digits"], 2, 1),
}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", SELF_PARALLEL)
def test_a_module_that_parallelizes_itself_trains_what_lightnings_model_parallel_strategy_trains(strategy, tmp_path):
    overrides, dp, tp = SELF_PARALLEL[strategy]
    ours = [SEARCHPATH, *overrides, f"strategy={strategy}", "devices=2", "trainer.max_epochs=2"]
    if strategy == "fsdp":  # its sharded checkpoint resumed: one epoch, then the second from last.ckpt
        train(tmp_path / "first", *ours, "trainer.max_epochs=1", "test=false", env=PROBES)
        last = run_dirs(tmp_path / "first")[0] / "checkpoints" / "last.ckpt"
        ours.append(f"ckpt_path={last}")
    train(tmp_path / "ours", *ours, env=PROBES)
    (run_dir,) = run_dirs(tmp_path / "ours")
    # Lightning's own Trainer(strategy=ModelParallelStrategy(...), devices=2), same module, data and seed: its
    # launcher runs the script again for rank 1
    script = tmp_path / "lightning_model_parallel.py"
    compose_overrides = [SEARCHPATH, *(o for o in overrides if not o.startswith(("monitor", "test")))]
    script.write_text(LIGHTNING_MODEL_PARALLEL.format(conf=ROOT / "conf", overrides=compose_overrides, dp=dp, tp=tp,
                                                      out=tmp_path / "lightning.pt"))  # fmt: skip
    subprocess.run([sys.executable, str(script)], check=True, capture_output=True, env=with_env(PROBES), timeout=300)
    lightning, mine = torch.load(tmp_path / "lightning.pt", weights_only=True), model_weights(run_dir)
    assert mine.keys() == lightning.keys()  # model.pt: the whole module, gathered from its shards
    assert max((mine[k] - lightning[k]).abs().max().item() for k in mine) <= 1e-6


@pytest.mark.slow
def test_a_module_that_parallelizes_itself_is_refused_by_a_pipeline_in_one_line(tmp_path):
    proc = train(tmp_path, SEARCHPATH, "model=tp_feedforward", "data=none", "strategy=pp", "devices=2", env=PROBES,
                 expect_ok=False)  # fmt: skip
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert (
        proc.returncode == 2
        and len(errors) == 1
        and errors[0].endswith(
            "strategy=pp cuts the net into pipeline stages itself, and TensorParallelDigits applies its own parallelism"
            " in configure_model(); train it with strategy=fsdp or strategy=tp (pipeline_parallel_size=1)"
        )
    ), errors


@pytest.mark.slow
def test_a_module_that_owns_its_loaders_runs_without_a_datamodule_split_by_lightnings_sampler(tmp_path):
    steps = {}
    # no DataModule said either way Hydra has: the option data=none, or the group dropped
    for name, processes in {"one": ["data=none"], "ddp": ["~data", "strategy=ddp", "devices=2"]}.items():
        train(tmp_path / name, SEARCHPATH, "model=own_loaders", "trainer.max_epochs=1", *processes, env=PROBES)
        (run_dir,) = run_dirs(tmp_path / name)
        steps[name] = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
        assert "test/acc" in read_metrics(run_dir)
    # 1,797 digits, 64 a batch: 29 batches in one process; each of two ranks Lightning's half (899), 15 batches
    assert steps == {"one": 29, "ddp": 15}
    # hyperparameters of plain values: Lightning's own load_from_checkpoint rebuilds it, weights-only
    from foreign.parallel import DigitsWithOwnLoaders

    (run_dir,) = run_dirs(tmp_path / "ddp")
    loaded = DigitsWithOwnLoaders.load_from_checkpoint(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert torch.equal(loaded.layer.weight, model_weights(run_dir)["layer.weight"])


def test_hyperparameters_of_types_of_their_own_are_saved_as_the_primitives_they_are(tmp_path):
    import collections
    import enum

    import numpy as np

    from starter.checkpointing.hyperparameters import PlainHyperparameters

    class Colour(str, enum.Enum):
        RED = "red"

    class Size(enum.IntEnum):
        BIG = 3

    pair = collections.namedtuple("Pair", "a b")
    saved = {"hyper_parameters": {"lr": np.float64(0.5), "steps": np.int64(3), "colour": Colour.RED, "size": Size.BIG,
                                  "pair": pair(1, np.float32(2.0)), "names": ["a", Colour.RED]}}  # fmt: skip
    PlainHyperparameters(model={}, data={}).on_save_checkpoint(None, None, saved)
    torch.save(saved, tmp_path / "saved.ckpt")
    loaded = torch.load(tmp_path / "saved.ckpt", weights_only=True)["hyper_parameters"]  # the starter's own reader
    assert loaded == {"lr": 0.5, "steps": 3, "colour": "red", "size": 3, "pair": (1, 2.0), "names": ["a", "red"]}
    assert [type(v) for v in loaded.values()] == [float, int, str, int, tuple, list]
