"""Shared test helpers: compose the real config, run the real train.py, and make small data sets."""

import importlib.util
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import SimpleNamespace

# Before numpy and torch load: a thread per process for OpenMP and BLAS. `make test` runs two test files at once on
# the machine's cores, each starting runs of 1 to 4 processes, and an OpenMP thread spins while it waits for work:
# more threads than cores made every run several times slower (tests/test_train.py twice at once on 2 cores: 270 s
# with a thread per core, 78 s with one). train.py's launcher gives each worker this value (launch/agent.py).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pytest
from omegaconf import OmegaConf

from starter.run_name import run_name
from starter.run_store import free_port  # noqa: F401 (the tests' too)

if not OmegaConf.has_resolver("run_name"):
    OmegaConf.register_new_resolver("run_name", run_name, use_cache=True)  # as train.py does, for runs made here

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
QUIET = ["trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]
PROBES = {"PYTHONPATH": str(ROOT / "tests")}  # the environment of a run that adds callbacks from tests/probes.py
BED = ROOT / "tests" / "bed"  # the engine's tests' own task, nets and data (tests/bed/__init__.py)
BED_DEFAULTS = {"model": "bed_mlp", "data": "bed_digits"}
CONFIG_DIRS = (CONF, BED / "conf")  # a run on the bed: the folders whose model configs its checkpoints may use


def on_bed(overrides, script: str = "train.py") -> list[str]:
    """Overrides of a run on the test bed: its options on the config search path (with any given there); for train.py,
    its model and data where the run names none (nor an experiment, which names its own)."""
    overrides = list(overrides)
    given = [o for o in overrides if o.startswith("hydra.searchpath=")]
    paths = [path for o in given for path in o.split("=", 1)[1].strip("[]").split(",") if path]
    named = {o.split("=", 1)[0].lstrip("~+") for o in overrides if not o.startswith("-")}
    chosen = script == "train.py" and "experiment" not in named
    defaults = [f"{g}={o}" for g, o in BED_DEFAULTS.items() if g not in named] if chosen else []
    searchpath = "hydra.searchpath=[" + ",".join([*paths, f"file://{BED / 'conf'}"]) + "]"
    return [*(o for o in overrides if o not in given), searchpath, *defaults]


def compose_config(overrides: list[str], run_dir: Path, keep_hydra: bool = False):
    """The config train.py would run with these overrides, its run directory `run_dir` (under log_dir
    `run_dir.parent`), resolvable outside a Hydra run."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=on_bed(overrides), return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)  # lets ${hydra:...} resolve
    with open_dict(cfg):
        cfg.paths.output_dir, cfg.paths.log_dir = str(run_dir), str(Path(run_dir).parent)
        if not keep_hydra:
            del cfg.hydra
    return cfg


def host_syncs(overrides: list[str], tmp_path: Path) -> dict[str, dict]:
    """{rank: counts} of `python train.py OVERRIDES` as benchmarks/host_syncs.py measures them (run, not imported)."""
    output = tmp_path / "host_syncs.json"
    command = [sys.executable, "-m", "benchmarks.host_syncs", f"--json={output}", *overrides]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(output.read_text())


def slurm_env(tasks: int, rank: int = 0, **more) -> dict:
    """The variables SLURM gives task `rank` of an `srun` step with `tasks` tasks on one node."""
    return {"SLURM_NTASKS": str(tasks), "SLURM_NTASKS_PER_NODE": str(tasks), "SLURM_NNODES": "1",
            "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0", "SLURM_JOB_ID": "4242",
            "SLURM_STEP_ID": "0", "SLURM_JOB_NAME": "train", "SLURM_NODELIST": "localhost", **more}  # fmt: skip


def wait_for_beat(port: int, rank: int, run_id: str | None = None, torchrun: bool = False, at: str = "127.0.0.1"):
    """Until `rank`'s watchdog has beaten in the run's store: at MASTER_PORT (srun's tasks; torch's agent that
    train.py starts: under its run id), or under torchrun (its run id) on the port rank 0 published in
    torchrun's agent store there. The first attempt's. `at`: MASTER_ADDR."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from starter.topology import STORE_KEY as KEY

    store = TCPStore(at, port, is_master=False, timeout=timedelta(seconds=60))
    prefix = KEY if run_id is None else f"{KEY}/{run_id}/0"
    if torchrun:
        served = int(store.get(f"{prefix}/store_port"))
        store = TCPStore(at, served, is_master=False, timeout=timedelta(seconds=60))
    deadline = time.monotonic() + 60
    while not (store.check([f"{prefix}/beat/{rank}"]) and store.add(f"{prefix}/beat/{rank}", 0)):
        assert time.monotonic() < deadline, f"rank {rank} never beat"
        time.sleep(0.2)


def wait_for_checkpoint(tmp_path: Path, proc: subprocess.Popen, epochs: int = 2) -> Path:
    """Wait until last.ckpt holds `epochs` finished epochs (so training is well under way)."""
    import torch

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        found = list(tmp_path.glob("logs/train/runs/*/checkpoints/last.ckpt"))
        if found and torch.load(found[0], weights_only=True)["epoch"] >= epochs - 1:
            return found[0]
        time.sleep(0.3)
    raise AssertionError(f"no checkpoint appeared; exit code {proc.poll()}")


def descendants(pid: int) -> list[int]:
    pids, found = [str(pid)], []
    while pids:
        pids = subprocess.run(["pgrep", "-P", ",".join(pids)], capture_output=True, text=True).stdout.split()
        found += pids
    return [int(p) for p in found]


def kill_with_descendants(proc: subprocess.Popen) -> None:
    """What a test that failed leaves behind (a stopped rank, workers training on) must not slow the tests after it."""
    for pid in [*descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


@contextmanager
def reaped(*procs: subprocess.Popen):
    """Whatever a failing test leaves running (a torchrun that timed out, its workers) ends with the test."""
    try:
        yield
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_with_descendants(proc)


def worker_of_rank(launcher: subprocess.Popen, rank: int) -> int:
    """The pid of the worker of `rank` among the launcher's descendants: our workers are named after their rank
    (children of its fork server), torchrun's have RANK in their environment."""
    for pid in descendants(launcher.pid):
        try:
            comm, environ = Path(f"/proc/{pid}/comm").read_text().strip(), environ_of(pid)
        except OSError:
            continue
        if comm == f"rank {rank}" or environ.get("RANK") == str(rank):
            return pid
    raise AssertionError("worker not found")


def environ_of(pid: int) -> dict[str, str]:
    """The environment process `pid` started with."""
    entries = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)


def on_cpu(overrides) -> list[str]:
    """CPU-meant runs stay on the CPU on a GPU host too; a test that names an accelerator gets it."""
    overrides = list(overrides)
    return overrides if any(o.startswith("accelerator=") for o in overrides) else ["accelerator=cpu", *overrides]


# The strategies that tests/test_clipping_and_fp16.py runs on 2 processes through train.py, clipped at 32 and with an
# fp16 overflow at 16-mixed, comparing weights with one process: test_matrix.py does not run these pairs again.
CLIPPED_ON_TWO = ["ddp", "ddp_spawn", "fsdp", "tp", "pp"]
OVERFLOW_ON_TWO = ["fsdp", "tp", "pp"]


# The default MLP, 4 epochs x 5 batches = 20 optimizer steps of the global batch 64 on CPU in fp32, with SGD: what
# data-parallel modes and several nodes reproduce up to float summation order (SGD: see SMALL_VIT_20_STEPS; measured
# between ddp on 2 processes and one, 1.8e-5 with AdamW, 1.5e-8 with SGD).
MLP_20_STEPS = ["accelerator=cpu", "debug=limit", "trainer.max_epochs=4", "model.optimizer._target_=torch.optim.SGD",
                "model.optimizer.lr=0.05"]  # fmt: skip


# The small ViT, 4 epochs x 5 batches = 20 optimizer steps of the global batch 64, fp32: what the model-parallel,
# clipping and fp16 tests compare with one process. SGD: Adam would turn rounding noise into full-size steps for
# parameters whose gradient is zero up to rounding (an attention key bias: softmax ignores it), which says nothing
# about the parallel maths. The last item is trainer.max_epochs (tests resuming for more epochs replace it).
SMALL_VIT_20_STEPS = [
    "model=bed_vit",
    "model.optimizer._target_=torch.optim.SGD",
    "model.optimizer.lr=0.05",
    "~model.optimizer.weight_decay",
    "accelerator=cpu",
    "debug=limit",
    "trainer.max_epochs=4",
]


def train(tmp_path: Path, *overrides: str, expect_ok: bool = True, env: dict | None = None, timeout: int = 600,
          script: str = "train.py"):  # fmt: skip
    """Run `python train.py` (or `script`: predict.py, export.py) as a user would, with logs under tmp_path/logs;
    returns the finished process.

    Most runs go through the script's Hydra entry point inside this test process (see train_here): the same program,
    without importing torch and Lightning again (8 s of CPU a run). A run of several processes launches its workers
    from this process's fork server, as a sweep's later jobs do, started once. Runs that need an environment of
    their own (SLURM's, torchrun's, several nodes'), another Hydra launcher, or DataLoader workers in one process
    (they would come from this test process's fork server, whose environment is the first test's) run as
    `python train.py`.
    """
    tmp_path.mkdir(parents=True, exist_ok=True)
    flags = [o for o in overrides if o.startswith("-")]  # e.g. -m: Hydra wants flags before overrides
    quiet = QUIET if script == "train.py" else []
    overrides = [f"paths.log_dir={tmp_path / 'logs'}", *quiet, *on_cpu(o for o in overrides if not o.startswith("-"))]
    overrides = on_bed(overrides, script)
    if runs_here(overrides, flags, env):
        proc = train_here(tmp_path, [*flags, *overrides], script, timeout)
    else:
        command = [sys.executable, str(ROOT / script), *flags, *overrides]
        proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=timeout, env=with_env(env))
    if expect_ok and proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def predict(tmp_path: Path, *overrides: str, **kwargs):
    """`python predict.py OVERRIDES`, as `train` runs train.py (without loader workers unless asked for)."""
    workers = [] if any(o.startswith("num_workers=") for o in overrides) else ["num_workers=0"]
    proc = train(tmp_path, *workers, *overrides, script="predict.py", **kwargs)
    proc.cwd = tmp_path  # where the paths it prints start
    return proc


