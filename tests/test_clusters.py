"""Who starts the processes (DESIGN.md), simulated on CPU: SLURM allocations, several nodes on localhost, a
machine that reports CUDA GPUs (a faked count for the decisions taken before launch)."""

import json
import re
import subprocess
import sys
from functools import partial

import pytest

from conftest import (
    MLP_20_STEPS,
    PROBES,
    QUIET,
    ROOT,
    compose_config,
    free_port,
    max_difference,
    model_weights,
    on_bed,
    run_dirs,
    slurm_env,
    start_all,
    train,
    with_env,
)
from starter.errors import UserError
from starter.preflight import prepare

SHORT = ["accelerator=cpu", "debug=limit", "trainer.max_epochs=1", "test=false"]


@pytest.mark.slow
def test_one_task_slurm_job_gets_two_distinct_ranks_from_our_launcher(tmp_path):
    # sbatch --ntasks=1, then `python train.py strategy=ddp devices=2`: the workers inherit SLURM's variables;
    # Lightning would read SLURM_PROCID=0 in both and train two unrelated copies, each rank 0 of a world of 1.
    train(tmp_path, "strategy=ddp", "devices=2", "callbacks=state_bytes", *SHORT, env=slurm_env(1))
    (run_dir,) = run_dirs(tmp_path)
    assert sorted(p.name for p in (run_dir / "state_bytes").iterdir()) == ["rank0.json", "rank1.json"]
    assert "GLOBAL_RANK: 0, MEMBER: 1/2" in (run_dir / "train.log").read_text()  # one group of 2 (rank 0's log)


@pytest.mark.slow
def test_srun_tasks_are_the_ranks_and_share_one_run_directory(tmp_path):

    port = free_port()
    command = [sys.executable, str(ROOT / "train.py"), *on_bed(["strategy=ddp", "devices=2", "callbacks=state_bytes",
               f"paths.log_dir={tmp_path / 'logs'}", *QUIET, *SHORT])]  # fmt: skip
    envs = [with_env(slurm_env(2, rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)) for rank in (0, 1)]
    outputs = start_all([(command, env) for env in envs], tmp_path)
    (run_dir,) = run_dirs(tmp_path)  # each task composed the config; both named the run after the job step
    assert run_dir.name == "slurm-4242.0" and (run_dir / "metrics.json").is_file()
    assert sorted(p.name for p in (run_dir / "state_bytes").iterdir()) == ["rank0.json", "rank1.json"]
    tables = [re.search(r"^metric +value$", out, re.MULTILINE) is not None for out, _ in outputs]
    assert tables == [True, False]  # rank 0 reports
    assert outputs[1][0] == "" and outputs[0][0].count("train: data=bed_digits") == 1  # each line once, rank 0's


def scheduler_env(scheduler: str, rank: int, port: int, tmp_path) -> dict:
    """What Kubeflow's PyTorchJob gives each pod, or jsrun each task of an LSF job, here for 2 one-process "nodes"."""
    import socket

    if scheduler == "kubeflow":
        given = dict(KUBERNETES_PORT="tcp://10.96.0.1:443", MASTER_ADDR="127.0.0.1", WORLD_SIZE="2", RANK=str(rank))
    else:  # the rank file: the launch node, then a line per task's host
        rankfile = tmp_path / "rankfile"
        rankfile.write_text(f"batch\n{socket.gethostname()}\n{socket.gethostname()}\n")
        given = dict(LSB_JOBID="77", LSB_DJOB_RANKFILE=str(rankfile), JSM_NAMESPACE_LOCAL_RANK="0",
                     JSM_NAMESPACE_SIZE="2", JSM_NAMESPACE_RANK=str(rank))  # fmt: skip
    return with_env(given, MASTER_PORT=str(port))


@pytest.mark.slow
@pytest.mark.parametrize("scheduler,name", [("kubeflow", "kubeflow-127.0.0.1"), ("lsf", "lsf-77")])
def test_the_ranks_kubeflow_or_lsf_start_train_as_one_process_in_one_run_directory(
    scheduler, name, reference_weights, tmp_path
):
    port = free_port()
    command = [sys.executable, str(ROOT / "train.py"), *on_bed(["strategy=ddp", "devices=1", "num_nodes=2",
               *MLP_20_STEPS, f"paths.log_dir={tmp_path / 'logs'}", *QUIET])]  # fmt: skip
    outputs = start_all([(command, scheduler_env(scheduler, rank, port, tmp_path)) for rank in (0, 1)], tmp_path)
    (run_dir,) = run_dirs(tmp_path)  # each process composed the config; both named the run after the job
    assert run_dir.name == name and (run_dir / "metrics.json").is_file()
    assert max_difference(reference_weights, model_weights(run_dir)) <= 1e-5
    assert [out.count("train: data=bed_digits") for out, _ in outputs] == [1, 0]  # rank 0 says it


