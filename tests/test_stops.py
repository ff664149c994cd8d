"""Stops, losses and listeners, told true from the first second to the last process: a stop signal while the run starts
(in the script, or while the workers start) is one line and leaves no process; a worker the OOM killer takes is named
by its signal; a stranger on a port of the run changes nothing; a full disk is one line with what was saved whole."""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from subprocess import PIPE, Popen

import pytest
import torch

from conftest import QUIET, ROOT, descendants, on_bed, on_cpu, train, wait_for_checkpoint, with_env, worker_of_rank
from starter.process_state import gone, process_state

pytestmark = pytest.mark.slow


def start(tmp_path: Path, *overrides: str, script: str = "train.py", env=None) -> Popen:
    overrides = [f"paths.log_dir={tmp_path / 'logs'}", *on_cpu(overrides)]
    command = [sys.executable, str(ROOT / script), *on_bed(overrides, script)]
    return Popen(command, cwd=tmp_path, stdout=PIPE, stderr=PIPE, text=True, env=with_env(env))


def error_lines(proc: Popen) -> list[str]:
    return [line for line in proc.stderr.read().splitlines() if line.startswith(("error:", "Traceback"))]


@pytest.mark.parametrize(
    "script,overrides,name",
    [
        ("train.py", [], "SIGTERM"),
        ("train.py", [], "SIGUSR1"),
        ("predict.py", ["ckpt_path=x", "inputs=y"], "SIGUSR2"),
        ("export.py", ["ckpt_path=x"], "SIGTERM"),
    ],
)
def test_a_stop_signal_as_the_script_starts_is_one_line_and_exit_143(script, overrides, name, tmp_path):
    # before Hydra, torch and Lightning have loaded: sbatch's requeue (`[ $? -eq 143 ]`) sees a stop, and it is said
    proc = start(tmp_path, *overrides, script=script)
    time.sleep(0.3)
    proc.send_signal(signal.Signals[name])
    assert proc.wait(timeout=30) == 143
    assert error_lines(proc) == [f"error: stopped by {name} while starting; nothing was saved"]


def worker_names(pid: int) -> list[str]:
    names = []
    for child in descendants(pid):
        try:
            names.append(Path(f"/proc/{child}/comm").read_text().strip())
        except OSError:
            pass
    return names


def test_a_stop_while_the_workers_start_ends_every_process_in_seconds_with_one_line(tmp_path):
    # the workers may be importing, meeting in the rendezvous (a wait in C, where no Python handler runs) or setting
    # up: none has anything to save, each ends at once, and the one line names the phase
    proc = start(tmp_path, "strategy=ddp", "devices=2", *QUIET)
    while sum(name.startswith("rank ") for name in worker_names(proc.pid)) < 2:
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.02)
    everyone = descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143  # not after join or heartbeat timeouts, which a wait in C would take
    lines = error_lines(proc)
    assert len(lines) == 1 and lines[0].startswith("error: stopped by SIGTERM during "), lines
    assert "nothing was saved" in lines[0] or "after saving checkpoints/last.ckpt" in lines[0], lines
    deadline = time.monotonic() + 60  # the fork server sees its parent gone a moment later
    while not all(gone(pid) for pid in everyone) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(gone(pid) for pid in everyone), [(pid, process_state(pid)) for pid in everyone]


