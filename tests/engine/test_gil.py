"""The engine sets Python's thread switch interval (its loop shares the GIL with the caller's threads)."""

import sys

import pytest

from sgjax.engine.engine import Engine
from sgjax.model.presets import MICRO_LLAMA as CFG
from sgjax.model.weights import dummy_weights


@pytest.fixture
def restore_interval():
    before = sys.getswitchinterval()
    yield before
    sys.setswitchinterval(before)


def _engine(**kwargs):
    return Engine.from_weights(CFG, dummy_weights(CFG), max_total_tokens=256, max_running_requests=4, **kwargs)


def test_default_and_explicit_interval(restore_interval):
    sys.setswitchinterval(0.005)
    engine = _engine()
    try:
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        out = engine.generate(input_ids=[[1, 2, 3]], sampling_params={"max_new_tokens": 3, "temperature": 0})
        assert len(out[0]["output_ids"]) == 3
    finally:
        engine.shutdown()
    engine = _engine(gil_switch_interval_ms=2.0)
    engine.shutdown()
    assert sys.getswitchinterval() == pytest.approx(0.002)


def test_none_leaves_the_interpreter_alone(restore_interval):
    sys.setswitchinterval(0.003)
    _engine(gil_switch_interval_ms=None).shutdown()
    assert sys.getswitchinterval() == pytest.approx(0.003)


@pytest.mark.parametrize("value", [0.0, -1.0])
def test_non_positive_interval_is_named(restore_interval, value):
    with pytest.raises(ValueError, match="gil_switch_interval_ms"):
        _engine(gil_switch_interval_ms=value)
