"""A Hydra callback: a multirun ends with its answer. One table across the jobs (each job's overrides, its monitored
metric, the best marked, its run directory), the same rows in `<sweep dir>/summary.csv`, and the sweeper's own best
where it wrote one (Optuna's best trial and its parameters). What is monitored, and which way, is this sweep's own
config; a job directory's files supply values only (read as plain YAML and JSON, never resolved)."""

import csv
from pathlib import Path

import yaml
from hydra.experimental.callback import Callback

from starter.atomic_write import replacing
from starter.errors import USER_ERROR_EXIT_CODE, UserError, to_stderr
from starter.loggers.report import shown
from starter.untrusted import formula_safe, reading


class SweepSummary(Callback):
    def on_multirun_end(self, config, **kwargs) -> None:
        try:
            self.summarise(config)
        except UserError as err:
            to_stderr(f"error: {err}")
            raise SystemExit(USER_ERROR_EXIT_CODE) from None

    def summarise(self, config) -> None:
        sweep = Path(config.hydra.sweep.dir)
        trial_key = config.hydra.sweeper.get("pruning_key")  # the overrides that tell a job its trial: not a choice
        results = plain(sweep / "optimization_results.yaml", dict) or {}
        pruned = set(results.get("pruned_trials") or [])  # a job's number: its trial's
        monitor, mode = str(config.monitor), str(config.monitor_mode)
        rows = summary_rows(sweep, monitor, mode, f"{trial_key}." if trial_key else None, pruned)
        if not rows:
            return
        write_summary(sweep / "summary.csv", rows, monitor)
        shared = set.intersection(*(set(r["overrides"].split()) for r in rows)) if len(rows) > 1 else set()
        swept = [" ".join(o for o in r["overrides"].split() if o not in shared) for r in rows]  # what differs
        lines = [f"sweep of {len(rows)} job(s) by {monitor}, the {'highest' if mode == 'max' else 'lowest'} marked *:"]
        width = max(len(s) for s in swept)
        for row, own in zip(rows, swept):
            value = f"{row['value']:.4g}" if row["value"] is not None else "-"
            mark = "*" if row["best"] else " "
            state = "  (pruned)" if row["job"] in pruned else ""
            lines.append(f"{mark} job {row['job']:<3} {own:<{width}}  {value:<8}  {shown(row['run_dir'])}{state}")
        if results.get("best_trial") is not None:
            chosen = " ".join(f"{k}={v}" for k, v in results["best_params"].items())
            best, trial = results["best_value"], results["best_trial"]
            lines.append(f"optuna: best {monitor} {best:.4g} (trial {trial}) with {chosen}")
        lines.append(f"summary: {shown(sweep / 'summary.csv')}")
        print("\n".join(lines), flush=True)


def plain(path: Path, kind: type):
    """A YAML or JSON file's content as plain values (never resolved: `${...}` is text), None where there is none; one
    of another `kind` is one line."""
    if not path.is_file():
        return None
    with reading(path, "hydra.sweep.dir", path.name):
        content = yaml.safe_load(path.read_text())
        if not isinstance(content, kind):
            raise TypeError(f"a {type(content).__name__}, not a {kind.__name__}")
    return content


def summary_rows(sweep: Path, monitor: str, mode: str, hidden: str | None = None, pruned=frozenset()) -> list[dict]:
    """A row per job directory that holds a run's config: its number, overrides (but those under `hidden`), `monitor`
    (None where the job left none: it failed or was stopped) and whether that is the best (`mode`: max or min) of the
    jobs not `pruned`."""
    rows = []
    for job in sorted((p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)):
        if not (job / "config.yaml").is_file():
            continue
        overrides = plain(job / ".hydra" / "overrides.yaml", list) or []
        value = (plain(job / "metrics.json", dict) or {}).get(monitor)
        overrides = [str(o) for o in overrides if not (hidden and str(o).startswith(hidden))]
        value = float(value) if type(value) in (int, float) else None
        rows.append({"job": int(job.name), "overrides": " ".join(overrides), "value": value, "run_dir": job})
    values = [r["value"] for r in rows if r["value"] is not None and r["job"] not in pruned]
    best = (max if mode == "max" else min)(values) if values else None
    for row in rows:
        row["best"] = row["value"] is not None and row["job"] not in pruned and row["value"] == best
    return rows


def write_summary(path: Path, rows: list[dict], monitor: str) -> None:
    with replacing(path, newline="") as f:
        out = csv.writer(f)
        out.writerow(["job", "overrides", formula_safe(monitor), "best", "run_dir"])
        for row in rows:
            value = "" if row["value"] is None else row["value"]
            text = [formula_safe(row["overrides"]), formula_safe(str(row["run_dir"]))]
            out.writerow([row["job"], text[0], value, int(row["best"]), text[1]])
