"""What the worker pool (billiard) does to a tool's running code, named here once for the tools:
the exception an attempt's soft time limit raises into it (billiard's, raised by the pool's signal
handler; the tools catch and report it), and whether the pool is ending this process (its SIGTERM
handler fired: a SystemExit then is the pool's, not the code's). The only import of billiard
outside the transport (.importlinter)."""

from billiard.exceptions import SoftTimeLimitExceeded as SoftTimeLimitExceeded

__all__ = ["SoftTimeLimitExceeded", "pool_terminating"]


def pool_terminating() -> bool:
    """Whether billiard's terminate handler already ran in this process: a SystemExit now is the
    pool process being ended, not the running code's own (billiard >= 4.3 says so; older ones
    keep the same flag unnamed)."""
    from billiard import common

    fired = getattr(common, "terminate_handler_fired", None)
    if fired is not None:
        return bool(fired())
    flag = getattr(common, "_should_have_exited", None)
    return bool(flag and flag[0])
