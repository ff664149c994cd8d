"""Model parallelism on 2 (and 4) CPU processes: tensor parallel (tp), pipeline parallel (pp, every schedule) and
2D (fsdp x tp) train the weights of one process, split what they say they split, resume from their sharded
checkpoints and export a model.pt that loads into the plain net."""

import json

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from conftest import (
    ROOT,
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
# The small ViT, 4 epochs x 5 batches = 20 optimizer steps of the global batch 64, fp32.
# SGD: Adam would turn rounding noise into full-size steps for parameters whose gradient is zero up to rounding
# (an attention key bias: softmax ignores it), which says nothing about the parallel maths.
VIT = [
    "model=vit",
    "model.optimizer._target_=torch.optim.SGD",
    "model.optimizer.lr=0.05",
    "~model.optimizer.weight_decay",
    "accelerator=cpu",
    "debug=limit",
    "trainer.max_epochs=4",
    "trainer.log_every_n_steps=1",
]
PROBES = {"PYTHONPATH": str(ROOT / "tests")}
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
    train(tmp_path, "-m", "strategy=tp,pp", "devices=2", *VIT, "+model.optimizer.foreach=true",
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
    train(tmp_path, "strategy=pp", "devices=2", f"strategy.schedule={schedule}", *VIT, "test=false")
    assert max_difference(model_weights(reference), model_weights(run_dirs(tmp_path)[0])) <= SAME


def test_2d_fsdp_across_tensor_parallel_pairs_trains_the_weights_of_one_process(reference, tmp_path):
    # 4 processes: 2 data-parallel groups of a tensor-parallel pair; each pair shares one half of the batch
    train(tmp_path, "strategy=fsdp", "strategy.tensor_parallel_size=2", "devices=4", *VIT, "test=false")
    assert max_difference(model_weights(reference), model_weights(run_dirs(tmp_path)[0])) <= SAME


def test_model_pt_of_a_model_parallel_run_loads_into_the_plain_net(jobs):
    for run_dir in jobs.values():
        model = instantiate(OmegaConf.load(run_dir / "config.yaml").model)
        model.load_state_dict(model_weights(run_dir))  # strict: every stage and shard, plain names


@pytest.mark.parametrize("strategy", ["tp", "pp"])
def test_a_model_parallel_run_resumes_from_its_sharded_checkpoint(strategy, jobs, tmp_path):
    last = jobs[strategy] / "checkpoints" / "last.ckpt"
    assert last.is_symlink() and (last / ".metadata").is_file()
    train(tmp_path, f"strategy={strategy}", "devices=2", f"ckpt_path={last}", *VIT[:-2], "trainer.max_epochs=5",
          "trainer.log_every_n_steps=1", "test=false")  # fmt: skip
    with open(run_dirs(tmp_path)[0] / "metrics.csv", newline="") as f:
        import csv

        assert {row["epoch"] for row in csv.DictReader(f) if row["train/loss"]} == {"4"}  # epochs 0-3 restored


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["strategy=tp", "model=cnn"],
            "strategy=tp splits the Linear layers of model=mlp or model=vit; this model's"
            " net \\(CNN\\) has none it can split",
        ),
        (["strategy=tp", "model=vit", "devices=3"], "model.net.heads=4 does not split over 3"),
        (["strategy=fsdp", "strategy.tensor_parallel_size=3", "devices=4"], "tensor_parallel_size=3 does not divide"),
        (["strategy=pp", "strategy.microbatches=5"], "data.batch_size=64 does not split into strategy.microbatches=5"),
        (["strategy=pp", "trainer.gradient_clip_val=1.0"], "gradient_clip_val with strategy=pp"),
        (["strategy=pp", "compile=true"], "compile=true with strategy=pp"),
    ],
)
def test_what_model_parallelism_cannot_run_is_refused_before_launch(overrides, message, tmp_path):
    with pytest.raises(UserError, match=message):
        prepare(compose_config(["devices=2", "accelerator=cpu", *overrides], tmp_path))


@pytest.mark.parametrize(
    "strategy,message",
    [
        ("tp", "strategy=tp cannot scale fp16 losses"),
        ("pp", "strategy=pp cannot scale fp16 losses .* inside the pipeline schedule"),
    ],
)
def test_fp16_on_gpus_is_refused_where_nothing_scales_the_loss(strategy, message, tmp_path, monkeypatch):
    monkeypatch.setattr("starter.preflight.cuda_device_count", lambda: 2)
    with pytest.raises(UserError, match=message):
        prepare(compose_config([f"strategy={strategy}", "devices=2", "precision=16-mixed"], tmp_path))
