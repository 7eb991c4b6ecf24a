"""The live dashboard in a real browser, /metrics against kv.stats(), and the merged timeline, all on
one 2-worker, 2-server job (tests/jobs/dashboard_job.py) that runs while the test watches it.

The scenario runs once (a module fixture) and each test asserts one part of what it saw:
  1. the job page lists every role; two looks at the workers page a moment apart show the step
     counters and the loss curves moving (headless Chromium from Debian's `chromium` package,
     driven by playwright; screenshots go to test-artifacts/dashboard/);
  2. without the token every route answers 401;
  3. after training stops, /metrics (parsed by prometheus-client) matches worker 0's kv.stats();
  4. worker 1 is SIGKILLed: the job page shows it failed (the dashboard lingers after the failure);
  5. the processes' traces merge into valid Chrome-trace JSON with one track per process.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from paratrain.metrics.dashboard import DashboardConfig
from paratrain.metrics.trace import merge_traces
from paratrain.testing import run_job

JOB = Path(__file__).parent / "jobs" / "dashboard_job.py"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = (
    Path(os.environ.get("PARATRAIN_TEST_ARTIFACTS", Path(__file__).parents[1] / "test-artifacts"))
    / "dashboard"
)
URL = re.compile(r"dashboard at (http://\S+)")
WAIT_S = 60.0
http = httpx.Client(timeout=WAIT_S)  # the first request waits for the scheduler to start serving

pytestmark = pytest.mark.timeout(240)


def _browser_missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (the test extra)"
    if not os.path.exists(CHROMIUM):
        return "Debian's chromium is not installed (scripts/setup_chromium.sh)"
    return None


def _wait_for(what: str, check: Any, timeout_s: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s} s for {what}")
        time.sleep(0.2)


def _samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _metric(samples: dict, name: str, **labels: str) -> list[float]:
    want = set(labels.items())
    return [v for (n, ls), v in samples.items() if n == name and want <= ls]


def _matches_stats(samples: dict, stats: dict) -> list[str]:
    """Every difference between /metrics and kv.stats() (empty when they agree)."""
    wrong = []
    for key, kv in stats["kv"].items():
        for metric, name, combine in (
            ("paratrain_key_pushes_total", "pushes", max),
            ("paratrain_key_pulls_total", "pulls", max),
            ("paratrain_key_received_bytes_total", "bytes_in", sum),
            ("paratrain_key_sent_bytes_total", "bytes_out", sum),
            ("paratrain_key_version", "version", min),
        ):
            got = _metric(samples, metric, key=key)
            if not got or combine(got) != kv[name]:
                wrong.append(f"{metric}{{key={key!r}}}: {got} (kv.stats(): {kv[name]})")
    total_in = sum(_metric(samples, "paratrain_server_received_bytes_total", role="server"))
    if total_in != sum(kv["bytes_in"] for kv in stats["kv"].values()):
        wrong.append(f"paratrain_server_received_bytes_total sums to {total_in}")
    for rank, steps in stats["steps"].items():
        got = _metric(samples, "paratrain_worker_steps_total", role="worker", rank=rank)
        if got != [steps]:
            wrong.append(f"paratrain_worker_steps_total{{rank={rank}}}: {got} (worker said {steps})")
    return wrong


class Scenario:
    """Runs the job in a thread and watches it; what it saw is kept for the tests."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.urls: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.seen: dict[str, Any] = {}
        self.outcome: Any = None
        self.error: BaseException | None = None

    def _watch(self, line: str) -> None:
        found = URL.search(line)
        if found:
            self.urls.put(found[1])

    def _run_job(self) -> None:
        try:
            self.outcome = run_job(
                JOB,
                workers=2,
                servers=2,
                args=[str(self.folder)],
                env={"PARATRAIN_TRACE_DIR": str(self.folder / "trace")},
                timeout_s=180,
                expect="failure",
                dashboard=DashboardConfig(linger_s=4.0),
                watch=self._watch,
            )
        except BaseException as exc:
            self.error = exc

    def mark(self, what: str) -> None:
        self.seen.setdefault("times", []).append((what, round(time.monotonic() - self.started, 1)))

    def start(self) -> None:
        """Start the job (the browser starts meanwhile)."""
        self.job = threading.Thread(target=self._run_job, name="job", daemon=True)
        self.started = time.monotonic()
        self.job.start()

    def run(self, browser: Any) -> None:
        try:
            url = self.urls.get(timeout=WAIT_S)
            self.mark("url")
            self.base, self.token = url.split("/?token=")
            self.seen["unauthorized"] = self._unauthorized()
            page = browser.new_page(viewport={"width": 1280, "height": 720}) if browser else None
            self.mark("browser")
            if page is not None:
                self._look_at_pages(page, url)
            self.mark("looked")
            (self.folder / "stop").touch()
            stats_path = self.folder / "stats.json"
            self.seen["stats"] = stats = json.loads(
                _wait_for("stats.json", stats_path.exists) and stats_path.read_text()
            )
            self.mark("stats")
            self.seen["metrics"] = self._metrics_matching(stats)
            self.mark("metrics")
            self._kill_worker_1(page)
            self.mark("failure seen")
        finally:
            (self.folder / "stop").touch()
            (self.folder / "end").touch()
            self.job.join(WAIT_S * 2)
            self.mark("job ended")
            print("scenario times (s):", self.seen["times"])
        if self.error is not None:
            raise self.error

    def _unauthorized(self) -> dict[str, int]:
        codes = {
            path: http.get(self.base + path).status_code
            for path in ("/", "/workers", "/api/state", "/metrics")
        }
        codes["/?token=wrong"] = http.get(self.base + "/?token=wrong").status_code
        codes["bearer wrong"] = http.get(
            self.base + "/metrics", headers={"Authorization": "Bearer x"}
        ).status_code
        codes["with token"] = http.get(f"{self.base}/api/state?token={self.token}").status_code
        return codes

    def _look_at_pages(self, page: Any, url: str) -> None:
        page.goto(url)
        # the nodes register in any order: wait until the page lists all four
        page.wait_for_function(
            "() => document.querySelectorAll('tr[data-role]').length >= 4", timeout=WAIT_S * 1000
        )
        self.seen["roles"] = page.eval_on_selector_all(
            "tr[data-role]", "rows => rows.map(r => [r.dataset.role, +r.dataset.rank, r.dataset.state])"
        )
        page.screenshot(path=str(ARTIFACTS / "job.png"))
        with page.expect_navigation():  # no cookie: the link carries the token on (dashboard.html)
            page.click('nav a[href^="/workers?token="]')
        looks = []
        moving = """() => {
            const s = [...document.querySelectorAll('tr[data-worker] .step')].map(e => +e.textContent);
            const p = [...document.querySelectorAll('svg.loss')].map(e => +e.dataset.points);
            return s.length == 2 && p.length == 2 && %s }"""
        page.wait_for_function(moving % "s.every(x => x > 0) && p.every(x => x > 0)", timeout=WAIT_S * 1000)
        looks.append(self._worker_figures(page))
        page.wait_for_function(
            moving % f"s.every((x, i) => x > {looks[0]['steps']}[i]) "
            f"&& p.every((x, i) => x > {looks[0]['points']}[i])",
            timeout=WAIT_S * 1000,
        )
        looks.append(self._worker_figures(page))
        self.mark("second look")
        self.seen["looks"] = looks
        page.screenshot(path=str(ARTIFACTS / "workers.png"), full_page=True)
        for name in ("servers", "keys", "staleness"):
            page.goto(f"{self.base}/{name}?token={self.token}")
            page.wait_for_selector("main section", timeout=WAIT_S * 1000)
            page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)

    @staticmethod
    def _worker_figures(page: Any) -> dict[str, list[int]]:
        return {
            "steps": page.eval_on_selector_all(
                "tr[data-worker] .step", "els => els.map(e => +e.textContent)"
            ),
            "points": page.eval_on_selector_all("svg.loss", "els => els.map(e => +e.dataset.points)"),
        }

    def _metrics_matching(self, stats: dict) -> dict:
        """/metrics once it carries the heartbeats sent after training stopped (or the last look)."""
        headers = {"Authorization": f"Bearer {self.token}"}
        samples: dict = {}
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            samples = _samples(http.get(self.base + "/metrics", headers=headers).text)
            if not _matches_stats(samples, stats):
                break
            time.sleep(0.5)
        return samples

    def _kill_worker_1(self, page: Any) -> None:
        state = http.get(f"{self.base}/api/state?token={self.token}").json()
        pid = next(r["pid"] for r in state["roles"] if r["role"] == "worker" and r["rank"] == 1)
        os.kill(pid, signal.SIGKILL)
        if page is None:
            return
        page.goto(f"{self.base}/?token={self.token}")
        page.wait_for_selector(
            'tr[data-role="worker"][data-rank="1"][data-state="failed"]', timeout=WAIT_S * 1000
        )
        page.wait_for_selector('[data-failed="worker-1"]', timeout=WAIT_S * 1000)
        self.seen["failure_text"] = page.inner_text('[data-failed="worker-1"]')
        page.screenshot(path=str(ARTIFACTS / "failed.png"), full_page=True)


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Scenario:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    seen = Scenario(tmp_path_factory.mktemp("dashboard"))
    seen.start()
    if _browser_missing():
        seen.run(None)
        return seen
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            seen.run(browser)
        finally:
            browser.close()
    return seen


