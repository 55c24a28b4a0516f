"""The comparison as a person sees it: a real `mlflow server` on the comparison's store, MLflow's
compare-runs page for its balanced and contiguous training runs opened in headless Chromium, and
every metric of both runs read back from the rendered page next to its value.

Chromium is driven over its DevTools pipe (stdlib only: JSON messages ending in NUL on fds 3/4),
because the page's metric table is virtualized: only ~17 rows exist in the DOM at a time, so a
plain `--dump-dom` never shows later metrics such as samples_per_s; the test scrolls the table."""
from __future__ import annotations

import base64
import contextlib
import json
import math
import os
import select
import shutil
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

from tests.helpers import mlflow_server, stop_group

pytestmark = pytest.mark.extended  # docs/testing.md: the extended tier

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
BROWSER = next((found for name in BROWSERS if (found := shutil.which(name))), None)
# The metrics the comparison exists for; the page must show each for both runs.
REQUIRED_METRICS = ("bubble_fraction", "idle_fraction", "samples_per_s", "hr_at_10")
WINDOW = (1600, 1200)
PAGE_READY_S = 60  # per try; a loaded 2-core machine took 25 s to load and render the page


def compare_runs_url(server: str, run_ids: list[str], experiment_ids: list[str]) -> str:
    """The URL the MLflow UI itself links to (Routes.getCompareRunPageRoute in mlflow 3.17's
    bundle): a hash route whose parameters are JSON lists."""
    return f"{server}/#/compare-runs?runs={json.dumps(run_ids)}&experiments={json.dumps(experiment_ids)}"


