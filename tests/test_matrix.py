"""Every strategy x precision pair on CPU, checked against the support matrix in docs/support.md (the table is
the spec): each pair that runs is run (a few batches; 16-mixed for real, fp16 autocast and a loss scaler), each
refused pair is refused in one line naming the alternative."""

import re

import pytest

from conftest import CLIPPED_ON_TWO, OVERFLOW_ON_TWO, ROOT, run_dirs, train

pytestmark = pytest.mark.slow
PRECISIONS = ["32", "16-mixed", "bf16-mixed", "bf16-true"]


def documented_cpu_matrix() -> dict[tuple[str, str, str], str]:
    """{(mode, devices, precision): outcome} from the "CPU (gloo)" table of docs/support.md; a mode is the strategy's
    name and the overrides that make it (`pp` `strategy.pipeline_parallel_size=2`: pp x dp)."""
    text = (ROOT / "docs" / "support.md").read_text()
    table = text.split("**CPU (gloo)")[1].split("\n\n")[1]
    rows = [line.strip("|").split("|") for line in table.splitlines() if line.startswith("|")][2:]
    matrix = {}
    for strategy, devices, *cells in rows:
        assert len(cells) == len(PRECISIONS)
        for precision, cell in zip(PRECISIONS, cells):
            matrix[" ".join(re.findall(r"`([^`]+)`", strategy)), devices.strip(), precision] = cell.strip()
    return matrix


MATRIX = documented_cpu_matrix()
# Pairs that test_clipping_and_fp16.py runs through train.py already, for 20 steps with the weights compared with
# one process (a stronger check than this file's): not run a second time here.
RUN_BY_THE_CLIPPING_AND_FP16_TESTS = {(s, "2", "32") for s in CLIPPED_ON_TWO} | {
    (s, "2", "16-mixed") for s in OVERFLOW_ON_TWO
}


def test_the_readme_matrix_covers_every_strategy_and_precision():
    strategies = {p.stem for p in (ROOT / "conf" / "strategy").glob("*.yaml")}
    assert {mode.split()[0] for mode, _, _ in MATRIX} == strategies
    assert {p for _, _, p in MATRIX} == set(PRECISIONS)
    assert set(MATRIX.values()) <= {"runs"} | {v for v in MATRIX.values() if v.startswith("refused")}
    assert all(MATRIX[pair] == "runs" for pair in RUN_BY_THE_CLIPPING_AND_FP16_TESTS)


@pytest.mark.parametrize("mode,devices,precision", sorted(set(MATRIX) - RUN_BY_THE_CLIPPING_AND_FP16_TESTS))
def test_pair_behaves_as_the_support_matrix_says(mode, devices, precision, tmp_path):
    expected = MATRIX[mode, devices, precision]
    strategy, *overrides = mode.split()
    proc = train(tmp_path, f"strategy={strategy}", *overrides, f"devices={devices}", f"precision={precision}",
                 "accelerator=cpu", "debug=limit", "trainer.max_epochs=1", "test=false", expect_ok=False)  # fmt: skip
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