@pytest.mark.slow
def test_two_nodes_of_two_processes_each_on_hosts_of_their_own_train_as_one_process_whatever_their_run_directories(
    reference_weights, hosts, tmp_path
):
    # each node on a host of its own (tests/hosts.py), its run directory its own (hydra.run.dir, as a job script on
    # nodes without a shared disk pins it): the nodes meet by what both are given (MASTER_ADDR: node 0's host,
    # MASTER_PORT), not by a name each makes; no GLOO_SOCKET_IFNAME, though each host's name resolves to loopback
    port = free_port()
    command = [sys.executable, str(ROOT / "train.py"), *on_bed(["strategy=ddp", "devices=2", "num_nodes=2",
               *MLP_20_STEPS, f"paths.log_dir={tmp_path / 'logs'}", *QUIET])]  # fmt: skip
    envs = {n: with_env(MASTER_ADDR=hosts.address(0), MASTER_PORT=str(port), NODE_RANK=str(n)) for n in (0, 1)}
    commands = [([*command, f"hydra.run.dir={tmp_path / f'node{n}'}"], env) for n, env in envs.items()]
    start_all(commands, tmp_path, hosts=hosts)
    run_dir = tmp_path / "node0"  # rank 0's node keeps the run's outputs
    assert "num_nodes: 2" in (run_dir / "config.yaml").read_text() and (run_dir / "metrics.json").is_file()
    assert not (tmp_path / "node1" / "checkpoints").exists()
    assert max_difference(reference_weights, model_weights(run_dir)) <= 1e-5  # float summation order only


@pytest.mark.parametrize(
    "env,message",
    [
        ({}, "num_nodes=2: set MASTER_ADDR, MASTER_PORT, NODE_RANK on every node"),
        ({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}, "num_nodes=2: set NODE_RANK on every node"),
        ({"MASTER_PORT": "29500", "NODE_RANK": "0"}, "MASTER_PORT is set but MASTER_ADDR is not"),
        ({"MASTER_ADDR": "h", "MASTER_PORT": "1", "NODE_RANK": "2"}, "NODE_RANK=2: with num_nodes=2 it must be 0 to 1"),
    ],
)
def test_several_nodes_without_their_rendezvous_variables_is_one_line_before_any_wait(env, message, tmp_path,
                                                                                      monkeypatch):  # fmt: skip
    for name in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UserError, match=message):
        prepare(compose_config(["strategy=ddp", "devices=2", "num_nodes=2", "accelerator=cpu"], tmp_path))


def test_srun_with_another_task_count_than_devices_is_refused(tmp_path, monkeypatch):
    for name, value in slurm_env(3).items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UserError, match="SLURM started 3 tasks but devices x num_nodes = 2"):
        prepare(compose_config(["strategy=ddp", "devices=2", "accelerator=cpu"], tmp_path))


def test_srun_rank_0_says_when_the_stores_port_is_taken(monkeypatch):
    # srun's rank 0 serves the run's store at MASTER_PORT (else a port from the job id), which another job on the
    # node may hold: a line saying what to set, not a traceback while the other tasks wait.
    from starter.launch.watchdog import watch_external_ranks
    from starter.run_store import serve_store

    taken = serve_store("127.0.0.1")
    for name, value in slurm_env(2, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(taken.port)).items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UserError, match=f"rank 0 cannot serve the run's store at 127.0.0.1:{taken.port} .*; set"
                       " MASTER_PORT to a free port for every task"):  # fmt: skip
        watch_external_ranks("slurm", ranks_per_node=2, timeout_s=6, stall_timeout_s=60)


def test_a_stall_is_judged_inside_loops_only_and_names_the_ranks_behind_or_every_rank_of_a_deadlock():
    from starter.launch.stall import Stall
    from starter.launch.watchdog import where

    two_per_node, four_per_node = partial(where, ranks_per_node=2), partial(where, ranks_per_node=4)

    loader = "__getitems__ (my_data.py:9)"
    behind = {0: (7, 1, "all_reduce (torch/distributed/distributed_c10d.py:2)"), 1: (6, 1, loader)}
    stall = Stall(timeout_s=10, name=two_per_node)
    assert [stall.check(behind, now) for now in (0, 10)] == [None, None]
    assert stall.check(behind, 10.5) == (f"rank 1 (node 0) in {loader} has made no progress for 10 s while the others"
                                         " wait; every process of the run stops (raise stall_timeout_s if a step or a"
                                         " checkpoint save takes longer)")  # fmt: skip
    # rank 0 outside every loop (saving the final weights, alone): no judgement, and the clock starts again
    outside = {0: (7, 0, "save (torch/serialization.py:1)"), 1: (6, 1, loader)}
    stall = Stall(timeout_s=10, name=two_per_node)
    assert [stall.check(progress, now) for progress, now in ((behind, 0), (outside, 20), (behind, 25))] == [None] * 3
    assert stall.check(behind, 30.5).startswith("rank 1 (node 0) in")
    assert Stall(timeout_s=10, name=two_per_node).check(None, 0) is None  # a rank that has not said anything yet
    # every rank at the same count: each one's place, the first 4
    tied = {rank: (5, 2, f"step (x.py:{rank})") for rank in range(6)}
    stall = Stall(timeout_s=10, name=four_per_node)
    stall.check(tied, 0)
    assert stall.check(tied, 11).startswith(
        "no rank has made progress for 10 s (a deadlock: rank 0 (node 0) in step (x.py:0), rank 1 (node 0) in step"
        " (x.py:1), rank 2 (node 0) in step (x.py:2), rank 3 (node 0) in step (x.py:3) and 2 more); every process"
    )


