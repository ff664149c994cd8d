"""Runs are recoverable: atomic checkpoints, a killed rank, preemption by SIGTERM, concurrent runs, bad input."""

import csv
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from subprocess import PIPE, Popen

import pytest
import torch

from conftest import (
    BED,
    CONF,
    PROBES,
    QUIET,
    ROOT,
    descendants,
    free_port,
    kill_with_descendants,
    on_bed,
    on_cpu,
    plant,
    read_metrics,
    reaped,
    run_dirs,
    slurm_env,
    train,
    wait_for_beat,
    wait_for_checkpoint,
    with_env,
    worker_of_rank,
)
from starter.checkpointing.atomic_io import AtomicCheckpointIO
from starter.process_state import gone, process_state

pytestmark = pytest.mark.slow


class FailsToPickle:
    def __reduce__(self):
        raise RuntimeError("disk full")  # stands for any failure halfway through writing


def test_a_failed_save_leaves_the_previous_checkpoint_and_no_temporary_file(tmp_path):
    io, path = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint({"w": torch.ones(3)}, path)
    with pytest.raises(RuntimeError, match="disk full"):
        io.save_checkpoint({"w": torch.zeros(10_000_000), "x": FailsToPickle()}, path)
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


SAVE_FOREVER = """
import sys, torch
from starter.checkpointing.atomic_io import AtomicCheckpointIO
io, i = AtomicCheckpointIO(), 0
while True:
    io.save_checkpoint({"version": i, "w": torch.full((4_000_000,), float(i))}, sys.argv[1])
    if i == 0:
        print("saved", flush=True)
    i += 1
"""


