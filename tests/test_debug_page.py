"""The /debug/requests page in headless Chromium, against a sidecar with emulated engines that
has served requests of every kind: remote and local, completed, failed, cancelled, one still in
flight, and one whose id and error carry HTML.

The system's Chromium and chromedriver (Debian ``chromium``, ``chromium-driver``) are driven by
selenium; without them the tests skip, or fail under CI, like every test that needs a system
program (tests/tools.py; .ci/run installs both). Selenium blocks, so every browser step runs in a
worker thread while the event loop keeps serving the sidecar and the engines. A screenshot of the
page is saved under the test's ``tmp_path`` and, when ``PD_SIDECAR_ARTIFACTS`` names a directory,
there too.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.chrome.webdriver import WebDriver
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import Select, WebDriverWait

from sidecar.config import Settings
from sidecar.emulator import RunningEmulator
from sidecar.server.runner import RunningSidecar, start_sidecar
from tests.conftest import (
    StartEmulator,
    StartSidecar,
    chat,
    completion,
    eventually,
    get_json,
    inject,
)
from tests.tools import missing

CHROMIUM = next(
    (path for name in ("chromium", "chromium-browser") if (path := shutil.which(name))), None
)
CHROMEDRIVER = shutil.which("chromedriver")
FLAGS = [
    "--headless",
    "--no-sandbox",  # root in a container
    "--disable-gpu",
    # Nothing but loopback: no update checks, sync or field trials (a closed network refuses
    # them, and a test has no business outside).
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1500,1000",
]
WAIT_S = 10.0
XSS = '<img src=x onerror="window.__xss=1">'
LONG = (
    "Tell me how the KV cache of a long prompt moves from the prefill pod to the decode pod. " * 4
)
T = TypeVar("T")


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    """One headless Chromium for the module, with a fresh empty profile."""
    if CHROMIUM is None or CHROMEDRIVER is None:
        missing(
            "chromium and chromedriver are not installed (apt-get install chromium chromium-driver)"
        )
    with tempfile.TemporaryDirectory(prefix="pd-sidecar-chromium-") as profile:
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the page's console
        for flag in [*FLAGS, f"--user-data-dir={profile}"]:
            options.add_argument(flag)
        driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
        try:
            yield driver
        finally:
            driver.quit()


# --- what the page shows, read in the browser -----------------------------------------------------

ROWS = """return [...document.querySelectorAll('#rows tr')].map((tr) => ({
  id: tr.dataset.id, state: tr.dataset.state, decision: tr.dataset.decision,
  classes: tr.className, text: tr.innerText, width: tr.querySelector('.bar').offsetWidth,
  endpoint: tr.querySelector('td.endpoint .where').textContent,
  segments: [...tr.querySelectorAll('.seg')].map((s) => ({
    from: s.dataset.from, to: s.dataset.to, phase: s.dataset.phase, title: s.title,
    running: s.classList.contains('running')})),
}))"""


def rows(driver: WebDriver) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = driver.execute_script(ROWS)
    return result


def row_ids(driver: WebDriver) -> list[str]:
    return [row["id"] for row in rows(driver)]


def row_count(driver: WebDriver) -> int:
    return len(driver.find_elements(By.CSS_SELECTOR, "#rows tr"))


def wait_until(driver: WebDriver, read: Callable[[WebDriver], T], expected: T) -> None:
    """Wait until ``read(driver) == expected``; fail with the last value read."""
    seen: list[T] = []

    def holds(driver: WebDriver) -> bool:
        seen[:] = [read(driver)]
        return seen[0] == expected

    try:
        WebDriverWait(driver, WAIT_S, poll_frequency=0.05).until(holds)
    except TimeoutException as exc:
        raise AssertionError(f"expected {expected!r}, the page shows {seen!r}") from exc


def text_of(element_id: str) -> Callable[[WebDriver], str]:
    return lambda driver: driver.find_element(By.ID, element_id).text


def ticks(driver: WebDriver) -> list[str]:
    """The time axis's labels (redrawn at every render: read in one script)."""
    labels: list[str] = driver.execute_script(
        "return [...document.querySelectorAll('#ticks .tick')].map((t) => t.textContent)"
    )
    return labels


