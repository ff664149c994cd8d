"""A Hydra sweeper on current Optuna, ask and tell: each batch of trials asked of the study, launched as Hydra jobs by
the configured launcher (one process or ddp inside each job, a cluster's jobs), and told their figure. The study
lives in a journal file in the sweep directory (or `storage`): an interrupted sweep started again with the same
`hydra.sweep.dir` continues it, and sweepers sharing the file share the study. A trial whose validation metric falls
behind is pruned by the job itself (callbacks/optuna_pruning.py), told here as pruned. The best trial is written to
<sweep dir>/optimization_results.yaml."""

import json
import math
import os
import re
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from starter.atomic_write import replacing
from starter.errors import USER_ERROR_EXIT_CODE
from starter.process_state import gone

JOURNAL = "optuna.journal"
FINISHED = ("COMPLETE", "PRUNED", "FAIL")  # trial states that count towards n_trials, in a sweep or one continued
SWEEPER = "sweeper"  # a trial's user attribute: the host and pid of the sweep that asked for it


@dataclass
class OptunaJournalSweeperConf:
    _target_: str = "hydra_plugins.optuna_journal_sweeper.sweeper.OptunaJournalSweeper"
    direction: str = "maximize"  # or minimize
    n_trials: int = 10  # finished trials (complete, pruned or failed) the study should hold
    n_jobs: int = 1  # trials launched at once (a batch; the launcher runs them in parallel where it can)
    study_name: str = "sweep"
    storage: Any = None  # an Optuna storage URL; null: a journal file in the sweep directory
    sampler: Any = None  # a `_target_` config, e.g. optuna.samplers.TPESampler
    pruner: Any = None  # a `_target_` config, e.g. optuna.pruners.MedianPruner; read by the jobs' pruning callback
    pruning_key: Any = None  # the job's config key of the pruning callback: told the trial, study and storage
    params: dict = field(default_factory=dict)  # key: choice(...) | interval(a, b) | tag(log, interval(a, b)) | range


ConfigStore.instance().store(
    group="hydra/sweeper", name="optuna_journal", node=OptunaJournalSweeperConf, provider="optuna_journal_sweeper"
)


class OptunaJournalSweeper(Sweeper):
    def __init__(self, direction, n_trials, n_jobs, study_name, storage, sampler, pruner, pruning_key, params):
        self.direction, self.n_trials, self.n_jobs = str(direction), int(n_trials), max(1, int(n_jobs))
        self.study_name, self.storage = str(study_name), storage
        self.sampler, self.pruner, self.pruning_key = sampler, pruner, pruning_key
        self.params = dict(params or {})

    def setup(self, *, hydra_context, task_function, config) -> None:
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: list[str]) -> None:
        import optuna

        optuna.logging.disable_default_handler()  # its lines through the job's logging: the log file, not the console
        optuna.logging.enable_propagation()
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        storage = self.storage or f"journal:{sweep_dir / JOURNAL}"
        study = optuna.create_study(
            study_name=self.study_name,
            storage=open_storage(storage),
            sampler=built(self.sampler),
            pruner=built(self.pruner),
            direction=self.direction,
            load_if_exists=True,
        )
        if (direction := study.direction.name.lower()) != self.direction:
            refuse(f"{storage.removeprefix('journal:')}: its study is to {direction}, this sweep's direction is to"
                   f" {self.direction}; continue it with hydra.sweeper.direction={direction}, or give another"
                   " hydra.sweep.dir")  # fmt: skip
        if study.trials:  # a seeded sampler would draw its first points again: the study goes on from new ones
            study.sampler.reseed_rng()
        searched, fixed = search_space(self.params, arguments)
        for trial in study.trials:  # a journal is anyone's: its trials hold points of this space, and nothing else
            # (a waiting trial's fixed params too: Optuna hands them to the job even outside the space, with a warning)
            check_trial(trial.number, {**trial.system_attrs.get("fixed_params", {}), **trial.params}, searched, storage)
        fail_the_abandoned(study)
        done = [t for t in study.trials if t.state.name in FINISHED]  # those of an earlier sweep of this journal too
        while len(done) < self.n_trials:
            batch = [study.ask(searched) for _ in range(min(self.n_jobs, self.n_trials - len(done)))]
            for trial in batch:
                check_trial(trial.number, trial.params, searched, storage)
                trial.set_user_attr(SWEEPER, f"{socket.gethostname()} {os.getpid()}")  # fail_the_abandoned reads it
            overrides = [
                [*fixed, *(f"{k}={hydra_value(v)}" for k, v in t.params.items()), *self.told(t, storage)] for t in batch
            ]
            results = self.launcher.launch([tuple(o) for o in overrides], initial_job_idx=batch[0].number)
            for trial, result in zip(batch, results):
                frozen = study.trials[trial.number]
                if frozen.user_attrs.get("pruned_at_epoch") is not None:
                    study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                elif isinstance(result.return_value, (int, float)):
                    study.tell(trial, float(result.return_value))
                else:  # the job failed (Hydra raises its error when the result is read) or returned no figure
                    study.tell(trial, state=optuna.trial.TrialState.FAIL)
                    result.return_value  # noqa: B018
                done.append(trial)
        write_results(study, sweep_dir / "optimization_results.yaml")

    def told(self, trial, storage: str) -> list[str]:
        """The overrides that tell the job's pruning callback which trial it reports for."""
        if not self.pruning_key:
            return []
        key = self.pruning_key
        return [f"{key}.trial={trial.number}", f"{key}.study={self.study_name}", f"{key}.storage='{storage}'"]