def test_each_ranks_progress_is_read_from_the_store_once_every_rank_has_said_it(monkeypatch):
    from starter.job_token import signed
    from starter.launch.stall import read_progress
    from starter.run_store import serve_store

    monkeypatch.setenv("STARTER_JOB_TOKEN", "the job's secret")
    store = serve_store("127.0.0.1")
    store.set("run/progress/0", signed("run/progress/0", "12|1|"))
    assert read_progress(store, "run", world=2) is None
    store.set("run/progress/1", signed("run/progress/1", "11|2|__getitems__ (a|b.py:3)"))
    assert read_progress(store, "run", world=2) == {0: (12, 1, ""), 1: (11, 2, "__getitems__ (a|b.py:3)")}
    store.set("run/progress/1", ":11|2|")  # a stranger's, without the token's proof: no progress
    assert read_progress(store, "run", world=2) is None


@pytest.fixture
def gpus(monkeypatch):
    """Make the decisions taken before launch see `n` CUDA GPUs."""

    def machine_with(n: int):
        monkeypatch.setattr("starter.topology.cuda_device_count", lambda: n)

    return machine_with


def settled(overrides, tmp_path):
    cfg = compose_config(overrides, tmp_path)
    prepare(cfg)
    return cfg


def test_devices_auto_is_every_gpu_or_one_cpu_process(gpus, tmp_path):
    gpus(4)
    cfg = settled(["strategy=ddp", "devices=auto"], tmp_path)
    assert (cfg.accelerator, cfg.devices) == ("gpu", 4)
    gpus(0)
    cfg = settled(["strategy=ddp", "devices=auto"], tmp_path)
    assert (cfg.accelerator, cfg.devices) == ("cpu", 1)
    gpus(2)
    assert settled(["strategy=ddp", "devices=-1", "accelerator=cpu"], tmp_path).devices == 1


@pytest.mark.slow
def test_devices_auto_runs_as_one_cpu_process(tmp_path):
    proc = train(tmp_path, "strategy=ddp", "devices=auto", *SHORT)  # was len("auto") == 4 processes, then an IndexError
    (run_dir,) = run_dirs(tmp_path)
    assert "devices: 1\n" in (run_dir / "config.yaml").read_text() and "Traceback" not in proc.stderr


def test_devices_list_picks_gpus_by_index(gpus, tmp_path):
    gpus(4)
    cfg = settled(["strategy=ddp", "devices=[0,2]"], tmp_path)
    assert list(cfg.devices) == [0, 2] and cfg.data.batch_size % 2 == 0
    with pytest.raises(UserError, match=r"devices=\[0, 4\]: this machine has GPUs 0 to 3"):
        settled(["strategy=ddp", "devices=[0,4]"], tmp_path)
    with pytest.raises(UserError, match=r"devices=\[0, 1\] picks GPUs by index; on CPU give a count, e.g. devices=2"):
        settled(["strategy=ddp", "devices=[0,1]", "accelerator=cpu"], tmp_path)


def test_auto_accelerator_with_more_devices_than_gpus_is_one_line(gpus, tmp_path):
    gpus(1)  # strategy=ddp devices=2 on a one-GPU host: each worker used to raise Lightning's multi-line error
    with pytest.raises(
        UserError, match=r"devices=2: this machine has 1 CUDA GPU\(s\); use devices=1 \(or accelerator=cpu"
    ):
        settled(["strategy=ddp", "devices=2"], tmp_path)


def test_dp_with_compile_is_refused_in_one_line(gpus, tmp_path):
    gpus(2)
    with pytest.raises(UserError, match="compile=true with strategy=dp: .* use strategy=ddp"):
        settled(["strategy=dp", "devices=2", "compile=true"], tmp_path)


