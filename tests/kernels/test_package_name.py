"""kernels/ installs as sgjax.kernels, but a test run (or PYTHONPATH) puts the repository root on sys.path, where it
would be found as a top-level `kernels`: the name of the distribution transformers >= 5.25 imports."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_root_on_sys_path_leaves_kernels_to_its_distribution_and_transformers_imports():
    code = (
        "import kernels, sgjax.kernels, transformers.activations;"
        "print(kernels.__file__); print(sgjax.kernels.ref_attention.__module__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    installed, module = out.stdout.split()
    assert "site-packages" in installed and not installed.startswith(os.path.join(ROOT, "kernels"))
    assert module == "sgjax.kernels.ref"
