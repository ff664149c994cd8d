"""What a finished run leaves for people: metrics.json, learning_curves.png (from metrics.csv), a printed table."""

import csv
import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)


def write_run_outputs(run_dir: Path, metrics: dict[str, float], monitor: str) -> None:
    (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    if (run_dir / "metrics.csv").is_file():
        plot_learning_curves(run_dir / "metrics.csv", run_dir / "learning_curves.png", monitor)
    print(format_table(metrics), flush=True)
    log.info("run directory: %s", run_dir)


def format_table(metrics: dict[str, float]) -> str:
    width = max([len("metric")] + [len(k) for k in metrics])
    lines = [f"{'metric':<{width}}  value", f"{'-' * width}  ------"]
    lines += [f"{name:<{width}}  {value:.4f}" for name, value in sorted(metrics.items())]
    return "\n".join(lines)


def read_metrics_csv(path: Path) -> dict[str, list[tuple[int, float]]]:
    """Each logged metric as (step, value) pairs; CSVLogger writes one row per step with blanks elsewhere."""
    series: dict[str, list[tuple[int, float]]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            for name, value in row.items():
                if name not in ("epoch", "step") and value not in ("", None):
                    series.setdefault(name, []).append((int(row["step"]), float(value)))
    return series


def plot_learning_curves(csv_path: Path, png_path: Path, monitor: str) -> None:
    """The training and validation losses beside the monitored metric, by step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = read_metrics_csv(csv_path)
    fig, (ax_loss, ax_monitor) = plt.subplots(1, 2, figsize=(10, 4))
    for name in ("train/loss", "val/loss"):
        if name in series:
            ax_loss.plot(*zip(*series[name]), label=name, marker="o" if name == "val/loss" else None)
    if monitor in series:
        ax_monitor.plot(*zip(*series[monitor]), label=monitor, marker="o")
    for ax, title in ((ax_loss, "loss"), (ax_monitor, monitor)):
        ax.set(title=title, xlabel="step")
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