def test_browser_shows_every_role_and_moving_workers(scenario: Scenario) -> None:
    if _browser_missing():
        pytest.skip(_browser_missing())
    roles = {(role, rank) for role, rank, _ in scenario.seen["roles"]}
    assert roles == {("server", 0), ("server", 1), ("worker", 0), ("worker", 1)}
    first, second = scenario.seen["looks"]
    assert all(b > a > 0 for a, b in zip(first["steps"], second["steps"])), scenario.seen["looks"]
    assert all(b > a > 0 for a, b in zip(first["points"], second["points"])), scenario.seen["looks"]
    for name in ("job", "workers", "servers", "keys", "staleness", "failed"):
        assert (ARTIFACTS / f"{name}.png").stat().st_size > 10_000


def test_browser_shows_killed_worker_failed(scenario: Scenario) -> None:
    if _browser_missing():
        pytest.skip(_browser_missing())
    assert "worker 1 failed" in scenario.seen["failure_text"]
    assert "lost its connection" in scenario.seen["failure_text"]
    assert scenario.outcome.failure.role == "worker" and scenario.outcome.failure.rank == 1


def test_without_token_401(scenario: Scenario) -> None:
    codes = scenario.seen["unauthorized"]
    assert codes.pop("with token") == 200
    assert set(codes.values()) == {401}, codes