def runs_here(overrides: list[str], flags: list[str], env: dict | None) -> bool:
    """Whether train() runs the script in this process: see its docstring. A run of one process with an environment
    of its own (probes that record what its process imported) keeps a process of its own."""
    values = dict(o.split("=", 1) for o in overrides if "=" in o)
    one_process = values.get("strategy", "auto") in ("auto", "dp") and values.get("devices", "1") == "1"
    loader_workers = values.get("data.num_workers", "0") != "0" or values.get("num_workers", "0") != "0"
    if (env and env != PROBES) or "launcher" in values or "num_nodes" in values or (one_process and loader_workers):
        return False
    return not (one_process and env)


@dataclass
class Finished:
    """What subprocess.run returns, for a run made in this process."""

    returncode: int
    stdout: str
    stderr: str


def train_here(tmp_path: Path, overrides: list[str], script: str = "train.py", timeout: int = 600) -> Finished:
    """`python <script> OVERRIDES` in this process: Hydra's own entry point with sys.argv, the working directory,
    stdout and stderr as a subprocess would have them (its workers' too); what the run changes of the process is put
    back after. A run past `timeout` seconds raises subprocess.TimeoutExpired, as subprocess.run would."""
    from hydra.core.global_hydra import GlobalHydra

    def too_long(signum, frame):
        raise subprocess.TimeoutExpired(script, timeout)

    entry = _entry_point(script)
    stop_signals = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM)  # a run sets these handlers
    saved = (sys.argv, os.getcwd(), [signal.getsignal(s) for s in stop_signals], logging.getLogger().handlers[:])
    environment = dict(os.environ)  # a run sets some (Lightning's launcher at one process: LOCAL_RANK)
    code = 0
    run_name.cache_clear()  # a new run, a new name
    GlobalHydra.instance().clear()
    sys.argv = [str(ROOT / script), *overrides]
    os.chdir(tmp_path)
    signal.signal(signal.SIGALRM, too_long)
    signal.alarm(timeout)
    try:
        with process_output().collected() as output:
            try:
                entry()
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    finally:
        signal.alarm(0)
        sys.argv, cwd, signal_handlers, handlers = saved
        os.environ.clear()
        os.environ.update(environment)
        os.chdir(cwd)
        for signum, handler in zip(stop_signals, signal_handlers):
            signal.signal(signum, handler)
        root = logging.getLogger()
        for added in set(root.handlers) - set(handlers):  # Hydra's console and train.log handlers
            added.close()
        root.handlers[:] = handlers
        GlobalHydra.instance().clear()
    return Finished(code, output["stdout"], output["stderr"])


