"""The Theorem 3.1 optimum extended to LM programs, whose later prompts send back earlier outputs."""


def test_with_outputs_equals_the_prompt_only_optimum_when_nothing_is_decoded_into_later_prompts():
    import random

    from sgjax.cache.optimal import optimal_computed_tokens, optimal_prompt_tokens_with_outputs

    rng = random.Random(0)
    base = [rng.randrange(50) for _ in range(64)]
    prompts = [
        base[: rng.randrange(1, 64)] + [rng.randrange(50) for _ in range(rng.randrange(0, 40))] for _ in range(40)
    ]
    outputs = [[999] * rng.randrange(0, 8) for _ in prompts]  # a token no prompt contains
    for S in (1, 4, 16):
        assert optimal_prompt_tokens_with_outputs(prompts, outputs, S) == optimal_computed_tokens(prompts, S)


def test_with_outputs_a_fork_after_a_gen_reuses_the_decoded_tokens():
    from sgjax.cache.optimal import optimal_prompt_tokens_with_outputs

    prompt = list(range(32))
    out = list(range(100, 124))  # 24 decoded tokens; the KV of the last one is never computed
    branch = prompt + out + [7, 8]  # the next call sends the decoded text back
    # page 4: the first prompt (32) and the branch's pages lying in prompt+out[:-1] (55 tokens: 3 full pages) are
    # free; its page 4 (tokens 48..51, still decoded) is in prompt+out[:-1] too: 52 tokens would be 13 pages, but
    # only 55 // 4 = 13 full pages exist, so pages 1-13 are free and tokens 52..57 are computed.
    assert optimal_prompt_tokens_with_outputs([prompt, branch], [out, [1]], 4) == 32 + (58 - 52)
    # without the output the same prompts must compute the branch beyond the shared 32 tokens
    assert optimal_prompt_tokens_with_outputs([prompt, branch], [[1], [1]], 4) == 32 + 26
