"""The checkout's ``kernels/`` directory is ``moe_offload.kernels`` and never the top-level ``kernels``.

transformers >= 5.25 depends on the ``kernels`` distribution and imports it from its model files; with a
regular package at the checkout's ``kernels/`` any Python started in the checkout (``python -m pytest``,
``python -m moe_offload``) imported ours instead and every model build failed. The directory has no
``__init__.py``: a namespace portion loses to the installed distribution.
"""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import importlib.util, pathlib, sys
root = pathlib.Path(sys.argv[1]).resolve()
spec = importlib.util.find_spec("kernels")
# a regular package has an origin (its __init__.py); a namespace portion has none and loses to an install
ours = spec is not None and spec.origin is not None and pathlib.Path(spec.origin).resolve().parent == root / "kernels"
print("SHADOWED" if ours else "CLEAN", spec and spec.origin)
import moe_offload.kernels.fused_moe as fm
print(pathlib.Path(fm.__file__).resolve().parent == root / "kernels")
"""


def test_a_python_started_in_the_checkout_does_not_import_its_kernels_directory_as_kernels():
    out = subprocess.run([sys.executable, "-c", PROBE, str(ROOT)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.split("\n")[:2]
    assert first.startswith("CLEAN"), first
    assert second == "True", out.stdout


def test_the_kernels_directory_has_no_init_module():
    assert (ROOT / "kernels" / "fused_moe.py").is_file()
    assert not (ROOT / "kernels" / "__init__.py").exists()
