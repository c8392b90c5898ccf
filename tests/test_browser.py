"""What a person sees: `make lab`'s JupyterLab in a real headless Chromium.

Every notebook opens with its environment's kernel and renders its headings; PyTorch_MultiGPU, on a tiny CPU demo, runs
to the end through the Run menu with no error output, progress bars that update in place and its plots shown. The
screenshot of the finished notebook goes to test-results/browser/. Needs Debian's chromium package and playwright.
"""

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest
from conftest import selected_environments
from notebook_harness import (
    NOTEBOOK_DIR,
    PROGRESS_BAR,
    NotebookContract,
    execute,
    marks,
    noise,
    without_pytest_marker,
)

from common.run import environments

ROOT = Path(__file__).parent.parent
SCREENSHOTS = ROOT / "test-results" / "browser"
CHROMIUM = Path("/usr/bin/chromium")
NEEDS = "The browser test needs Debian's chromium package (apt-get install chromium) and playwright (requirements.txt)."
# Root needs --no-sandbox; the rest keeps Chromium off the network, which a closed CI machine does not have.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]
# The user's own settings would change what the page shows. The news prompt would cover the notebook, and windowing
# would leave the cells out of view unrendered, so their headings and outputs could not be read.
LAB_SETTINGS = {
    "apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    "notebook-extension/tracker": {"windowingMode": "none"},
}
# NotebookContract's run takes ten minutes on 2 busy cores; 32-pixel images and two epochs still draw both plots.
TINY = {**NotebookContract.TINY, "DEVICES": 1, "EPOCHS": 2, "IMAGE_SIZE": 32}
RUN_TIMEOUT_S = 600
# tqdm redraws one line per bar; a bar printed line by line would give one line per step (about 35 an epoch here).
MAX_TRAIN_LINES = 20
# A bound on the image's height; the tiny run's notebook is about 8,000 pixels tall.
MAX_SCREENSHOT_HEIGHT = 16000


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip(f"playwright is not installed. {NEEDS}")
    if not CHROMIUM.is_file():
        pytest.skip(f"{CHROMIUM} is missing. {NEEDS}")
    with sync_playwright() as playwright:
        # executable_path keeps Playwright from downloading a browser of its own.
        launched = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield launched
        launched.close()


