"""How far this process's main thread has got, for the watchdog to tell a run that waits forever from a slow one:
integer adds on the host, nothing read from the device."""

import lightning as L


class BatchTicks(L.Callback):
    boundaries = 0  # batch starts and ends this process has passed
    loops = 0  # loops (fit, validate, test, predict) entered and not yet left: where the boundaries must keep coming

    def on_train_batch_start(self, *args) -> None:
        BatchTicks.boundaries += 1

    on_train_batch_end = on_validation_batch_start = on_validation_batch_end = on_train_batch_start
    on_test_batch_start = on_test_batch_end = on_predict_batch_start = on_predict_batch_end = on_train_batch_start

    def on_fit_start(self, *args) -> None:
        BatchTicks.loops += 1  # a count, not a flag: fit's validation is a loop inside a loop

    on_validation_start = on_test_start = on_predict_start = on_fit_start

    def on_fit_end(self, *args) -> None:
        BatchTicks.loops -= 1

    on_validation_end = on_test_end = on_predict_end = on_fit_end
