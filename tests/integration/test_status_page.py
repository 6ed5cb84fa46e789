"""The status page in a real browser (headless Chromium) against a real gateway and engine.

One gateway (tiny demo: pong, fox, owl; the ``recovering`` one, shared with the supervisor's
tests) serves every test here, in order; the last one kills the engine and waits for its
recovery. Screenshots land in ``LORAGATE_TEST_ARTIFACTS`` (else
a temporary directory); ``docs/status-page.png`` is one of them.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import adapter_fixtures as fx
from tests.browser import artifacts_dir, console_errors, start_chromium, wait_until
from tests.conftest import phrase_of
from tests.gateway_process import ADMIN_KEY, GatewayProcess

# The first test also waits for the engine's boot, which takes minutes on a busy CI box.
pytestmark = [pytest.mark.engine, pytest.mark.timeout(1200)]

BASE = "loragate-demo"
MARKUP = "<img src=x onerror=window.pwned=1>"


@pytest.fixture(scope="module")
def served(recovering: GatewayProcess) -> GatewayProcess:
    """The gateway whose engine tests may kill (shared with test_supervisor_recovery)."""
    return recovering


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return artifacts_dir(tmp_path_factory.mktemp("status-page-shots"))


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    driver = start_chromium()
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def page(served: GatewayProcess, browser: Any) -> Any:
    """The page, opened from ``/`` as a person would, with the admin key entered once.

    Requested after ``served``, so the browser (and its open log stream) goes first at the end.
    """
    from selenium.webdriver.common.by import By

    browser.get(served.url + "/")
    assert browser.current_url == served.url + "/ui"
    wait_until(
        browser,
        lambda: "Read-only" in browser.find_element(By.ID, "access").text,
        "the read-only note",
    )
    browser.find_element(By.ID, "admin-key").send_keys(ADMIN_KEY)
    browser.find_element(By.ID, "key-use").click()
    wait_until(
        browser,
        lambda: browser.find_element(By.TAG_NAME, "body").get_attribute("data-admin") == "yes",
        "admin access after entering the key",
    )
    return browser


# ----- helpers --------------------------------------------------------------------------------


def row(driver: Any, name: str) -> Any:
    from selenium.webdriver.common.by import By

    rows = driver.find_elements(
        By.CSS_SELECTOR, f'#adapter-rows tr[data-name="{name}"]:not(.failure)'
    )
    return rows[0] if rows else None


def cell(driver: Any, name: str, column: str) -> str:
    """The text in one adapter's column, read again if the page redrew the row meanwhile."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    for _ in range(10):
        try:
            found = row(driver, name)
            return str(found.find_element(By.CLASS_NAME, column).text) if found is not None else ""
        except StaleElementReferenceException:
            time.sleep(0.1)
    raise AssertionError(f"the row of {name} kept being redrawn")


def click_in_row(driver: Any, name: str, button: str) -> None:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    def clicked() -> bool:
        try:
            row(driver, name).find_element(By.CLASS_NAME, button).click()
            return True
        except StaleElementReferenceException:
            return False

    wait_until(driver, clicked, f"the {button} button of {name}", 10)


def add_through_page(driver: Any, name: str, source: Path | str) -> None:
    from selenium.webdriver.common.by import By

    for field, value in (("add-name", name), ("add-source", str(source))):
        box = driver.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    driver.find_element(By.ID, "add-submit").click()


def version_of(served: GatewayProcess, name: str) -> str:
    answer = served.admin("GET", f"/admin/adapters/{name}")
    answer.raise_for_status()
    return str(answer.json()["version"])


