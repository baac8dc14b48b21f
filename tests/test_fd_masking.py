"""What code writes to file descriptors 1 and 2 itself is masked during a python tool attempt
(noetl_celery/observe/fd_masking.py). Each case runs in a process of its own, whose fds 1 and 2 are
pipes read here, as a worker's are its log."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SECRET = "Fd/secret+0042%canary"

PROGRAM = textwrap.dedent(
    """
    import os, subprocess, sys, threading
    from noetl_celery.config import secret_registry
    from noetl_celery.tools.base import ToolCall, get_tool

    secret_registry.register(SECRET)
    code = '''
    import os, subprocess, sys
    os.write(1, ("fd1 " + secret + "\\\\n").encode())
    os.write(2, ("fd2 " + secret.encode().hex() + "\\\\n").encode())
    subprocess.run(["sh", "-c", 'echo "child $S"; echo "child err $S" >&2'], env={"S": secret}, check=True)
    os.write(1, ("long " + "x" * 200000 + secret + "y" * 10 + " no newline").encode())
    result = "ran"
    '''
    run = get_tool("python").run
    outcome = run(ToolCall(kind="python", config={"code": code, "args": {"secret": SECRET}}))
    os.write(1, b"\\nafter the attempt: " + SECRET.encode() + b"\\n")  # the fds are the log's again
    print("data", outcome.data, outcome.error, flush=True)
    """
)


def test_writes_to_fds_1_and_2_during_an_attempt_reach_the_log_masked():
    proc = subprocess.run(
        [sys.executable, "-c", f"SECRET = {SECRET!r}\n" + PROGRAM],
        capture_output=True,
        text=True,
        timeout=60,
    )
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, err[-2000:]
    assert "data ran None" in out
    assert "fd1 ***" in out and "child ***" in out and "x" * 1000 + "***" + "y" * 10 + " no newline" in out
    assert "fd2 ***" in err and "child err ***" in err
    # after the attempt the descriptors are the process's own again: nothing masks them there
    assert f"after the attempt: {SECRET}" in out
    assert out.count(SECRET) == 1 and SECRET not in err and SECRET.encode().hex() not in err
