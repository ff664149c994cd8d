"""How far this process's main thread has got, for the watchdog's thread (launch/watchdog.py) to tell a run that
waits forever (a rank deadlocked in its data loader or its own code, its peers in a collective) from a slow one.
Counted by callbacks/batch_ticks.py: integer adds on the host, nothing read from the device."""

boundaries = 0  # batch starts and ends this process has passed
loops = 0  # loops (fit, validate, test, predict) entered and not yet left: where the boundaries must keep coming
