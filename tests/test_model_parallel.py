"""Model parallelism on 2, 4 and 8 CPU processes: tensor parallel (tp), pipeline parallel (pp, every schedule),
2D (fsdp x tp), pipelines side by side (pp x dp) and 3D (fsdp x pp x tp) train the weights of one process, also
accumulating gradients over two half batches, split what they say they split, resume from their sharded
checkpoints (also mid-epoch) and export a model.pt that loads into the plain net."""

import csv
import json

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from conftest import (
    CONFIG_DIRS,
    PROBES,
    SMALL_VIT_20_STEPS,
    compose_config,
    max_difference,
    model_weights,
    read_metrics,
    run_dirs,
    sweep_jobs,
    train,  # fmt: skip
)
from starter.errors import UserError
from starter.preflight import prepare

pytestmark = pytest.mark.slow
VIT = [*SMALL_VIT_20_STEPS, "trainer.log_every_n_steps=1"]
# Each optimizer step accumulates two half batches (10 batches of 32 an epoch): the same 20 steps of the same
# global batches as the reference. (A pipeline that dropped the accumulation factor from its loss would step twice
# as far.) Evaluation sees the same 128 samples in 4 batches of 32.
ACCUMULATE = ["data.batch_size=32", "trainer.accumulate_grad_batches=2", "trainer.limit_train_batches=10",
              "trainer.limit_val_batches=4", "trainer.limit_test_batches=4"]  # fmt: skip
# Float summation order differs (partial sums across ranks, micro-batches): the same maths, not the same bits.
SAME = 1e-5


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("single")
    train(tmp_path, *VIT)
    return run_dirs(tmp_path)[0]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """tp and pp (1f1b, 4 micro-batches) on 2 processes each, as users sweep them: `-m strategy=tp,pp`; with the
    multi-tensor (foreach) optimizer kernels that CUDA uses by default (tp failed with them on GPU)."""
    tmp_path = tmp_path_factory.mktemp("sweep")
    train(tmp_path, "-m", "strategy=tp,pp", "devices=2", *VIT, *ACCUMULATE, "+model.optimizer.foreach=true",
          "+callbacks.shards._target_=probes.RecordShardFractions",
          "+callbacks.shards.output=${paths.output_dir}/shards", env=PROBES)  # fmt: skip
    tp, pp = sweep_jobs(tmp_path)
    return {"tp": tp, "pp": pp}


@pytest.mark.parametrize("strategy", ["tp", "pp"])
def test_a_model_parallel_run_trains_the_weights_of_one_process_and_reports_as_one(strategy, reference, jobs):
    assert max_difference(model_weights(reference), model_weights(jobs[strategy])) <= SAME
    single, parallel = read_metrics(reference), read_metrics(jobs[strategy])
    assert parallel.keys() == single.keys()  # metrics.json, the table: as in every other mode
    assert abs(parallel["test/loss"] - single["test/loss"]) <= 1e-5


def test_tensor_parallel_ranks_hold_half_of_every_split_weight(jobs):
    for rank in (0, 1):
        fractions = json.loads((jobs["tp"] / "shards" / f"rank{rank}.json").read_text())
        split = {name for name in fractions if name.endswith(".weight")}
        assert len(split) == 3 * 6  # 3 blocks: q, k, v, proj, fc1, fc2
        assert all(fractions[name] == 0.5 for name in split)
        assert all(".attn." in n or ".mlp." in n for n in fractions)  # embedding, norms, head: replicated


@pytest.mark.parametrize("schedule", ["gpipe", "interleaved_1f1b"])  # 1f1b: the sweep's pp job
def test_every_pipeline_schedule_trains_the_weights_of_one_process(schedule, reference, tmp_path):
    train(tmp_path, "strategy=pp", "devices=2", f"strategy.schedule={schedule}", *VIT, *ACCUMULATE, "test=false")
    assert max_difference(model_weights(reference), model_weights(run_dirs(tmp_path)[0])) <= SAME


def test_2d_fsdp_across_tensor_parallel_pairs_trains_the_weights_of_one_process(reference, tmp_path):
    # 4 processes: 2 data-parallel groups of a tensor-parallel pair; each pair shares one half of the batch
    train(tmp_path, "strategy=fsdp", "strategy.tensor_parallel_size=2", "devices=4", *VIT, *ACCUMULATE, "test=false")
    assert max_difference(model_weights(reference), model_weights(run_dirs(tmp_path)[0])) <= SAME


