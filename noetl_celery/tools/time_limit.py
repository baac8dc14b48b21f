"""The exception an attempt's soft time limit raises into the tool's code (billiard's, raised by
the worker pool's signal handler): the tools catch and report it. It is billiard's own class, so
it is named here once, the only import of billiard outside the transport (.importlinter)."""

from billiard.exceptions import SoftTimeLimitExceeded as SoftTimeLimitExceeded

__all__ = ["SoftTimeLimitExceeded"]