@pytest.mark.parametrize("delay", [0.03, 0.11, 0.23])
def test_sigkill_during_saving_leaves_a_whole_checkpoint(delay, tmp_path):
    path = tmp_path / "last.ckpt"
    writer = subprocess.Popen([sys.executable, "-c", SAVE_FOREVER, str(path)], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline() == "saved\n"
    time.sleep(delay)  # each 16 MB save takes a few tens of ms: the kill lands inside one
    writer.kill()
    writer.wait()
    checkpoint = torch.load(path, weights_only=True)
    assert torch.equal(checkpoint["w"], torch.full((4_000_000,), float(checkpoint["version"])))


def start(tmp_path: Path, *overrides: str, env: dict | None = None, **popen) -> subprocess.Popen:
    command = [sys.executable, str(ROOT / "train.py"), *on_bed([f"paths.log_dir={tmp_path / 'logs'}", *QUIET,
               *on_cpu(overrides)])]  # fmt: skip
    return Popen(command, cwd=tmp_path, stdout=PIPE, stderr=PIPE, text=True, env=with_env(env), **popen)


LONG_DDP = ["strategy=ddp", "devices=2", "accelerator=cpu", "trainer.max_epochs=1000"]


def test_sigkill_of_one_ddp_rank_ends_the_run_and_it_resumes_from_the_last_checkpoint(tmp_path):
    proc = start(tmp_path, *LONG_DDP)
    last = wait_for_checkpoint(tmp_path, proc)
    # Rank 0 stopped first cannot leave by itself (on gloo a live peer would error out of its collective): the
    # launcher must stop it. (Its watchdog is stopped too: the default heartbeat_timeout_s is 120 s.)
    os.kill(worker_of_rank(proc, 0), signal.SIGSTOP)
    os.kill(worker_of_rank(proc, 1), signal.SIGKILL)
    killed_at = time.monotonic()
    proc.wait(timeout=60)
    seconds = time.monotonic() - killed_at
    # 128 + SIGKILL, as a shell says; the stopped rank 0 killed at once, not after the 10 s grace a live one gets
    assert proc.returncode == 137 and seconds < 8, (proc.returncode, seconds)
    lines = [line for line in proc.stderr.read().splitlines() if line.startswith("error:")]
    assert lines == ["error: rank 1 (node 0) was killed by SIGKILL (out of memory?); every process of the run stops"]
    epoch = torch.load(last, weights_only=True)["epoch"]  # whole, loadable
    train(tmp_path, *LONG_DDP[:3], "ckpt_path=last", f"trainer.max_epochs={epoch + 2}")
    resumed = [d for d in run_dirs(tmp_path) if d != last.parents[1]]
    assert len(resumed) == 1 and read_metrics(resumed[0])["test/acc"] > 0.9


def test_checkpoint_every_n_steps_bounds_the_steps_a_kill_costs(tmp_path):
    train(
        tmp_path, "checkpoint_every_n_steps=4", "trainer.max_epochs=1", "trainer.limit_train_batches=10", "test=false"
    )
    (run_dir,) = run_dirs(tmp_path)
    # 10 steps: last.ckpt at steps 4 and 8, none at the epoch's end (a kill at step 11 would cost 3)
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 8


def test_sigkill_during_a_sharded_fsdp_save_leaves_a_whole_checkpoint(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    proc = start(tmp_path, "strategy=fsdp", "devices=2", "accelerator=cpu", "trainer.max_epochs=1000",
                 "checkpoint_every_n_steps=1")  # fmt: skip
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("logs/train/runs/*/checkpoints/last.ckpt")):
        assert time.monotonic() < deadline and proc.poll() is None, "no checkpoint appeared"
        time.sleep(0.05)
    (last,) = tmp_path.glob("logs/train/runs/*/checkpoints/last.ckpt")
    workers = [worker_of_rank(proc, rank) for rank in (0, 1)]
    while len(list(last.parent.glob("last.ckpt.*"))) < 2:  # the next save has created its directory
        time.sleep(0.001)
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=60)
    versions = sorted(last.parent.glob("last.ckpt.*"))  # names grow with time
    # Killed inside the save (its directory made, not yet repointed): last.ckpt still names the previous save.
    # Killed after the repoint, before the old version was deleted: it names the new, whole save.
    assert len(versions) == 2 and last.resolve() in versions
    assert sorted(p.name for p in last.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    dcp_to_torch_save(last, tmp_path / "whole.pt")  # reads every shard the metadata names
    weights = torch.load(tmp_path / "whole.pt", weights_only=True)["state_dict"]
    assert weights and all(torch.isfinite(w).all() for w in weights.values())


@pytest.mark.parametrize(
    "phase,name", [("setup", "SIGTERM"), ("the sanity check", "SIGUSR1"), ("test", "SIGTERM"), ("test", "SIGUSR2")]
)
def test_a_stop_signal_at_any_phase_exits_143_with_one_line_naming_it_and_what_is_on_disk(phase, name, tmp_path):
    signal_in = ["+callbacks.stop._target_=probes.SignalInPhase", f"+callbacks.stop.phase='{phase}'",
                 f"+callbacks.stop.signal={name}"]  # fmt: skip
    proc = train(tmp_path, "trainer.max_epochs=2", *signal_in, expect_ok=False)
    (run_dir,) = run_dirs(tmp_path)
    last = run_dir / "checkpoints" / "last.ckpt"
    if phase == "test":  # trained to the end: the epochs' last.ckpt is there, and said, as on disk
        step = torch.load(last, weights_only=True)["global_step"]
        said = (
            f"checkpoints/last.ckpt holds step {step}, saved before; resume with ckpt_path={last.relative_to(tmp_path)}"
        )
    else:
        said = "nothing was saved (this run has no checkpoints/last.ckpt)"
        assert not last.exists()
    assert proc.returncode == 143 and not (run_dir / "metrics.json").exists()  # no figures it did not finish
    assert proc.stderr.strip().splitlines() == [f"error: stopped by {name} during {phase}; {said}"]


@pytest.mark.slow
def test_a_stop_signal_during_a_ddp_test_is_one_line_from_rank_0_and_exit_143(tmp_path):
    signal_in = ["+callbacks.stop._target_=probes.SignalInPhase", "+callbacks.stop.phase=test"]
    proc = train(tmp_path, "strategy=ddp", "devices=2", "debug=limit", *signal_in, expect_ok=False)
    (run_dir,) = run_dirs(tmp_path)
    last = run_dir / "checkpoints" / "last.ckpt"
    step = torch.load(last, weights_only=True)["global_step"]
    assert proc.returncode == 143 and not (run_dir / "metrics.json").exists()
    assert [line for line in proc.stderr.splitlines() if line.strip()] == [
        f"error: stopped by SIGTERM during test; checkpoints/last.ckpt holds step {step}, saved before; resume with"
        f" ckpt_path={last.relative_to(tmp_path)}"
    ]  # rank 0's, and not the launcher's too


def stop_said(name: str, step: int, last: Path, cwd: Path) -> str:
    """The line a run stopped by `name` while training ends with, once it saved `last` at `step` (errors.stop_line)."""
    saved = f"at step {step} after saving checkpoints/last.ckpt; resume with ckpt_path={last.relative_to(cwd)}"
    return f"error: stopped by {name} during training {saved}"


def test_a_stop_signal_that_reaches_one_rank_saves_last_checkpoint_and_exits_143_on_every_rank(tmp_path):
    proc = start(tmp_path, *LONG_DDP)
    last = wait_for_checkpoint(tmp_path, proc)
    before = torch.load(last, weights_only=True)["global_step"]
    # a signal reaching only one rank stops all of them at the same step too (its watchdog tells the others; the
    # launcher's forwarding of each stop signal to every worker: below)
    os.kill(worker_of_rank(proc, 1), signal.SIGTERM)
    proc.wait(timeout=60)
    assert proc.returncode == 143
    err = proc.stderr.read()
    saved = torch.load(last, weights_only=True)["global_step"]
    # rank 0's line alone: no traceback, nor torch's agent's warning ("Received 15 death signal, shutting down
    # workers"), nor the launcher's. Rank 0 names the signal its watchdog relayed from rank 1's request, or "a stop
    # signal" where a logging step's collective told it first
    assert err.strip() in (stop_said(cause, saved, last, tmp_path) for cause in ("SIGTERM", "a stop signal"))
    assert saved > before  # saved at the stop, not at an epoch's end only


SLOW = ["trainer.limit_train_batches=3", "trainer.limit_val_batches=1", "test=false"]


def test_a_stop_signal_saves_within_two_steps_however_long_a_step_takes(tmp_path):
    # Steps of 1.5 s (a large model's), logged every 10 steps: the ranks agree on the stop step through the run's
    # store, not at a logging step, and the launcher waits for the save (stop_grace_s) before it ends them
    ends = tmp_path / "step_ends"
    slow = [
        "+callbacks.slow._target_=probes.SlowSteps",
        "+callbacks.slow.seconds=1.5",
        f"+callbacks.slow.output={ends}",
    ]
    proc = start(tmp_path, *LONG_DDP, *SLOW, *slow, env=PROBES)
    last = wait_for_checkpoint(tmp_path, proc, epochs=1)
    os.kill(proc.pid, signal.SIGTERM)  # the launcher's: torch's agent forwards it to every worker
    signalled = time.monotonic()
    (code,), (ended,), lines = exits([proc], timeout=60, said=("error:", "Traceback", "W"))
    ended_steps = [line.split() for line in ends.read_text().splitlines()]
    in_progress = next(int(step) for step, at in ended_steps if float(at) > signalled)  # the step the signal met
    saved = torch.load(last, weights_only=True)["global_step"]
    # that line alone: no traceback, nor torch's agent's warning ("W... Received 15 death signal, shutting down")
    assert code == 143 and lines == [stop_said("SIGTERM", saved, last, tmp_path)]
    # the step after the one the signal met, or (where it met the end of that step) the next: within two steps
    assert in_progress < saved <= in_progress + 2 and saved > 3  # past the first epoch's 3 steps
    print(f"SIGTERM to exit: {ended - signalled:.1f} s with steps of 1.5 s")


def test_a_save_longer_than_stop_grace_s_is_said_to_be_unsaved(tmp_path):
    slow = ["+callbacks.slow._target_=probes.SlowSaves", "+callbacks.slow.seconds=30", "+callbacks.slow.after=3"]
    proc = start(tmp_path, *LONG_DDP, *SLOW, *slow, "stop_grace_s=2", env=PROBES)
    last = wait_for_checkpoint(tmp_path, proc, epochs=1)
    os.kill(proc.pid, signal.SIGTERM)
    (code,), (ended,), lines = exits([proc], timeout=60)
    # the launcher's (rank 0 did not get to say one), naming where the signal arrived where a worker recorded it
    said = re.fullmatch(
        r"error: stopped by SIGTERM( \(sent to node 0\) during training)?; the workers did not save within"
        r" stop_grace_s=2 \(raise it above a step and a save\); checkpoints/last.ckpt holds step 3, saved before;"
        rf" resume with ckpt_path={re.escape(str(last.relative_to(tmp_path)))}",
        lines[0] if len(lines) == 1 else "",
    )
    assert code == 143 and said, lines
    assert torch.load(last, weights_only=True)["global_step"] == 3  # the first epoch's, whole


@pytest.mark.parametrize("layout", ["1 process", "1 process, in a save", "2 processes, rank 0 in a save", "two nodes"])
def test_ctrl_c_ends_every_process_with_one_line_and_exit_130(layout, tmp_path):
    # The terminal sends SIGINT to its whole foreground group: train.py, torch's agent in it, the fork server and the
    # workers. Lightning catches it in fit and exits 1, torch's agent lets it through its loop (a traceback), a save
    # it cuts short raises an error of its own; on two nodes (Ctrl-C in node 1's terminal) node 0's rank would blame
    # its broken collective, or wait for rank 1's beat.
    said = "error: interrupted (Ctrl-C); to continue from the newest checkpoint saved: ckpt_path=last"
    marker, long = tmp_path / "in a save", ["trainer.max_epochs=1000"]
    if "in a save" in layout:  # the interrupt arrives there
        long += ["+callbacks.cut._target_=probes.CutShortByCtrlC", f"+callbacks.cut.marker={marker}"]
    if layout == "two nodes":
        port = free_port()
        procs = [start_node(tmp_path, node, port, *long, start_new_session=True) for node in (0, 1)]
        expected = ["error: node 1 was interrupted (Ctrl-C)", said]  # node 0's, then node 1's
    else:
        run = [*long, "strategy=ddp", "devices=2"] if layout.startswith("2 processes") else long
        procs = [start(tmp_path, *run, env=PROBES, start_new_session=True)]
        expected = [said]
    last = wait_for_checkpoint(tmp_path, procs[0], epochs=1)
    while "in a save" in layout and not marker.exists():
        assert procs[0].poll() is None, procs[0].stderr.read()[-3000:]
        time.sleep(0.05)
    workers = [pid for proc in procs for pid in descendants(proc.pid)]
    os.killpg(procs[-1].pid, signal.SIGINT)
    interrupted_at = time.monotonic()
    codes, ended, lines = exits(procs, timeout=60, said=("error:", "Traceback"))
    # within exits()' 60 s, half the heartbeat (120 s) that a node waiting for its lost peer's beat would take
    assert codes == [130] * len(procs) and lines == expected, (codes, lines)
    assert_gone_by(workers, interrupted_at + 60)
    assert torch.load(last, weights_only=True)["global_step"] > 0  # what was saved before is whole


@pytest.mark.parametrize("signalled", [0, 1], ids=["node 0", "node 1, each node on a host of its own"])
def test_a_stop_signal_to_one_node_stops_every_node_at_one_step_each_saying_the_signal_and_where(
    signalled, tmp_path, request
):
    # SIGTERM to one node's train.py alone (the scheduler's preemption of that node): its agent forwards it to its
    # workers, their watchdogs tell the other node's through the run's store, every rank saves at one step. Each node
    # says the one line, with the signal and the node it reached; node 0's train.py holds the store until node 1 has
    # read how the run stopped, and no node calls the store once it has gone (torch's C++ traces: none). Not after
    # stop_grace_s (90 s here): the exits' timeout is shorter.
    hosts = request.getfixturevalue("hosts") if signalled else None
    port = free_port()
    procs = [start_node(tmp_path, node, port, "devices=2", *LONG_DDP[-1:], hosts=hosts) for node in (0, 1)]
    with reaped(*procs):
        last = wait_for_checkpoint(tmp_path, procs[0], epochs=1)
        os.kill(procs[signalled].pid, signal.SIGTERM)
        codes, _, lines = exits(procs, timeout=60, said=("",))
    # torch's store warns where it cannot name a client by its address (a host of no DNS name): not a trace of ours
    lines = [line for line in lines if "The hostname of the client socket cannot be retrieved" not in line]
    saved = torch.load(last, weights_only=True)["global_step"]
    said = stop_said(f"SIGTERM (sent to node {signalled})", saved, last, tmp_path)
    assert codes == [143, 143] and lines == [said, said], (codes, lines[:6], len(lines))


def test_ctrl_c_named_in_stop_signals_saves_last_checkpoint_first(tmp_path):
    # stop_signals=[..., SIGINT]: Ctrl-C is a stop signal like the others, every rank saves at one step, exit 143
    proc = start(tmp_path, *LONG_DDP, "stop_signals=[SIGTERM,SIGINT]", start_new_session=True)
    last = wait_for_checkpoint(tmp_path, proc, epochs=1)
    os.killpg(proc.pid, signal.SIGINT)
    codes, _, lines = exits([proc], timeout=60, said=("error:", "Traceback"))
    saved = torch.load(last, weights_only=True)["global_step"]
    assert codes == [143] and lines == [stop_said("SIGINT", saved, last, tmp_path)], (codes, lines)


FORWARDS = """
import os, signal, sys, threading, time
from pathlib import Path
from omegaconf import OmegaConf
from starter.errors import WorkerFailed
from starter.launch.agent import start_workers
from starter.topology import Layout

stop_signals = sys.argv[2:]
for name in stop_signals:  # one launch per signal, as a scheduler would send it to the job's train.py
    run = Path(sys.argv[1]) / name
    run.mkdir()
    OmegaConf.save({"log_file": str(run / "train.log"), "heartbeat_timeout_s": 60, "stall_timeout_s": 60,
                    "stop_grace_s": 90, "stop_signals": stop_signals}, run / "config.yaml")

    def send(run=run, name=name):
        while len(list(run.glob("ready*"))) < 2:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.Signals[name])

    threading.Thread(target=send).start()
    try:
        start_workers("probes:wait_for_a_stop_signal", ("probes",), run / "config.yaml", Layout(1, 2), name,
                      stop_signals=stop_signals)
    except WorkerFailed as failed:
        print(name, failed.exit_code, failed.message, flush=True)
"""


def test_every_stop_signal_the_launcher_gets_reaches_every_worker(tmp_path):
    # Which signal a scheduler sends before it ends a job varies (SIGTERM; sbatch --signal: SIGUSR1; a time-out
    # warning: SIGUSR2): the launcher forwards each of `stop_signals` to each worker (which saves and exits 143).
    signals = ["SIGTERM", "SIGUSR1", "SIGUSR2"]
    out = subprocess.run([sys.executable, "-c", FORWARDS, str(tmp_path), *signals], capture_output=True, text=True,
                         env=with_env(PROBES), timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    for name in signals:
        assert [(tmp_path / name / f"rank{rank}").read_text() for rank in (0, 1)] == [name, name]
        said = f"{name} 143 stopped by {name} at step 0 after saving checkpoints/last.ckpt; resume with ckpt_path="
        assert said in out.stdout, out.stdout


@pytest.mark.parametrize("launcher", ["train.py", "torchrun's agent"])
def test_workers_whose_launcher_is_killed_save_last_checkpoint_at_one_step_and_stop(launcher, tmp_path):
    # A SIGKILLed launcher (kill -9, the OOM killer; torchrun's agent alone on a node) can neither forward a signal
    # nor collect its workers, which would train on with nobody to stop them: each sees it gone and stops as on
    # SIGTERM, every rank at one step.
    # The store went with train.py: each worker has stop_grace_s (90 s) to save and stop before its watchdog gives
    # up on the store, however short heartbeat_timeout_s is: here the save takes twice the heartbeat
    if launcher == "train.py":
        slow = [
            "+callbacks.slow._target_=probes.SlowSaves",
            "+callbacks.slow.seconds=8",
            "+callbacks.slow.stopping=true",
        ]
        proc = start(tmp_path, *LONG_DDP, "heartbeat_timeout_s=4", *slow, env=PROBES)
    else:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}"]
        command = [*torchrun, str(ROOT / "train.py"), *on_bed([f"paths.log_dir={tmp_path / 'logs'}", *QUIET,
                   *LONG_DDP[:1], *LONG_DDP[2:], "heartbeat_timeout_s=20"])]  # fmt: skip
        proc = Popen(command, cwd=tmp_path, stdout=PIPE, stderr=PIPE, text=True, env=with_env())
    last = wait_for_checkpoint(tmp_path, proc, epochs=1)
    before = torch.load(last, weights_only=True)["global_step"]
    workers = [worker_of_rank(proc, rank) for rank in (0, 1)]
    proc.kill()
    killed_at = time.monotonic()
    out, err = proc.communicate(timeout=60)  # the workers write to the same pipes: read until the last has closed them
    assert_gone_by(workers, killed_at + 30)
    said = f"error: node 0's launcher ({launcher}, pid {proc.pid}) is gone; its workers save checkpoints/last.ckpt" \
           " and stop"  # fmt: skip
    saved = torch.load(last, weights_only=True)["global_step"]
    # each once, by local rank 0: the watchdog's, and the stop's (its watchdog sent it SIGTERM, or the collective of
    # a logging step told it another rank's)
    lines = sorted(line for line in err.splitlines() if line.startswith("error:"))
    assert lines[0] == said and lines[1:] in (
        [stop_said(c, saved, last, tmp_path)] for c in ("SIGTERM", "a stop signal")
    )
    assert saved > before


QUICK_EXIT = """
import atexit, sys, threading, time
from pathlib import Path
from starter.errors import end_without_teardown

def main():
    atexit.register(lambda: Path(sys.argv[1]).write_text(Path(sys.argv[1]).read_text() + ", the exit hooks ran"))
    threading.Thread(target=lambda: time.sleep(0.3) or Path(sys.argv[1]).write_text("a thread wrote")).start()
    sys.stdout.write("buffered, no newline")
    raise SystemExit(int(sys.argv[2]) if sys.argv[2].isdigit() else sys.argv[2])

class Teardown:
    def __del__(self):  # freed in the interpreter's teardown, which the process does not reach
        Path(sys.argv[1]).write_text(Path(sys.argv[1]).read_text() + ", torn down")

kept = Teardown()
end_without_teardown(main)
"""


@pytest.mark.parametrize("code,exit_code", [("0", 0), ("2", 2), ("143", 143), ("error: a message", 1)])
def test_a_process_that_skips_the_interpreters_teardown_keeps_its_exit_code_output_threads_and_exit_hooks(
    code, exit_code, tmp_path
):
    # train.py ends so (errors.end_without_teardown): 1.5-2.5 s sooner where Lightning is imported.
    env = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}
    out = subprocess.run([sys.executable, "-c", QUICK_EXIT, str(tmp_path / "hooks"), code], capture_output=True,
                         text=True, env=env, timeout=60)  # fmt: skip
    assert (out.returncode, out.stdout) == (exit_code, "buffered, no newline"), out.stderr
    assert (tmp_path / "hooks").read_text() == "a thread wrote, the exit hooks ran"  # in the interpreter's order
    assert out.stderr == ("error: a message\n" if exit_code == 1 else "")


