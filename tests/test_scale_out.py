"""Multirun sweeps with multi-process jobs, torchrun and its restarts, and two torchrun "nodes" on one machine."""

import csv
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from conftest import (
    MLP_20_STEPS,
    PROBES,
    QUIET,
    ROOT,
    descendants,
    free_port,
    max_difference,
    model_weights,
    on_bed,
    read_metrics,
    reaped,
    run_dirs,
    sweep_jobs,
    train,
    wait_for_beat,
    wait_for_checkpoint,
    with_env,
    worker_of_rank,
)

pytestmark = pytest.mark.slow
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def test_multirun_with_ddp_inside_gives_one_directory_per_job(tmp_path):
    # hydra.job.chdir=true: each job works in its directory, and so do its workers (forked from the server the first
    # job started); rank 0 says on stdout, as one process does, where the run is, relative to where it works
    proc = train(tmp_path, "-m", "hydra.job.chdir=true", "strategy=ddp", "devices=2", "accelerator=cpu", "seed=1,2",
                 "debug=limit")  # fmt: skip
    assert proc.stdout.count("run directory: .\n") == 2, proc.stdout
    jobs = sweep_jobs(tmp_path)
    assert [j.name for j in jobs] == ["0", "1"]
    for seed, job in zip((1, 2), jobs):
        assert f"seed: {seed}\n" in (job / "config.yaml").read_text()
        assert (job / "metrics.json").is_file() and len(list(job.rglob("metrics.csv"))) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"]  # no stray outputs/ or runs/
    assert sorted(p.name for p in (tmp_path / "logs" / "train").iterdir()) == ["multiruns"]


def test_a_torchrun_restart_continues_the_run_directory_to_the_uninterrupted_weights(tmp_path):

    job = ["strategy=ddp", "accelerator=cpu", "trainer.max_epochs=3", "test=false"]  # killed in epoch 1 or 2
    command = [*TORCHRUN, "--nproc-per-node=2", "--max-restarts=1", str(ROOT / "train.py"), *on_bed([*job,
               "ckpt_path=auto", f"paths.log_dir={tmp_path / 'logs'}", *QUIET])]  # fmt: skip
    proc = subprocess.Popen(
        command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=with_env()
    )
    with reaped(proc):
        wait_for_checkpoint(tmp_path, proc, epochs=1)
        os.kill(worker_of_rank(proc, 1), signal.SIGKILL)  # torchrun stops rank 0 and starts both again
        out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    (run_dir,) = run_dirs(tmp_path)  # both ranks composed the config, agreed on rank 0's directory, and the
    # restart wrote into the first attempt's directory and resumed it
    assert "devices: 2" in (run_dir / "config.yaml").read_text() and (run_dir / "metrics.json").is_file()
    assert f"ckpt_path=auto -> {run_dir / 'checkpoints' / 'last.ckpt'} (resuming this run)" in out + err
    reference = train(tmp_path / "reference", *job, "devices=2")  # the same job, uninterrupted (train.py's agent)
    (reference_dir,) = run_dirs(tmp_path / "reference")
    restarted, whole = (model_weights(d) for d in (run_dir, reference_dir))
    assert reference.returncode == 0 and restarted.keys() == whole.keys()
    assert max((restarted[k].float() - whole[k].float()).abs().max().item() for k in whole) <= 1e-6


def lines_as_they_come(stream):
    """(monotonic time, line) of each line `stream` gives, read by a thread until it closes (the thread, to join;
    the only reader: a second one, communicate(), would take some of the lines)."""
    import threading

    lines = []
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), line) for line in stream), daemon=True)
    reader.start()
    return lines, reader


def saved_by(checkpoint: Path) -> tuple[int, int]:
    """(processes, epoch) of the run that saved `checkpoint` (callbacks/mid_epoch_resume.py keeps the first)."""
    state = torch.load(checkpoint, weights_only=True)
    (world,) = [s["world"] for s in state["callbacks"].values() if "world" in s]
    return world, state["epoch"]


def wait_until_saved_by(tmp_path: Path, proc: subprocess.Popen, processes: int) -> Path:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        for last in tmp_path.glob("logs/train/runs/*/checkpoints/last.ckpt"):
            if saved_by(last)[0] == processes:
                return last
        time.sleep(0.3)
    raise AssertionError(f"no checkpoint of {processes} processes; exit code {proc.poll()}")


