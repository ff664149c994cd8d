"""A Hydra callback: a multirun ends with its answer. One table across the jobs (each job's overrides, its monitored
metric, the best marked, its run directory), the same rows in `<sweep dir>/summary.csv`, and the sweeper's own best
where it wrote one (Optuna's best trial and its parameters)."""

import csv
import json
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

from starter.atomic_write import replacing
from starter.loggers.report import shown


class SweepSummary(Callback):
    def on_multirun_end(self, config, **kwargs) -> None:
        sweep = Path(config.hydra.sweep.dir)
        trial_key = config.hydra.sweeper.get("pruning_key")  # the overrides that tell a job its trial: not a choice
        found = sweep / "optimization_results.yaml"
        results = OmegaConf.load(found) if found.is_file() else None
        pruned = set(results.get("pruned_trials", [])) if results is not None else set()  # a job's number: its trial's
        rows = summary_rows(sweep, f"{trial_key}." if trial_key else None, pruned)
        if not rows:
            return
        monitor = rows[0]["monitor"]
        write_summary(sweep / "summary.csv", rows)
        shared = set.intersection(*(set(r["overrides"].split()) for r in rows)) if len(rows) > 1 else set()
        swept = [" ".join(o for o in r["overrides"].split() if o not in shared) for r in rows]  # what differs
        best = "highest" if rows[0]["mode"] == "max" else "lowest"
        lines = [f"sweep of {len(rows)} job(s) by {monitor}, the {best} marked *:"]
        width = max(len(s) for s in swept)
        for row, own in zip(rows, swept):
            value = f"{row['value']:.4g}" if row["value"] is not None else "-"
            mark = "*" if row["best"] else " "
            state = "  (pruned)" if row["job"] in pruned else ""
            lines.append(f"{mark} job {row['job']:<3} {own:<{width}}  {value:<8}  {shown(row['run_dir'])}{state}")
        if results is not None and results.best_trial is not None:
            chosen = " ".join(f"{k}={v}" for k, v in results.best_params.items())
            lines.append(f"optuna: best {monitor} {results.best_value:.4g} (trial {results.best_trial}) with {chosen}")
        lines.append(f"summary: {shown(sweep / 'summary.csv')}")
        print("\n".join(lines), flush=True)


def summary_rows(sweep: Path, hidden: str | None = None, pruned: set[int] = frozenset()) -> list[dict]:
    """A row per job directory that holds a run's config: its number, overrides (but those under `hidden`), monitored
    metric (None where the job left none: it failed or was stopped) and whether that is the best of the jobs not
    `pruned`."""
    rows = []
    for job in sorted((p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)):
        if not (job / "config.yaml").is_file():
            continue
        config = OmegaConf.load(job / "config.yaml")
        overrides = (
            OmegaConf.load(job / ".hydra" / "overrides.yaml") if (job / ".hydra" / "overrides.yaml").is_file() else []
        )
        metrics = json.loads((job / "metrics.json").read_text()) if (job / "metrics.json").is_file() else {}
        monitor, mode = str(config.get("monitor")), str(config.get("monitor_mode", "max"))
        overrides = [o for o in overrides if not (hidden and o.startswith(hidden))]
        rows.append(
            {
                "job": int(job.name),
                "overrides": " ".join(overrides),
                "monitor": monitor,
                "mode": mode,
                "value": metrics.get(monitor),
                "run_dir": job,
            }
        )
    values = [r["value"] for r in rows if r["value"] is not None and r["job"] not in pruned]
    best = (max if rows and rows[0]["mode"] == "max" else min)(values) if values else None
    for row in rows:
        row["best"] = row["value"] is not None and row["job"] not in pruned and row["value"] == best
    return rows


def write_summary(path: Path, rows: list[dict]) -> None:
    with replacing(path, newline="") as f:
        out = csv.writer(f)
        out.writerow(["job", "overrides", rows[0]["monitor"], "best", "run_dir"])
        for row in rows:
            out.writerow(
                [
                    row["job"],
                    row["overrides"],
                    "" if row["value"] is None else row["value"],
                    int(row["best"]),
                    str(row["run_dir"]),
                ]
            )
