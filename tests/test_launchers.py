"""Hydra's launchers: submitit's (launcher=slurm, launcher=local), one SLURM job per sweep point; joblib's
(launcher=joblib), a sweep's jobs side by side on one machine. Part of the larger examples (`examples=minimal` leaves
them out; the SLURM environment itself is handled in test_clusters.py)."""

import pytest

from conftest import compose_config, sweep_jobs, train


@pytest.mark.slow
def test_local_submitit_launcher_runs_ddp_jobs(tmp_path):
    train(tmp_path, "-m", "launcher=local", "strategy=ddp", "devices=2", "accelerator=cpu", "seed=1,2", "debug=limit")
    jobs = sweep_jobs(tmp_path)
    assert [j.name for j in jobs] == ["0", "1"] and all((j / "metrics.json").is_file() for j in jobs)


@pytest.mark.slow
def test_hydras_joblib_launcher_runs_ddp_jobs_side_by_side_each_in_a_run_directory_of_its_own(tmp_path):
    # each job in a loky worker, whose start method of its own its ddp workers could not take (its jobs failed so)
    train(tmp_path, "-m", "launcher=joblib", "hydra.launcher.n_jobs=2", "strategy=ddp", "devices=2", "seed=1,2",
          "debug=fdr")  # fmt: skip
    jobs = sweep_jobs(tmp_path)
    assert [j.name for j in jobs] == ["0", "1"] and all((j / "metrics.json").is_file() for j in jobs)
    assert [compose_seed(j) for j in jobs] == [1, 2]


def compose_seed(job) -> int:
    from omegaconf import OmegaConf

    return OmegaConf.load(job / "config.yaml").seed


def test_slurm_launcher_takes_nodes_and_devices_and_lets_slurm_start_the_ranks(tmp_path, monkeypatch):
    from starter.launch.environment import launched_by
    from starter.topology import Layout

    cfg = compose_config(["launcher=slurm", "strategy=ddp", "devices=4", "num_nodes=2"], tmp_path, keep_hydra=True)
    launcher = cfg.hydra.launcher
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (2, 4, 4)
    assert launcher.max_num_timeout == 3 and launcher._target_.endswith("SlurmLauncher")
    assert launched_by(Layout.of(cfg).world, multi_process=True) == "ours"  # on a login node: train.py's agent would
    monkeypatch.setenv("SLURM_NTASKS", "8")
    assert launched_by(Layout.of(cfg).world, multi_process=True) == "slurm"  # inside the job: SLURM started all 8


def test_local_launcher_lets_each_job_see_its_gpus(tmp_path):
    cfg = compose_config(["launcher=local", "strategy=ddp", "devices=2"], tmp_path, keep_hydra=True)
    assert cfg.hydra.launcher.gpus_per_node == 2  # submitit sets CUDA_VISIBLE_DEVICES to that many (0 hid all)
