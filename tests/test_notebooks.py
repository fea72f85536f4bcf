"""Execute every notebook (jupytext py:percent source -> nbclient, real kernel) on the tiny checkpoint, twice: the
default path a user gets (no ``OMNILAB_THREADS``: on few cores the stages share this process) and one thread per
stage (``OMNILAB_THREADS=1``: the stages split the CPUs and run in worker processes).

Each notebook must run without an error or any stderr output and show what it is for: images (plots) everywhere,
audio players where it makes sound, and the text each cell promises (``PROMISES``: trace invariants that hold, a
batch that really batches, the profile read back where each stage runs, the tiny checkpoint named as tiny), and
never a broken invariant. Executed copies go to ``$OMNILAB_NB_OUT`` (default: a tmp dir).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from _deps import need  # noqa: E402

jupytext = need("jupytext")
nbclient = need("nbclient")
need("ipykernel")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
WANTS = {"00_quickstart": {"audio", "image"}, "01_stepwise_talker_and_code2wav": {"audio", "image"},
         "02_latency_and_threads": {"image"}, "03_deploy_profiles": {"image"}, "04_benchmark_analysis": {"image"},
         "05_quantization": {"audio", "image"}, "06_scale_out": {"audio", "image"}}

# text some output of the notebook must contain (what its cells say they show)
PROMISES = {"00_quickstart": ["tiny custom_voice", "<b>SynthesisResult</b>", "quickstart.wav"],
            "01_stepwise_talker_and_code2wav": ["trace invariants: all hold", "max |chunked - full| ="],
            "02_latency_and_threads": ["max_num_seqs 2 | the talker steps of the two requests overlap: True",
                                       "% of talker step time", "stream.perfetto.json"],
            "03_deploy_profiles": ["placement: ", "read-back CPUs", "applied threads", "before:", "after: "],
            "04_benchmark_analysis": ["ttfa_ms"],
            "05_quantization": ["checkpoint: ", "c0_agreement"],
            "06_scale_out": ["utterances_per_s", "audio_s_per_s", "redone: ('utt03', 'utt07')",
                             "frames equal before the first difference", "talker-rank1", "no memory-bandwidth gain"]}
NEVER = ("broken", "outside the request span", "0b6 custom_voice", "Traceback")

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


def _text(nb) -> tuple[str, list[str]]:
    """(every text output joined, the stderr outputs)."""
    text, stderr = [], []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                (stderr if out.get("name") == "stderr" else text).append(out.get("text", ""))
            data = out.get("data", {})
            text += [str(data.get(k, "")) for k in ("text/plain", "text/html")]
    return "\n".join(text), stderr


@pytest.mark.parametrize("mode", ["inprocess", "workers"])
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, mode, tmp_path, monkeypatch):
    monkeypatch.setenv("OMNILAB_TINY", "1")
    if mode == "workers":  # one thread per stage: the profile splits the CPUs, the stages run in worker processes
        monkeypatch.setenv("OMNILAB_THREADS", os.environ.get("OMNILAB_THREADS", "1"))
    else:  # what a user gets: the auto profile of this machine
        monkeypatch.delenv("OMNILAB_THREADS", raising=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend makes PNG outputs
    nb = jupytext.read(path)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    out_dir = Path(os.environ.get("OMNILAB_NB_OUT", tmp_path))
    out_dir.mkdir(parents=True, exist_ok=True)
    jupytext.write(nb, out_dir / f"{path.stem}-{mode}.ipynb")
    assert WANTS[path.stem] <= _kinds(nb), f"{path.stem} lacks {WANTS[path.stem] - _kinds(nb)}"
    text, stderr = _text(nb)
    assert not stderr, f"{path.stem} ({mode}) wrote to stderr:\n" + "".join(stderr)[:4000]
    missing = [p for p in PROMISES[path.stem] if p not in text]
    assert not missing, f"{path.stem} ({mode}) does not show {missing}"
    shown = [n for n in NEVER if n in text]
    assert not shown, f"{path.stem} ({mode}) shows {shown}"
