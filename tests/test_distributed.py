"""ddp and ddp_spawn on 2 CPU processes (gloo): same results as one process, one run directory, one voice."""

import json
import multiprocessing
import os

import pytest

from conftest import MLP_20_STEPS, PROBES, max_difference, model_weights, run_dirs, train

pytestmark = pytest.mark.slow
RECORD_PROCESS = [
    "+callbacks.process._target_=probes.RecordProcess",
    "+callbacks.process.output=${paths.output_dir}/process",
]


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_two_processes_match_one_process_in_one_run_directory(strategy, reference_weights, tmp_path):
    proc = train(tmp_path, f"strategy={strategy}", "devices=2", *MLP_20_STEPS, *RECORD_PROCESS, env=PROBES)
    (run_dir,) = run_dirs(tmp_path)  # one directory, however many processes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"]
    # forked from the launcher's fork server (ddp) or spawned (ddp_spawn), each worker is set up as a process of its own
    threads = int(os.environ.get("OMP_NUM_THREADS", max(1, len(os.sched_getaffinity(0)) // 2)))
    for rank in (0, 1):
        process = json.loads((run_dir / "process" / f"rank{rank}.json").read_text())
        assert process == {"name": f"rank {rank}", "threads": threads,
                           "start_method": multiprocessing.get_start_method(), "RANK": str(rank)}  # fmt: skip

    # Each rank averages the gradient of its 32 samples and all-reduce averages the two: the same mean over 64, the
    # same weights up to float summation order.
    assert max_difference(reference_weights, model_weights(run_dir)) <= 1e-5

    # images/s counts the global batch: 5 steps of 64 images in the last epoch's time
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["train/images_per_s"] * metrics["train/epoch_time"] == pytest.approx(5 * 64, rel=1e-3)

    checkpoints = sorted(p.name for p in run_dir.rglob("*.ckpt"))
    assert checkpoints == ["best.ckpt", "last.ckpt"] and len(list(run_dir.rglob("metrics.csv"))) == 1
    lines = (proc.stdout + proc.stderr).splitlines()  # rank 0 speaks, rank 1 does not: each line once
    said = [line for line in lines if not line.startswith("epoch ") and not line.startswith(("train/", "val/"))]
    assert len(said) == len(set(said)) and said[0].startswith("train: data=bed_digits model=bed_mlp strategy=")


def test_worker_error_stops_all_workers_with_one_message(tmp_path):
    # Rank 0 fails in prepare_data while rank 1 waits for it at a barrier: rank 1 must leave too, and only the
    # rank that met the error says it.
    proc = train(tmp_path, "strategy=ddp", "devices=2", "accelerator=cpu", "data._target_=probes.DigitsFromDisk",
                 f"+data.folder={tmp_path / 'none'}", expect_ok=False, timeout=120, env=PROBES)  # fmt: skip
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: rank 0 (node 0): digits not found in {tmp_path / 'none'}")


def test_a_port_an_ended_store_of_this_process_held_serves_the_next_jobs_store(monkeypatch):
    """A sweep's jobs run in one process, and the OS hands out again a port that an earlier job's store held (after 63
    stores here): the agent's rendezvous, which finds the job's store by its port in torch's cache, finds it there."""
    from torch.distributed import TCPStore

    from starter.launch import nodes

    port = nodes.free_port("127.0.0.1")
    ended = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, multi_tenant=True)
    del ended  # an earlier job's: gone, its entry left in torch's cache
    monkeypatch.setattr(nodes, "free_port", lambda address: port)  # the OS picks that port again
    store = nodes.join_nodes("127.0.0.1", 0, serve=True)
    rendezvous = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, multi_tenant=True)  # as torch's
    rendezvous.set("written by the rendezvous", "")
    assert store.check(["written by the rendezvous"])