def test_an_elastic_job_takes_in_a_node_that_comes_and_goes_on_without_one_lost_in_the_same_run(tmp_path):
    # torchrun --nnodes=1:2, agents that share no store (torch's shared one leaves a node that joins a running job
    # waiting for its round's MASTER_ADDR). Node A trains alone; node B comes and A's agent restarts A's worker with
    # it (1 -> 2); then B's agent and worker are SIGKILLed (its kernel panics): A names it and goes on alone (2 -> 1).
    # A round waits 5 s for more nodes once one has come (last_call_timeout; 30 s by default).
    from starter.run_store import listening

    port, env = free_port(), with_env(PROBES, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    rendezvous = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic",
                  "--rdzv-conf=last_call_timeout=5"]  # fmt: skip
    node = [*TORCHRUN, "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=2", *rendezvous, str(ROOT / "train.py"),
            *on_bed(["strategy=ddp", "accelerator=cpu", "ckpt_path=auto", "trainer.max_epochs=12",
            "trainer.limit_train_batches=5", "trainer.limit_val_batches=1", "test=false",
            "+callbacks.alone._target_=probes.AloneAtFirst", "+callbacks.alone.seconds=1",
            f"paths.log_dir={tmp_path / 'logs'}", *QUIET])]  # fmt: skip
    out = tmp_path / "node_a.out"
    with out.open("w") as sink:  # node A serves the rendezvous (a node that stays: the c10d store's host)
        a = subprocess.Popen(node, cwd=tmp_path, env=env, stdout=sink, stderr=subprocess.PIPE, text=True)
    with reaped(a):
        said, reader = lines_as_they_come(a.stderr)
        try:
            wait_until_saved_by(tmp_path, a, processes=1)
            assert listening("127.0.0.1", port)
            b = subprocess.Popen(node, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            with reaped(b):
                last = wait_until_saved_by(tmp_path, a, processes=2)
                for pid in [b.pid, *descendants(b.pid)]:
                    os.kill(pid, signal.SIGKILL)
                killed_at, saved = time.monotonic(), torch.load(last, weights_only=True)["global_step"]
                a.wait(timeout=240)
        finally:
            reader.join(timeout=10)
    assert a.returncode == 0, "".join(line for _, line in said[-60:])
    lost = [(t, line) for t, line in said if line.startswith("error:") and "is gone" in line]
    (at, line), *_ = lost or [(0, "".join(line for _, line in said[-60:]))]
    assert (
        re.fullmatch(
            r"error: rank \d \(node \d\) is gone: its connection closed \(killed, or its node lost\); every"
            r" process of the run stops\n",
            line,
        )
        and at - killed_at < 10
    ), (line, at - killed_at)
    (run_dir,) = run_dirs(tmp_path)  # each restart continued the run's directory from its last.ckpt
    assert run_dir.name == "torchrun-elastic"
    said_out = out.read_text()
    assert re.search(r"continuing at 2 processes \(was 1\) from step \d+", said_out), said_out[-3000:]
    (step,) = map(int, re.findall(r"continuing at 1 process \(was 2\) from step (\d+)", said_out))
    assert step >= saved and saved_by(last) == (1, 11) and (run_dir / "metrics.json").is_file()
    print(f"node lost to its line: {at - killed_at:.1f} s")


def test_a_stopped_torchrun_worker_ends_the_run_within_the_heartbeat_timeout_with_a_line_naming_it(tmp_path):
    # Rank 0's watchdog finds the stopped worker after heartbeat_timeout_s, kills it (torchrun's agent would give it
    # 30 s to act on a SIGTERM it cannot see) and leaves with 124; the agent exits 1 (its code).
    port = free_port()
    command = [*TORCHRUN, "--nproc-per-node=2", f"--master-port={port}", "--rdzv-id=stopped", str(ROOT / "train.py"),
               *on_bed(["strategy=ddp", "accelerator=cpu", "trainer.max_epochs=1000", "heartbeat_timeout_s=6",
               f"paths.log_dir={tmp_path / 'logs'}", *QUIET])]  # fmt: skip
    proc = subprocess.Popen(
        command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=with_env()
    )
    with reaped(proc):
        wait_for_checkpoint(tmp_path, proc, epochs=1)
        wait_for_beat(port, rank=1, run_id="stopped", torchrun=True)
        os.kill(worker_of_rank(proc, 1), signal.SIGSTOP)
        stopped_at = time.monotonic()
        _, err = proc.communicate(timeout=120)
    seconds = time.monotonic() - stopped_at
    assert proc.returncode == 1 and seconds < 6 + 14, (proc.returncode, seconds, err[-3000:])
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    said = r"error: rank 1 \(node 0\) has not answered for (\d+) s \(killed, stopped, or its node lost\); every"
    said += " process of the run stops"  # the silence measured: the bound, 6 s, and at most a beat more
    assert len(lines) == 1 and (found := re.fullmatch(said, lines[0])) and 6 <= int(found[1]) <= 15, lines
    # torchrun's summary names the watchdog's work: rank 1 killed, or rank 0's exit 124, whichever its agent saw first
    killed, left = r"rank +: 1 \(local_rank: 1\)\n +exitcode +: -9 ", r"rank +: 0 \(local_rank: 0\)\n +exitcode +: 124"
    assert re.search(f"{killed}|{left}", err), err[-3000:]


def test_two_single_process_nodes_on_hosts_of_their_own_train_like_one_process(reference_weights, hosts, tmp_path):
    # torchrun on each host as the docs' command has it (--master_addr: host 0's address), no GLOO_SOCKET_IFNAME though
    # each host's name resolves to loopback
    port = free_port()
    nodes = [
        hosts.popen(
            rank,
            [
                *TORCHRUN,
                "--nnodes=2",
                f"--node_rank={rank}",
                "--nproc_per_node=1",
                f"--master_addr={hosts.address(0)}",
                f"--master_port={port}",
                str(ROOT / "train.py"),
                *on_bed(["strategy=ddp", *MLP_20_STEPS, f"paths.log_dir={tmp_path / 'logs'}", *QUIET]),
            ],
            with_env(),
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    said = []
    with reaped(*nodes):
        for node in nodes:
            out, err = node.communicate(timeout=300)
            assert node.returncode == 0, err[-3000:]
            said.append(out + err)
    # each line once, from rank 0: also those said before a rank knows the run's console (torchrun's sizes)
    assert [text.count("torchrun: devices=1 num_nodes=2 (from LOCAL_WORLD_SIZE and WORLD_SIZE)") for text in said] == [
        1,
        0,
    ]
    assert [text.count("train: data=bed_digits model=bed_mlp") for text in said] == [1, 0]
    (run_dir,) = run_dirs(tmp_path)  # one directory: the nodes share rank 0's run name
    assert "num_nodes: 2" in (run_dir / "config.yaml").read_text() and (run_dir / "metrics.json").is_file()
    assert max_difference(reference_weights, model_weights(run_dir)) <= 1e-5  # float summation order only


def test_optuna_sweep_writes_the_best_value_and_parameters(tmp_path):
    proc = train(tmp_path, "-m", "hparams_search=optuna", "hydra.sweeper.n_trials=2", "strategy=ddp", "devices=2",
                 "accelerator=cpu", "debug=limit")  # fmt: skip
    (sweep,) = (tmp_path / "logs" / "train" / "multiruns").iterdir()
    results = OmegaConf.load(sweep / "optimization_results.yaml")
    assert set(results.best_params) == {"model.optimizer.lr", "model.net.width"}
    jobs = [read_metrics(job)["val/acc"] for job in sweep_jobs(tmp_path)]
    assert len(jobs) == 2 and results.best_value == max(jobs)  # the figure each job returned: its last val/acc
    import optuna

    assert optuna.__version__.split(".")[0] in ("4", "5")  # a current Optuna, not hydra-optuna-sweeper's 2.x
    chosen = " ".join(f"{k}={v}" for k, v in results.best_params.items())
    assert f"optuna: best val/acc {results.best_value:.4g} (trial {results.best_trial}) with {chosen}" in proc.stdout


OPTUNA_ONE_PROCESS = ["-m", "hparams_search=optuna", "accelerator=cpu", "debug=limit", "trainer.max_epochs=2"]


def test_an_interrupted_optuna_sweep_continues_its_study_from_the_journal(tmp_path):
    sweep = tmp_path / "sweep"
    train(tmp_path, *OPTUNA_ONE_PROCESS, "hydra.sweeper.n_trials=1", f"hydra.sweep.dir={sweep}")
    first = (sweep / "0" / "metrics.json").read_text()
    assert (sweep / "optuna.journal").is_file() and OmegaConf.load(sweep / "optimization_results.yaml").trials == 1
    # killed while Optuna held its journal's lock (a symlink beside it, made by Optuna's own lock), a minute ago,
    # and its trial 1 with it (left running, its sweep's pid gone)
    import optuna
    from optuna.storages.journal import JournalFileSymlinkLock

    from hydra_plugins.optuna_journal_sweeper.sweeper import open_storage

    study = optuna.load_study(study_name="sweep", storage=open_storage(f"journal:{sweep / 'optuna.journal'}"))
    ended = subprocess.Popen(["true"])
    ended.wait()  # its pid: a sweep that is gone
    study.ask().set_user_attr("sweeper", f"{socket.gethostname()} {ended.pid}")
    JournalFileSymlinkLock(str(sweep / "optuna.journal")).acquire()
    os.utime(sweep / "optuna.journal", (time.time() - 60,) * 2)
    # the same command again, asking for 3 trials: the lock cleared as Optuna clears a stale one, the one trial
    # finished kept (not run again), the killed one marked failed (it counts), 1 more run
    again = train(tmp_path, *OPTUNA_ONE_PROCESS, "hydra.sweeper.n_trials=3", f"hydra.sweep.dir={sweep}")
    assert f"{sweep / 'optuna.journal.lock'}: a stale lock of the journal" in again.stdout
    assert "trial 1 was left running by a sweep that is gone" in again.stdout
    assert (sweep / "0" / "metrics.json").read_text() == first
    assert sorted(p.name for p in sweep.iterdir() if p.name.isdigit()) == ["0", "2"]
    assert OmegaConf.load(sweep / "optimization_results.yaml").trials == 3
    states = [t.state.name for t in optuna.load_study(study_name="sweep", storage=open_storage(
        f"journal:{sweep / 'optuna.journal'}")).trials]  # fmt: skip
    assert states == ["COMPLETE", "FAIL", "COMPLETE"], states
    lrs = [OmegaConf.load(sweep / job / "config.yaml").model.optimizer.lr for job in ("0", "2")]
    assert len(set(lrs)) == 2  # the continued study draws new points, not the seeded sampler's first ones again


def test_a_journal_that_is_not_optunas_is_refused_in_one_line_before_a_trial_runs(tmp_path):
    import pickle

    sweep = tmp_path / "sweep"
    sweep.mkdir()
    operation = '{"op_code": 0, "worker_id": "w", "study_name": "sweep", "directions": [1]}\n'
    (sweep / "optuna.journal").write_bytes(operation.encode() + pickle.dumps(print) + b"\n")
    proc = train(tmp_path, *OPTUNA_ONE_PROCESS, f"hydra.sweep.dir={sweep}", expect_ok=False)
    assert proc.returncode == 2 and sorted(p.name for p in sweep.iterdir()) == ["optuna.journal"]  # no trial
    assert proc.stderr.strip().splitlines() == [
        f"error: {sweep / 'optuna.journal'}: line 2 is no Optuna journal operation; continue a sweep from the journal"
        " a sweep wrote, or give another hydra.sweep.dir"
    ]


def hostile_journal(sweep, trial) -> None:
    """A journal as Optuna itself writes it, for the default sweep's study, holding `trial` (study -> None)."""
    import optuna

    from hydra_plugins.optuna_journal_sweeper.sweeper import open_storage

    sweep.mkdir()
    study = optuna.create_study(study_name="sweep", storage=open_storage(f"journal:{sweep / 'optuna.journal'}"),
                                direction="maximize")  # fmt: skip
    trial(study)


def test_a_journal_trial_that_sets_keys_the_sweep_does_not_search_is_refused_before_any_job(tmp_path):
    from optuna.distributions import CategoricalDistribution
    from optuna.trial import TrialState, create_trial

    # a waiting trial that Optuna's ask() hands back as it is: its params would be the job's overrides
    marker = tmp_path / "called"
    code = {"+callbacks.x._target_": "builtins.open", "+callbacks.x.file": str(marker), "+callbacks.x.mode": "w"}
    waiting = create_trial(state=TrialState.WAITING, params=code,
                           distributions={k: CategoricalDistribution([v]) for k, v in code.items()})  # fmt: skip
    sweep = tmp_path / "sweep"
    hostile_journal(sweep, lambda study: study.add_trial(waiting))
    proc = train(tmp_path, *OPTUNA_ONE_PROCESS, f"hydra.sweep.dir={sweep}", expect_ok=False)
    assert proc.returncode == 2 and not marker.exists()
    assert sorted(p.name for p in sweep.iterdir()) == ["optuna.journal"]
    assert proc.stderr.strip().splitlines() == [
        f"error: {sweep / 'optuna.journal'}: trial 0 sets +callbacks.x._target_, which this sweep does not search;"
        " continue a sweep with the space it searched, or give another hydra.sweep.dir"
    ]


def test_a_journal_trial_outside_the_searched_space_is_refused_before_any_job(tmp_path):
    sweep = tmp_path / "sweep"  # Optuna would hand the job lr=5.0 with a warning
    hostile_journal(sweep, lambda study: study.enqueue_trial({"model.optimizer.lr": 5.0}))
    proc = train(tmp_path, *OPTUNA_ONE_PROCESS, f"hydra.sweep.dir={sweep}", expect_ok=False)
    assert proc.returncode == 2 and sorted(p.name for p in sweep.iterdir()) == ["optuna.journal"]
    assert proc.stderr.strip().splitlines() == [
        f"error: {sweep / 'optuna.journal'}: trial 0 sets model.optimizer.lr=5.0, outside the space searched"
        " (FloatDistribution(high=0.01, log=True, low=0.0003, step=None)); continue a sweep with the space it"
        " searched, or give another hydra.sweep.dir"
    ]


@pytest.mark.parametrize("value", ["true", "null", "64", "it's", "a\\b", "end\\", 3, 0.001, 1e-05, True, None])
def test_a_point_of_the_space_reaches_the_job_as_the_value_searched(value):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from hydra_plugins.optuna_journal_sweeper.sweeper import hydra_value

    # choice('true', 'null') gives the strings: a job must not get a bool and None
    parsed = OverridesParser.create().parse_override(f"key={hydra_value(value)}").value()
    assert parsed == value and type(parsed) is type(value)


def test_the_sweep_space_is_searched_as_hydra_defines_it_and_every_other_override_reaches_the_trials():
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    from hydra_plugins.optuna_journal_sweeper.sweeper import search_space

    params = {"model.optimizer.lr": "tag(log, interval(0.0003, 0.01))", "model.net.width": "choice(64, 128)"}
    arguments = ["model.net.depth=range(1, 11, 3)", "model.net.dropout=range(0.1, 1.0, 0.2)",
                 "trainer.max_epochs=tag(int, interval(1, 10))", "seed=range(10, 0, -2)", "model.net.width=64",
                 "~callbacks.early_stopping", "+trainer.deterministic=true"]  # fmt: skip
    searched, fixed = search_space(params, arguments)
    assert searched == {
        "model.optimizer.lr": FloatDistribution(0.0003, 0.01, log=True),
        "model.net.depth": IntDistribution(1, 10, step=3),  # range's stop excluded: 1, 4, 7, 10
        "model.net.dropout": FloatDistribution(0.1, 0.9, step=0.2),
        "trainer.max_epochs": IntDistribution(1, 10),
        "seed": IntDistribution(2, 10, step=2),
    }
    assert search_space({}, ["x=tag(int, log, interval(16, 1024))"])[0] == {"x": IntDistribution(16, 1024, log=True)}
    assert not isinstance(searched.get("model.net.width"), CategoricalDistribution)  # the command line's 64 wins
    assert fixed == ["model.net.width=64", "~callbacks.early_stopping", "+trainer.deterministic=true"]


@pytest.mark.parametrize(
    "spec,said",
    [
        ("tag(float, interval(1, 2))", "x: tag float means nothing to the sweeper; tags are log and int"),
        ("tag(int, interval(1.5, 4))", "x: tag(int, interval(1.5, 4)) needs whole-number ends"),
        ("tag(log, choice(1, 2))", "x: choice() takes no tag (log); tag an interval() or range()"),
        (
            "tag(log, range(16, 513, 16))",
            "x=tag(log, range(16, 513, 16)): a log scale takes no step; search tag(int, log, interval(16, 512))"
            " or choice()",
        ),
        ("range(5, 1)", "x=range(5, 1): the range holds no point"),
        (
            "tag(log, range(0.5, 2.0, 0.5))",
            "x=tag(log, range(0.5, 2.0, 0.5)): a log scale takes no step; search tag(log, interval(0.5, 1.5))"
            " or choice()",
        ),
    ],
)
def test_a_sweep_space_the_sweeper_cannot_search_is_one_line(spec, said, capsys):
    from hydra_plugins.optuna_journal_sweeper.sweeper import search_space

    with pytest.raises(SystemExit) as stop:
        search_space({}, [f"x={spec}"])
    assert stop.value.code == 2 and capsys.readouterr().err == f"error: {said}\n"


def test_a_continued_journal_counts_its_complete_pruned_and_failed_trials(tmp_path):
    import optuna
    from optuna.distributions import FloatDistribution
    from optuna.trial import TrialState, create_trial

    from hydra_plugins.optuna_journal_sweeper.sweeper import open_storage

    sweep = tmp_path / "sweep"
    sweep.mkdir()
    study = optuna.create_study(study_name="sweep", storage=open_storage(f"journal:{sweep / 'optuna.journal'}"),
                                direction="maximize")  # fmt: skip
    space = {"model.optimizer.lr": FloatDistribution(0.0003, 0.01, log=True)}
    for state, value in ((TrialState.COMPLETE, 0.5), (TrialState.PRUNED, None), (TrialState.FAIL, None)):
        study.add_trial(
            create_trial(state=state, value=value, params={"model.optimizer.lr": 0.001}, distributions=space)
        )
    train(tmp_path, *OPTUNA_ONE_PROCESS, "hydra.sweeper.n_trials=4", f"hydra.sweep.dir={sweep}")
    assert sorted(p.name for p in sweep.iterdir() if p.name.isdigit()) == ["3"]  # one more trial, numbered after them
    assert OmegaConf.load(sweep / "optimization_results.yaml").trials == 4


def test_the_sweep_table_marks_the_best_job_that_ran_to_the_end_not_a_pruned_one(tmp_path):
    from starter.loggers.sweep_summary import summary_rows

    # a pruned trial stopped early, its figure not comparable: job 1's 0.99 is no answer
    for job, value in enumerate([0.9, 0.99, 0.95]):
        (tmp_path / str(job)).mkdir()
        OmegaConf.save({"monitor": "val/acc", "monitor_mode": "max"}, tmp_path / str(job) / "config.yaml")
        (tmp_path / str(job) / "metrics.json").write_text(f'{{"val/acc": {value}}}')
    assert [row["best"] for row in summary_rows(tmp_path, "val/acc", "max", pruned={1})] == [False, False, True]
    assert [row["best"] for row in summary_rows(tmp_path, "val/acc", "max")] == [False, True, False]


def test_an_optuna_trial_that_falls_behind_is_pruned_after_its_validation(tmp_path):
    # a pruner that prunes every figure below 2 (val/acc never is): the trial stops after its first epoch
    prune = ["hydra.sweeper.n_trials=1", "hydra.sweeper.pruner._target_=optuna.pruners.ThresholdPruner",
             "~hydra.sweeper.pruner.n_startup_trials", "~hydra.sweeper.pruner.n_warmup_steps",
             "+hydra.sweeper.pruner.lower=2.0"]  # fmt: skip
    proc = train(tmp_path, *OPTUNA_ONE_PROCESS, *prune)
    (job,) = sweep_jobs(tmp_path)
    with open(job / "metrics.csv", newline="") as f:
        assert {row["epoch"] for row in csv.DictReader(f) if row.get("val/acc")} == {"0"}  # one of two epochs
    assert "optuna: trial 0 pruned after epoch 1 (val/acc" in proc.stdout
    (sweep,) = (tmp_path / "logs" / "train" / "multiruns").iterdir()
    assert list(OmegaConf.load(sweep / "optimization_results.yaml").pruned_trials) == [0]
    assert any(line.startswith("  job 0") and line.endswith("(pruned)") for line in proc.stdout.splitlines())
