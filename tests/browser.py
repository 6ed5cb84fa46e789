"""Headless Chromium for the status page's tests: Debian's ``chromium`` and ``chromium-driver``,
driven by Selenium. Missing pieces fail the tests with the command that installs them."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path(os.environ.get("LORAGATE_CHROMIUM", "/usr/bin/chromium"))
CHROMEDRIVER = Path(os.environ.get("LORAGATE_CHROMEDRIVER", "/usr/bin/chromedriver"))
INSTALL_HINT = (
    "the status page's browser tests need headless Chromium and its driver: install them with "
    "`sudo apt-get install -y chromium chromium-driver` (scripts/setup.sh --test does this), "
    "and Selenium with `pip install -e '.[test]'`; or point LORAGATE_CHROMIUM and "
    "LORAGATE_CHROMEDRIVER at other binaries"
)
# Without these, Chromium in a closed network stalls on first-run, sync and update calls.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1280,1900",
)


def start_chromium() -> Any:
    """A fresh headless Chromium (its own profile dir) with its console log kept."""
    missing = [str(path) for path in (CHROMIUM, CHROMEDRIVER) if not path.exists()]
    if missing:
        pytest.fail(f"{', '.join(missing)} not found: {INSTALL_HINT}", pytrace=False)
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail(f"selenium is not installed: {INSTALL_HINT}", pytrace=False)
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tempfile.mkdtemp(prefix='loragate-chromium-')}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)


def wait_until(driver: Any, condition: Callable[[], Any], what: str, timeout: float = 60) -> Any:
    """Poll ``condition`` until it returns something true; fail saying ``what`` never happened."""
    from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    def attempt(_: Any) -> Any:
        try:
            return condition()
        except StaleElementReferenceException:  # the page redrew the element meanwhile
            return None

    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.2).until(attempt)
    except TimeoutException:
        pytest.fail(f"the status page never showed {what} within {timeout:g} s", pytrace=False)


def console_errors(driver: Any) -> list[dict[str, Any]]:
    """The browser console's errors since the last call (reading drains the log)."""
    return [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def artifacts_dir(default: Path) -> Path:
    """Where screenshots go: ``LORAGATE_TEST_ARTIFACTS`` when set, else ``default``."""
    chosen = os.environ.get("LORAGATE_TEST_ARTIFACTS")
    path = Path(chosen) if chosen else default
    path.mkdir(parents=True, exist_ok=True)
    return path