def test_two_ddp_runs_at_once_do_not_collide(tmp_path, monkeypatch):
    # Rank 0 of each run serves its rendezvous store on a port the OS gave it and holds (no MASTER_PORT given);
    monkeypatch.delenv("MASTER_PORT", raising=False)
    procs = [start(tmp_path / name, "strategy=ddp", "devices=2", "accelerator=cpu", "debug=limit")
             for name in ("a", "b") if not (tmp_path / name).mkdir()]  # fmt: skip
    for proc in procs:
        proc.wait(timeout=300)
        assert proc.returncode == 0, proc.stderr.read()[-2000:]


@pytest.mark.parametrize("strategy", ["auto", "ddp"])
def test_nan_loss_stops_naming_its_step_and_keeps_no_bad_checkpoint(strategy, tmp_path):
    # Step 13 of epoch 0 (19 steps): found at the end of the epoch, before its checkpoint would be written.
    proc = train(tmp_path, f"strategy={strategy}", f"devices={1 if strategy == 'auto' else 2}",
                 "+callbacks.nan._target_=probes.NanWeightsAtStep", "+callbacks.nan.step=13",
                 env=PROBES, expect_ok=False)  # fmt: skip
    assert proc.returncode == 2
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    (line,) = lines
    # several processes: both meet it; the line names the one that said it first, once
    rank = r"rank [01] \(node 0\): " if strategy == "ddp" else ""
    assert re.fullmatch(f"error: {rank}the training loss is nan at step 13 \\(epoch 0, batch 13\\); lower"
                        r" model\.optimizer\.lr, or check the data for NaN/inf", line), line  # fmt: skip
    assert not list(tmp_path.glob("logs/**/*.ckpt")) and not list(tmp_path.glob("logs/**/model.pt"))


