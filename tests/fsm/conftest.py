"""Vocabularies for the FSM tests (hypothesis settings live in fsm_helpers.SETTINGS, not a global profile)."""

import pytest


@pytest.fixture(scope="session")
def toy_vocab():
    from fsm_helpers import TOY

    return TOY


@pytest.fixture(scope="session")
def smollm2_vocab():
    from sgjax.fsm.vocab import load_vocabulary

    return load_vocabulary()
