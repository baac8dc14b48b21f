"""observe: how a run is seen from outside: the log line's format (log_format), the masking of
what user code writes to file descriptors 1 and 2 (fd_masking), a worker's Prometheus metrics
(metrics), signed webhooks of chosen events (webhooks) and `noetl-celery watch` (watch).

It reads the store and the config but takes no engine decision: it imports no engine, app,
runner, command line, tool, schedule or dashboard (`.importlinter`, contract observe).
"""