@pytest.mark.parametrize("strategy", ["ddp"])
def test_an_exception_on_one_rank_is_its_traceback_and_one_line_naming_it_and_every_rank_exits_1(strategy, tmp_path):
    proc = train(tmp_path, f"strategy={strategy}", "devices=2", "debug=limit",
                 "+callbacks.bug._target_=probes.RaiseAtStep", "+callbacks.bug.step=2", "+callbacks.bug.rank=1",
                 env=PROBES, expect_ok=False, timeout=120)  # fmt: skip
    assert proc.returncode == 1
    assert [x for x in proc.stderr.splitlines() if x.startswith("error:")] == [
        "error: rank 1 (node 0): ValueError: a bug at step 2"  # rank 0's broken collective adds nothing
    ]
    assert proc.stderr.count("Traceback (most recent call last)") == 1  # rank 1's


def test_checkpoint_of_a_different_model_is_refused_before_training(default_run, tmp_path):
    best = default_run[1] / "checkpoints" / "best.ckpt"
    proc = train(tmp_path, "model=bed_cnn", f"ckpt_path={best}", expect_ok=False)
    assert proc.returncode == 2 and "holds weights of a different model" in proc.stderr
    assert not list(tmp_path.glob("logs/**/metrics.csv"))
    # another size: the line names the settings of the run that saved it, and with them the checkpoint loads
    narrow = ["model.net.width=32", f"ckpt_path={best}", "train=false"]
    proc = train(tmp_path / "narrow", *narrow, expect_ok=False)
    assert proc.returncode == 2 and proc.stderr.endswith(
        "use the model config of the run that saved it: model.net.width=256\n"
    )
    train(tmp_path / "as_saved", *narrow, "model.net.width=256")


