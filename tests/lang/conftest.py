"""One real SmolLM2 engine (fp32, CPU) for every end-to-end test of the frontend."""

import pytest


@pytest.fixture(scope="session")
def engine():
    from sgjax.engine.engine import Engine

    with Engine(max_total_tokens=4096, max_running_requests=8) as eng:
        yield eng


@pytest.fixture(scope="session")
def backend(engine):
    from sgjax.lang.backend.engine import EngineBackend

    return EngineBackend(engine)
