"""The training step is a hot path: a step that is not a logging step makes no host-device synchronisation and no
collective beyond those the mode needs (counted on CPU by benchmarks/host_syncs.py; on a GPU the same script
counts with torch.cuda.set_sync_debug_mode)."""

import pytest

from conftest import host_syncs

pytestmark = pytest.mark.slow
# Lightning 2.6 itself broadcasts a SIGTERM flag from rank 0 and reads it after every training step when
# world_size > 1 (training_epoch_loop._broadcast_sigterm_tensor; Lightning issue #21487, PR #21640 adds a
# setting). No public seam turns it off: it is the one sync and collective per step left under ddp and fsdp.
LIGHTNING_SIGTERM_BROADCAST = "lightning/pytorch/loops/training_epoch_loop.py"


@pytest.mark.parametrize("strategy,devices", [("auto", 1), ("ddp", 2), ("fsdp", 2)])
def test_steps_that_are_not_logging_steps_make_no_host_sync_and_no_collective(strategy, devices, tmp_path):
    run = [f"strategy={strategy}", f"devices={devices}", "accelerator=cpu", "trainer.enable_progress_bar=true"]
    counts = host_syncs([*run, "trainer.enable_model_summary=false"], tmp_path)
    assert sorted(counts) == [f"rank{r}" for r in range(devices)]
    for summary in counts.values():
        assert summary["non_logging_steps"] >= 10 and summary["logging_steps"] == 1  # steps 3-17 of 19
        ours = {site: n for site, n in summary["non_logging_sites"].items() if LIGHTNING_SIGTERM_BROADCAST not in site}
        assert ours == {}  # the NaN check, the SIGTERM agreement, the progress display: all wait for logging steps
        if devices > 1:  # still there, and nothing else
            assert summary["syncs_per_non_logging_step"] == summary["collectives_per_non_logging_step"] == 1
        # validation steps too: metrics without per-step argument checks or NaN scans, sample counts on the device
        assert summary["evaluation_steps"] == 3 and summary["evaluation_sites"] == {}