def test_an_unpickling_error_of_a_users_own_code_is_its_own_not_a_checkpoints(tmp_path):
    proc = train(tmp_path, "debug=fdr", "+callbacks.theirs._target_=conftest.UnpicklesItsOwn", expect_ok=False)
    assert proc.returncode == 1 and "UnpicklingError: the callback's own cache is unreadable" in proc.stderr
    assert "holds pickled objects" not in proc.stderr  # no checkpoint was loaded, none is blamed


@pytest.mark.parametrize("saved", ["best.ckpt", "model.pt"])
def test_a_checkpoint_holding_pickled_code_is_refused_in_one_line_by_every_reader(default_run, saved, tmp_path):
    planted = tmp_path / saved
    planted.write_bytes((default_run[1] / "checkpoints" / saved).read_bytes())
    plant(planted)
    # each reader of a checkpoint file: evaluating, resuming (a Lightning checkpoint), fine-tuning from it,
    # predicting, exporting
    readers = [["train=false", f"ckpt_path={planted}"], [f"init_from={planted}"]]
    readers += [[f"ckpt_path={planted}"]] if saved.endswith(".ckpt") else []
    runs = [train(tmp_path, *how, expect_ok=False) for how in readers]
    scripts = {"predict.py": ["inputs=.", "num_workers=0"], "export.py": ["format=torch_export"]}
    runs += [train(tmp_path, f"ckpt_path={planted}", *more, script=s, expect_ok=False) for s, more in scripts.items()]
    for proc in runs:
        assert proc.returncode == 2 and "CODE FROM THE CHECKPOINT RAN" not in proc.stdout + proc.stderr
        (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert re.match(rf"error: (ckpt_path|init_from)={planted} holds pickled objects besides tensors \(", line), line
        assert line.endswith("refused: loading it could run code. Load only checkpoints written by this starter")


def test_a_config_beside_a_checkpoint_is_read_as_data_never_resolved(default_run, tmp_path):
    # someone else's run directory: its config.yaml asks for this machine's environment, which a resolve would read
    run = tmp_path / "theirs"
    (run / "checkpoints").mkdir(parents=True)
    checkpoint = run / "checkpoints" / "last.ckpt"
    checkpoint.write_bytes((default_run[1] / "checkpoints" / "last.ckpt").read_bytes())
    config = (default_run[1] / "config.yaml").read_text()
    (run / "config.yaml").write_text(config.replace("task_name: train", "task_name: ${oc.env:SECRET_TOKEN}"))
    proc = train(tmp_path, f"ckpt_path={checkpoint}", env={"SECRET_TOKEN": "hunter2"}, expect_ok=False)
    assert proc.returncode == 2 and "hunter2" not in proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: {run / 'config.yaml'}: refused, it holds an interpolation ('${{oc.env:SECRET_TOKEN}}'), a run's none;"
        " move the checkpoint out of that directory to load it without its config"
    ]
    (run / "config.yaml").write_text("!!python/object/apply:os.system ['echo CODE FROM THE CONFIG RAN']")
    proc = train(tmp_path, f"ckpt_path={checkpoint}", expect_ok=False)
    assert proc.returncode == 2 and "CODE FROM THE CONFIG RAN" not in proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {run / 'config.yaml'}: refused, not a run's")


