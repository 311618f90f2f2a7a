"""The native kernels' work sharing (kernels/cpu_parallel.h) under preemption: a C++ driver runs many short jobs on
more threads than this machine has cores and checks that each item runs exactly once and is done on return.

A helper delayed between seeing a job and reading its fields once ran the next job's items with a stale claim and
counted them done, so a kernel could return while a helper still wrote its output: heap corruption, a suspect in
test workers crashing inside XLA (issue #42; not the only cause: engine.no_cache_writes). On a busy 2-core machine
the old header failed the 8-thread case in 5 of 6 runs (4 threads and 300000 jobs: 5 of 20); this header passed
20 of 20."""

import os
import shutil
import subprocess

import pytest

KERNELS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "kernels")
DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pool_stress.cc")


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    assert compiler, "the native kernels' tests need a C++ compiler"
    out = str(tmp_path_factory.mktemp("pool") / "pool_stress")
    subprocess.run([compiler, "-O2", "-std=c++17", "-pthread", f"-I{KERNELS}", DRIVER, "-o", out], check=True)
    return out


@pytest.mark.parametrize("threads", [2, 8])
def test_every_item_runs_once_and_is_done_on_return(driver, threads):
    done = subprocess.run(
        [driver, "2000000"],
        env={**os.environ, "SGJAX_CPU_THREADS": str(threads)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("0 faults"), done.stdout