def fail_the_abandoned(study) -> None:
    """A trial left running by a sweep of this host that is gone (killed, its machine restarted) is marked failed, in a
    line each: it counts as finished, as its job did not end. One that another live sweeper of the journal runs, or a
    sweeper of another host, is left to it."""
    from optuna.trial import TrialState

    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        host, _, pid = str(trial.user_attrs.get(SWEEPER, "")).partition(" ")
        if host == socket.gethostname() and pid.isdigit() and gone(int(pid)):
            study.tell(trial.number, state=TrialState.FAIL)
            print(f"trial {trial.number} was left running by a sweep that is gone (pid {pid}): marked failed")


def built(node):
    """A sampler or pruner: Hydra builds the sweeper's nested `_target_`s; one left a config is built here."""
    return instantiate(node) if isinstance(node, (dict, DictConfig)) else node


def open_storage(storage: str):
    """A journal file (`journal:<path>`), which needs no server, or any storage URL Optuna takes."""
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    if storage.startswith("journal:"):
        path = Path(storage.removeprefix("journal:"))
        check_journal(path)
        return JournalStorage(JournalFileBackend(str(path)))
    return storage


def check_journal(path: Path) -> None:
    """A journal to continue holds what Optuna writes there: one JSON object a line, each an operation (`op_code`)
    of a worker (`worker_id`). Anything else stops the sweep in one line naming the file, before Optuna replays it."""
    if path.is_symlink():  # Optuna opens and appends to what the name leads to
        refuse(f"{path} is a symlink; a journal to continue is a file of the sweep directory")
    if not path.is_file():
        return
    with open(path, "rb") as journal:
        for number, line in enumerate(journal, 1):
            try:
                operation = json.loads(line)
                known = isinstance(operation["op_code"], int) and isinstance(operation["worker_id"], str)
            except (ValueError, KeyError, TypeError):
                known = False
            if not known and line.strip():
                instead = "continue a sweep from the journal a sweep wrote, or give another hydra.sweep.dir"
                refuse(f"{path}: line {number} is no Optuna journal operation; {instead}")


def check_trial(number: int, params: dict, searched: dict, storage: str) -> None:
    """A trial's params become the job's overrides: each must be a searched key, its value a point of that key's
    distribution (of the choice list, inside the interval). Anything else is refused in one line before any job."""
    storage = storage.removeprefix("journal:")
    for key, value in params.items():
        space = searched.get(key)
        if space is None:
            refuse(f"{storage}: trial {number} sets {key}, which this sweep does not search; {CONTINUE}")
        if not contains(space, value):
            refuse(f"{storage}: trial {number} sets {key}={value!r}, outside the space searched ({space}); {CONTINUE}")


def contains(space, value) -> bool:
    """Whether `value` is a point of the distribution `space`: one of its choices (of the same type: True is no 1), or
    a number of its kind within its bounds, on its step."""
    from optuna.distributions import CategoricalDistribution, IntDistribution

    if isinstance(space, CategoricalDistribution):
        return any(type(choice) is type(value) and choice == value for choice in space.choices)
    kinds = (int,) if isinstance(space, IntDistribution) else (int, float)
    if type(value) not in kinds or not space.low <= value <= space.high:
        return False
    return not space.step or math.isclose(round(steps := (value - space.low) / space.step), steps, abs_tol=1e-8)