def test_sharded_checkpoint_under_another_strategy_is_refused_before_training(tmp_path):
    sharded = tmp_path / "last.ckpt"  # what strategy=fsdp writes: a directory with its meta.pt (a symlink to one)
    (tmp_path / "last.ckpt.1").mkdir()
    (tmp_path / "last.ckpt.1" / "meta.pt").write_bytes(b"")
    sharded.symlink_to("last.ckpt.1")
    proc = train(tmp_path, f"ckpt_path={sharded}", expect_ok=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: ckpt_path={sharded} is a sharded (fsdp) checkpoint; resume or evaluate it with strategy=fsdp"
    )
    assert not list(tmp_path.glob("logs/**/metrics.csv"))


def test_a_train_split_smaller_than_one_batch_is_refused_rather_than_trained_for_no_step(tmp_path):
    proc = train(tmp_path, "data.batch_size=2048", expect_ok=False)  # digits: 1,257 training images
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: the train split's 1257 samples make no whole batch of data.batch_size=2048; use data.batch_size=1257"
        " or less"
    )


def test_unwritable_output_directory_is_one_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *on_bed([f"paths.log_dir={blocker / 'logs'}"])],
                          capture_output=True, text=True, cwd=tmp_path)  # fmt: skip
    assert proc.returncode != 0
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"error: cannot write the run directory {blocker / 'logs'}")
    assert f"{blocker} is not a directory; set paths.log_dir" in proc.stderr