def limit_choices(driver: WebDriver) -> list[tuple[str, str]]:
    select = Select(driver.find_element(By.ID, "limit"))
    return [(option.get_attribute("value") or "", option.text) for option in select.options]


def click_row(driver: WebDriver, request_id: str) -> None:
    for row in driver.find_elements(By.CSS_SELECTOR, "#rows tr"):
        if row.get_attribute("data-id") == request_id:
            row.click()
            return
    raise AssertionError(f"no row for {request_id!r}")


def shown_record(driver: WebDriver) -> Any:
    return json.loads(driver.find_element(By.ID, "detail-json").get_attribute("textContent") or "")


def save_screenshot(driver: WebDriver, directory: Path) -> None:
    """To ``directory`` and, when set, to ``$PD_SIDECAR_ARTIFACTS``; the paths are printed."""
    path = directory / "debug-page.png"
    driver.save_screenshot(str(path))
    saved = [path]
    if artifacts := os.environ.get("PD_SIDECAR_ARTIFACTS"):
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        saved.append(Path(shutil.copy(path, Path(artifacts) / path.name)))
    print("screenshot of the /debug/requests page:", *saved)


# --- the sidecar's requests -----------------------------------------------------------------------


async def send(
    http: aiohttp.ClientSession,
    sidecar: RunningSidecar,
    request_id: str,
    body: Any,
    headers: dict[str, str] | None = None,
) -> int:
    path = (
        "/v1/chat/completions"
        if isinstance(body, dict) and "messages" in body
        else "/v1/completions"
    )
    kwargs: dict[str, Any] = {"data": body} if isinstance(body, bytes) else {"json": body}
    async with http.post(
        sidecar.url + path, headers={"x-request-id": request_id, **(headers or {})}, **kwargs
    ) as response:
        await response.read()
        return response.status


async def has_first_byte(http: aiohttp.ClientSession, sidecar: RunningSidecar, rid: str) -> bool:
    async with http.get(f"{sidecar.url}/debug/requests/{rid}") as response:
        return response.status == 200 and "first_byte" in (await response.json())["phases"]


async def is_cancelled(http: aiohttp.ClientSession, sidecar: RunningSidecar, rid: str) -> bool:
    record = await get_json(http, f"{sidecar.url}/debug/requests/{rid}")
    return bool(record["state"] == "cancelled")


async def serve_every_kind(
    http: aiohttp.ClientSession,
    sidecar: RunningSidecar,
    prefill: RunningEmulator,
    decode: RunningEmulator,
) -> asyncio.Task[int]:
    """Finished requests of each kind, and one left in flight (returned; the decode engine
    holds it until ``/emulator/release``)."""
    remote = {"x-prefiller-host-port": prefill.endpoint}
    statuses = await asyncio.gather(
        send(http, sidecar, "remote-chat", chat(LONG, stream=True, max_tokens=8), remote),
        send(http, sidecar, "remote-completion", completion(LONG, max_tokens=8), remote),
        send(http, sidecar, "local-chat", chat(stream=True, max_tokens=8)),
        send(http, sidecar, "local-completion", completion(max_tokens=8)),
    )
    assert list(statuses) == [200] * 4
    assert await send(http, sidecar, "bad-json", b"{") == 400
    # A client's id and an error quoting a client's header, both HTML.
    assert await send(http, sidecar, XSS, completion(), {"x-prefiller-host-port": XSS}) == 400
    await inject(http, decode, kind="status", status=500, role="plain")
    assert await send(http, sidecar, "local-500", completion()) == 500

    # Cancelled: the client leaves while the decode stream stalls after its first event.
    await inject(http, decode, kind="stall", role="decode", after_chunks=1)

    async def leave() -> None:
        async with aiohttp.ClientSession() as own:  # closed by the cancel: the client is gone
            await send(own, sidecar, "leaver", chat(LONG, stream=True), remote)

    leaver = asyncio.create_task(leave())
    await eventually(lambda: has_first_byte(http, sidecar, "leaver"))
    leaver.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await leaver

    await eventually(lambda: is_cancelled(http, sidecar, "leaver"))

    await inject(http, decode, kind="stall", role="decode", after_chunks=1)
    slow = asyncio.create_task(send(http, sidecar, "in-flight", chat(LONG, stream=True), remote))
    await eventually(lambda: has_first_byte(http, sidecar, "in-flight"))
    return slow