@pytest.mark.slow
def test_compile_under_ddp_compiles_in_each_process_that_trains(tmp_path):
    # The model is compiled where it trains, after the strategy set the process up (a compiled module cannot be
    # pickled to another process). The eager backend keeps the test fast; the path is inductor's too.
    probe = tmp_path / "probe"
    proc = train(tmp_path, "strategy=ddp", "devices=2", "compile=true", "+compile_options.backend=eager",
                 *SHORT, "trainer.limit_train_batches=3", "trainer.limit_val_batches=1",
                 "+callbacks.probe._target_=probes.RecordCompiledGraphs", f"+callbacks.probe.output={probe}",
                 env=PROBES)  # fmt: skip
    ranks = [json.loads((probe / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["graphs"] > 0 for r in ranks)  # each training process ran a compiled forward
    assert ranks[0]["parent"] == ranks[1]["parent"] not in {r["pid"] for r in ranks}  # both from one fork server
    assert "Traceback" not in proc.stderr


def test_the_workers_fork_server_imports_torch_and_lightning_without_touching_cuda():
    # On a GPU host, a CUDA driver initialised before a fork fails in the forked workers: what the fork server
    # preloads (main.py's worker_preload) must not ask CUDA anything, not even whether it is there.
    probe = """
import sys, torch
asked = []
for name in ("_cuda_getDeviceCount", "_cuda_init"):
    real = getattr(torch._C, name)
    setattr(torch._C, name, lambda *a, _real=real, _name=name: asked.append(_name) or _real(*a))
from starter.main import TRAIN, worker_preload
for module in worker_preload(TRAIN):
    __import__(module)
print(asked, torch.cuda.is_initialized(), "lightning.pytorch" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[0] == "[] False True"


def test_a_failure_one_process_reports_is_what_every_other_process_reads_from_the_store(capsys):
    from starter.run_failure import failure, report
    from starter.run_store import client, serve_store

    served = serve_store("127.0.0.1")
    other = client("127.0.0.1", served.port, timeout_s=5)
    assert failure(other) is None
    assert report(served, 2, "rank 1 (node 1): no data", node=1)  # the first: written, and said
    assert not report(other, 1, "rank 0 (node 0): a broken collective", node=0)  # later ones: neither
    assert failure(other) == (2, "rank 1 (node 1): no data", 1)
    assert capsys.readouterr().err == "error: rank 1 (node 1): no data\n"


def test_a_node_that_never_starts_is_one_line_naming_it_after_the_wait_and_one_that_failed_is_its_line():
    from starter.errors import WorkerFailed
    from starter.launch.nodes import wait_for_all_nodes
    from starter.launch.watchdog import report
    from starter.run_store import serve_store
    from starter.topology import key_prefix

    store, prefix = serve_store("127.0.0.1"), key_prefix("run")
    with pytest.raises(WorkerFailed) as missing:  # node 0 waits for nodes 1 and 2 of 3; neither comes
        wait_for_all_nodes(store, prefix, nodes=3, node=0, wait_s=1, config="{}")
    said = "nodes 1, 2 have not started within 1 s; start train.py on every node with the same MASTER_ADDR and"
    assert (missing.value.exit_code, missing.value.message) == (124, f"{said} MASTER_PORT")
    report(store, 2, "node 2: no directory images/train", node=2, prefix=prefix)
    with pytest.raises(WorkerFailed) as failed:  # node 1 reads node 2's failure before it launches
        wait_for_all_nodes(store, prefix, nodes=3, node=1, wait_s=60, config="{}")
    found = failed.value
    assert (found.message, found.exit_code, found.node) == ("node 2: no directory images/train", 2, 2)


@pytest.mark.parametrize(
    "env,started_by",
    [  # a Kubeflow PyTorchJob's pod, one process; torchrun inside a Kubernetes pod (its variables are the pod's too)
        ({"KUBERNETES_PORT": "tcp://10.0.0.1:443", "MASTER_ADDR": "m", "MASTER_PORT": "1", "WORLD_SIZE": "4",
          "RANK": "2"}, "kubeflow"),
        ({"KUBERNETES_PORT": "tcp://10.0.0.1:443", "MASTER_ADDR": "m", "MASTER_PORT": "1", "WORLD_SIZE": "4",
          "RANK": "3", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "job"}, "torchrun"),
    ],
)  # fmt: skip
def test_torchrun_inside_a_kubernetes_pod_is_torchrun_not_a_kubeflow_job(env, started_by, monkeypatch):
    from starter.launch.environment import cluster_environment, external_launcher

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert external_launcher(4) == started_by
    # torchrun's environment reads each rank's local rank (Kubeflow's would say 0 for every rank of a pod)
    assert cluster_environment(started_by).local_rank() == (0 if started_by == "kubeflow" else int(env["LOCAL_RANK"]))


def test_lightnings_own_slurm_requeue_is_off_every_stop_signal_being_ours():
    from starter.launch.environment import cluster_environment

    assert cluster_environment("slurm").auto_requeue is False
