"""Lightning callbacks, one per file: NaN stop, preemption, state bytes, compile, progress."""