def test_a_requeued_job_resumes_from_its_own_directory_with_ckpt_path_auto(tmp_path):
    # What a SLURM requeue does: the same command again, into the same job directory.
    run_dir = tmp_path / "logs" / "job"
    again = ["ckpt_path=auto", f"hydra.run.dir={run_dir}", "debug=limit", "trainer.log_every_n_steps=1"]
    first = train(tmp_path, *again, "trainer.max_epochs=1")
    assert "ckpt_path=auto ->" not in first.stdout + first.stderr  # nothing to resume: a fresh start
    second = train(tmp_path, *again, "trainer.max_epochs=2")
    assert (
        f"ckpt_path=auto -> {run_dir / 'checkpoints' / 'last.ckpt'} (resuming this run)"
        in second.stdout + second.stderr
    )
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["epoch"] == 1
    with open(run_dir / "metrics.csv", newline="") as f:  # the first attempt's rows are kept, then the second's
        rows = [(int(r["epoch"]), int(r["step"])) for r in csv.DictReader(f) if r["train/loss"]]
    assert rows == [(epoch, step) for step in range(10) for epoch in [step // 5]]


def start_node(tmp_path: Path, node: int, port: int, *overrides: str, cwd: Path | None = None, hosts=None, **popen):
    """`train.py` as node `node` of two, one process each, on localhost (`hosts`: on host `node`); `cwd` stands for the
    node's own disk."""
    env = with_env(MASTER_ADDR=hosts.address(0) if hosts else "127.0.0.1", MASTER_PORT=str(port), NODE_RANK=str(node))
    command = [sys.executable, str(ROOT / "train.py"), *on_bed(["strategy=ddp", "devices=1", "num_nodes=2",
               "accelerator=cpu", f"paths.log_dir={tmp_path / 'logs'}", *QUIET, *overrides])]  # fmt: skip
    options = dict(cwd=cwd or tmp_path, stdout=PIPE, stderr=PIPE, text=True, **popen)
    return hosts.popen(node, command, env, **options) if hosts else subprocess.Popen(command, env=env, **options)


def assert_gone_by(pids: list[int], by: float) -> None:
    """Every process of `pids` has ended by monotonic time `by` (else: each one's state). A process closes its pipes,
    and its parent may end, a moment before it has ended itself (the fork server sees its parent gone only then)."""
    while not all(gone(pid) for pid in pids) and time.monotonic() < by:
        time.sleep(0.05)
    assert all(gone(pid) for pid in pids), [(pid, process_state(pid)) for pid in pids]


def exits(procs: list[Popen], timeout: float = 120, said=("error:",)) -> tuple[list[int], list[float], list[str]]:
    """Each process's exit code, when it exited (monotonic), and the lines of all of them that start as `said`."""
    deadline, ended = time.monotonic() + timeout, {}
    while len(ended) < len(procs) and time.monotonic() < deadline:
        ended |= {i: time.monotonic() for i, p in enumerate(procs) if i not in ended and p.poll() is not None}
        time.sleep(0.1)
    if len(ended) < len(procs):
        for proc in procs:
            kill_with_descendants(proc)
        raise AssertionError(f"still running after {timeout} s: {[p.args[-1] for p in procs]}")
    lines = [line for p in procs for line in p.stderr.read().splitlines() if line.startswith(said)]
    return [p.returncode for p in procs], [ended[i] for i in range(len(procs))], lines


def node_1_without_the_data(tmp_path: Path, *data: str) -> tuple[list[int], list[float], list[str]]:
    """Two nodes on localhost training with `data`, which is on node 0's disk (its working directory holds it) and
    not on node 1's, each its own run directory: how each exits (exits())."""
    (tmp_path / "node1").mkdir()
    port = free_port()
    nodes = [
        start_node(
            tmp_path,
            n,
            port,
            *data,
            f"hydra.run.dir={tmp_path / f'run{n}'}",
            cwd=tmp_path / f"node{n}" if n else tmp_path,
        )
        for n in (0, 1)
    ]
    return exits(nodes)


def test_a_config_option_that_does_not_exist_on_node_0_is_said_on_node_1_too(tmp_path):
    # refused before Hydra composes anything (config_choices), as Hydra's own errors would be, then told to node 1
    port = free_port()
    nodes = [start_node(tmp_path, n, port, "debug=limit", *([] if n else ["model=nope"])) for n in (0, 1)]
    codes, ended, lines = exits(nodes, timeout=60)
    options = sorted(p.stem for folder in (CONF, BED / "conf") for p in (folder / "model").glob("*.yaml"))
    said = f"error: model=nope: no such option; choose one of {', '.join(options)}"  # the project's and the bed's
    assert codes == [2, 2] and lines[0].startswith(said) and lines[1].startswith("error: node 0: model=nope"), lines


def test_nodes_started_with_other_configs_are_told_so_in_one_line_within_seconds(tmp_path):
    port = free_port()
    nodes = [start_node(tmp_path, n, port, "debug=limit", *(["model.net.width=64"] if n else [])) for n in (0, 1)]
    codes, ended, lines = exits(nodes, timeout=60)
    said = "error: node 1 runs another config than node 0: model.net.width=64 (node 0: 256); start every node"
    # within exits()' 60 s, not nodes_wait_s (300 s): both read it as soon as both have come
    assert codes == [2, 2] and len(lines) == 2 and all(line.startswith(said) for line in lines), (codes, lines)


def test_a_node_that_never_comes_is_named_in_one_line_after_nodes_wait_s(tmp_path):
    codes, ended, lines = exits([start_node(tmp_path, 0, free_port(), "nodes_wait_s=3")], timeout=60)
    assert codes == [124] and lines == [
        "error: node 1 has not started within 3 s; start train.py on every node with the same MASTER_ADDR and"
        " MASTER_PORT"
    ]


def test_node_0_gone_before_node_1_comes_is_one_line_on_node_1_after_nodes_wait_s(tmp_path):
    # node 1 waits for node 0's store in a loop of its own, hearing signals: not in torch's C client, which retries for
    # its timeout deaf to them, printing a C++ trace a try
    port = free_port()
    node_1 = start_node(tmp_path, 1, port, "nodes_wait_s=3")
    _, err = node_1.communicate(timeout=60)
    assert node_1.returncode == 124 and err.strip().splitlines() == [
        f"error: node 0 has not served the nodes' store at 127.0.0.1:{port} within 3 s (not started, or gone); start"
        " train.py on node 0 with the same MASTER_ADDR and MASTER_PORT"
    ], (node_1.returncode, err[-3000:])


def test_a_rank_starved_on_a_loaded_machine_is_slow_not_lost(tmp_path):
    # Rank 1 runs nothing for 4 heartbeat timeouts (its threads neither: no beat), as on a machine loaded far past its
    # cores. Rank 0 sees its process alive on this host and not stopped: slow, not lost; the run ends as any other.
    starve = ["+callbacks.starve._target_=probes.StarvedAtStep", "+callbacks.starve.step=2",
              "+callbacks.starve.seconds=8"]  # fmt: skip
    proc = train(tmp_path, "strategy=ddp", "devices=2", "heartbeat_timeout_s=2", "debug=limit",
                 "trainer.max_epochs=1", *starve, env=PROBES)  # fmt: skip
    assert "error:" not in proc.stderr and "has not answered" not in proc.stdout + proc.stderr


def test_a_user_error_on_node_1_is_one_line_naming_it_and_every_node_exits_2(tmp_path):
    # The data exists on node 0's disk (its working directory holds data/), not on node 1's: node 1's ranks (2 and 3
    # of two processes a node) meet it in prepare_data, while node 0's wait for them in a collective.
    (tmp_path / "data").mkdir()
    data = ["data._target_=probes.DigitsFromDisk", "+data.folder=data", "devices=2"]
    codes, ended, lines = node_1_without_the_data(tmp_path, *data)
    assert codes == [2, 2] and max(ended) - min(ended) < 60, (codes, ended)
    # said once on each node: by the rank that met it first, and by node 0's launcher, which read it from the store
    said = r"error: rank [23] \(node 1\): digits not found in data: this data set reads its files from the node's disk"
    assert len(lines) == 2 and lines[0] == lines[1] and re.match(said, lines[0]), lines


# full examples: begin
def test_a_user_error_before_launch_on_node_1_ends_node_0_at_once_saying_node_1s_cause(tmp_path):
    # An image folder is read before launch (its class count): node 1's disk lacks it. Node 0 reads node 1's line
    # from the store the nodes share, says it, and exits 2 without waiting for node 1's ranks.
    from PIL import Image

    for split in ("train", "val"):
        for label in ("a", "b"):
            (tmp_path / "images" / split / label).mkdir(parents=True)
            for i in range(2):
                Image.new("RGB", (8, 8), (60 * i, 0, 0)).save(tmp_path / "images" / split / label / f"{i}.png")
    data = ["data=imagenet", "data.root=images", "data.image_shape=[3,8,8]", "data.batch_size=4"]
    codes, ended, lines = node_1_without_the_data(tmp_path, *data)
    # not after node 1's ranks' heartbeat timeout (120 s): node 0 ends within half of it of node 1, its launch
    # included; each node with its own run directory
    assert codes == [2, 2] and ended[0] - ended[1] < 60, (codes, ended)
    said = "error: node 1: no directory images/train: data.num_classes is read from its class folders"
    assert len(lines) == 2 and all(line.startswith(said) for line in lines), lines


# full examples: end
@pytest.mark.parametrize("fault,devices,lost", [("host", 1, 1), ("SIGKILL", 2, 0), ("SIGSTOP", 2, 1)])
def test_a_whole_node_lost_is_named_in_one_line_by_the_other_which_exits_124(fault, devices, lost, tmp_path, request):
    # Every process of node `lost` at once (its train.py, fork server and workers), as when its machine dies
    # (SIGKILL; "host": each node on a host of its own, every process of node 1's host SIGKILLed) or hangs or is cut
    # off (SIGSTOP). Node 0's train.py serves the run's store, rank 0 holds the lifelines. The other node names it by
    # how it is found: a closed connection (SIGKILL: its kernel closes them) at once, not the heartbeat; a silent one
    # (SIGSTOP), after heartbeat_timeout_s
    hosts = request.getfixturevalue("hosts") if fault == "host" else None
    port, long = free_port(), [f"devices={devices}", "trainer.max_epochs=1000", "heartbeat_timeout_s=4"]
    procs = [start_node(tmp_path, n, port, *long, start_new_session=True, hosts=hosts) for n in (0, 1)]
    with reaped(*procs):
        wait_for_checkpoint(tmp_path, procs[0], epochs=1)
        # a rank that never beat gets the startup allowance (60 s); on hosts, asked from host 0's network
        if hosts:
            beats = [f"wait_for_beat({port}, {rank}, 'nodes-0', at={hosts.address(0)!r})" for rank in range(2)]
            hosts.run(0, [sys.executable, "-c", "from conftest import wait_for_beat; " + "; ".join(beats)],
                      with_env(PROBES))  # fmt: skip
        else:
            for rank in range(2 * devices):
                wait_for_beat(port, rank=rank, run_id="nodes-0")
        if hosts:
            hosts.kill(lost)
        else:
            os.killpg(procs[lost].pid, signal.Signals[fault])  # its session: the node's whole process tree
        survivor = procs[1 - lost]
        codes, _, lines = exits([survivor], timeout=60)
        if fault == "SIGSTOP":  # continued once the run has ended: the stopped node says what befell it, once
            os.killpg(procs[lost].pid, signal.SIGCONT)
            continued = exits([procs[lost]], timeout=60)
    named = "|".join(f"rank {rank} \\(node {lost}\\)" for rank in range(lost * devices, (lost + 1) * devices))
    said = re.escape("is gone: its connection closed (killed, or its node lost)") if fault != "SIGSTOP" else (
        r"has not answered for [4-9] s \(killed, stopped, or its node lost\)")  # the bound, 4 s, measured  # fmt: skip
    line = rf"error: ({named}) {said}; every process of the run stops"  # any of its ranks, found first
    assert codes == [124] and len(lines) == 1 and re.fullmatch(line, lines[0]), (codes, lines)
    if fault == "SIGSTOP":  # not the store's holder blamed, by each of its processes, for its own node's stop
        said = r"error: rank [23] \(node 1\) did not run for \d+ s \(stopped, or starved\); the run's store is gone"
        assert continued[0] == [124] and len(continued[2]) == 1 and re.match(said, continued[2][0]), continued


@pytest.mark.parametrize("fault", ["SIGSTOP", "SIGKILL"])
def test_a_lost_srun_task_ends_the_run_within_the_heartbeat_timeout_with_a_line_naming_it(fault, tmp_path):
    # One task per rank, each a train.py of its own; no launcher of ours. SIGSTOP: the rank neither exits nor answers
    # (nor does its own watchdog), as a hung node; rank 0 finds it, and kills it (srun would wait for it). A task a
    # signal killed has no launcher of ours to say so: rank 0 finds it by its closed connection.
    port, long = free_port(), ["trainer.max_epochs=1000", "heartbeat_timeout_s=6"]
    command = [sys.executable, str(ROOT / "train.py"), *on_bed(["strategy=ddp", "devices=2", "accelerator=cpu",
               f"paths.log_dir={tmp_path / 'logs'}", *QUIET, *long])]  # fmt: skip
    procs = [subprocess.Popen(command, cwd=tmp_path, env=with_env(slurm_env(2, rank), MASTER_ADDR="127.0.0.1",
             MASTER_PORT=str(port)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]  # fmt: skip
    with reaped(*procs):
        wait_for_checkpoint(tmp_path, procs[0], epochs=1)
        wait_for_beat(port, rank=1)  # a rank that never beat gets the startup allowance (60 s)
        os.kill(procs[1].pid, signal.Signals[fault])
        codes, _, lines = exits(procs, timeout=60)
    # the stopped rank killed by rank 0's watchdog (a SIGKILLed one: killed); found by how it is lost, as above
    said = r"error: rank 1 \(node 0\) " + (
        r"has not answered for ([6-9]|1[0-5]) s \(killed, stopped, or its node lost\)"  # the bound, 6 s, measured
        if fault == "SIGSTOP"
        else re.escape("is gone: its connection closed (killed, or its node lost)")
    )
    assert codes == [124, -9] and len(lines) == 1 and re.fullmatch(f"{said}; every process of the run stops", lines[0])


def test_a_rank_whose_loader_waits_forever_ends_the_run_within_the_stall_timeout_with_a_line_naming_it(tmp_path):
    # Its main thread waits in the data set while its threads live on, so it answers every heartbeat; rank 0 waits for
    # it in the step's collective. Rank 0's watchdog sees no rank pass a batch boundary for stall_timeout_s, rank 1
    # behind the others, and where rank 1's main thread is.
    marker = tmp_path / "waiting"
    proc = start(tmp_path, "strategy=ddp", "devices=2", "accelerator=cpu", "debug=limit", "stall_timeout_s=4",
                 "heartbeat_timeout_s=8", "data._target_=probes.HangingDigits", "+data.rank=1", "+data.fetch=4",
                 f"+data.marker={marker}", env=PROBES)  # fmt: skip
    while not marker.exists():
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(0.1)
    codes, ended, lines = exits([proc], timeout=60)
    # named by the stall judge (its line), not the heartbeat: every rank answers it
    assert codes == [124], codes
    at = f"__getitems__ ({PROBES_FILE}:{_line_of('threading.Event().wait()')})"
    assert lines == [f"error: rank 1 (node 0) in {at} has made no progress for 4 s while the others wait; every"
                     " process of the run stops (raise stall_timeout_s if a step or a checkpoint save takes"
                     " longer)"]  # fmt: skip


PROBES_FILE = ROOT / "tests" / "probes.py"  # outside the run's working directory: named in full


def _line_of(code: str) -> int:
    """The line of tests/probes.py that holds `code`."""
    (number,) = [i for i, line in enumerate(PROBES_FILE.read_text().splitlines(), 1) if code in line]
    return number