CONTINUE = "continue a sweep with the space it searched, or give another hydra.sweep.dir"


def hydra_value(value) -> str:
    """A point of the space as an override's value that Hydra parses back to it: a string stays the string given
    (quoted: `choice('true', 'null')` reaches the job as those words, not a bool and None; `${...}` as the text, not
    what it would resolve to)."""
    if isinstance(value, str):
        # Hydra reads a backslash as one unless it stands before a quote or the end: those are doubled
        quoted = re.sub(r"(\\*)('|$)", lambda m: m[1] * 2 + "\\" * bool(m[2]) + m[2], value)
        return "'" + quoted.replace("${", "\\${") + "'"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)


def search_space(params: dict, arguments: list[str]) -> tuple[dict, list[str]]:
    """(Optuna distributions of the swept keys, the overrides passed to every trial as they are) from the sweeper's
    `params` and the command line's overrides, in Hydra's sweep syntax: `choice(...)`, `range(start, stop[, step])`
    (stop excluded, as Hydra's own sweeps take it: every point it gives is reachable), `interval(a, b)` (floats),
    `tag(int, interval(a, b))`, `tag(log, ...)`. An override of the command line replaces a `params` key of its
    name; every other one (`~key`, `+key=value`, `key=value`) reaches every trial."""
    parser = OverridesParser.create()
    given = parser.parse_overrides(arguments)
    named = {override.key_or_group for override in given}
    configured = [f"{key}={spec}" for key, spec in params.items() if key not in named]
    searched, fixed = {}, []
    for override in [*parser.parse_overrides(configured), *given]:
        if override.is_sweep_override():  # named with its `+` or `++`: the job's override adds the key too
            searched[override.get_key_element()] = distribution(override)
        else:
            fixed.append(override.input_line)
    return searched, fixed


def distribution(override):
    """The Optuna distribution of one swept key (search_space)."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    key, value = override.key_or_group, override.value()
    tags = set(getattr(value, "tags", None) or ())
    if unknown := tags - {"log", "int"}:
        refuse(f"{key}: tag {', '.join(sorted(unknown))} means nothing to the sweeper; tags are log and int")
    if isinstance(value, ChoiceSweep):
        if tags:
            refuse(f"{key}: choice() takes no tag ({', '.join(sorted(tags))}); tag an interval() or range()")
        return CategoricalDistribution(list(value.list))
    if isinstance(value, RangeSweep):
        points = list(override.sweep_iterator())
        if not points:
            refuse(f"{override.input_line}: the range holds no point")
        ints = all(isinstance(v, int) for v in (value.start, value.stop, value.step))
        low, high, step = min(points), max(points), abs(value.step)
        kind = IntDistribution if ints or "int" in tags else FloatDistribution
        if "log" not in tags:
            return kind(low, high, step=step)
        if kind is FloatDistribution or step != 1:  # Optuna's log distributions have no step: the points would be lost
            instead = f"tag({'int, ' if kind is IntDistribution else ''}log, interval({low}, {high})) or choice()"
            refuse(f"{override.input_line}: a log scale takes no step; search {instead}")
        return kind(low, high, log=True)
    if isinstance(value, IntervalSweep):
        if "int" not in tags:
            return FloatDistribution(value.start, value.end, log="log" in tags)
        if not all(float(v).is_integer() for v in (value.start, value.end)):
            refuse(f"{key}: tag(int, interval({value.start:g}, {value.end:g})) needs whole-number ends")
        return IntDistribution(int(value.start), int(value.end), log="log" in tags)
    refuse(f"{override.input_line}: the sweeper searches choice(), range() and interval()")


def refuse(line: str):
    """A sweep the sweeper cannot run as given: one line, exit 2, before any trial."""
    print(f"error: {line}", file=sys.stderr, flush=True)
    raise SystemExit(USER_ERROR_EXIT_CODE)


def write_results(study, path: Path) -> None:
    """The best complete trial (none where every trial was pruned or failed), and the pruned trials' numbers."""
    import optuna

    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    best = study.best_trial if complete else None
    pruned = [t.number for t in study.trials if t.state == optuna.trial.TrialState.PRUNED]
    results = {
        "name": "optuna",
        "best_trial": best and best.number,
        "best_params": best.params if best else {},
        "best_value": best and best.value,
        "trials": len(study.trials),
        "pruned_trials": pruned,
    }
    with replacing(path) as file:
        OmegaConf.save(OmegaConf.create(results), file)
