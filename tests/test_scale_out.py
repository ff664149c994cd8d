"""Multirun sweeps with multi-process jobs, torchrun, and two torchrun "nodes" on one machine."""

import socket
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from conftest import QUIET, ROOT, read_metrics, run_dirs, sweep_jobs, train

pytestmark = pytest.mark.slow
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def test_multirun_with_ddp_inside_gives_one_directory_per_job(tmp_path):
    train(tmp_path, "-m", "strategy=ddp", "devices=2", "accelerator=cpu", "seed=1,2", "debug=limit")
    jobs = sweep_jobs(tmp_path)
    assert [j.name for j in jobs] == ["0", "1"]
    for seed, job in zip((1, 2), jobs):
        assert f"seed: {seed}\n" in (job / "config.yaml").read_text()
        assert (job / "metrics.json").is_file() and len(list(job.rglob("metrics.csv"))) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"]  # no stray outputs/ or runs/
    assert sorted(p.name for p in (tmp_path / "logs" / "train").iterdir()) == ["multiruns"]


def test_multirun_runs_fsdp_and_ddp_spawn_jobs(tmp_path):
    train(tmp_path, "-m", "strategy=fsdp,ddp_spawn", "devices=2", "accelerator=cpu", "debug=limit")
    jobs = sweep_jobs(tmp_path)
    assert [j.name for j in jobs] == ["0", "1"]
    assert ["name: fsdp" in (j / "config.yaml").read_text() for j in jobs] == [True, False]
    assert all((j / "metrics.json").is_file() for j in jobs)


def test_torchrun_trains_with_one_run_directory(tmp_path):
    command = [*TORCHRUN, "--nproc_per_node=2", str(ROOT / "train.py"), "strategy=ddp", "accelerator=cpu",
               f"paths.log_dir={tmp_path / 'logs'}", "debug=limit", *QUIET]  # fmt: skip
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = run_dirs(tmp_path)  # both ranks composed the config; they agreed on rank 0's directory
    assert "devices: 2" in (run_dir / "config.yaml").read_text() and (run_dir / "metrics.json").is_file()


def test_two_single_process_nodes_train_like_one_process(default_run, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = [
        subprocess.Popen(
            [
                *TORCHRUN,
                "--nnodes=2",
                f"--node_rank={rank}",
                "--nproc_per_node=1",
                "--master_addr=127.0.0.1",
                f"--master_port={port}",
                str(ROOT / "train.py"),
                "strategy=ddp",
                "accelerator=cpu",
                f"paths.log_dir={tmp_path / 'logs'}",
                *QUIET,
            ],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    for node in nodes:
        _, err = node.communicate(timeout=300)
        assert node.returncode == 0, err[-3000:]
    (run_dir,) = run_dirs(tmp_path)  # one directory: the nodes share rank 0's run name
    assert "num_nodes: 2" in (run_dir / "config.yaml").read_text()
    two_nodes, single = read_metrics(run_dir), read_metrics(default_run[1])
    assert abs(two_nodes["test/acc"] - single["test/acc"]) <= 1 / 271 + 1e-9  # float summation order only


def test_optuna_sweep_writes_the_best_value_and_parameters(tmp_path):
    train(tmp_path, "-m", "hparams_search=optuna", "hydra.sweeper.n_trials=2", "strategy=ddp", "devices=2",
          "accelerator=cpu", "debug=limit")  # fmt: skip
    (sweep,) = (tmp_path / "logs" / "train" / "multiruns").iterdir()
    results = OmegaConf.load(sweep / "optimization_results.yaml")
    assert set(results.best_params) == {"model.optimizer.lr", "model.net.width"}
    jobs = [read_metrics(job)["val/acc"] for job in sweep_jobs(tmp_path)]
    assert len(jobs) == 2 and results.best_value == max(jobs)