def test_metrics_match_kv_stats(scenario: Scenario) -> None:
    samples, stats = scenario.seen["metrics"], scenario.seen["stats"]
    assert set(stats["kv"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert _matches_stats(samples, stats) == []
    # dist_sync: every push is 0 rounds behind; the histogram counts every pushed slice
    for rank in ("0", "1"):
        pushes = _metric(samples, "paratrain_server_pushes_total", rank=rank)
        at_zero = _metric(samples, "paratrain_push_staleness_rounds_bucket", rank=rank, le="0")
        count = _metric(samples, "paratrain_push_staleness_rounds_count", rank=rank)
        assert pushes[0] > 0 and at_zero == count == pushes
    assert set(_metric(samples, "paratrain_node_up")) == {1.0}
    assert len(_metric(samples, "paratrain_node_up")) == 4


def test_merged_trace_has_one_track_per_process(scenario: Scenario) -> None:
    merged = json.loads(json.dumps(merge_traces(scenario.folder / "trace")))  # valid JSON, both ways
    events = merged["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(names.values()) == ["scheduler 0", "server 0", "server 1", "worker 0", "worker 1"]
    assert {e["pid"] for e in events} == set(names)
    ranges = [e for e in events if e["ph"] == "X"]
    assert all(isinstance(e["ts"], float) and e["dur"] >= 0 and isinstance(e["tid"], int) for e in ranges)
    by_process = {pid: {e["name"] for e in ranges if e["pid"] == pid} for pid in names}
    worker = {"forward", "backward", "optimizer step", "push", "wait for round (pull)"}
    for pid, name in names.items():
        if name.startswith("worker"):
            assert worker <= by_process[pid], (name, by_process[pid])
        if name.startswith("server"):
            assert "serve pushpull" in by_process[pid]
