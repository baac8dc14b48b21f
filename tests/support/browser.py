"""Headless Chromium for browser tests: Debian's `chromium` and `chromium-driver` (installed with
apt-get when missing and running as root, as on CI), driven by Selenium."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1300,1500",
)
APT_TIMEOUT = 900  # seconds for apt-get update + install
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"  # gitignored


class BrowserUnavailable(RuntimeError):
    pass


def ensure_chromium() -> None:
    """Chromium and its driver at /usr/bin, installed with apt-get when missing (root only)."""
    if Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists():
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise BrowserUnavailable("chromium/chromium-driver missing and cannot be installed (needs root and apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env, timeout=APT_TIMEOUT, capture_output=True)
    subprocess.run(
        ["apt-get", "install", "-y", "-q", "chromium", "chromium-driver"],
        check=True,
        env=env,
        timeout=APT_TIMEOUT,
        capture_output=True,
    )


def chrome(profile_dir: str | None = None):  # type: ignore[no-untyped-def]
    """A Selenium driver for a fresh headless Chromium profile."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError as exc:
        raise BrowserUnavailable("selenium is not installed (pip install -e .[test])") from exc
    ensure_chromium()
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile_dir or tempfile.mkdtemp(prefix='noetl-chromium-')}")
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
