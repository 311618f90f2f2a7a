"""The runtime: requests, scheduler (Algorithm 1), runner (jitted steps), sampler, detokenizer, Engine API."""
