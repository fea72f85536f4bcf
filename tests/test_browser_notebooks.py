"""Every notebook as a user runs it: JupyterLab on 127.0.0.1, headless Chromium (Debian's ``chromium`` through
Playwright), each ``notebooks/*.py`` opened by its URL (the default viewer: jupytext's notebook, not the text
editor), Run All on the tiny checkpoint in the default in-process placement (no ``OMNILAB_THREADS``).

Asserted per notebook: it opened as a notebook with the ``omnilab`` kernel; no error and no stderr output in any
cell; every ``<audio>`` element decodes (duration > 0); every widget renders (no "Loading widget", no
"Error displaying widget", no text repr such as ``HBox(children=``); images are present and decoded. In notebook
00 the live player's play button is pressed as soon as it appears, and its position must keep advancing (never
reset) across at least two chunk arrivals and reach the end of the audio.

Needs ``playwright`` (the dev extra) and a chromium binary (``.ci/run`` installs Debian's); skipped, saying so,
when either is missing, and failed under ``CI=true`` (tests/_deps.py). Playwright downloads no browser here: it drives the system chromium.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from _deps import need, need_program  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.notebook]

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
AUDIO = {"00_quickstart", "01_stepwise_talker_and_code2wav", "05_quantization"}
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--autoplay-policy=no-user-gesture-required", "--mute-audio"]
BAD_TEXT = ("Loading widget", "Error displaying widget", "model not found", "HBox(children=", "VBox(children=",
            "Traceback (most recent call last)")

sync_api = need("playwright.sync_api", "playwright is not installed (the dev extra)")
need("jupyterlab", "jupyterlab is not installed (the notebook extra)")
need("jupytext", "jupytext is not installed (the notebook extra)")
need_program("chromium", "apt-get install chromium; .ci/run does", path=CHROMIUM)

# Presses the live player's play button the moment it appears and samples its position every 10 ms.
INIT_JS = """
window.__omnilab = {samples: []};
const press = () => {
  const b = document.querySelector('.omnilab-live-play');
  if (b && !b.dataset.pressed) { b.dataset.pressed = '1'; b.click(); }
};
new MutationObserver(press).observe(document, {childList: true, subtree: true});
setInterval(() => {
  press();
  const el = document.querySelector('.omnilab-live');
  if (el && el.dataset.chunks !== undefined)
    window.__omnilab.samples.push([+el.dataset.chunks, +el.dataset.positionS, +el.dataset.scheduledS]);
}, 10);
"""
KERNEL_IDLE_JS = """() => {
  const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
  return !!k && k.status === 'idle';
}"""
KERNEL_JS = """() => {
  const w = window.jupyterapp.shell.currentWidget;
  return {kernel: w.sessionContext.session.kernel.name, notebook: !!w.content && 'widgets' in w.content};
}"""
DONE_JS = """() => {
  const w = window.jupyterapp.shell.currentWidget;
  const code = w.content.widgets.filter(c => c.model.type === 'code');
  const k = w.sessionContext.session.kernel;
  const failed = document.querySelector('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]');
  return !!failed || (k.status === 'idle' && code.every(c => c.model.executionCount !== null));
}"""
OUTPUTS_JS = """async () => {
  const outs = [...document.querySelectorAll('.jp-NotebookPanel .jp-OutputArea-output')];
  const stderr = outs.filter(o => o.dataset.mimeType === 'application/vnd.jupyter.stderr').map(o => o.innerText);
  const imgs = [...document.querySelectorAll('.jp-NotebookPanel .jp-OutputArea-output img')];
  await Promise.all(imgs.map(i => i.complete ? null : new Promise(r => { i.onload = r; i.onerror = r; })));
  const audios = [...document.querySelectorAll('.jp-NotebookPanel .jp-OutputArea-output audio')];
  const durations = await Promise.all(audios.map(a => a.readyState >= 1 && a.duration > 0 ? a.duration :
    new Promise(r => {
      a.addEventListener('loadedmetadata', () => r(a.duration));
      a.addEventListener('error', () => r(-1));
      setTimeout(() => r(a.duration || 0), 10000);
      a.load();
    })));
  const nb = window.jupyterapp.shell.currentWidget.context.model.toJSON();
  const all = nb.cells.flatMap(c => c.outputs || []);
  const widgets = all.filter(o => o.data && o.data['application/vnd.jupyter.widget-view+json']).length;
  for (const o of all) {  // the saved outputs too, rendered or not
    if (o.output_type === 'error') stderr.push(o.ename + ': ' + o.evalue);
    if (o.output_type === 'stream' && o.name === 'stderr') stderr.push([].concat(o.text).join(''));
  }
  return {stderr, text: outs.map(o => o.innerText).join('\\n'), images: imgs.map(i => i.naturalWidth),
          audio: durations, widgets,
          live: document.querySelectorAll('.omnilab-live').length};
}"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on a copy of the notebooks: ``(base_url, token)``."""
    root = tmp_path_factory.mktemp("lab-root")
    for p in [*NOTEBOOKS, ROOT / "notebooks" / "jupytext.toml"]:
        shutil.copy(p, root / p.name)
    home = tmp_path_factory.mktemp("lab-home")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNILAB_") or k in (
        "OMNILAB_CACHE", "OMNILAB_PLAN_TIMING", "OMNILAB_CPU_GEMV", "OMNILAB_CPU_SNAKE", "OMNILAB_CPU_QGEMV",
        "OMNILAB_DTYPE")}
    env.pop("MPLBACKEND", None)  # the kernel's inline backend makes PNG outputs
    env.update(OMNILAB_TINY="1", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
               JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTERLAB_SETTINGS_DIR=str(home / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"), JUPYTER_RUNTIME_DIR=str(home / "runtime"))
    if not (Path(sys.prefix) / "share/jupyter/kernels/omnilab/kernel.json").is_file():
        # scripts/setup.sh registers it; without that, this interpreter under the same name
        spec = home / "data/kernels/omnilab"
        spec.mkdir(parents=True)
        (spec / "kernel.json").write_text(json.dumps({
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Python (omnilab)", "language": "python"}))
        env["JUPYTER_DATA_DIR"] = str(home / "data")
    port, token = _free_port(), secrets.token_hex(16)
    log = open(home / "lab.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
         f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
         f"--ServerApp.root_dir={root}", "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         *(["--allow-root"] if os.geteuid() == 0 else [])],
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2).read()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail("JupyterLab did not start:\n" + (home / "lab.log").read_text()[-3000:])
            time.sleep(0.5)
    yield base, token
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with sync_api.sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=CHROMIUM, headless=True,
            args=CHROMIUM_ARGS, viewport={"width": 1400, "height": 1000})
        ctx.add_init_script(INIT_JS)
        yield ctx
        ctx.close()


def _check_live_player(page) -> None:
    """The position never goes back and keeps advancing across two or more chunk arrivals, to the end."""
    page.wait_for_function("""() => { const el = document.querySelector('.omnilab-live');
        if (!el) return false;
        const total = window.__omnilab.samples.length ? window.__omnilab.samples.at(-1)[2] : 0;
        return total > 0 && +el.dataset.positionS >= total - 0.06; }""", timeout=30_000)
    samples = page.evaluate("window.__omnilab.samples")
    pos = [s[1] for s in samples]
    assert all(b >= a - 1e-6 for a, b in zip(pos, pos[1:])), "the live player's position went back"
    started = next((i for i, p in enumerate(pos) if p > 0), None)
    assert started is not None, "the live player never played (position stayed at 0)"
    arrivals = [i for i in range(max(started, 1), len(samples)) if samples[i][0] > samples[i - 1][0]]
    assert len(arrivals) >= 2, f"chunks arrived during playback: {len(arrivals)} (samples from {started})"
    for i in arrivals:  # playback goes on past each arrival
        assert pos[-1] > pos[i], (i, pos[i], pos[-1])
    assert samples[-1][0] >= 3 and pos[-1] > samples[arrivals[0]][2]


def _check_reopened(page, base: str, token: str, path: Path) -> None:
    """Saved and reopened (a new kernel, no widget model in it): the live player comes back from the saved widget
    state, the static player of the final audio still plays, and nothing says "model not found"."""
    page.evaluate("window.jupyterapp.commands.execute('docmanager:save')")
    page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext.shutdown()")
    page.goto(f"{base}/lab/workspaces/{path.stem}-reopened/tree/{path.name}?reset&token={token}")
    page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output", timeout=90_000)
    page.wait_for_selector(".omnilab-live", timeout=30_000)
    try:  # widgets render one after another from the saved state: give the others the same 30 s, then judge
        page.wait_for_function("() => !document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)')"
                               ".innerText.includes('Loading widget')", timeout=30_000, polling=250)
    except Exception:  # playwright's TimeoutError: the assertion below names what is still showing
        pass
    out = page.evaluate(OUTPUTS_JS)
    bad = [b for b in BAD_TEXT if b in out["text"]]
    assert not bad, f"reopened {path.stem}: outputs show {bad}"
    assert out["audio"] and min(out["audio"]) > 0 and out["live"] == 1, out


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_in_the_browser(lab, browser, path):
    base, token = lab
    page = browser.new_page()
    try:
        # a fresh workspace per notebook (no tabs restored from the previous one), the file opened by its URL: the
        # default viewer decides what opens it, and it must be a notebook, not the text editor
        page.goto(f"{base}/lab/workspaces/{path.stem}/tree/{path.name}?reset&token={token}")
        page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell", timeout=90_000)
        page.wait_for_function(KERNEL_IDLE_JS, timeout=120_000)
        info = page.evaluate(KERNEL_JS)
        assert info == {"kernel": "omnilab", "notebook": True}, info
        t0 = time.monotonic()
        page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
        page.wait_for_function(DONE_JS, timeout=240_000, polling=250)
        print(f"{path.stem}: ran in {time.monotonic() - t0:.1f} s")
        if path.stem == "00_quickstart":
            _check_live_player(page)
        out = page.evaluate(OUTPUTS_JS)
        assert not out["stderr"], f"{path.stem}: stderr/error output:\n" + "\n---\n".join(out["stderr"])[:4000]
        bad = [b for b in BAD_TEXT if b in out["text"]]
        assert not bad, f"{path.stem}: outputs show {bad}"
        assert out["images"] and min(out["images"]) > 0, f"{path.stem}: images {out['images']}"
        if path.stem in AUDIO:
            assert out["audio"] and min(out["audio"]) > 0, f"{path.stem}: audio durations {out['audio']}"
        if path.stem == "00_quickstart":
            assert out["live"] == 1 and out["widgets"] >= 1, out["widgets"]  # the player rendered as a widget
            _check_reopened(page, base, token, path)
    finally:
        page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext.shutdown()")  # free its pipeline
        page.close()
