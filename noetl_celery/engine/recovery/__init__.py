"""Time and recovery: the sweeper, how an execution ends from outside (cancel, timeout), resume."""
