"""Execute every notebook (jupytext py:percent source -> nbclient, real kernel) on the tiny checkpoint.

Each notebook must run without an error and show what it is for: images (plots) everywhere, audio
players where it makes sound. Executed copies go to ``$OMNILAB_NB_OUT`` (default: a tmp dir).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
WANTS = {"00_quickstart": {"audio", "image"}, "01_stepwise_talker_and_code2wav": {"audio", "image"},
         "02_latency_and_threads": {"image"}, "03_deploy_profiles": {"image"}, "04_benchmark_analysis": {"image"},
         "05_quantization": {"audio", "image"}}

pytestmark = [pytest.mark.notebook, pytest.mark.slow]


def test_every_notebook_is_listed():
    assert {p.stem for p in NOTEBOOKS} == set(WANTS)
    assert (ROOT / "notebooks" / "jupytext.toml").is_file()


def _kinds(nb) -> set[str]:
    kinds = set()
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            assert out.get("output_type") != "error", out
            data = out.get("data", {})
            if "image/png" in data:
                kinds.add("image")
            if "<audio" in str(data.get("text/html", "")):
                kinds.add("audio")
    return kinds


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, tmp_path, monkeypatch):
    monkeypatch.setenv("OMNILAB_TINY", "1")
    monkeypatch.setenv("OMNILAB_THREADS", os.environ.get("OMNILAB_THREADS", "1"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend makes PNG outputs
    nb = jupytext.read(path)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    out_dir = Path(os.environ.get("OMNILAB_NB_OUT", tmp_path))
    out_dir.mkdir(parents=True, exist_ok=True)
    jupytext.write(nb, out_dir / f"{path.stem}.ipynb")
    assert WANTS[path.stem] <= _kinds(nb), f"{path.stem} lacks {WANTS[path.stem] - _kinds(nb)}"
