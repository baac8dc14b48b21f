"""Ctrl-C on `noetl-celery run` as cron, nohup or CI see it: a real subprocess whose stdout and
stderr are files, sent SIGINT while its attempt runs (fd 2 then points at the attempt's masking
pipe), exits 130 with its message and no traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SLOW = """apiVersion: noetl.io/v10
kind: Playbook
metadata: {name: interrupted_run}
workflow:
  - step: start
    tool:
      kind: python
      code: |
        import os, time
        os.write(2, b"attempt started" + bytes([10]))
        time.sleep(5)
        result = 1
"""


def _wait_for(path: Path, text: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while text not in path.read_text(errors="replace"):
        assert proc.poll() is None, f"ended early ({proc.returncode}): {path.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"never saw {text!r}: {path.read_text()[-2000:]}"
        time.sleep(0.1)


def test_ctrl_c_with_stderr_in_a_file_exits_130_with_its_message(tmp_path):
    playbook = tmp_path / "slow.yaml"
    playbook.write_text(SLOW)
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("NOETL_")}
    env.update({"NOETL_HOME": str(tmp_path / "home"), "PYTHONPATH": str(REPO_ROOT)})
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "noetl_celery.cli", "run", str(playbook)],
            cwd=tmp_path,
            env=env,
            stdout=stdout,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
        )
        try:
            _wait_for(err, "attempt started", proc)  # the attempt runs: fd 2 is its masking pipe
            proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    said = err.read_text()
    assert code == 130, said[-3000:]
    assert "interrupted: execution" in said and "cancelled" in said, said[-3000:]
    assert "Traceback" not in said and "Illegal seek" not in said, said[-3000:]
