"""fault_tolerance=torchft: replica groups that are one ddp run while all live, a refused step trained again (not
applied twice), a lost group costing the others one heartbeat and no restart, a returning group healed equal."""

import concurrent.futures
import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from functools import partial
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from conftest import (
    MLP_20_STEPS,
    PROBES,
    QUIET,
    ROOT,
    free_port,
    max_difference,
    model_weights,
    on_bed,
    read_metrics,
    reaped,
    run_dirs,
    with_env,
)

pytestmark = pytest.mark.slow

HEARTBEAT_S = 2
# the probes one group runs and another not are that group's own: every other key is compared as groups join
PROBES_HOST_OWN = [
    *OmegaConf.load(ROOT / "conf/fault_tolerance/torchft.yaml").host_own,
    *(f"callbacks.{name}" for name in ("slow", "kill", "refuse", "stop", "probe", "alone")),
]


def group(tmp_path: Path, number: int, port: int, *overrides: str, session: bool = False, hosts=None, env=None):
    """Replica group `number` of two, one process (unless `overrides` say), as a user starts it: its own train.py, its
    logs under tmp_path/g<n>; group 0 serves the lighthouse on `port`. `session`: in a session of its own, which a
    probe can kill whole. `hosts` (conftest.hosts): each group on a host of its own, group 0's named by its address
    (the docs' commands, as written: no MASTER_ADDR, no GLOO_SOCKET_IFNAME); else every group on this loopback."""
    at = hosts.address(0) if hosts else "localhost"
    lighthouse = [f"fault_tolerance.lighthouse=http://{at}:{port}"] if number else []
    command = [sys.executable, str(ROOT / "train.py"), *on_bed(["accelerator=cpu", "fault_tolerance=torchft",
               f"fault_tolerance.replica_group={number}", f"fault_tolerance.lighthouse_port={port}", *lighthouse,
               f"fault_tolerance.host_own={PROBES_HOST_OWN}",
               f"fault_tolerance.heartbeat_timeout_s={HEARTBEAT_S}", "fault_tolerance.timeout_s=20",
               f"paths.log_dir={tmp_path / f'g{number}' / 'logs'}", *QUIET, *overrides])]  # fmt: skip
    (tmp_path / f"g{number}").mkdir(parents=True, exist_ok=True)
    env = with_env(PROBES, **(env or {}))
    options = dict(cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=session)
    return hosts.popen(number, command, env, **options) if hosts else subprocess.Popen(command, env=env, **options)


def finished(proc: subprocess.Popen, timeout: int = 300) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"{out[-3000:]}\n{err[-3000:]}"
    return out + err


def run_dir(tmp_path: Path, number: int, which: int = -1) -> Path:
    return run_dirs(tmp_path / f"g{number}")[which]


def logged_steps(run: Path) -> list[int]:
    (metrics,) = run.glob("**/metrics.csv")
    return [int(row["step"]) for row in csv.DictReader(metrics.open()) if row.get("train/loss")]


def validated_steps(run: Path) -> list[int]:
    (metrics,) = run.glob("**/metrics.csv")
    return [int(row["step"]) for row in csv.DictReader(metrics.open()) if row.get("val/acc")]


FSDP_INSIDE = ["strategy=fsdp", "devices=2"]  # HSDP: each group's shards averaged with the other group's same shards


@pytest.mark.parametrize("inside", [[], FSDP_INSIDE], ids=["one process a group", "fsdp over two a group"])
def test_two_replica_groups_train_as_ddp_and_a_refused_step_is_trained_again_not_applied_twice(
    inside, tmp_path, reference_weights
):
    """Two groups of one process are ddp on two processes (the data split, the gradients averaged), two groups of
    fsdp over two are fsdp over four: the weights of one process with the same global batch. The quorum refuses step
    8 in both: each trains it again on its batch."""
    port = free_port()
    refuse = ["+callbacks.refuse._target_=probes.RefusedCommitAtStep", "+callbacks.refuse.step=8"]
    procs = [
        group(tmp_path, g, port, *MLP_20_STEPS, *inside, *refuse, f"+callbacks.refuse.output={tmp_path / f'steps{g}'}")
        for g in (0, 1)
    ]
    outputs = [finished(p) for p in procs]
    weights = [model_weights(run_dir(tmp_path, g)) for g in (0, 1)]
    assert max_difference(weights[0], weights[1]) == 0
    assert max_difference(weights[0], reference_weights) < 1e-5
    for g, out in enumerate(outputs):
        assert (
            "replica group 1 of 2 (torchft)" in outputs[1]
            and "replica group 0 started the lighthouse at http://localhost:" in outputs[0]
        )
        assert f"replica group {g}: the quorum did not commit step 8; training it again on the same batch" in out
        steps = [int(s) for s in (tmp_path / f"steps{g}").read_text().split()]
        assert steps == [*range(1, 9), *range(8, 21)]  # step 8 trained twice, applied once: the reference's weights
        assert "Traceback" not in out