class DevTools:
    """Chromium's DevTools protocol over --remote-debugging-pipe: commands to fd 3, replies from
    fd 4, each a JSON object ending in NUL; events in between are skipped."""

    def __init__(self, write_fd: int, read_fd: int):
        self.write_fd, self.read_fd = write_fd, read_fd
        self.last_id, self.buffer, self.session = 0, b"", None

    def call(self, method: str, timeout_s: float = 30, **params) -> dict:
        self.last_id += 1
        message = {"id": self.last_id, "method": method, "params": params}
        if self.session:
            message["sessionId"] = self.session
        os.write(self.write_fd, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        while True:
            reply = self._next(deadline, method)
            if reply.get("id") == self.last_id:
                if "error" in reply:
                    raise RuntimeError(f"DevTools {method}: {reply['error']}")
                return reply["result"]

    def _next(self, deadline: float, method: str) -> dict:
        while b"\0" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.read_fd], [], [], left)[0]:
                raise TimeoutError(f"DevTools {method}: no reply")
            chunk = os.read(self.read_fd, 1 << 20)
            if not chunk:
                raise RuntimeError(f"DevTools {method}: Chromium closed its pipe")
            self.buffer += chunk
        message, _, self.buffer = self.buffer.partition(b"\0")
        return json.loads(message)

    def evaluate(self, expression: str, timeout_s: float = 30):
        result = self.call("Runtime.evaluate", timeout_s, expression=expression, awaitPromise=True,
                           returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")


@contextlib.contextmanager
def headless_chromium(browser: str, workdir: Path) -> Iterator[DevTools]:
    """Headless Chromium with a fresh profile, attached to its one page."""
    to_chrome_r, to_chrome_w = os.pipe()
    from_chrome_r, from_chrome_w = os.pipe()
    flags = ["--headless=new", "--no-sandbox",  # root in CI: Chromium's sandbox refuses root
             "--disable-gpu", "--enable-unsafe-swiftshader",  # software WebGL for the plots
             "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check", "--hide-scrollbars",
             f"--user-data-dir={workdir / 'chromium-profile'}", f"--window-size={WINDOW[0]},{WINDOW[1]}",
             "--remote-debugging-pipe", "about:blank"]
    with open(workdir / "chromium.log", "wb") as out:
        chrome = subprocess.Popen(
            ["bash", "-c", f'exec "$@" 3<&{to_chrome_r} 4>&{from_chrome_w}', "bash", browser, *flags],
            pass_fds=(to_chrome_r, from_chrome_w), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    os.close(to_chrome_r)
    os.close(from_chrome_w)
    try:
        tools = DevTools(to_chrome_w, from_chrome_r)
        try:
            page = next(t for t in tools.call("Target.getTargets")["targetInfos"] if t["type"] == "page")
        except (RuntimeError, TimeoutError) as err:
            pytest.fail(f"{browser} did not start: {err}: {(workdir / 'chromium.log').read_text()[-2000:]}")
        tools.session = tools.call("Target.attachToTarget", targetId=page["targetId"], flatten=True)["sessionId"]
        tools.call("Page.enable")
        # The viewport itself, not the window (which includes headless Chromium's own frame).
        tools.call("Emulation.setDeviceMetricsOverride", width=WINDOW[0], height=WINDOW[1],
                   deviceScaleFactor=1, mobile=False)
        yield tools
    finally:
        os.close(to_chrome_w)
        os.close(from_chrome_r)
        stop_group(chrome)


# Scrolls the compare page's virtualized metric table (names grid left, one value column per run
# right; cells placed by style top/left) and returns {row: {name, values: {column: text}}}.
READ_METRIC_TABLE = """(async () => {
  const link = document.querySelector('a[title="Plot chart"][href*="/metric?"]');
  if (!link) return null;
  const namesGrid = link.closest('.ReactVirtualized__Grid');
  const grids = [...document.querySelectorAll('.ReactVirtualized__Grid')];
  const valuesGrid = grids[grids.indexOf(namesGrid) + 1];
  const cells = (grid) => grid.querySelectorAll('.ReactVirtualized__Grid__innerScrollContainer > div');
  const place = (cell) => [Math.round(parseFloat(cell.style.top) / parseFloat(cell.style.height)),
                           Math.round(parseFloat(cell.style.left) / parseFloat(cell.style.width))];
  const frames = () => new Promise(done => requestAnimationFrame(() => requestAnimationFrame(done)));
  const rows = {};
  for (let top = 0, previous = -1; ; previous = valuesGrid.scrollTop, top += valuesGrid.clientHeight / 2) {
    valuesGrid.scrollTop = top;
    valuesGrid.dispatchEvent(new Event('scroll'));
    await frames();
    for (const cell of cells(namesGrid)) {
      const [row] = place(cell);
      (rows[row] = rows[row] || {values: {}}).name = cell.textContent.trim();
    }
    for (const cell of cells(valuesGrid)) {
      const [row, column] = place(cell);
      (rows[row] = rows[row] || {values: {}}).values[column] = cell.textContent.trim();
    }
    if (valuesGrid.scrollTop <= previous) break;  // the bottom (or nothing to scroll)
  }
  // Back to the first rows (bubble_fraction) for the screenshot. The page syncs the names grid
  // to the values grid's position before its last scroll, so the names grid is set here too.
  valuesGrid.scrollTop = 0;
  namesGrid.scrollIntoView({block: 'center'});
  await frames();
  namesGrid.scrollTop = 0;
  await frames();
  await new Promise(done => setTimeout(done, 300));
  return rows;
})()"""


def open_compare_page(tools: DevTools, url: str, run_names: list[str], metrics: list[str]) -> dict:
    """Loads the page, waits until the React app shows both runs and its metric table, and reads
    the table; once more after a reload if the page is not ready within PAGE_READY_S or the table
    lacks metrics (a slow API answer on a loaded machine). The last table read is returned."""
    ready = (f"{json.dumps(run_names)}.every(n => document.body && document.body.innerText.includes(n))"
             " && !!document.querySelector('a[title=\"Plot chart\"][href*=\"/metric?\"]')")
    table = None
    for attempt in range(2):
        if attempt == 0:
            tools.call("Page.navigate", url=url)
        else:
            tools.call("Page.reload")
        deadline = time.monotonic() + PAGE_READY_S
        while time.monotonic() < deadline and not tools.evaluate(ready):
            time.sleep(0.5)
        if tools.evaluate(ready):
            table = tools.evaluate(READ_METRIC_TABLE)
            if {row.get("name") for row in table.values()} == set(metrics):
                break
    if table is None:
        text = tools.evaluate("document.body ? document.body.innerText : ''") or ""
        pytest.fail(f"compare page never showed runs {run_names} and their metrics; page text: {text[:1500]!r}")
    return table


def shown_as(value: float, text: str) -> bool:
    """Whether the UI's text is this value under MLflow's formatMetric (3 decimals under 10, 2 under
    100, 1 above, 4 significant digits under 0.001)."""
    if math.isnan(value):
        return text == "NaN"
    try:
        shown = float(text)
    except ValueError:
        return False
    return math.isclose(shown, value, rel_tol=1e-3, abs_tol=5.001e-4)


def check_compare_view(comparison, browser: str, workdir: Path) -> tuple[Path, dict[str, float]]:
    """Serves the comparison, opens its compare view, checks it; the screenshot and the seconds
    each phase took."""
    from mlflow.tracking import MlflowClient
    from PIL import Image

    client = MlflowClient(comparison.tracking_uri)
    runs = [client.get_run(comparison.child_run_ids[variant][0]) for variant in ("balanced", "contiguous")]
    run_ids, run_names = [r.info.run_id for r in runs], [r.info.run_name for r in runs]
    for run in runs:
        missing = [m for m in REQUIRED_METRICS if m not in run.data.metrics]
        assert not missing, f"run {run.info.run_name} lacks {missing}"

    expected = sorted(set().union(*(r.data.metrics for r in runs)))
    screenshot, seconds, last = workdir / "compare-runs.png", {}, time.monotonic()

    def lap(phase: str) -> None:
        nonlocal last
        now = time.monotonic()
        seconds[phase], last = now - last, now

    # The session's server when the comparison is recorded there; else one for its store.
    serving = (contextlib.nullcontext(comparison.tracking_uri) if comparison.tracking_uri.startswith("http")
               else mlflow_server(comparison.tracking_uri, workdir))
    with serving as server:
        lap("server_start")
        with headless_chromium(browser, workdir) as tools:
            url = compare_runs_url(server, run_ids, [str(comparison.experiment_id)])
            table = open_compare_page(tools, url, run_names, expected)
            lap("page_load_and_read")
            columns = tools.evaluate(f"{json.dumps(run_ids)}.map(id => document.body.innerText.indexOf(id))")
            png = tools.call("Page.captureScreenshot", format="png")["data"]
            lap("screenshot")
        lap("chromium_stop")
    lap("server_stop")
    screenshot.write_bytes(base64.b64decode(png))

    # Columns follow the page's run order (its "Run ID:" row), which the test reads, not assumes.
    assert all(position >= 0 for position in columns), f"run ids {run_ids} not on the page"
    order = sorted(range(len(run_ids)), key=lambda i: columns[i])
    assert all("name" in row for row in table.values()), f"metric rows without a name: {table}"
    shown = {row["name"]: [row["values"].get(str(c)) for c in range(len(order))] for row in table.values()}
    assert sorted(shown) == expected, f"metric rows on the page {sorted(shown)} != the runs' metrics {expected}"
    wrong = [(name, runs[i].info.run_name, runs[i].data.metrics[name], shown[name][column])
             for column, i in enumerate(order) for name in expected if name in runs[i].data.metrics
             and not shown_as(runs[i].data.metrics[name], shown[name][column] or "")]
    assert not wrong, f"values on the page differ from the runs' (metric, run, logged, shown): {wrong}"

    with Image.open(screenshot) as image:
        assert image.size == WINDOW, image.size
        colours = image.convert("RGB").getcolors(maxcolors=1 << 16)
    # A page with text, a table and a plot has thousands of colours (anti-aliasing); a blank or
    # error page a handful.
    assert colours is None or len(colours) > 200, f"screenshot {screenshot} has only {len(colours)} colours"
    return screenshot, seconds


@pytest.mark.slow
@pytest.mark.skipif(BROWSER is None, reason=f"chromium not installed: none of {', '.join(BROWSERS)} on PATH "
                    "(apt-get install chromium; .ci/run does)")
def test_compare_view_shows_both_runs_metrics_in_chromium(movielens_comparison, tmp_path):
    screenshot, seconds = check_compare_view(movielens_comparison, BROWSER, tmp_path)
    print(f"compare view screenshot: {screenshot}; seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in seconds.items()))


def page_text_when(tools: DevTools, url: str, condition: str, what: str) -> str:
    """Loads ``url`` (once more after a reload if needed) until the page script ``condition`` holds;
    the page's text."""
    for attempt in range(2):
        tools.call("Page.navigate" if attempt == 0 else "Page.reload", **({"url": url} if attempt == 0 else {}))
        deadline = time.monotonic() + PAGE_READY_S
        while time.monotonic() < deadline:
            if tools.evaluate(f"!!document.body && ({condition})"):
                return tools.evaluate("document.body.innerText")
            time.sleep(0.5)
    text = tools.evaluate("document.body ? document.body.innerText : ''") or ""
    pytest.fail(f"{url} never showed {what}; page text: {text[:1500]!r}")


@pytest.mark.slow
@pytest.mark.skipif(BROWSER is None, reason=f"chromium not installed: none of {', '.join(BROWSERS)} on PATH "
                    "(apt-get install chromium; .ci/run does)")
def test_run_pages_show_the_comparison_its_timelines_and_the_data_used(movielens_comparison, tmp_path):
    """The pages a person opens from compare's printed links: the experiment in the training-runs view,
    the parent run's description (the table and the verdict), its timelines image previewed, and a
    training run's dataset input named with its manifest's digest."""
    import hashlib

    cmp = movielens_comparison
    summary, server = cmp.summary, cmp.tracking_uri
    with headless_chromium(BROWSER, tmp_path) as tools:
        text = page_text_when(tools, summary["experiment_url"], "document.body.innerText.includes('compare-k2-b16')",
                              "the runs table")
        assert "Run Name" in text and "Usage" not in text and "Token Usage" not in text  # not the GenAI overview

        text = page_text_when(tools, summary["parent_run_url"], "document.body.innerText.includes('bubble_reduction')",
                              "the description")
        for shown in ("contiguous", "balanced", "control", "bubble_reduction", "signal", summary["comparison"]):
            assert shown in text, f"{shown!r} not on the parent run's page"

        artifact = summary["parent_run_url"].replace("?", "/artifacts/comparison_timelines.png?")
        page_text_when(tools, artifact, "[...document.images].some(i => i.src.startsWith('blob:') && i.naturalWidth > 600)",
                       "the timelines image")

        variant, (run_id,) = "balanced", cmp.child_run_ids["balanced"]
        digest = hashlib.sha256((Path(summary["shards"][variant]) / "manifest.json").read_bytes()).hexdigest()[:32]
        run_page = summary["parent_run_url"].replace(cmp.parent_run_id, run_id)
        text = page_text_when(tools, run_page, f"document.body.innerText.includes({json.dumps(digest)})",
                              f"the dataset input with digest {digest}")
        assert f"shards:shards-{variant} ({digest})" in text and "Training" in text
    assert server.startswith("http")