def listening(pid: int) -> list[tuple[str, int]]:
    """The (address, port) process `pid` listens on (/proc: its sockets' inodes in the table of listening ones)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            inodes.add(os.readlink(fd).removeprefix("socket:[").removesuffix("]"))
        except OSError:
            pass
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].rsplit(":", 1)
                found.append((socket.inet_ntop(socket.AF_INET, bytes.fromhex(address)[::-1]) if table == "tcp"
                              else "::" if set(address) == {"0"} else address, int(port, 16)))  # fmt: skip
    return found


def test_strangers_on_the_runs_ports_and_store_change_nothing_and_a_sigkilled_worker_is_named_by_its_signal(tmp_path):
    from starter.run_store import client

    proc = start(tmp_path, "strategy=ddp", "devices=2", "trainer.max_epochs=1000", *QUIET)
    wait_for_checkpoint(tmp_path, proc, epochs=1)
    rank_0 = worker_of_rank(proc, 0)
    environ = dict(v.split(b"=", 1) for v in Path(f"/proc/{rank_0}/environ").read_bytes().split(b"\0") if b"=" in v)
    token = environ[b"STARTER_JOB_TOKEN"]  # made by train.py for the job's processes, this host's alone
    assert len(token) == 32 and b"STARTER_JOB_TOKEN" not in Path(f"/proc/{proc.pid}/environ").read_bytes()
    ours = listening(proc.pid) + listening(rank_0)  # the run's store (train.py's), rank 0's lifeline, gloo's
    assert {address for address, _ in ours} == {"127.0.0.1"}, ours  # where the peers reach them, nowhere else
    ports = [port for _, port in ours]
    (store,) = [client("127.0.0.1", port, 10) for port in listening_only(proc.pid)]
    published = [store.get(key) for key in store.list_keys()]  # all a stranger reads from the run's store
    replayed = [*(b"1 " + value + b"\n" for value in published), *(value + b"\n" for value in published)]
    for port in ports:  # a port scan, a rank alone, a wrong secret, noise, and every value the store holds replayed
        for said in (b"", b"1\n", b"1 0123456789abcdef\n", b"GET / HTTP/1.0\r\n\r\n", *replayed):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as stranger:
                stranger.sendall(said)
    prefix = next(k for k in store.list_keys() if k.endswith("/lifeline")).removesuffix("/lifeline")
    lifeline = int(store.get(f"{prefix}/lifeline").split(b":")[-1])  # its value carries the job token's proof first
    flood = [socket.create_connection(("127.0.0.1", lifeline), timeout=10) for _ in range(2000)]  # held, silent
    # records written as the run's own are, without the job token's proof (a record of the run's own, replayed, too)
    store.set(f"{prefix}/failed", "2|0|stranger: this run was ended by someone outside it")
    store.set(f"{prefix}/stop/origin", b":".join([b"", b"SIGTERM|0|training"]))
    store.set(f"{prefix}/stop/at", published[0])
    store.set(f"{prefix}/lifeline/proof/1", b"0" * 64)
    store.set(f"{prefix}/progress/1", "no|progress|here")  # what rank 0's stall judge reads each beat
    steps = torch.load(wait_for_checkpoint(tmp_path, proc, epochs=3), weights_only=True)["global_step"]
    for stranger in flood:
        stranger.close()
    assert proc.poll() is None and steps > 0  # training went on
    os.kill(worker_of_rank(proc, 1), signal.SIGKILL)  # what the OOM killer does
    assert proc.wait(timeout=60) == 137, proc.stderr.read()[-3000:]
    assert error_lines(proc) == ["error: rank 1 (node 0) was killed by SIGKILL (out of memory?); every process of the"
                                 " run stops"]  # fmt: skip
    assert gone(rank_0)
    written = [path for path in tmp_path.rglob("*") if path.is_file() and token in path.read_bytes()]
    assert written == []  # the token is in no file (config.yaml, the logs, the checkpoints)


def listening_only(pid: int) -> list[int]:
    return [port for _, port in listening(pid)]


def test_a_flood_before_rank_0_reads_its_lifeline_closes_strangers_never_a_rank_that_said_who_it_is():
    # rank 1 connects and proves itself; before rank 0's watchdog first looks, more silent connections than PENDING
    # arrive: making room closes the oldest silent ones, not rank 1 (the oldest of all), whose proof is heard first
    from starter.launch.lifeline import PENDING, Lifeline, published_port
    from starter.run_store import client, serve_store

    store = serve_store("127.0.0.1")
    rank_0 = Lifeline(store, "run", "127.0.0.1", 0)
    rank_1 = Lifeline(client("127.0.0.1", store.port, 10), "run", "127.0.0.1", 1)
    port = published_port(store, "run")
    time.sleep(0.2)  # rank 1's proof is in its connection's buffer
    flood = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(PENDING + 16)]
    assert rank_0.gone() == [] and list(rank_0.peers) == [1] and len(rank_0.unknown) <= PENDING
    for stranger in flood:
        stranger.close()
    rank_1.close()
    rank_0.close()


def test_a_lifeline_takes_only_its_runs_ranks_whatever_a_stranger_reads_writes_or_floods_and_names_one_that_closes(
    monkeypatch,
):
    from starter.launch.lifeline import PENDING, Lifeline, proof
    from starter.run_store import client, serve_store

    monkeypatch.setenv("STARTER_JOB_TOKEN", "the job's secret")
    store = serve_store("127.0.0.1")
    rank_0 = Lifeline(store, "run", "127.0.0.1", 0)
    rank_1 = Lifeline(client("127.0.0.1", store.port, 10), "run", "127.0.0.1", 1)
    stranger_store = client("127.0.0.1", store.port, 10)
    published = {key: stranger_store.get(key) for key in stranger_store.list_keys()}  # all a stranger can read
    port = int(published["run/lifeline"].split(b":")[1])
    time.sleep(0.2)
    assert rank_0.gone() == [] and list(rank_0.peers) == [1]
    live = rank_0.peers[1]
    for rank in (1, 2):  # a second hello for the connected rank, and one for a rank not yet there: the stranger wrote
        stranger_store.set(f"run/lifeline/proof/{rank}", b":" + proof("mine").encode())  # their proofs, without ours
        with socket.create_connection(("127.0.0.1", port)) as second:
            second.sendall(f"{rank} mine\n".encode())
            time.sleep(0.2)
            assert rank_0.gone() == [] and rank_0.peers == {1: live}
    strangers = [socket.create_connection(("127.0.0.1", port)) for _ in range(5)]
    strangers[0].close()  # a port scan
    strangers[1].sendall(b"1\n")  # a rank without a proof
    strangers[2].sendall(b"2 " + b"0" * 32 + b"\n")  # a wrong one
    strangers[3].sendall(b"1 " + published["run/lifeline/proof/1"].split(b":")[1] + b"\n")  # the store's, replayed
    strangers[4].sendall(b"0 " + published["run/lifeline/proof/1"].split(b":")[1] + b"\n")  # rank 0's own place
    lost, beating = [], threading.Event()

    def beat():  # rank 0's watchdog thread: it waits on the lifeline and reads it
        while not beating.is_set():
            rank_0.wait(0.5)
            lost.extend(rank_0.gone())
            descriptors.append(len(os.listdir("/proc/self/fd")))

    descriptors, beater = [], threading.Thread(target=beat)
    beater.start()
    flood = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2000)]  # idle, saying nothing
    for stranger in [*strangers[1:], *flood]:
        stranger.close()
    time.sleep(0.5)
    beating.set()
    beater.join()
    assert lost == [] and list(rank_0.peers) == [1] and len(rank_0.unknown) <= PENDING
    assert max(descriptors) < 2000 + 2 * PENDING + 100  # the flood's own ends, and at most PENDING of the lifeline's
    rank_1.peers[0].close()  # rank 1 gone without a "bye"
    time.sleep(0.2)
    assert rank_0.gone() == [1]


def test_a_stop_is_decided_only_once_every_rank_has_said_it_knows_whatever_a_stranger_writes(monkeypatch):
    # two ranks, the second not yet asked when the first reaches the agreed step: a stranger's counts and forged
    # records of rank 1 (the run's own value replayed without its proof, one under another rank's key) do not make
    # rank 0 stop alone (it would wait in the next step's collective for a rank that steps on)
    from starter import run_store
    from starter.callbacks.stop_agreement import StopAgreement
    from starter.job_token import signed

    monkeypatch.setenv("STARTER_JOB_TOKEN", "0123456789abcdef")
    served = run_store.serve_store("127.0.0.1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(served.port))
    rank_0, rank_1 = StopAgreement(2, 0), StopAgreement(2, 1)
    stranger = run_store.client("127.0.0.1", served.port, 10)
    stranger.add(f"{rank_0.prefix}/ranks", 1000)  # the counter this agreement once kept
    stranger.set(f"{rank_0.prefix}/knows/1", ":1")
    assert not rank_0.stop_at(5, "SIGTERM|0|training")  # proposes step 6
    stranger.set(f"{rank_0.prefix}/knows/1", signed(f"{rank_0.prefix}/knows/0", "1"))
    assert not rank_0.stop_at(6, "SIGTERM|0|training")  # rank 1 does not know: one step more, for both
    assert not rank_1.stop_at(6, "SIGTERM|0|training")
    assert rank_0.stop_at(7, "SIGTERM|0|training") and rank_1.stop_at(7, "SIGTERM|0|training")


def test_a_process_record_or_a_said_mark_a_stranger_wrote_is_none(monkeypatch):
    # the watchdogs and the launcher's oversight signal a rank's process by the pid its record names (a stopped rank,
    # SIGKILLed; a node's workers as it stops): a stranger's record, or a rank's replayed under another's key, is none
    from starter import run_store
    from starter.job_token import signed
    from starter.launch.watchdog import pid_here

    monkeypatch.setenv("STARTER_JOB_TOKEN", "0123456789abcdef")
    served = run_store.serve_store("127.0.0.1")
    store = run_store.client("127.0.0.1", served.port, 10)
    here = f"{socket.gethostname()} {os.getpid()}"
    for forged in (here, f":{here}", signed("starter/process/0", here)):
        store.set("starter/process/1", forged)
        assert pid_here(store, 1, "starter") is None, forged
    store.set("starter/process/1", signed("starter/process/1", here))  # as rank 1's watchdog publishes it
    assert pid_here(store, 1, "starter") == os.getpid()
    from starter.run_failure import said  # the mark that a failing process said its line: else its launcher says it

    store.set("starter/failed/said", "")
    assert not said(store, "starter")
    store.set("starter/failed/said", signed("starter/failed/said", "1"))
    assert said(store, "starter")


def test_a_run_name_or_a_nodes_record_a_stranger_wrote_names_no_directory_and_no_config(monkeypatch, capsys):
    # rank 0's record names the run's directory (a stranger's `../..` would put the run elsewhere); the nodes compare
    # the configs their records hold (a stranger's, written first, would end the run over a difference no node has)
    import hashlib
    import json

    from starter import run_store
    from starter.job_token import signed
    from starter.launch.nodes import wait_for_all_nodes
    from starter.run_name import KEY, _share

    monkeypatch.setenv("STARTER_JOB_TOKEN", "0123456789abcdef")
    served = run_store.serve_store("127.0.0.1")
    store, stamp = run_store.client("127.0.0.1", served.port, 1), "2026-12-05_10-00-00-000001"
    store.set(KEY, "../../elsewhere")  # before rank 0: its own replaces it
    assert _share(store, KEY, stamp, first=True) == stamp and _share(store, KEY, "mine", first=False) == stamp
    store.set(f"{KEY}/x", signed(f"{KEY}/x", ".."))  # proven, yet no directory's name
    with pytest.raises(SystemExit) as ended:
        _share(store, f"{KEY}/x", stamp, first=False)  # the store's timeout here: 1 s
    assert ended.value.code == 124 and "error: rank 0 named no run in 1 s" in capsys.readouterr().err
    config = json.dumps({"seed": 42})
    store.set("nodes/config/1", '{"seed": 3}')
    store.set("nodes/ready/1", hashlib.sha256(b'{"seed": 3}').hexdigest())
    node_1 = threading.Timer(0.5, wait_for_all_nodes, (run_store.client("127.0.0.1", served.port, 10), "nodes", 2, 1,
                                                       10, config))  # fmt: skip
    node_1.start()
    wait_for_all_nodes(store, "nodes", 2, 0, 10, config)  # met: no "node 1 runs another config"
    node_1.join()


WATCHDOG_FAILS = """
import time
from starter import run_store
from starter.launch import lifeline, watchdog
store = run_store.serve_store("127.0.0.1")
lifeline.Lifeline.gone = lambda self: 1 / 0  # a bug in the beat thread
watchdog.Watchdog("127.0.0.1", store.port, 0, 2, 2, 10, 60, "node 0's train.py")
time.sleep(30)
"""


def test_a_watchdog_whose_thread_fails_ends_its_process_with_a_line_naming_it(tmp_path):
    proc = subprocess.run([sys.executable, "-c", WATCHDOG_FAILS], capture_output=True, text=True, timeout=60)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and lines == [
        "error: rank 0 (node 0): its watchdog failed (ZeroDivisionError: division by zero)"
    ], proc.stderr


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MB file system, mounted for the test (root only: where none can be, the test cannot run here)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small file system here: {mounted.stderr.decode().strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


@pytest.mark.parametrize(
    "mode",
    [[], ["strategy=fsdp"], ["strategy=pp", "devices=2", "strategy.async_save=false"]],
    ids=["one file", "fsdp, sharded while training goes on", "pp on 2 processes, sharded"],
)
def test_a_full_disk_is_one_line_naming_the_file_and_what_was_saved_resumes(mode, small_disk, tmp_path):
    # each checkpoint about 1 MB (the MLP with Adam's state): the first epoch's two fit, the next one's do not; a
    # sharded one is a directory (its shards, .metadata, meta.pt), a name repointed only once it is whole
    wide = ["debug=limit", "trainer.max_epochs=6", *mode]
    proc = train(tmp_path, *wide, f"hydra.run.dir={small_disk / 'run'}", expect_ok=False)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, (proc.returncode, proc.stderr[-3000:])  # once, however many ranks
    line = re.sub(r"^error: rank \d+ \(node \d+\): ", "error: ", lines[0])  # several: the rank that met it first
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert line.startswith(f"error: no space left on device writing {small_disk / 'run' / 'checkpoints'}/")
    assert line.endswith("; what was saved before is whole: make room and resume with ckpt_path=auto")
    last = small_disk / "run" / "checkpoints" / "last.ckpt"
    saved = checkpoint_epoch(last)
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)  # room made
    resumed = train(tmp_path, *wide, "ckpt_path=auto", f"hydra.run.dir={small_disk / 'run'}")
    assert checkpoint_epoch(last) == 5 > saved and "test/acc" in resumed.stdout


def test_a_file_size_limit_is_named_as_such_not_as_a_full_disk(tmp_path):
    # `ulimit -f 200` (200 KB): each checkpoint is about 1 MB, the disk has room; Python ignores SIGXFSZ, so the
    # write fails (EFBIG, which torch's zip writer swallows: its bytes found lost)
    import resource

    limit = 200 * 1024
    command = [sys.executable, str(ROOT / "train.py"), *on_bed([f"paths.log_dir={tmp_path / 'logs'}", "debug=limit",
               "trainer.max_epochs=1", *on_cpu([])])]  # fmt: skip
    proc = subprocess.run(command, cwd=tmp_path, env=with_env(), capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if line.startswith(("error:", "Traceback"))]
    said = f"error: the file size limit (ulimit -f: {limit} bytes) was reached writing {tmp_path / 'logs'}"
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(said), (proc.returncode, lines)
    assert lines[0].endswith("raise it (ulimit -f unlimited) and resume with ckpt_path=auto")


@pytest.mark.parametrize("interrupt", [None, "remembered", "raised while handling it"])
def test_a_save_cut_short_by_ctrl_c_is_not_taken_for_a_full_disk(interrupt, monkeypatch, tmp_path):
    # torch's zip writer says bytes lost to Ctrl-C as it says them lost to a full disk ("unexpected pos"), and swallows
    # the KeyboardInterrupt (catch_ctrl_c remembers it): the interrupt goes on its way, with no word about room
    from starter import errors
    from starter.atomic_write import room_for

    lost = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 73280 vs 73232")
    if interrupt == "remembered":
        monkeypatch.setattr(errors, "_ctrl_c", [signal.SIGINT])
    with pytest.raises(errors.UserError if interrupt is None else RuntimeError) as raised:
        with room_for(tmp_path / "last.ckpt"):
            try:
                if interrupt == "raised while handling it":
                    raise KeyboardInterrupt
            except KeyboardInterrupt:
                raise lost from None
            raise lost
    assert (raised.value is lost) == (interrupt is not None), raised.value


def checkpoint_epoch(path: Path) -> int:
    return torch.load(path / "meta.pt" if path.is_dir() else path, weights_only=True)["epoch"]