@pytest.mark.parametrize(
    "gone,lost_by,again,inside",
    [(1, "host", [], FSDP_INSIDE), (1, "SIGKILL", ["checkpoint_every_n_steps=7", "ckpt_path=auto"], []),
     (0, "SIGTERM", ["ckpt_path=auto"], [])],
    ids=["two hosts, fsdp inside: group 1's host lost, back afresh, its shards healed",
         "group 1 killed, back from its mid-epoch checkpoint",
         "group 0 stopped (it started the lighthouse), back from its stop's save"],
)  # fmt: skip
def test_a_lost_replica_group_costs_the_others_a_heartbeat_and_a_returning_one_heals_equal(
    gone, lost_by, again, inside, tmp_path, request
):
    """A group (one process; or fsdp over two on a host of its own, every process of which is SIGKILLed at once: its
    train.py and workers) is SIGKILLed (or SIGTERMed: it saves last.ckpt mid-epoch and stops) as step 10 begins,
    group 0 too, whose train.py started the lighthouse (a process of its own, which outlives it): the other names it
    within a heartbeat and a step, and trains on in the same process (its steps never start again), slowed while
    alone. The lost group started again (afresh, or resuming its own mid-epoch last.ckpt; group 0 finds the
    lighthouse on its port) joins mid-epoch: healed from the survivor (weights, optimizer, step, data position;
    under fsdp each rank's shards from the same rank's), it trains with it; a step its quorum refuses where the
    survivor's commits heals it again (an epoch's last: the survivor crosses the epoch's end, and steps its lr
    schedule, first). Both end with equal weights (one process a group: their averages, which the heal carries),
    logging at the same steps, and the test accuracy of a 5-epoch run."""
    port, kept = free_port(), 1 - gone
    hosts = request.getfixturevalue("hosts") if lost_by == "host" else None
    group_ = partial(group, hosts=hosts)
    epochs = ["trainer.max_epochs=5", "+callbacks.slow._target_=probes.SlowWhileAlone", "+callbacks.slow.seconds=0.3"]
    epochs += inside or ["callbacks.weight_averaging.decay=0.9"]  # an average of the weights, healed with them
    own = [f"hydra.run.dir={tmp_path / f'g{gone}' / 'logs' / 'train' / 'runs' / 'own'}", *again] if again else []
    lost = group_(tmp_path, gone, port, *epochs, *own, f"+callbacks.slow.output={tmp_path / 'lost'}",
                  "+callbacks.kill._target_=probes.KilledAtStep", "+callbacks.kill.step=10",
                  f"+callbacks.kill.signal={'SIGKILL' if hosts else lost_by}",
                  f"+callbacks.kill.host={bool(hosts)}")  # fmt: skip
    if gone == 0:  # it starts the lighthouse, the other meets it there
        while not list(tmp_path.glob("g0/logs/train/runs/*/train.log")):
            time.sleep(0.2)
    survivor = group_(tmp_path, kept, port, *epochs, f"+callbacks.slow.output={tmp_path / 'kept'}")
    lost.communicate(timeout=300)
    assert lost.returncode == (143 if lost_by == "SIGTERM" else -9)
    if again:  # mid-epoch: the stop's save at step 11, or the 7th step's
        saved = torch.load(run_dir(tmp_path, gone) / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
        assert saved == (7 if lost_by == "SIGKILL" else 11)
    time.sleep(HEARTBEAT_S)  # gone from the lighthouse's view before it comes back
    back = group_(tmp_path, gone, port, *epochs, *own, f"+callbacks.slow.output={tmp_path / 'back'}",
                 "+callbacks.refuse._target_=probes.RefusedCommitAtStep", "+callbacks.refuse.after=3",
                 "+callbacks.refuse.epoch_end=true",
                 f"+callbacks.refuse.output={tmp_path / 'refused'}")  # fmt: skip
    said, said_back = finished(survivor), finished(back)
    if gone == 0:  # started again, group 0 finds the lighthouse it started before, and says so
        assert f"replica group 0 found the lighthouse at http://localhost:{port}" in said_back

    ends = [line.split() for line in (tmp_path / "kept").read_text().splitlines()]
    steps, times = [int(s) for s, _ in ends], [float(t) for _, t in ends]
    assert steps == list(range(1, 96))  # one process, never restarted: every step once, in order
    # the loss cost a heartbeat, once, at the loss (a stopped group trains on to step 11): no other pause as long
    # until the lost group is back (its join, a heal, pauses the survivor too), none past a heartbeat, the quorum's
    # forming again and a few steps (well short of two heartbeats or a quorum's timeout; the steps' part in steps of
    # its own, which load stretches alike)
    first = int((tmp_path / "back").read_text().split()[0])
    gaps = [b - a for a, b, step in zip(times, times[1:], steps[1:]) if step < first - 1]
    longest, median = max(range(len(gaps)), key=gaps.__getitem__), sorted(gaps)[len(gaps) // 2]
    assert steps[longest + 1] in (10, 11, 12) and gaps[longest] < 1.5 * HEARTBEAT_S + 10 * median, gaps
    assert said.count(f"replica group {gone} lost: training on with 1 of 2") == 1
    assert said.index(f"replica group {gone} lost") < said.rindex(f"replica group {gone} joined: training on with 2")
    healed = [line for line in said_back.splitlines() if f"replica group {gone} healed from a live group at" in line]
    assert len(healed) == 2 and int(healed[0].split()[-1]) > 10  # on joining mid-run, and after the refused step
    assert first > 11  # it began where the survivor was
    refused = next(step for step in range(first + 2, 96) if step % 19 == 0)  # an epoch's last: the survivor ends it
    assert f"replica group {gone}: the quorum did not commit step {refused}" in said_back  # first, stepping its lr

    runs = [run_dir(tmp_path, kept), run_dir(tmp_path, gone)]
    assert max_difference(*(model_weights(r) for r in runs)) == 0
    assert set(logged_steps(runs[1])) <= set(logged_steps(runs[0]))  # its steps are the survivor's
    ends = validated_steps(runs[1])  # its epochs end where the survivor's do, before the loss and after its return
    assert set(ends) <= set(validated_steps(runs[0])) and ends[-1] == validated_steps(runs[0])[-1], ends
    metrics = [read_metrics(r) for r in runs]
    # the last epoch's validation of the same weights, equal; each tests its own best.ckpt, picked among the epochs it
    # validated (a group back from its own checkpoint missed some): an uninterrupted run's, 0.94
    assert metrics[0]["val/acc"] == metrics[1]["val/acc"] and min(m["test/acc"] for m in metrics) > 0.9
    assert "Traceback" not in said + said_back


OUTER_SGD = ["fault_tolerance.outer_optimizer.lr=1.0", "fault_tolerance.outer_optimizer.momentum=0",
             "fault_tolerance.outer_optimizer.nesterov=false"]  # fmt: skip


def test_diloco_syncing_every_step_with_a_plain_outer_step_is_ddp_and_every_three_a_returning_group_heals_equal(
    tmp_path, reference_weights
):
    """DiLoCo (fault_tolerance.sync_every): with H=1, an outer SGD of lr 1 and an inner SGD, the groups' averaged
    pseudo-gradient is the averaged gradient times the lr, so two groups of one process are one process with the same
    global batch. With H=5, group 1 SIGKILLed at step 10 and started again from its own last.ckpt (step 7) joins at the
    survivor's next sync, healed from it (the manager's step counts syncs in both: never the survivor from it),
    (weights, inner and outer optimizer, the last synced weights, the data position): the run ends on a sync at its
    last step, 57 (no multiple of 5), both groups with equal weights, validating at the same steps."""
    port, every_step = free_port(), ["fault_tolerance.sync_every=1", *OUTER_SGD]
    procs = [group(tmp_path / "h1", g, port, *MLP_20_STEPS, *every_step) for g in (0, 1)]
    for proc in procs:
        finished(proc)
    weights = [model_weights(run_dir(tmp_path / "h1", g)) for g in (0, 1)]
    assert max_difference(weights[0], weights[1]) == 0 and max_difference(weights[0], reference_weights) < 1e-5

    port, every_5 = free_port(), ["fault_tolerance.sync_every=5", "trainer.max_epochs=3"]
    every_5 += ["+callbacks.slow._target_=probes.SlowWhileAlone", "+callbacks.slow.seconds=0.5"]
    own = [f"hydra.run.dir={tmp_path / 'g1' / 'logs' / 'train' / 'runs' / 'own'}", "checkpoint_every_n_steps=7"]
    lost = group(tmp_path, 1, port, *every_5, *own, f"+callbacks.slow.output={tmp_path / 'lost'}",
                 "+callbacks.kill._target_=probes.KilledAtStep", "+callbacks.kill.step=10")  # fmt: skip
    survivor = group(tmp_path, 0, port, *every_5, f"+callbacks.slow.output={tmp_path / 'kept'}")
    lost.communicate(timeout=300)
    assert lost.returncode == -9
    time.sleep(HEARTBEAT_S)
    back = group(tmp_path, 1, port, *every_5, *own, "ckpt_path=auto", f"+callbacks.slow.output={tmp_path / 'back'}")
    said, said_back = finished(survivor), finished(back)
    steps = [int(line.split()[0]) for line in (tmp_path / "kept").read_text().splitlines()]
    assert steps == list(range(1, 58))  # never restarted, nor sent back
    first = int((tmp_path / "back").read_text().split()[0])
    assert first > 11 and (first - 1) % 5 == 0  # it began after a sync of the survivor's
    assert "replica group 1 lost: training on with 1 of 2" in said and "replica group 1 joined" in said
    runs = [run_dir(tmp_path, 0), run_dir(tmp_path, 1)]
    assert max_difference(*(model_weights(r) for r in runs)) == 0
    ends = validated_steps(runs[1])
    assert set(ends) <= set(validated_steps(runs[0])) and ends[-1] == validated_steps(runs[0])[-1], ends
    assert "Traceback" not in said + said_back


def test_a_stop_during_a_diloco_sync_saves_the_step_once(tmp_path):
    # H=5; group 1 slow, so group 0 waits at each sync; SIGTERM to group 0 after step 9: it stops at step 10, whose
    # sync it waits in. last.ckpt holds step 10 with AdamW's 10 steps: a resume trains from batch 11.
    port = free_port()
    every_5 = ["accelerator=cpu", "debug=limit", "trainer.max_epochs=4", "fault_tolerance.sync_every=5"]
    slow = ["+callbacks.slow._target_=probes.SlowSteps", "+callbacks.slow.seconds=0.4"]
    slow = group(tmp_path, 1, port, *every_5, *slow, f"+callbacks.slow.output={tmp_path / 'steps1'}")
    stop = ["+callbacks.stop._target_=probes.SigtermAtStep", "+callbacks.stop.step=9"]
    stopped = group(tmp_path, 0, port, *every_5, *stop)
    _, err = stopped.communicate(timeout=300)
    assert stopped.returncode == 143, err[-3000:]
    saved = torch.load(run_dir(tmp_path, 0) / "checkpoints" / "last.ckpt", weights_only=True)
    adam_steps = {int(state["step"]) for state in saved["optimizer_states"][0]["state"].values()}
    assert saved["global_step"] == 10 and adam_steps == {10}, (saved["global_step"], adam_steps)
    finished(slow)


@pytest.mark.parametrize("done", [3, 4])
def test_a_group_joining_in_a_step_makes_the_scheduler_calls_the_live_groups_loop_makes_after_it(done):
    # 5 batches an epoch; the step joined in is the epoch's 4th (done=3) or its last (done=4): the live groups' loop
    # then steps a per-step schedule once, and a per-epoch one only after the last. Missing the epoch's call leaves the
    # joining group's lr an epoch behind the others' for the rest of the run.
    from types import SimpleNamespace

    import torch
    from lightning.pytorch.utilities.types import LRSchedulerConfig

    from starter.strategies.fault_tolerant import FaultTolerant

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    per_step, per_epoch = (torch.optim.lr_scheduler.StepLR(optimizer, step_size=1) for _ in range(2))
    configs = [LRSchedulerConfig(per_step, interval="step"), LRSchedulerConfig(per_epoch, interval="epoch")]
    trainer = SimpleNamespace(num_training_batches=5, lr_scheduler_configs=configs)
    module = SimpleNamespace(lr_scheduler_step=lambda scheduler, metric: scheduler.step())
    FaultTolerant._schedule_after(SimpleNamespace(lightning_module=module), trainer, epoch=2, done=done, step=13)
    assert (per_step.last_epoch, per_epoch.last_epoch) == (1, 1 if done == 4 else 0)


def test_a_group_joining_with_a_wider_net_is_refused_in_one_line_before_any_collective_and_the_others_train_on(
    tmp_path,
):
    # Group 0 trains alone (it waits 1 s for the others), slowly until group 1 has ended; group 1 comes with a wider
    # net: its gradients would not fit group 0's all-reduce (a C++ abort). Its config is compared with group 0's as
    # the quorum forms: refused in one line, exit 2; group 0 trains on to its end.
    port, alone = free_port(), ["trainer.max_epochs=12", "fault_tolerance.join_timeout_s=1"]
    survivor = group(tmp_path, 0, port, *alone, "+callbacks.slow._target_=probes.SlowSteps",
                     "+callbacks.slow.seconds=0.1", f"+callbacks.slow.output={tmp_path / 'steps0'}",
                     f"+callbacks.slow.until={tmp_path / 'refused'}")  # fmt: skip
    while not (tmp_path / "steps0").exists():  # group 0 is training
        time.sleep(0.2)
    refused = group(tmp_path, 1, port, *alone, "model.net.width=64")
    _, err = refused.communicate(timeout=300)
    (tmp_path / "refused").touch()
    lines = [line for line in err.splitlines() if line.startswith(("error:", "Traceback", "terminate"))]
    assert refused.returncode == 2 and lines == [
        "error: replica group 1 trains another config than replica group 0: model.net.width=64 (replica group 0:"
        " 256); start every group with the same config, its fault_tolerance.replica_group apart"
    ], (refused.returncode, lines)
    out = finished(survivor)
    assert "replica group 1 came with another config (model.net.width=64 (here: 256)): refused, training on" in out, out
    assert "Traceback" not in out and (tmp_path / "steps0").read_text().count("\n") == 12 * 19
    assert "STARTER_JOB_TOKEN is not set: anyone who reaches this job's ports can end it" in out  # given none


def test_a_stranger_speaking_torchft_is_refused_before_any_collective_never_healed_from_and_the_groups_train_on(
    tmp_path,
):
    # Two groups holding the job's token train slowly; a stranger (foreign/stranger_group.py: torchft's own Manager)
    # joins as replica group 2 for 6 s, claiming step 10**6, echoing group 0's config and proof, serving zero weights.
    # The groups refuse every quorum it is in (one line), heal from it never, and train on once it has gone.
    port, token = free_port(), {"STARTER_JOB_TOKEN": "the job's secret"}
    slow = ["trainer.max_epochs=4", "+callbacks.slow._target_=probes.SlowSteps", "+callbacks.slow.seconds=0.1"]
    procs = [group(tmp_path, g, port, *slow, f"+callbacks.slow.output={tmp_path / f'steps{g}'}", env=token)
             for g in (0, 1)]  # fmt: skip
    while not (tmp_path / "steps1").exists():  # both groups train
        time.sleep(0.2)
    (lighthouse,) = [
        int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _runs(p, f"lighthouse {port}")
    ]
    assert os.getsid(lighthouse) == lighthouse  # a session of its own: killing group 0's session or group spares it
    stranger = subprocess.run(
        [sys.executable, str(ROOT / "tests/foreign/stranger_group.py"), f"http://localhost:{port}", "6"],
        env=with_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "stranger left" in stranger.stdout, stranger.stderr[-2000:]
    page = urllib.request.urlopen(f"http://localhost:{port}/status", timeout=10).read().decode()
    (replica,) = set(re.findall(r"replica_group_1:[0-9a-f-]+", page))
    with pytest.raises(urllib.error.HTTPError, match="403"):  # the dashboard's kill: torchft's would end group 1
        urllib.request.urlopen(f"http://localhost:{port}/replica/{replica}/kill", b"")  # a POST
    said = [finished(proc) for proc in procs]
    assert all("a member claiming replica group 2 came, outside this job's 0 to 1: refused" in s for s in said), said
    assert not any("at step 1000000" in s for s in said), said  # never healed from the stranger
    assert not any("STARTER_JOB_TOKEN is not set" in s for s in said)
    weights = [model_weights(run_dir(tmp_path, g)) for g in (0, 1)]
    assert max_difference(*weights) == 0.0 and all(w.abs().sum() > 0 for w in weights[0].values())
    assert all((tmp_path / f"steps{g}").read_text().count("\n") == 4 * 19 for g in (0, 1))


def _runs(proc: Path, command: str) -> bool:
    try:
        return command in (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return False


CONFIG = {"model.optimizer.lr": 0.002, "fault_tolerance.replica_groups": 2, "model.net.width": 256,
          "processes per group": 2, "strategy.name": "fsdp"}  # fmt: skip


@pytest.mark.parametrize(
    "members,said",
    [
        (
            [(0, {}), (1, {"model.optimizer.lr": 0.02})],
            "replica group 1 trains another config than replica group 0:"
            " model.optimizer.lr=0.02 (replica group 0: 0.002); start every group",
        ),
        (
            [(0, {}), (1, {"fault_tolerance.replica_groups": 3})],
            "replica group 1 trains another config than replica group 0:"
            " fault_tolerance.replica_groups=3 (replica group 0: 2); start every group",
        ),
        (
            [(0, {}), (1, {"processes per group": 1, "strategy.name": "ddp"})],
            "replica group 1 trains another config than replica group 0: processes per group=1 (replica group 0: 2),"
            " strategy.name=ddp (replica group 0: fsdp); start every group",
        ),
        ([(0, {}), (1, {}), (1, {})], "replica group 1 is here already; give each group its own"),
        ([(0, {}), ("stranger", 1), (1, {})], "replica group 1 at the lighthouse is another job's (it cannot prove"),
        ([(0, {}), ("stranger", 0), (1, {})], "replica group 0 came without proof that it holds this job's"),
        ([(0, {}), ("stranger", 2), (1, {})], "a member claiming replica group 2 came, outside this job's 0 to 1"),
        ([(0, {}), (1, {})], None),
    ],
    ids=[
        "lr",
        "groups",
        "fsdp's shards over groups of another size",
        "a number taken",
        "another job's number",
        "a stranger's proof",
        "a number outside",
        "agreeing",
    ],  # fmt: skip
)
def test_groups_agree_through_the_quorums_store_on_what_they_train_and_who_they_are(members, said, monkeypatch):
    # what each member of a quorum writes to and reads from its store as torchft configures it, all at once: this
    # job's groups (a number and their config's changes), or a stranger who knows every key and format but not the
    # job's token; the last member joins, and is told `said` (None: it agrees)
    from types import SimpleNamespace

    from starter.run_store import serve_store
    from starter.strategies.replica_agreement import disagreement

    monkeypatch.setenv("STARTER_JOB_TOKEN", "the job's secret")
    store = serve_store("127.0.0.1")
    address = f"127.0.0.1:{store.port}/torchft/7/0"
    for _, number in [m for m in members if m[0] == "stranger"]:
        store.set(f"{address.split('/', 1)[1]}/starter/member/beef", f"{'0' * 64}:{json.dumps(CONFIG)}")
        store.append(f"{address.split('/', 1)[1]}/starter/members", f"{number}:beef ")
    ours = [m for m in members if m[0] != "stranger"]

    def says(number: int, theirs: dict, joining: bool):
        ft = SimpleNamespace(replica_group=number, replica_groups=2, timeout_s=10, lighthouse=None)
        member = SimpleNamespace(ft=ft, agreed=json.dumps(CONFIG | theirs), world_size=1, nonce=os.urandom(4).hex())
        return disagreement(address, member, list(range(len(members))), joining=joining)

    with concurrent.futures.ThreadPoolExecutor(len(ours)) as pool:
        found = [pool.submit(says, *member, joining=i == len(ours) - 1) for i, member in enumerate(ours)]
        found = [f.result() for f in found]
    assert (found[-1] and found[-1][1]) == said or found[-1][1].startswith(said), found[-1]


@pytest.mark.parametrize(
    "theirs,differ",
    [
        (["data.batch_size=32"], ["data.batch_size"]),
        (["trainer.limit_train_batches=10"], ["trainer.limit_train_batches"]),
        (
            ["+trainer.max_steps=7", "+trainer.val_check_interval=3"],
            ["trainer.max_steps", "trainer.val_check_interval"],
        ),  # noqa: E501
        (["callbacks.weight_averaging.decay=0.9"], ["callbacks.weight_averaging.decay"]),
        (["+my_new_key=1"], ["my_new_key"]),  # a key nobody listed yet is compared
        (
            [
                "paths.data_dir=/elsewhere",
                "data.num_workers=4",
                "fault_tolerance.replica_group=1",
                "logger=tensorboard",
                "fault_tolerance.host=10.0.0.2",
                "checkpoint_every_n_steps=5",
                "trainer.log_every_n_steps=1",
            ],
            [],
        ),
    ],
    ids=[
        "a data key",
        "a step-shaping trainer key",
        "max_steps and val_check_interval",
        "a callback's",
        "a new key",
        "what a host keeps to itself",
    ],  # fmt: skip
)
def test_the_config_groups_compare_is_the_whole_config_less_what_a_host_keeps_to_itself(theirs, differ, tmp_path):
    from conftest import compose_config
    from starter.strategies.replica_agreement import agreed_config

    base = ["fault_tolerance=torchft", "data=bed_digits"]
    ours = json.loads(agreed_config(compose_config(base, tmp_path / "a"), 1))
    other = json.loads(agreed_config(compose_config(base + theirs, tmp_path / "b"), 1))
    assert sorted(k for k in ours.keys() | other.keys() if ours.get(k) != other.get(k)) == differ


def test_a_stop_signal_while_a_group_waits_for_a_quorum_saves_and_stops_it_at_once(tmp_path):
    # Group 0 and the lighthouse (a process of its own, group 0's train.py started it) are SIGKILLed: group 1's next
    # quorum waits for a lighthouse that is gone, quorum_timeout_s (120 s) by default. A SIGTERM there saves last.ckpt
    # as the weights stand and stops it (143), well before the quorum would time out.
    port = free_port()
    long = ["trainer.max_epochs=40", "+callbacks.slow._target_=probes.SlowSteps", "+callbacks.slow.seconds=0.1"]
    procs = [group(tmp_path, g, port, *long, f"+callbacks.slow.output={tmp_path / f'steps{g}'}") for g in (0, 1)]
    while not (tmp_path / "steps1").exists() or len((tmp_path / "steps1").read_text().split()) < 10:
        time.sleep(0.2)
    procs[0].kill()
    subprocess.run(["pkill", "-9", "-f", f"starter.strategies.lighthouse {port} "], check=True)
    time.sleep(3)  # group 1 waits in its quorum
    procs[1].send_signal(signal.SIGTERM)
    _, err = procs[1].communicate(timeout=60)
    last = run_dir(tmp_path, 1) / "checkpoints" / "last.ckpt"
    step = torch.load(last, weights_only=True)["global_step"]
    lines = [line for line in err.splitlines() if line.startswith(("error:", "Traceback"))]
    assert procs[1].returncode == 143 and lines == [
        f"error: stopped by SIGTERM during training at step {step} after saving checkpoints/last.ckpt; resume with"
        f" ckpt_path={last.relative_to(tmp_path)}"
    ], (procs[1].returncode, lines)
    procs[0].wait()


HEAL_SHARDS = """
import torch, torch.distributed as dist
from types import SimpleNamespace
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from starter.strategies.fault_tolerant import FaultTolerant

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
mesh, batch = init_device_mesh("cpu", (1,)), torch.tensor([1, 2, 3])

def replica_group(seed):  # a tied net (an output layer sharing its embedding's weight) under fsdp, one AdamW step in
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    net[1].weight = net[0].weight
    fully_shard(net, mesh=mesh)
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.1)
    net(batch).square().mean().backward()
    optimizer.step()
    group = object.__new__(FaultTolerant)
    batches = SimpleNamespace(current=SimpleNamespace(completed=2))
    loop = SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=batches))
    trainer = SimpleNamespace(current_epoch=1, global_step=7, num_training_batches=5, lr_scheduler_configs=[],
                              fit_loop=loop, callbacks=[])
    group.lightning_module = SimpleNamespace(trainer=trainer, named_buffers=net.named_buffers)
    group.optimizers, group.joining, group.ft = [optimizer], True, SimpleNamespace(replica_group=seed)
    group.outer = None
    group.parameters_by_name = dict(net.named_parameters())
    return group, net, optimizer

live, live_net, live_optimizer = replica_group(0)
back, back_net, back_optimizer = replica_group(1)
assert not torch.equal(back_net[0].weight.to_local(), live_net[0].weight.to_local())
sent = {path!r}
torch.save(live._state(), sent)  # as torchft's transport sends it, read weights-only
back._heal(torch.load(sent, weights_only=True))
assert back.healed == [1, 2, 7] and back_net[1].weight is back_net[0].weight
assert isinstance(back_net[0].weight, DTensor)
assert torch.equal(back_net[0].weight.to_local(), live_net[0].weight.to_local())
for net, optimizer in ((live_net, live_optimizer), (back_net, back_optimizer)):  # the same step from the same state
    optimizer.zero_grad()
    net(batch).square().mean().backward()
    optimizer.step()
assert torch.equal(back_net[0].weight.to_local(), live_net[0].weight.to_local())
print("healed equal")
"""


def test_a_heal_writes_fsdps_shards_and_optimizer_state_in_place_and_keeps_a_tie(tmp_path):
    # what a group sends (its process's shards, weights-only) and how the healing one writes it: into its own sharded
    # parameters (DTensors), in place, so a tie (one parameter, two owners) stays one; its optimizer state as DTensors
    # like its parameters, so the next step of both is equal
    script = HEAL_SHARDS.format(port=free_port(), path=str(tmp_path / "state.pt"))
    done = subprocess.run([sys.executable, "-c", script], env=with_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "healed equal" in done.stdout, done.stderr[-3000:]


def resident_mb(pid: int) -> float:
    """Process `pid`'s resident memory, in MB (0 once it has gone, or has ended and is not yet reaped: no VmRSS)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    return int(next((line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")), 0)) / 1024


def test_the_lighthouses_host_lost_ends_the_other_group_in_one_line_with_last_ckpt_and_flat_memory(hosts, tmp_path):
    # Group 0 and the lighthouse it started on host 0, group 1 on host 1, started as the docs' commands say. Host 0 is
    # lost mid-run (every process on it SIGKILLed): group 1's next quorum waits for a lighthouse that is gone. Within
    # quorum_timeout_s and a heartbeat it says so in one line, having saved last.ckpt, and exits 2. Its memory stays
    # flat meanwhile: torchft's own TimeoutError was once taken for "still waiting" (Python's concurrent.futures raises
    # the same class), and the wait went on forever, growing by its traceback's frames each half second.
    port, quorum_s = free_port(), 10
    long = ["trainer.max_epochs=40", "+callbacks.slow._target_=probes.SlowSteps", "+callbacks.slow.seconds=0.1",
            f"fault_tolerance.quorum_timeout_s={quorum_s}", "fault_tolerance.timeout_s=5"]  # fmt: skip
    procs = [group(tmp_path, g, port, *long, f"+callbacks.slow.output={tmp_path / f'steps{g}'}", hosts=hosts)
             for g in (0, 1)]  # fmt: skip
    with reaped(*procs):
        while not (tmp_path / "steps1").exists() or len((tmp_path / "steps1").read_text().splitlines()) < 10:
            assert procs[1].poll() is None, procs[1].communicate()
            time.sleep(0.2)
        hosts.kill(0)
        lost_at, memory = time.monotonic(), [resident_mb(procs[1].pid)]
        while procs[1].poll() is None and time.monotonic() - lost_at < 120:
            memory.append(resident_mb(procs[1].pid))
            time.sleep(0.5)
        took = time.monotonic() - lost_at
        _, err = procs[1].communicate(timeout=10)
    lines = [line for line in err.splitlines() if line.startswith(("error:", "Traceback"))]
    step = torch.load(run_dir(tmp_path, 1) / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    said = (f"error: replica group 1: the lighthouse at http://{hosts.address(0)}:{port} does not answer (its process"
            " or its host gone); torchft said: ")  # fmt: skip
    assert procs[1].returncode == 2 and len(lines) == 1 and lines[0].startswith(said), (procs[1].returncode, lines)
    assert lines[0].endswith(f"(quorum_timeout_s=10); checkpoints/last.ckpt saved at step {step}, resume with"
                             " ckpt_path=auto") and step >= 10  # fmt: skip
    print(f"named {took:.1f} s after the host was lost: {lines[0]}")
    assert took < quorum_s + HEARTBEAT_S + 10, took  # the quorum's wait, a heartbeat, the save and the exit
    assert max(memory) - memory[0] < 100, memory


def test_a_stop_signal_while_a_group_waits_for_the_others_to_join_is_acted_on_within_a_second(tmp_path):
    # Group 0 alone waits up to join_timeout_s for group 1, in quorums that each return at once: the signal is heard
    # between them, not once the join is over.
    import re

    from starter.strategies.lighthouse import status

    port = free_port()
    proc = group(tmp_path, 0, port, "fault_tolerance.join_timeout_s=120", "trainer.max_epochs=1")
    with reaped(proc):  # a quorum formed: the group is in its join's quorums (its manager beats from setup on)
        while int((re.search(r"Current quorum_id: (\d+)", status(f"http://localhost:{port}") or "") or [0, 0])[1]) < 1:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        stopped_at = time.monotonic()
        _, err = proc.communicate(timeout=120)
        took = time.monotonic() - stopped_at
    lines = [line for line in err.splitlines() if line.startswith(("error:", "Traceback"))]
    assert proc.returncode == 143 and lines == [
        "error: stopped by SIGTERM during training; nothing was saved (this run has no checkpoints/last.ckpt)"
    ], (proc.returncode, lines)
    print(f"stopped {took:.2f} s after the signal")
    assert took < 5, took  # within a second of the signal, the process's end included (was: the join's 120 s)


def test_a_quorum_that_never_forms_is_one_line_within_quorum_timeout_s(tmp_path):
    # min_replicas=2 and one group: no quorum ever forms; its wait ends (it once went on forever, growing) in one line
    # naming what is missing
    port = free_port()
    proc = group(tmp_path, 0, port, "fault_tolerance.min_replicas=2", "fault_tolerance.quorum_timeout_s=3")
    with reaped(proc):
        _, err = proc.communicate(timeout=120)
    lines = [line for line in err.splitlines() if line.startswith(("error:", "Traceback"))]
    said = f"error: replica group 0: no quorum of 2 group(s) at the lighthouse at http://localhost:{port}; torchft"
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(said), (proc.returncode, lines)
    assert lines[0].endswith("(quorum_timeout_s=3)")  # joining: nothing trained, nothing to save


def test_a_torchft_wait_that_raises_timeouterror_raises_it_at_once():
    # torchft raises the builtin TimeoutError (a quorum that timed out); since Python 3.11 it is also what
    # concurrent.futures raises for "not yet": a wait that caught that to poll again never ended
    import threading

    from starter.strategies.fault_tolerant import FaultTolerant

    def quorum():
        time.sleep(0.7)  # past the wait's first poll
        raise TimeoutError("quorum timed out")

    raised = []
    waiting = threading.Thread(target=lambda: raised.append(_raised(FaultTolerant.__new__(FaultTolerant), quorum)))
    waiting.start()
    waiting.join(timeout=10)
    assert not waiting.is_alive() and raised == ["quorum timed out"], raised


def _raised(strategy, call) -> str | None:
    try:
        strategy._waited(call)
    except TimeoutError as err:
        return str(err)
    return None


@pytest.mark.parametrize("named", [False, True], ids=["group 0's port", "a named lighthouse"])
def test_a_port_that_answers_but_is_not_a_lighthouse_is_refused_in_one_line(named, monkeypatch):
    import http.server
    import threading

    from omegaconf import OmegaConf

    from starter.errors import UserError
    from starter.strategies.torchft_setup import start_lighthouse

    class Other(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"<html>a status page of something else</html>")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Other)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "")  # restored after: start_lighthouse sets it
    address = f"http://localhost:{port}"
    ft = OmegaConf.create(dict(lighthouse=address if named else None, lighthouse_port=port, min_replicas=1,
                               join_timeout_s=1, heartbeat_timeout_s=1))  # fmt: skip
    said = (f"{address} answers, but is not a torchft lighthouse; name the lighthouse's address" if named else
            f"replica group 0 cannot serve the lighthouse at port {port} (something that is not a torchft"
            f" lighthouse answers at {address}); give another fault_tolerance.lighthouse_port, the same to every"
            " group")  # fmt: skip
    try:
        with pytest.raises(UserError) as refused:
            start_lighthouse(ft)
    finally:
        server.shutdown()
    assert str(refused.value) == said
