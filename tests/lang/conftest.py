"""One real SmolLM2 engine (fp32, CPU) for every end-to-end test of the frontend, and checks shared by the tests of
every backend."""

import pytest

import sgjax as sgl
from tests.conftest import SMALL


@pytest.fixture(scope="session")
def engine():
    from sgjax.engine.engine import Engine

    # The settings of the session's server (tests/conftest.py), so both run the same batches and compiled steps.
    with Engine(**SMALL) as eng:
        yield eng


@pytest.fixture(scope="session")
def backend(engine):
    from sgjax.lang.backend.engine import EngineBackend

    return EngineBackend(engine)


@sgl.function
def moon_line(s):
    s += sgl.user("Write a line about the moon.")
    s += sgl.assistant(sgl.gen("line", max_tokens=10))


def assert_streams_as_a_whole_run(backend):
    """A streamed gen arrives in several pieces that add up to the value of the same run without streaming."""
    state = moon_line.run(backend=backend, temperature=0, stream=True)
    chunks = list(state.text_iter("line"))
    assert len(chunks) > 1
    assert "".join(chunks) == state["line"] == moon_line.run(backend=backend, temperature=0)["line"]
    return state
