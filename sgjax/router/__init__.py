"""The data-parallel router (the paper's Appendix A.4, SGLang's sgl-router): several `sgjax serve` workers behind one
HTTP endpoint that sends each request to the worker most likely to hold its prefix in cache.

meta_tree  the router's picture of the workers' caches: one radix tree, workers per node, per-worker LRU and bound
policy     cache_aware, round_robin, shortest_queue, random: pure choices over a snapshot of the workers
keys       the tree key of a request body (characters of its text, or its token ids)
proxy      workers' health and load, forwarding with fail-over, stream relay
app        the routes (FastAPI)
launch     `sgjax router` and `sgjax serve --dp-size N` (worker processes, signals)
process    a router or launcher in a child process (tests, scripts/perf/bench_router.py)
"""