class Lab:
    """A JupyterLab server on localhost serving copies of the notebooks from ``root``."""

    def __init__(self, root: Path, home: Path):
        self.root = root
        self.token = secrets.token_hex(16)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ServerApp.ip=127.0.0.1"]
        command += [f"--ServerApp.port={self.port}", f"--IdentityProvider.token={self.token}"]
        command += [f"--ServerApp.root_dir={root}", "--LabApp.news_url=None", "--LabApp.extension_manager=readonly"]
        self.log = (home / "lab.log").open("w")
        self.process = subprocess.Popen(
            command, env=lab_env(home), stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def api(self, path: str, method: str = "GET"):
        request = urllib.request.Request(
            f"{self.url}/api/{path}", method=method, headers={"Authorization": f"token {self.token}"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            body = response.read()
        return json.loads(body) if body else None

    def wait_until_up(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"jupyter lab exited:\n{self.log_tail()}"
            try:
                self.api("status")
                return
            except OSError:
                time.sleep(0.5)
        raise AssertionError(f"jupyter lab did not answer within {timeout} s:\n{self.log_tail()}")

    def shut_down_kernels(self) -> None:
        """Interrupt first: a cell that launched torchrun stops its workers only on an interrupt."""
        for kernel in self.api("kernels"):
            self.api(f"kernels/{kernel['id']}/interrupt", "POST")
        time.sleep(1)
        for kernel in self.api("kernels"):
            self.api(f"kernels/{kernel['id']}", "DELETE")

    def stop(self) -> None:
        try:
            self.shut_down_kernels()
        except OSError:
            pass
        # SIGTERM lets the server shut down any kernel left; the group kill is for a server that hangs.
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.log.close()

    def log_tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-3000:]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def lab_env(home: Path) -> dict[str, str]:
    """Jupyter's folders under ``home``, so the user's config, settings and saved workspace stay out of the run; its
    kernels show what they write to file descriptor 2, as a user's do."""
    folders = {
        "JUPYTER_CONFIG_DIR": home / "config",
        "JUPYTER_DATA_DIR": home / "data",
        "JUPYTER_RUNTIME_DIR": home / "runtime",
        "JUPYTERLAB_SETTINGS_DIR": home / "settings",
        "JUPYTERLAB_WORKSPACES_DIR": home / "workspaces",
    }
    for plugin, values in LAB_SETTINGS.items():
        path = folders["JUPYTERLAB_SETTINGS_DIR"] / "@jupyterlab" / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    return {**without_pytest_marker(), **{name: str(folder) for name, folder in folders.items()}}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    root = tmp_path_factory.mktemp("lab-root")
    for notebook in NOTEBOOK_DIR.glob("*.ipynb"):
        shutil.copy(notebook, root)
    server = Lab(root, tmp_path_factory.mktemp("lab-home"))
    try:
        server.wait_until_up()
        yield server
    finally:
        server.stop()


def kernel_display_name(notebook: str) -> str:
    return environments.for_notebook(notebook.removesuffix(".ipynb").removesuffix("-tiny")).display_name


def start_opening(browser, lab: Lab, name: str):
    """A new page opening notebook ``name`` in a workspace of its own, emptied first (``reset``), so that pages open
    side by side show one notebook each; its kernel starts on the server."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    workspace = re.sub(r"\W", "-", name)
    page.goto(f"{lab.url}/lab/workspaces/{workspace}/tree/{name}?reset&token={lab.token}")
    return page


def wait_until_ready(page, name: str) -> None:
    page.locator("#jp-main-statusbar").get_by_text(f"{kernel_display_name(name)} | Idle").wait_for(timeout=120_000)


def open_notebook(browser, lab: Lab, name: str):
    """A new page showing notebook ``name`` once its kernel is up."""
    page = start_opening(browser, lab, name)
    wait_until_ready(page, name)
    # The file browser would take a quarter of the screenshot's width.
    page.keyboard.press("Control+b")
    return page


def markdown_headings(path: Path, level: int = 2) -> list[str]:
    """The headings of ``level`` in the notebook's markdown cells; a ``#`` line inside a code block is no heading."""
    headings = []
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type != "markdown":
            continue
        fenced = False
        for line in cell.source.splitlines():
            fenced ^= line.lstrip().startswith("```")
            if not fenced and line.startswith("#" * level + " "):
                headings.append(line[level + 1 :].strip())
    return headings


def rendered_headings(page, level: int = 2) -> list[str]:
    return [text.strip() for text in page.locator(f".jp-MarkdownCell .jp-RenderedMarkdown h{level}").all_inner_texts()]


NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def shown_on_opening(page) -> dict:
    """What an opened notebook's page shows: the kernel's name, the headings, the tabs marked modified, the code cells
    shown collapsed."""
    return {
        "kernel": page.locator(".jp-NotebookPanel-toolbar .jp-KernelName").inner_text().strip(),
        "headings": rendered_headings(page),
        "modified": page.locator(".lm-TabBar-tab.jp-mod-dirty").count(),
        "collapsed": page.locator(".jp-CodeCell .jp-InputPlaceholder").count(),
    }


@pytest.fixture(scope="module")
def opened(browser, lab):
    """Every notebook of the selected environments, opened all at once (their kernels start side by side, in the time
    one takes alone on an idle machine), then read page by page: ``{notebook: what it shows, or what went wrong}``."""
    selected = [path.name for path in NOTEBOOKS if environments.for_notebook(path.stem).name in selected_environments()]
    pages = {name: start_opening(browser, lab, name) for name in selected}
    shown = {}
    try:
        for name, page in pages.items():
            try:
                wait_until_ready(page, name)
                shown[name] = shown_on_opening(page)
            except Exception as error:  # raised again by that notebook's test
                shown[name] = error
    finally:
        for page in pages.values():
            page.close()
        lab.shut_down_kernels()
    return shown


@pytest.mark.parametrize("notebook", [pytest.param(path.name, marks=marks(path.stem)) for path in NOTEBOOKS])
def test_notebook_opens_with_its_environments_kernel_and_its_headings(opened, lab, notebook):
    shown = opened[notebook]
    if isinstance(shown, Exception):
        raise shown
    assert shown["kernel"] == kernel_display_name(notebook)
    assert shown["headings"] == markdown_headings(lab.root / notebook)
    # opening it changed nothing (a notebook saved without the kernel's whole language_info is marked modified)
    assert shown["modified"] == 0
    # the exercises' answers open collapsed: JupyterLab shows a placeholder instead of their code
    cells = nbformat.read(lab.root / notebook, as_version=4).cells
    answers = sum("answer" in cell.metadata.get("tags", []) for cell in cells)
    assert answers and shown["collapsed"] == answers


def run_all_cells(page) -> None:
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()


def expand_all_code(page) -> None:
    """A collapsed cell (the exercises' answers) shows neither its code nor its prompt: expanded, every cell shows when
    it has run."""
    page.get_by_role("menuitem", name="View", exact=True).click()
    page.get_by_role("menuitem", name="Expand All Code", exact=True).click()


def prompts(page) -> list[str]:
    return [text.strip() for text in page.locator(".jp-CodeCell .jp-InputArea-prompt").all_inner_texts()]


def outputs(page) -> list[dict]:
    """Every code cell's source and outputs as the page shows them: mime type, text and number of images."""
    return page.evaluate(
        """() => [...document.querySelectorAll('.jp-CodeCell')].map(cell => ({
            source: cell.querySelector('.jp-InputArea-editor').innerText,
            outputs: [...cell.querySelectorAll('.jp-OutputArea-output')].map(out => ({
                mime: out.getAttribute('data-mime-type'),
                text: out.innerText,
                images: out.querySelectorAll('img').length,
            })),
        }))"""
    )


def stderr_beyond_progress(cells: list[dict]) -> list[str]:
    """What cells wrote to stderr other than progress bars: warnings and tracebacks, which JupyterLab shows alike."""
    found = []
    for cell in cells:
        for out in cell["outputs"]:
            if out["mime"] == "application/vnd.jupyter.stderr":
                found += noise(out["text"])
    return found


def wait_until_finished(page, timeout: float) -> None:
    """Until every code cell has run; an error stops Run All, so stderr other than progress ends the wait too."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        shown = prompts(page)
        if all(re.fullmatch(r"\[\d+\]:", prompt) for prompt in shown):
            return
        if stderr_beyond_progress(outputs(page)):
            return
        page.wait_for_timeout(2000)
    raise AssertionError(f"the notebook did not finish within {timeout} s; prompts: {shown}")


def save_screenshot(page, path: Path) -> None:
    """The whole notebook in one image: JupyterLab scrolls inside the page, so the page grows to fit the last cell."""
    scroller = page.locator(".jp-NotebookPanel .jp-WindowedPanel-outer")
    for _ in range(5):
        overflow = scroller.evaluate(
            """element => { element.scrollTo({top: 0, behavior: 'instant'});
                const last = [...element.querySelectorAll('.jp-Cell')].pop();
                return last.getBoundingClientRect().bottom - element.getBoundingClientRect().bottom }"""
        )
        height = page.viewport_size["height"]
        if overflow <= 0 or height >= MAX_SCREENSHOT_HEIGHT:
            break
        page.set_viewport_size({"width": 1280, "height": min(height + int(overflow) + 20, MAX_SCREENSHOT_HEIGHT)})
        page.wait_for_timeout(500)
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=path)
    print(f"screenshot: {path}")


@pytest.fixture(scope="module")
def finished(browser, lab, notebook_data):
    """PyTorch_MultiGPU run to the end through the Run menu: its cells as the page shows them."""
    name = "PyTorch_MultiGPU"
    execute(name, notebook_data, lab.root, output=lab.root / f"{name}-tiny.ipynb", prepare_only=True, **TINY)
    page = open_notebook(browser, lab, f"{name}-tiny.ipynb")
    try:
        expand_all_code(page)
        run_all_cells(page)
        wait_until_finished(page, RUN_TIMEOUT_S)
        yield outputs(page)
    finally:
        save_screenshot(page, SCREENSHOTS / f"{name}.png")
        page.close()


@marks("PyTorch_MultiGPU")
def test_run_shows_no_error_or_warning(finished):
    assert not stderr_beyond_progress(finished)


@marks("PyTorch_MultiGPU")
def test_training_progress_updates_in_place(finished):
    texts = ["".join(out["text"] for out in cell["outputs"]) for cell in finished]
    text = next((text for text in texts if re.search(r"^epoch 1\b", text, re.MULTILINE)), None)
    assert text and PROGRESS_BAR.search(text), "no training progress bar in any output"
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) <= MAX_TRAIN_LINES, f"{len(lines)} lines of progress:\n" + "\n".join(lines[:40])


@marks("PyTorch_MultiGPU")
def test_plots_are_displayed(finished):
    plots = [cell["source"].splitlines()[0] for cell in finished if any(out["images"] for out in cell["outputs"])]
    # The training curves and, in Record, the utilization over the run.
    assert len(plots) >= 2, plots