class ProcessOutput:
    """stdout and stderr of the runs made in this process, of their workers too: two files that only grow.

    A run of several processes here has torch's agent fork its workers from a fork server that this process starts
    once and that outlives the run (as in a sweep), so the workers write where the server's stdout and stderr lead:
    fd 1 and 2 of this process at the time, these files, kept for the session. A run's output is what they gained
    while it ran (its workers have ended when it returns)."""

    def __init__(self):
        self.fds = []
        for _ in range(2):
            handle, path = tempfile.mkstemp(prefix="run-output-")
            self.fds.append(os.open(path, os.O_RDWR | os.O_APPEND))  # every writer at the end, whatever its offset
            os.close(handle)
            os.unlink(path)

    @contextmanager
    def collected(self):
        """fd 1 and 2, sys.stdout and sys.stderr lead into the files inside the block; yields a dict that has "stdout"
        and "stderr" after it."""
        sys.stdout.flush()
        sys.stderr.flush()
        saved, starts = [os.dup(1), os.dup(2)], [os.fstat(fd).st_size for fd in self.fds]
        os.dup2(self.fds[0], 1)
        os.dup2(self.fds[1], 2)
        result = {}
        out = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
        err = open(2, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
        try:
            with redirect_stdout(out), redirect_stderr(err):
                yield result
        finally:
            out.flush()
            err.flush()
            for fd in (1, 2):
                os.dup2(saved[fd - 1], fd)
                os.close(saved[fd - 1])
            texts = [os.pread(fd, os.fstat(fd).st_size - start, start) for fd, start in zip(self.fds, starts)]
            result["stdout"], result["stderr"] = (text.decode(errors="replace") for text in texts)


@cache
def process_output() -> ProcessOutput:
    return ProcessOutput()


@pytest.fixture(scope="session", autouse=True)
def fork_server_writing_into_the_runs_output():
    """This process's fork server, started before any test: a process has one (multiprocessing's forkserver, with the
    first caller's preload), and a test's own DataLoader workers could otherwise start it with that test's captured
    output as its stdout and stderr, where the workers of every later run of several processes here would write.
    Preloaded as train.py's (Lightning), so its workers start at once."""
    from starter.fork_server import fork_server
    from starter.main import TRAIN, worker_preload

    with process_output().collected():
        fork_server(worker_preload(TRAIN))


@cache
def _entry_point(script: str):
    spec = importlib.util.spec_from_file_location(f"{Path(script).stem}_entry_point", ROOT / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main.__wrapped__.__module__ = "__main__"  # Hydra then finds conf/ beside the file, as for the script
    return module.main


def with_env(extra: dict | None = None, **more: str) -> dict:
    """The environment of every process a test starts: this one's, plus `extra` and `more`, with the checkout under
    test first on PYTHONPATH (a PYTHONPATH given goes before it), then tests/ (the bed). So a child imports this
    checkout's `starter`, never a package installed from another one."""
    given = {**(extra or {}), **more}
    env = {**os.environ, **given}
    paths = [given.get("PYTHONPATH"), str(ROOT / "src"), str(ROOT / "tests"), os.environ.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path for path in paths if path))
    return env


def run_dirs(tmp_path: Path, task: str = "train") -> list[Path]:
    return sorted((tmp_path / "logs" / task / "runs").glob("*"))


def read_metrics(run_dir: Path) -> dict[str, float]:
    return json.loads((run_dir / "metrics.json").read_text())


def sweep_jobs(tmp_path: Path, task: str = "train") -> list[Path]:
    """The job directories of the one multirun under tmp_path, in job order."""
    (sweep,) = (tmp_path / "logs" / task / "multiruns").iterdir()
    return sorted((p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))


def model_weights(run_dir: Path) -> dict:
    import torch

    return torch.load(run_dir / "checkpoints" / "model.pt", weights_only=True)["state_dict"]


def start_all(commands_envs, tmp_path, hosts=None):
    """Start every (command, env) at once (the nodes of one run; with `hosts`, the i-th on host i); wait for each to
    exit 0; their outputs."""
    options = dict(cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs = [hosts.popen(i, command, env, **options) if hosts else subprocess.Popen(command, env=env, **options)
             for i, (command, env) in enumerate(commands_envs)]  # fmt: skip
    outputs = [p.communicate(timeout=300) for p in procs]
    codes = [p.returncode for p in procs]  # every process's output: the one that failed first may not be the first
    assert codes == [0] * len(procs), (codes, [err[-3000:] for _, err in outputs])
    return outputs


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


class Planted:
    """A pickled object whose loading would run code (here, a harmless print)."""

    def __reduce__(self):
        return print, ("CODE FROM THE CHECKPOINT RAN",)


class UnpicklesItsOwn:
    """A user's callback whose own unpickling fails as the training starts: no checkpoint's doing."""

    def __new__(cls):
        import lightning as L

        class Callback(L.Callback):
            def on_train_start(self, trainer, pl_module):
                raise pickle.UnpicklingError("the callback's own cache is unreadable")

        return Callback()


def as_rank(datamodule, world: int, rank: int, global_rank: int | None = None, processes: int | None = None):
    """A DataModule as the process of data-parallel rank `rank` of `world` sees it, without starting them; a process
    of a tensor-parallel group or pipeline has a global rank of its own among more `processes`."""
    strategy = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": world, "rank": rank})
    datamodule.trainer = SimpleNamespace(world_size=processes or world, strategy=strategy,
                                         global_rank=rank if global_rank is None else global_rank)  # fmt: skip
    return datamodule


def plant(checkpoint_file: Path) -> None:
    """Add a Planted object to a checkpoint file, as a tampered checkpoint would hold one."""
    import torch

    checkpoint = torch.load(checkpoint_file, weights_only=False)
    checkpoint["planted"] = Planted()
    torch.save(checkpoint, checkpoint_file)


def write_idx(path: Path, array: np.ndarray) -> None:
    """`array` (uint8 values) as an MNIST IDX file, as torchvision reads it."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(n.to_bytes(4, "big") for n in array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


@pytest.fixture
def mnist_dir(tmp_path: Path) -> Path:
    """A tiny MNIST in torchvision's layout: 200 training and 50 test images whose label is legible."""
    raw = tmp_path / "data" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 200), ("t10k", 50)):
        labels = rng.integers(0, 10, n)
        images = rng.integers(0, 40, (n, 28, 28))
        for i, label in enumerate(labels):  # a bright bar whose row encodes the label
            images[i, 2 + 2 * label : 4 + 2 * label, 4:24] = 255
        write_idx(raw / f"{prefix}-images-idx3-ubyte", images)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels)
    return tmp_path / "data"