def ask_in_chat_box(driver: Any, first: str, second: str = "") -> tuple[str, str]:
    """Pick two models, send a prompt, and wait for both streamed answers."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    for pane, model in ((1, first), (2, second)):

        def offered(pane: int = pane, model: str = model) -> bool:
            option = f'#chat-model-{pane} option[value="{model}"]'
            return model == "" or bool(driver.find_elements(By.CSS_SELECTOR, option))

        wait_until(driver, offered, f"{model} in the model picker")
        Select(driver.find_element(By.ID, f"chat-model-{pane}")).select_by_value(model)
    prompt = driver.find_element(By.ID, "chat-prompt")
    prompt.clear()
    prompt.send_keys("Hello")
    driver.find_element(By.ID, "chat-send").click()
    answers = []
    for pane in (1, 2):
        answer = driver.find_element(By.ID, f"chat-answer-{pane}")

        def answered(answer: Any = answer) -> bool:
            return bool(answer.get_attribute("data-done") == "yes")

        wait_until(driver, answered, "an answer", 120)
        answers.append(answer.text)
    assert driver.find_element(By.ID, "chat-message").text == ""
    return answers[0], answers[1]


# ----- the tests, in order --------------------------------------------------------------------


def test_page_loads_without_console_errors_and_lists_the_demo_adapters(
    page: Any, served: GatewayProcess, shots: Path
) -> None:
    from selenium.webdriver.common.by import By

    for name in ("pong", "fox", "owl"):

        def ready(name: str = name) -> bool:
            return cell(page, name, "state") == "ready"

        wait_until(page, ready, f"{name} ready")
        assert cell(page, name, "active") == version_of(served, name)[:12]
    wait_until(
        page, lambda: page.find_element(By.ID, "engine-state").text == "ready", "the engine ready"
    )
    assert page.find_element(By.ID, "engine-pid").text == str(served.engine_info()["pid"])
    assert page.find_element(By.ID, "health").text == "healthy"
    logs = page.find_element(By.ID, "log-lines")
    wait_until(
        page, lambda: "[engine]" in logs.text and "[gateway]" in logs.text, "both logs in the tail"
    )
    page.save_screenshot(str(shots / "status-page.png"))
    assert console_errors(page) == []


def test_adding_an_adapter_through_the_page_serves_it_in_the_chat_box(
    page: Any, served: GatewayProcess, demo_dir: Path, tmp_path: Path, shots: Path
) -> None:
    from selenium.webdriver.common.by import By

    hooting = fx.with_unique_config(demo_dir / "adapters" / "owl", tmp_path / "echo-v1")
    add_through_page(page, "echo", hooting)
    wait_until(page, lambda: cell(page, "echo", "state") == "ready", "the new adapter ready", 120)
    # Its progress record, to the end (just after the row turns ready: the add then tidies
    # the store before it returns).
    done = '#adds .add[data-name="echo"][data-stage="done"]'
    wait_until(page, lambda: page.find_elements(By.CSS_SELECTOR, done), "the add's progress done")
    message = page.find_element(By.ID, "adapter-message")
    wait_until(page, lambda: "echo: serving" in message.text, "the add's answer")
    mine, base = ask_in_chat_box(page, "echo", BASE)
    assert phrase_of(mine) == "owl", mine  # the owl copy answers: the page's add serves
    assert phrase_of(base) is None, base
    page.save_screenshot(str(shots / "status-page-added.png"))


def test_rollback_through_the_page_changes_the_active_version(
    page: Any, served: GatewayProcess, demo_dir: Path, tmp_path: Path, shots: Path
) -> None:

    first = version_of(served, "echo")
    foxy = fx.with_unique_config(demo_dir / "adapters" / "fox", tmp_path / "echo-v2")
    add_through_page(page, "echo", foxy)  # the same name: a swap
    second = wait_until(
        page,
        lambda: (
            (v := version_of(served, "echo")) != first
            and cell(page, "echo", "active") == v[:12]
            and v
        ),
        "the swapped-in version",
        120,
    )
    assert cell(page, "echo", "previous") == first[:12]
    assert phrase_of(ask_in_chat_box(page, "echo")[0]) == "fox"
    click_in_row(page, "echo", "rollback")
    wait_until(
        page, lambda: cell(page, "echo", "active") == first[:12], "the rolled-back version", 120
    )
    assert version_of(served, "echo") == first
    assert cell(page, "echo", "previous") == second[:12]
    assert phrase_of(ask_in_chat_box(page, "echo")[0]) == "owl"
    page.save_screenshot(str(shots / "status-page-rolled-back.png"))


def test_markup_in_sources_and_failures_renders_as_text(
    page: Any, served: GatewayProcess, demo_dir: Path, tmp_path: Path, shots: Path
) -> None:
    """Names cannot carry markup (``adapters/names.py``); sources and failure reasons can."""
    from selenium.webdriver.common.by import By

    marked = fx.with_unique_config(demo_dir / "adapters" / "pong", tmp_path / MARKUP)
    add_through_page(page, "marked", marked)
    wait_until(
        page,
        lambda: cell(page, "marked", "state") == "ready",
        "the adapter with markup in its source",
        120,
    )
    assert cell(page, "marked", "source") == str(marked)
    # Under an adapter source root (tools/harness.py), so the failure names the path: a path
    # outside the roots gets one answer that names nothing (docs/security.md).
    missing = tmp_path / "nowhere" / f"{MARKUP}<script>window.pwned=2</script>"
    add_through_page(page, "broken", str(missing))
    failed = wait_until(
        page,
        lambda: page.find_elements(
            By.CSS_SELECTOR, '#adds .add[data-name="broken"][data-stage="failed"]'
        ),
        "the failed add",
    )
    assert MARKUP in failed[0].text
    assert MARKUP in page.find_element(By.ID, "adapter-message").text
    assert page.find_elements(By.CSS_SELECTOR, "main img, main script") == []
    assert page.execute_script("return window.pwned") is None
    page.save_screenshot(str(shots / "status-page-markup.png"))


def test_killing_the_engine_shows_the_state_change_and_recovery_without_a_reload(
    page: Any, served: GatewayProcess, shots: Path
) -> None:
    from selenium.webdriver.common.by import By

    before = served.engine_info()
    page.execute_script("window.sameDocument = true")
    os.kill(int(before["pid"]), signal.SIGKILL)

    def engine_state() -> str | None:  # found again each time: the page redraws it every poll
        text = str(page.find_element(By.ID, "engine-state").text)
        return text if text not in ("ready", "") else None

    seen = wait_until(page, engine_state, "the engine leaving ready", 60)
    assert seen in ("unhealthy", "restarting", "starting"), seen
    page.save_screenshot(str(shots / "status-page-restarting.png"))
    wait_until(
        page,
        lambda: (
            page.find_element(By.ID, "engine-state").text == "ready"
            and page.find_element(By.ID, "health").text == "healthy"
        ),
        "the engine ready again",
        900,  # a reboot; minutes on a busy box
    )
    assert page.find_element(By.ID, "engine-restarts").text == str(int(before["restarts"]) + 1)
    assert "killed by SIGKILL" in page.find_element(By.ID, "engine-last-exit").text
    assert page.find_element(By.ID, "engine-pid").text != str(before["pid"])
    assert page.execute_script("return window.sameDocument") is True  # no reload
    time.sleep(0.5)
    page.save_screenshot(str(shots / "status-page-recovered.png"))
