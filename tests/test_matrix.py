"""Every strategy x precision pair on CPU, checked against the support matrix in docs/support.md (the table is
the spec): each pair that runs is run (a few batches); 16-mixed, which CPUs run as bf16-mixed, is checked where
that is decided, before launch."""

import re

import pytest

from conftest import ROOT, compose_config, run_dirs, train
from starter.preflight import prepare

pytestmark = pytest.mark.slow
PRECISIONS = ["32", "16-mixed", "bf16-mixed", "bf16-true"]


def documented_cpu_matrix() -> dict[tuple[str, str, str], str]:
    """{(strategy, devices, precision): outcome} from the "CPU (gloo)" table of docs/support.md."""
    text = (ROOT / "docs" / "support.md").read_text()
    table = text.split("**CPU (gloo)")[1].split("\n\n")[1]
    rows = [line.strip("|").split("|") for line in table.splitlines() if line.startswith("|")][2:]
    matrix = {}
    for strategy, devices, *cells in rows:
        assert len(cells) == len(PRECISIONS)
        for precision, cell in zip(PRECISIONS, cells):
            matrix[strategy.strip(" `"), devices.strip(), precision] = cell.strip()
    return matrix


MATRIX = documented_cpu_matrix()


def test_the_readme_matrix_covers_every_strategy_and_precision():
    strategies = {p.stem for p in (ROOT / "conf" / "strategy").glob("*.yaml")}
    assert {s for s, _, _ in MATRIX} == strategies
    assert {p for _, _, p in MATRIX} == set(PRECISIONS)
    assert set(MATRIX.values()) <= {"runs", "runs as bf16-mixed"} | {
        v for v in MATRIX.values() if v.startswith("refused")
    }


RUNS = sorted(pair for pair, outcome in MATRIX.items() if outcome != "runs as bf16-mixed")
REDIRECTED = sorted(pair for pair, outcome in MATRIX.items() if outcome == "runs as bf16-mixed")


@pytest.mark.parametrize("strategy,devices,precision", REDIRECTED)
def test_fp16_on_cpu_runs_as_the_bf16_mixed_pair_after_one_line(strategy, devices, precision, tmp_path, caplog):
    # The decision is taken before launch and the run is then the bf16-mixed pair, which the test below runs.
    cfg = compose_config([f"strategy={strategy}", f"devices={devices}", f"precision={precision}", "accelerator=cpu"],
                         tmp_path)  # fmt: skip
    prepare(cfg)
    assert cfg.precision == cfg.trainer.precision == "bf16-mixed" and MATRIX[strategy, devices, "bf16-mixed"] == "runs"
    assert [r.getMessage() for r in caplog.records if "16-mixed" in r.getMessage()] == [
        "precision=16-mixed: CPUs have no fp16 autocast; running bf16-mixed (say precision=bf16-mixed)"
    ]


@pytest.mark.parametrize("strategy,devices,precision", RUNS)
def test_pair_behaves_as_the_support_matrix_says(strategy, devices, precision, tmp_path):
    expected = MATRIX[strategy, devices, precision]
    proc = train(tmp_path, f"strategy={strategy}", f"devices={devices}", f"precision={precision}", "accelerator=cpu",
                 "debug=limit", "trainer.max_epochs=1", "test=false", expect_ok=False)  # fmt: skip
    out = proc.stdout + proc.stderr
    if expected.startswith("refused"):
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(errors) == 1, out[-3000:]
        reason = re.search(r"use `?([^`]+)`?", expected).group(1)  # the table names the alternative
        assert reason in errors[0]
        assert not list(tmp_path.glob("logs/**/*.ckpt"))
        return
    assert proc.returncode == 0, out[-3000:]
    (run_dir,) = run_dirs(tmp_path)
    assert f"precision: {precision}" in (run_dir / "config.yaml").read_text()
    assert (run_dir / "metrics.json").is_file() and (run_dir / "checkpoints" / "model.pt").is_file()