def test_model_pt_of_a_model_parallel_run_loads_into_the_plain_net(jobs):
    for run_dir in jobs.values():
        model = instantiate(OmegaConf.load(run_dir / "config.yaml").model)
        model.load_state_dict(model_weights(run_dir))  # strict: every stage and shard, plain names
        assert_loads_whole_for_inference(run_dir)


def assert_loads_whole_for_inference(run_dir) -> None:
    """The run's sharded last.ckpt (the final weights) loads, in one process, into the plain model that predict.py
    and export.py use: the same weights as its model.pt."""
    from starter.checkpointing.inference import load_for_inference

    model, record = load_for_inference(run_dir / "checkpoints" / "last.ckpt", list(CONFIG_DIRS))
    assert max_difference(model.state_dict(), model_weights(run_dir)) == 0.0 and record["classes"][9] == "9"


@pytest.mark.parametrize("strategy", ["tp"])  # pp: stopped mid-epoch and resumed below (pp x dp)
def test_a_model_parallel_run_resumes_from_its_sharded_checkpoint(strategy, jobs, tmp_path):
    last = jobs[strategy] / "checkpoints" / "last.ckpt"
    assert last.is_symlink() and (last / ".metadata").is_file()
    train(tmp_path, f"strategy={strategy}", "devices=2", f"ckpt_path={last}", *VIT[:-2], *ACCUMULATE,
          "trainer.max_epochs=5", "trainer.log_every_n_steps=1", "test=false")  # fmt: skip
    with open(run_dirs(tmp_path)[0] / "metrics.csv", newline="") as f:
        assert {row["epoch"] for row in csv.DictReader(f) if row["train/loss"]} == {"4"}  # epochs 0-3 restored


# Stopped by SIGTERM after optimizer step 7 (epoch 1, mid-epoch), then the same command again in the same directory.
STOP = ["+callbacks.stop._target_=probes.SigtermAtStep", "+callbacks.stop.step=7"]


def stopped_and_resumed(tmp_path, *overrides: str) -> None:
    stopped = train(tmp_path, *overrides, *STOP, env=PROBES, expect_ok=False)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    train(tmp_path, *overrides)


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory):
    """pp x dp (2 pipelines of 2 stages, a multirun job) and 3D (fsdp over 2 pipelines of 2 stages, each a
    tensor-parallel pair: 8 processes), each stopped mid-epoch and resumed, accumulating half batches."""
    runs = {}
    tmp_path = tmp_path_factory.mktemp("ppdp")
    sweep = ["-m", f"hydra.sweep.dir={tmp_path / 'sweep'}", "ckpt_path=auto"]
    stopped_and_resumed(tmp_path, *sweep, "strategy=pp", "strategy.pipeline_parallel_size=2", "devices=4", *VIT,
                        *ACCUMULATE)  # fmt: skip
    runs["pp x dp"] = tmp_path / "sweep" / "0"
    tmp_path = tmp_path_factory.mktemp("3d")
    three_d = ["strategy=fsdp", "devices=8", "strategy.tensor_parallel_size=2", "strategy.pipeline_parallel_size=2"]
    stopped_and_resumed(tmp_path, f"hydra.run.dir={tmp_path / 'run'}", "ckpt_path=auto", *three_d, *VIT, *ACCUMULATE)
    runs["3D"] = tmp_path / "run"
    return runs


@pytest.mark.parametrize("mode", ["pp x dp", "3D"])
def test_pipelines_beside_data_parallel_train_the_weights_of_one_process_through_a_mid_epoch_resume(
    mode, pipelines, reference
):
    assert max_difference(model_weights(reference), model_weights(pipelines[mode])) <= SAME
    with open(pipelines[mode] / "metrics.csv", newline="") as f:  # every step trained once, none twice
        assert sorted(int(row["step"]) for row in csv.DictReader(f) if row["train/loss"]) == list(range(20))
    single, parallel = read_metrics(reference), read_metrics(pipelines[mode])
    assert abs(parallel["test/loss"] - single["test/loss"]) <= 1e-5 and parallel["test/acc"] == single["test/acc"]
    model = instantiate(OmegaConf.load(pipelines[mode] / "config.yaml").model)
    model.load_state_dict(model_weights(pipelines[mode]))  # model.pt: the plain net's names, every stage
    assert_loads_whole_for_inference(pipelines[mode])


