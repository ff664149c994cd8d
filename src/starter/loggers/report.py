"""What a finished run leaves for people: metrics.json, learning_curves.png (from metrics.csv), a printed table."""

import csv
import json
import logging
import os
from pathlib import Path

from starter.atomic_write import replacing
from starter.untrusted import reading

log = logging.getLogger(__name__)


def write_run_outputs(run_dir: Path, metrics: dict[str, float], monitor: str, tested: str | None) -> None:
    """`tested`: the checkpoint the test/* figures are of."""
    with replacing(run_dir / "metrics.json") as file:
        file.write(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    if (run_dir / "metrics.csv").is_file():
        plot_learning_curves(run_dir / "metrics.csv", run_dir / "learning_curves.png", monitor)
    print(format_table(metrics, tested), flush=True)
    log.info("run directory: %s", shown(run_dir))


def format_table(metrics: dict[str, float], tested: str | None = None) -> str:
    """Figures in 4 significant digits; the test's marked with the checkpoint they are of."""
    width = max([len("metric")] + [len(k) for k in metrics])
    lines = [f"{'metric':<{width}}  value", f"{'-' * width}  ------"]
    for name, value in sorted(metrics.items()):
        of = f"  ({tested})" if tested and name.startswith("test/") else ""
        lines.append(f"{name:<{width}}  {value:<8.4g}{of}".rstrip())
    return "\n".join(lines)


def shown(path, within=None) -> str:
    """A path as a user reads it: relative to `within` (the working directory) where it is inside it."""
    relative = os.path.relpath(path, within)
    return str(path) if relative.startswith("..") else relative


def plot_learning_curves(csv_path: Path, png_path: Path, monitor: str) -> None:
    """The training and validation losses beside the monitored metric, by step (metrics.csv: a row per logged step,
    blank where a metric has no value)."""
    from matplotlib.figure import Figure  # not pyplot: no backend or global figure state

    series = metric_series(csv_path)
    fig = Figure(figsize=(10, 4))
    ax_loss, ax_monitor = fig.subplots(1, 2)
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
    with replacing(png_path, "wb") as file:
        fig.savefig(file, dpi=100, format="png")


def metric_series(csv_path: Path) -> dict[str, list[tuple[int, float]]]:
    """{metric: [(step, value), ...]} of a metrics.csv; a file another wrote (not text, no step column, a value that
    is no number) is one line naming it, read before a run continues it (preflight.py)."""
    series: dict[str, list[tuple[int, float]]] = {}
    with reading(csv_path.parent, "hydra.run.dir", csv_path.name), open(csv_path, newline="") as f:
        for row in csv.DictReader(f):
            for name, value in row.items():
                if name not in ("epoch", "step") and value not in ("", None):
                    series.setdefault(name, []).append((int(row["step"]), float(value)))
    return series


def log_model_summary(model, image_shape) -> None:
    """The net's layers with their parameters, and its FLOPs for one image where a forward pass can count them, to
    the run's log file (and the console with verbose=true): the rows that matter, no metric objects."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    net = getattr(model, "net", model)
    rows = [
        (name, type(layer).__name__, sum(p.numel() for p in layer.parameters())) for name, layer in net.named_children()
    ]
    flops, training = "not counted", net.training
    try:  # in eval mode: a forward in training mode would move BatchNorm's statistics and draw dropout's numbers
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            net.eval()(torch.zeros(1, *image_shape))
        flops = f"{counter.get_total_flops() / 1e6:.4g} MFLOPs per image"
    except Exception:  # a net of one's own that takes other input
        pass
    finally:
        net.train(training)
    width = max([len(name) for name, _, _ in rows] + [5])
    lines = [f"{name:<{width}}  {kind:<20}  {count:>12,}" for name, kind, count in rows]
    total = sum(p.numel() for p in net.parameters())
    logging.getLogger("summary").info("\n".join([f"{type(net).__name__}: {total:,} parameters, {flops}", *lines]))