# --- the tests ------------------------------------------------------------------------------------


@pytest.mark.system
async def test_the_page_in_chromium(
    browser: WebDriver,
    http: aiohttp.ClientSession,
    start_engine: StartEmulator,
    start_sidecar_with: StartSidecar,
    tmp_path: Path,
) -> None:
    prefill = await start_engine(prefill_s_per_token=0.002)
    decode = await start_engine(decode_s_per_token=0.005)
    sidecar = await start_sidecar_with(decode_url=decode.url)
    slow = await serve_every_kind(http, sidecar, prefill, decode)
    try:
        listed = await get_json(http, sidecar.url + "/debug/requests")
        expected = [record["id"] for record in listed["inflight"] + listed["recent"]]
        assert expected[:2] == ["in-flight", "leaver"]
        assert len(expected) == 9
        errors = {record["id"]: record["error"] for record in listed["recent"]}
        totals = {record["id"]: record["durations_ms"]["total"] for record in listed["recent"]}
        await asyncio.to_thread(
            check_page, browser, sidecar.url, expected, errors, totals, prefill.endpoint, tmp_path
        )
    finally:
        async with http.post(decode.url + "/emulator/release") as released:
            assert released.status == 200
        assert await slow == 200


def check_page(
    driver: WebDriver,
    url: str,
    expected: list[str],
    errors: dict[str, str],
    totals: dict[str, float],
    prefill: str,
    artifacts: Path,
) -> None:
    # A browser asks /debug/requests for HTML first: it gets the page, not the JSON.
    driver.get(url + "/debug/requests")
    assert driver.title == "pd-sidecar · requests"
    wait_until(driver, row_ids, expected)
    shown = {row["id"]: row for row in rows(driver)}
    assert (
        text_of("counts")(driver) == f"{len(expected)} shown of {len(expected)} held · 1 in flight"
    )

    # Where each request was prefilled: the endpoint, "local", or "—" before any decision.
    where = {rid: row["endpoint"] for rid, row in shown.items()}
    assert where["remote-chat"] == where["leaver"] == where["in-flight"] == prefill
    assert where["local-chat"] == where["local-500"] == "local"
    assert where["bad-json"] == where[XSS] == "—"

    # The default axis: durations on a log scale. The shortest request (rejected in well under
    # a millisecond) keeps a readable bar beside the one in flight for seconds, and a longer
    # request never has a shorter bar.
    finished = sorted(totals, key=totals.__getitem__)
    width = {row["id"]: row["width"] for row in rows(driver)}  # one read: the bars grow
    assert width[finished[0]] >= 24, (totals, width)
    assert width[finished[-1]] > width[finished[0]]
    for shorter, longer in itertools.pairwise(finished):
        assert width[shorter] <= width[longer] + 1, (shorter, longer, totals, width)
    assert "1 ms" in ticks(driver)
    # On the shared clock the same request is a sliver: that axis shows when, not how long.
    Select(driver.find_element(By.ID, "axis")).select_by_value("shared")
    wait_until(driver, lambda d: "axis=shared" in d.current_url, True)
    assert rows(driver)[expected.index(finished[0])]["width"] < width[finished[0]] / 2
    Select(driver.find_element(By.ID, "axis")).select_by_value("log")

    # Phase bars: the segments a record's phases make, in order, named as in the legend.
    remote = shown["remote-chat"]
    assert [(s["from"], s["to"], s["phase"]) for s in remote["segments"]] == [
        ("received", "prefill_sent", "placing"),
        ("prefill_sent", "prefill_done", "prefill"),
        ("prefill_done", "decode_sent", "handoff"),
        ("decode_sent", "first_byte", "first token"),
        ("first_byte", "done", "streaming"),
    ]
    assert remote["segments"][1]["title"].startswith("prefill: prefill_sent → prefill_done, ")
    assert remote["width"] > 20
    assert [s["from"] for s in shown["local-chat"]["segments"]] == [
        "received",
        "decode_sent",
        "first_byte",
    ]
    flying = shown["in-flight"]
    assert flying["segments"][-1] == {**flying["segments"][-1], "to": "now", "running": True}
    assert flying["state"] == "decoding"

    # Colours come from a row's decision and outcome.
    outcome = {rid: (row["decision"], row["classes"].split()[2]) for rid, row in shown.items()}
    assert outcome["remote-chat"] == ("remote", "o-completed")
    assert outcome["local-completion"] == ("local", "o-completed")
    assert outcome["local-500"] == ("local", "o-failed")
    assert outcome["bad-json"] == ("none", "o-failed")
    assert outcome["leaver"] == ("remote", "o-cancelled")
    assert outcome["in-flight"] == ("remote", "o-inflight")

    # Client-supplied HTML is shown as text, never parsed.
    assert XSS in shown[XSS]["text"]
    assert driver.execute_script("return document.querySelectorAll('img').length") == 0
    assert driver.execute_script("return window.__xss") is None
    click_row(driver, XSS)
    wait_until(driver, text_of("detail-id"), XSS)
    assert shown_record(driver)["error"] == errors[XSS]

    # Rows take the keyboard: arrows move between them, Enter opens one.
    active = driver.switch_to.active_element
    assert active.get_attribute("data-id") == XSS
    active.send_keys(Keys.ARROW_DOWN)
    after = expected[expected.index(XSS) + 1]
    driver.switch_to.active_element.send_keys(Keys.ENTER)
    wait_until(driver, text_of("detail-id"), after)

    # Click a row: its full record beside the timeline, and in the URL.
    click_row(driver, "remote-chat")
    wait_until(driver, text_of("detail-id"), "remote-chat")
    record = shown_record(driver)
    assert (record["id"], record["decision"], record["state"]) == (
        "remote-chat",
        "remote",
        "completed",
    )
    assert "id=remote-chat" in driver.current_url
    # The scheduler's view beside it.
    assert "policy" in driver.find_element(By.ID, "scheduler-body").text

    # Refreshes keep the selection (1 s refresh; the status line shows each one).
    Select(driver.find_element(By.ID, "interval")).select_by_value("1")
    before = text_of("status")(driver)
    WebDriverWait(driver, WAIT_S).until(lambda d: text_of("status")(d) != before)
    assert text_of("detail-id")(driver) == "remote-chat"
    assert [row["id"] for row in rows(driver) if "selected" in row["classes"]] == ["remote-chat"]
    save_screenshot(driver, artifacts)

    # The pause toggle (paused, no fetch is scheduled; resumed, one runs at once).
    pause = driver.find_element(By.ID, "pause")
    pause.click()
    assert (pause.text, pause.get_attribute("aria-pressed")) == ("Resume", "true")
    assert text_of("status")(driver).startswith("paused · ")
    pause.click()
    wait_until(driver, lambda d: text_of("status")(d).startswith("updated "), True)

    # Filters: by decision, then a link with the filters in its hash reproduces the view.
    driver.find_element(By.CSS_SELECTOR, "input[name=decision][value=local]").click()
    wait_until(driver, row_ids, [rid for rid in expected if not rid.startswith("local")])
    assert "decision=remote,none" in driver.current_url
    driver.get(url + "/debug/ui#state=failed,cancelled")
    wait_until(
        driver, row_ids, [rid for rid in expected if shown[rid]["state"] in ("failed", "cancelled")]
    )
    boxes = driver.find_elements(By.CSS_SELECTOR, "input[name=state]:checked")
    assert sorted(box.get_attribute("value") or "" for box in boxes) == ["cancelled", "failed"]

    # ?limit= is what the page fetches (per list); a record beyond it, named in the hash, is
    # looked up at /debug/requests/{id}.
    driver.get(url + "/debug/ui?limit=1#id=bad-json")
    wait_until(driver, row_ids, expected[:2])
    wait_until(
        driver, lambda d: shown_record(d)["id"] if text_of("detail-json")(d) else "", "bad-json"
    )
    assert text_of("detail-note")(driver).startswith("Not in the list now")

    # Nothing refused by the Content-Security-Policy or Trusted Types, no script error.
    assert [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"] == []


@pytest.mark.system
async def test_the_limit_control(
    browser: WebDriver, http: aiohttp.ClientSession, start_sidecar_with: StartSidecar
) -> None:
    """More records held than the page fetches: the header says how many are held, and the
    limit control (up to the server's maximum, the history size) fetches more."""
    sidecar = await start_sidecar_with(debug_history=150)
    for batch in range(10):
        ids = [f"r{batch * 16 + index}" for index in range(16)]
        statuses = await asyncio.gather(*(send(http, sidecar, rid, completion()) for rid in ids))
        assert statuses == [200] * 16
    await asyncio.to_thread(check_limit, browser, sidecar.url)


def check_limit(driver: WebDriver, url: str) -> None:
    driver.get("about:blank")
    driver.get_log("browser")  # the previous test's page, left when its sidecar stopped
    driver.get(url + "/debug/ui")
    wait_until(driver, row_count, 100)
    newest = row_ids(driver)[:2]
    assert newest == ["r159", "r158"]
    assert text_of("counts")(driver) == "100 shown of 150 held · 50 beyond the limit · 0 in flight"
    assert limit_choices(driver) == [
        ("20", "20"),
        ("50", "50"),
        ("100", "100"),
        ("150", "150 (all)"),
    ]

    Select(driver.find_element(By.ID, "limit")).select_by_value("150")
    wait_until(driver, row_count, 150)
    assert row_ids(driver)[-1] == "r10"  # the oldest the history still holds
    assert text_of("counts")(driver) == "150 shown of 150 held · 0 in flight"
    assert "limit=150" in driver.current_url

    # The limit lives in the link; one above the maximum is clamped to it and shown so.
    driver.get(url + "/debug/ui#limit=20")
    wait_until(driver, row_count, 20)
    driver.get(url + "/debug/ui?limit=999")
    wait_until(driver, row_count, 150)
    assert Select(driver.find_element(By.ID, "limit")).first_selected_option.text == "150 (all)"
    assert [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"] == []


@pytest.mark.system
async def test_the_page_says_when_the_sidecar_is_gone(
    browser: WebDriver, decode: RunningEmulator
) -> None:
    """On the admin port (the page's URLs are relative), an empty history, then an error
    banner once the sidecar stops answering."""
    sidecar = await start_sidecar(
        Settings(host="127.0.0.1", port=0, admin_port=0, decode_url=decode.url)
    )
    try:
        await asyncio.to_thread(browser.get, sidecar.admin_url + "/debug/ui")
        await asyncio.to_thread(
            wait_until,
            browser,
            text_of("empty"),
            "No requests yet: none served since the sidecar started.",
        )
    finally:
        await sidecar.close()

    await asyncio.to_thread(wait_until, browser, unreachable, (True, True))


def unreachable(driver: WebDriver) -> tuple[bool, bool]:
    """The error banner says so, and the last data seen is greyed out."""
    banner = text_of("error")(driver).startswith("sidecar unreachable")
    return banner, "stale" in (
        driver.find_element(By.TAG_NAME, "body").get_attribute("class") or ""
    )
