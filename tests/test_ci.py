"""CI fails fast rather than hanging: the suite's own pytest settings (pyproject.toml) end a run whose worker crashes
(a segmentation fault) or whose test hangs inside C code, within a minute, with a non-zero status. Each case runs
pytest in a child process on a tiny test file of its own, with this repository's configuration and two workers as
`make test` runs them."""

import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

CRASH = """
import ctypes, time

def test_crashes():
    ctypes.string_at(0)  # a segmentation fault in this worker

def test_slow_neighbour():
    time.sleep(1)
"""

HANG = """
import time

def test_hangs():
    time.sleep(3600)  # in C (the interpreter's sleep)

def test_fine():
    assert True
"""


def _run(tmp_path, body: str, *extra: str) -> tuple[int, float, str]:
    (tmp_path / "test_case.py").write_text(body)
    start = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-c",
            str(ROOT / "pyproject.toml"),
            "--rootdir",
            str(tmp_path),
            "-q",
            "-n",
            "2",
            "--dist",
            "loadfile",
            "-p",
            "no:cacheprovider",
            *extra,
            str(tmp_path / "test_case.py"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )
    return done.returncode, time.monotonic() - start, done.stdout + done.stderr


def test_a_crashed_worker_ends_the_run_within_a_minute(tmp_path):
    code, seconds, out = _run(tmp_path, CRASH)
    assert code != 0 and seconds < 60, (code, seconds, out[-2000:])
    assert "crashed" in out or "node down" in out, out[-2000:]


def test_a_hung_test_ends_the_run_within_a_minute(tmp_path):
    code, seconds, out = _run(tmp_path, HANG, "--timeout", "5")
    assert code != 0 and seconds < 60, (code, seconds, out[-2000:])
    # the thread method ends the hung worker (its stack dump goes to the worker's stderr), and the run with it
    assert "crashed while running 'test_case.py::test_hangs'" in out, out[-2000:]
