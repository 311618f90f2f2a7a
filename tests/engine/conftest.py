"""Engine test fixtures: 16 mixed-length prompts with shared prefixes and their HF greedy continuations, and engines
over the tiny random model."""

import pytest

from tests.conftest import SMALL

FEW_SHOT = (
    "Answer each question with one word.\n"
    "Q: What color is the sky on a clear day?\nA: Blue\n"
    "Q: What animal says moo?\nA: Cow\n"
    "Q: What is frozen water called?\nA: Ice\n"
)
CHAT = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"

PROMPTS = (
    [
        FEW_SHOT + f"Q: {q}\nA:"
        for q in (
            "What do bees make?",
            "What is the opposite of hot?",
            "Which planet do we live on?",
            "What do cows drink?",
            "What falls from clouds when it rains?",
        )
    ]
    + [
        CHAT + f"{m}<|im_end|>\n<|im_start|>assistant\n"
        for m in ("Say hello.", "Name a fruit.", "What is the capital of Italy?", "Write a short poem about the sea.")
    ]
    + [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village,",
        "Water boils at",
        "The quick brown fox",
        "Hello",
        "In machine learning, a transformer is a model that",
    ]
)
NEW_TOKENS = 12


@pytest.fixture(scope="session")
def prompt_ids(smollm2_tokenizer):
    return [smollm2_tokenizer.encode(p) for p in PROMPTS]


def tiny_engine(tiny, **server_args):
    """An engine over the tiny random model (the `tiny` fixture) with the shared settings, overridden by
    server_args: engines with the same settings reuse each other's compiled steps."""
    from sgjax.engine.engine import Engine

    return Engine.from_weights(*tiny, **{**SMALL, **server_args})


@pytest.fixture(scope="session")
def hf_greedy(hf_smollm2, prompt_ids):
    """HF transformers' greedy continuation (new token ids, EOS included) of every prompt."""
    from tests.conftest import hf_generate_greedy

    return hf_generate_greedy(hf_smollm2, prompt_ids, NEW_TOKENS)
