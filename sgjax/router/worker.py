"""`python -m sgjax.router.worker serve ...`: a worker of `sgjax serve --dp-size N`, which is `sgjax serve` plus a
watchdog that kills the process when its launcher is gone.

A launcher that stops normally stops its workers itself (SIGTERM, launch.stop_workers). One killed outright (SIGKILL,
OOM killer) cannot, and its workers would keep their ports and memory with nobody left to route to them. Linux's
PR_SET_PDEATHSIG was tried first: it did not fire here for workers whose launcher had started serving, so a thread
that polls the parent pid once a second does the job portably. SIGKILL, not SIGTERM: the workers' clients were all
behind the dead router, and a SIGTERM can be lost while a worker loads its model (launch.stop_workers).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from sgjax.cli import main as cli_main
from sgjax.router.launch import LAUNCHER_PID_ENV


def watch_parent(parent: int | None = None, interval: float = 1.0) -> threading.Thread:
    """A daemon thread that SIGKILLs this process once its parent is no longer `parent` (the launcher died and the
    process was re-parented). `parent` defaults to $SGJAX_LAUNCHER_PID, else the current parent."""
    if parent is None:
        parent = int(os.environ.get(LAUNCHER_PID_ENV) or os.getppid())

    def watch():
        while os.getppid() == parent:
            time.sleep(interval)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="sgjax-launcher-watch", daemon=True)
    thread.start()
    return thread


def main() -> None:
    watch_parent()
    cli_main(sys.argv[1:])


if __name__ == "__main__":
    main()
