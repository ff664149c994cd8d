"""Counts the batch boundaries the main thread passes (starter/progress_count.py), so that the watchdog can end a run
in which no rank has moved for `stall_timeout_s`, naming the rank the others wait for."""

import lightning as L

from starter import progress_count


class BatchTicks(L.Callback):
    def on_train_batch_start(self, *args) -> None:
        progress_count.boundaries += 1

    on_train_batch_end = on_validation_batch_start = on_validation_batch_end = on_train_batch_start
    on_test_batch_start = on_test_batch_end = on_predict_batch_start = on_predict_batch_end = on_train_batch_start

    def on_fit_start(self, *args) -> None:
        progress_count.loops += 1  # a count, not a flag: fit's validation is a loop inside a loop

    on_validation_start = on_test_start = on_predict_start = on_fit_start

    def on_fit_end(self, *args) -> None:
        progress_count.loops -= 1

    on_validation_end = on_test_end = on_predict_end = on_fit_end
