"""Lightning callbacks, one per file: NaN stop, preemption, progress, weight averaging, ..."""
