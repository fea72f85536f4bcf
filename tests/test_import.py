"""``import omnilab`` stays light: no vllm, matplotlib, ipywidgets (nor torch) at import time."""
import subprocess
import sys


def test_import_omnilab_is_light():
    code = ("import sys, omnilab; heavy = [m for m in ('vllm', 'matplotlib', 'ipywidgets', 'torch') "
            "if m in sys.modules]; print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"import omnilab pulled in: {out.stdout.strip()}"


def test_public_names_resolve_lazily():
    code = "import omnilab; print(omnilab.Pipeline.__name__, omnilab.make_random_checkpoint.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["Pipeline", "make_random_checkpoint"]