def test_a_pipeline_checkpoint_evaluates_on_another_cut_and_resumes_only_on_its_own(pipelines, reference, tmp_path):
    last = pipelines["pp x dp"] / "checkpoints" / "last.ckpt"
    train(tmp_path, "train=false", f"ckpt_path={last}", "strategy=pp", "devices=4", *VIT)  # 4 stages, not 2
    single, evaluated = read_metrics(reference), read_metrics(run_dirs(tmp_path)[0])
    assert abs(evaluated["test/loss"] - single["test/loss"]) <= 1e-5 and evaluated["test/acc"] == single["test/acc"]
    with pytest.raises(UserError, match="saved by a pipeline of 2 processes x 1 stages each; this run asks for a"
                                        " pipeline of 4 processes x 1 stages each"):  # fmt: skip
        prepare(compose_config(["strategy=pp", "devices=4", f"ckpt_path={last}", *VIT], tmp_path))


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["strategy=fsdp", "strategy.tensor_parallel_size=3", "devices=4"], "tensor_parallel_size=3 does not divide"),
        (
            ["strategy=pp", "strategy.microbatches=5"],
            "gives each pipeline 64 samples a step, which strategy.microbatches=5 does not divide",
        ),
        (
            ["strategy=pp", "devices=4", "strategy.pipeline_parallel_size=2", "strategy.microbatches=64"],
            "data.batch_size=64 gives each pipeline 32 samples",
        ),
        (
            ["strategy=pp", "devices=8", "strategy.microbatches=4", "data.batch_size=64"],
            "strategy.microbatches=4 is fewer than the 8 stages of the pipeline, which 1f1b needs at least",
        ),
        (
            ["strategy=pp", "strategy.schedule=interleaved_1f1b", "strategy.stages_per_rank=1"],
            "interleaved_1f1b with strategy.stages_per_rank=1: .* use strategy.stages_per_rank=2",
        ),
        (
            ["strategy=pp", "strategy.stages_per_rank=2"],
            "1f1b with strategy.stages_per_rank=2: .* use strategy.schedule=interleaved_1f1b",
        ),
        (["strategy=pp", "strategy.schedule=zigzag"], "strategy.schedule=zigzag: choose one of gpipe, 1f1b"),
        (["strategy=pp", "compile=true"], "compile=true with a pipeline"),
        (
            ["strategy=fsdp", "devices=4", "strategy.pipeline_parallel_size=2", "compile=true"],
            "compile=true with a pipeline",
        ),
        (
            ["strategy=fsdp", "devices=2", "num_nodes=2", "strategy.tensor_parallel_size=4"],
            "strategy.tensor_parallel_size=4 would span nodes \\(2 processes per node\\)",
        ),
    ],
)
def test_what_model_parallelism_cannot_run_is_refused_before_launch(overrides, message, tmp_path):
    with pytest.raises(UserError, match=message):
        prepare(compose_config(["devices=2", "accelerator=cpu", *overrides], tmp_path))


def test_tensor_parallel_refuses_a_net_whose_split_layer_shares_its_weight_in_one_line():
    # tp, fsdp over tp and 3D all split through split_layers, before any weight moves: a decoder tied to an encoder's
    # weight would become two tensors, each split its own way (or one split, one whole)
    from types import SimpleNamespace

    from torch import nn

    from starter.strategies.tp import split_layers

    net = nn.Sequential(nn.Flatten(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    net[5].weight = net[3].weight  # net.3 split row-wise, net.5 left whole: one parameter
    with pytest.raises(UserError) as refused:
        split_layers(net, SimpleNamespace(size=lambda: 2))
    assert str(refused.value) == (
        "tensor parallel would split Sequential.3 and Sequential.5, which share a parameter (tied weights), into two"
        " tensors; untie them or train with strategy=fsdp or ddp"
    )


def test_a_pipeline_that_would_split_tied_weights_between_stages_is_refused_in_one_line():
    from torch import nn

    from starter.strategies.pipeline import check_ties

    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    net[2].weight = net[0].weight  # tied
    check_ties(net, [(0, 3)], "pp")  # in one stage: fine
    with pytest.raises(UserError) as refused:
        check_ties(net, [(0, 2), (2, 3)], "pp")
    assert str(refused.value) == (
        "strategy=pp cuts the net into 2 stages, and its layers 0 and 2 share a parameter (tied weights) across two of"
        " them; keep them in one stage or train with strategy=fsdp"
    )