@pytest.fixture(scope="session")
def default_run(tmp_path_factory):
    """The default single-process run (digits + MLP, 20 epochs), shared by the tests that inspect it."""
    tmp_path = tmp_path_factory.mktemp("default")
    # as users run it, with the bar and the model summary; stdout is a pipe here
    proc = train(tmp_path, "trainer.enable_progress_bar=true", "trainer.enable_model_summary=true")
    (run_dir,) = run_dirs(tmp_path)
    return tmp_path, run_dir, proc


def trained_weights(tmp_path: Path, *overrides: str, env: dict | None = None) -> dict:
    """The final weights (model.pt) of `python train.py OVERRIDES`, its one run directory under `tmp_path`."""
    train(tmp_path, *overrides, env=env)
    (run_dir,) = run_dirs(tmp_path)
    return model_weights(run_dir)


@pytest.fixture(scope="session")
def reference_weights(tmp_path_factory) -> dict:
    """MLP_20_STEPS trained by one process: the weights every data-parallel mode and node layout must reproduce."""
    return trained_weights(tmp_path_factory.mktemp("reference"), *MLP_20_STEPS)


@pytest.fixture(scope="session")
def digit_files(tmp_path_factory) -> Path:
    """The default run's test split (digits, seed 42) as 8-bit PNG files named <index>_<label>.png."""
    from PIL import Image

    from bed.data import Digits

    folder = tmp_path_factory.mktemp("digit_files")
    digits = Digits(image_shape=[1, 8, 8], num_classes=10)
    digits.setup()
    for i, (image, label) in enumerate(zip(digits.test_set.images, digits.test_set.labels)):
        Image.fromarray(image[0].numpy()).save(folder / f"{i:04d}_{int(label)}.png")
    return folder


def predictions(proc) -> list[dict]:
    """The rows of the predictions.csv that a finished `predict.py` named."""
    import csv
    import re

    (path,) = re.findall(r"^\d+ predictions in (\S+):$", proc.stdout, re.M)
    with open(proc.cwd / path, newline="") as f:
        return list(csv.DictReader(f))


def correct(rows: list[dict]) -> int:
    """How many predictions name the label in their file's name (<...>_<label>.<ext>)."""
    return sum(row["class"] == Path(row["path"]).stem.rsplit("_", 1)[1] for row in rows)


@pytest.fixture
def hosts(request):
    """Hosts of their own network (tests/hosts.py; `indirect` parametrization: how many, else 2), torn down with every
    process on them; where namespaces cannot be made, this machine's loopback, with a warning saying why."""
    from hosts import make_hosts

    made, why_not = make_hosts(getattr(request, "param", 2))
    if why_not:
        import warnings

        warnings.warn(f"{why_not}: this test runs on this machine's loopback", stacklevel=1)
    try:
        yield made
    finally:
        made.close()
