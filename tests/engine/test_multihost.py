"""Multi-host tensor parallelism (engine/distributed.py) on one machine: two `sgjax serve` processes, 2 CPU devices
each, joined by jax.distributed on 127.0.0.1 with gloo collectives. Rank 0 serves HTTP; rank 1 follows its steps.

The model is random weights of a tiny llama config (tests/conftest.py TINY_CHECKPOINT, --load-format dummy) with
SmolLM2's tokenizer: 4 heads and 2 KV heads split over the 4 devices of the two processes."""

import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np
import pytest

from sgjax.server.process import free_ports
from tests.conftest import TINY_SERVE
from tests.server.conftest import REPO

FLAGS = [
    *(x for name, value in TINY_SERVE.items() for x in ("--" + name.replace("_", "-"), str(value))),
    "--load-format",
    "dummy",
    "--skip-server-warmup",
    "--precompile",
]
PROMPT, PARAMS = "The capital of France is", {"max_new_tokens": 8, "temperature": 0.0}


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return tiny_checkpoint


def _env(devices: int) -> dict:
    import jax

    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    return {
        **env,
        "JAX_PLATFORMS": "cpu",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "JAX_NUM_CPU_DEVICES": str(devices),
        "JAX_COMPILATION_CACHE_DIR": jax.config.jax_compilation_cache_dir,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


class Rank:
    """One `sgjax serve` process in its own process group (killed as a group at the end), its output in a file."""

    def __init__(self, flags, port):
        self.port = port
        self.log = tempfile.NamedTemporaryFile("w+", prefix="sgjax-mh-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sgjax.cli", "serve", "--port", str(port), *flags],
            cwd=REPO,
            env=_env(2),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def text(self) -> str:
        with open(self.log.name) as f:
            return f.read()[-5000:]

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


def start_pair(model_dir, smollm2_path, *extra):
    coordinator, http, other_http = free_ports(2, 1, 1)  # the coordinator's port + 1 carries liveness
    addr = f"127.0.0.1:{coordinator}"
    common = [
        *FLAGS,
        "--model-path",
        model_dir,
        "--tokenizer-path",
        smollm2_path,
        "--tp-size",
        "4",
        "--nnodes",
        "2",
        "--dist-init-addr",
        addr,
        *extra,
    ]
    ranks = [Rank([*common, "--node-rank", "0"], http), Rank([*common, "--node-rank", "1"], other_http)]
    url = f"http://127.0.0.1:{http}"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        for r in ranks:
            if r.proc.poll() is not None:
                raise RuntimeError(f"rank exited with {r.proc.returncode}:\n{r.text()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return ranks, url
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise TimeoutError("\n---\n".join(r.text() for r in ranks))


@pytest.fixture
def pair(model_dir, smollm2_path):
    yield from running_pair(model_dir, smollm2_path)


def running_pair(model_dir, smollm2_path, *extra):
    ranks, url = start_pair(model_dir, smollm2_path, *extra)
    try:
        yield ranks, url
    finally:
        for r in ranks:
            r.kill()
        for r in ranks:  # no process of either group is left
            assert r.proc.poll() is not None
            with pytest.raises(ProcessLookupError):
                os.killpg(r.proc.pid, 0)
            r.log.close()
            os.unlink(r.log.name)


def test_two_processes_answer_like_one_device(pair, model_dir, smollm2_path):
    from sgjax.engine.engine import Engine

    ranks, url = pair
    with httpx.Client(base_url=url, timeout=120) as c:
        got = c.post("/generate", json={"text": PROMPT, "sampling_params": PARAMS})
        assert got.status_code == 200, got.text
        info = c.get("/get_server_info").json()
    assert info["tp_size"] == 4 and info["nnodes"] == 2 and info["node_rank"] == 0
    assert info["mesh_shape"] == {"data": 1, "tensor": 4} and info["mesh_processes"] == [0, 1]
    # the readouts' own jitted prefill reaches the follower too (a READOUT broadcast; without it rank 0 would
    # wait in the prefill's all-reduces for ever)
    texts = [PROMPT, "Hello"]
    score = dict(query="Is the sky blue? Answer:", items=[" yes", " no"], label_token_ids=[5, 17, 300])
    with httpx.Client(base_url=url, timeout=120) as c:
        emb = c.post("/v1/embeddings", json={"model": "m", "input": texts})
        scored = c.post("/v1/score", json={"model": "m", **score})
    assert emb.status_code == 200 and scored.status_code == 200, (emb.text, scored.text)
    # float32 on one device, as the tensor-parallel ranks run it (auto keeps float32 under tensor parallelism)
    engine = Engine(model_dir, load_format="dummy", tokenizer_path=smollm2_path, dtype="float32", **TINY_SERVE)
    try:
        want = engine.generate(PROMPT, PARAMS)
        want_emb, want_scores = engine.encode(texts), engine.score(**score)
    finally:
        engine.shutdown()
    assert got.json()["text"] == want["text"] and got.json()["meta_info"]["completion_tokens"] == 8
    np.testing.assert_allclose([d["embedding"] for d in emb.json()["data"]], want_emb, atol=1e-5)
    np.testing.assert_allclose(scored.json()["scores"], want_scores, rtol=1e-4, atol=1e-7)
    # a clean shutdown: SIGTERM on rank 0 stops both ranks with status 0
    ranks[0].proc.send_signal(signal.SIGTERM)
    for r in ranks:
        assert r.proc.wait(60) == 0, r.text()


def test_killed_follower_fails_requests_naming_the_rank(pair):
    """SIGKILL on rank 1 while two requests run: rank 0 answers one with a 500 naming rank 1 and ends the other's
    stream with that error, within a bounded time, and exits non-zero; no process is left."""
    import threading

    ranks, url = pair
    box = {}

    def ask():
        with httpx.Client(base_url=url, timeout=60) as c:
            box["r"] = c.post(
                "/generate",
                json={
                    "text": PROMPT,
                    "sampling_params": {"max_new_tokens": 400, "temperature": 0.0, "ignore_eos": True},
                },
            )

    def ask_stream():
        with httpx.Client(base_url=url, timeout=60) as c:
            with c.stream(
                "POST",
                "/generate",
                json={
                    "text": PROMPT,
                    "stream": True,
                    "sampling_params": {"max_new_tokens": 400, "temperature": 0.0, "ignore_eos": True},
                },
            ) as r:
                box["stream"] = "".join(r.iter_text())

    t = threading.Thread(target=ask)
    t.start()
    ts = threading.Thread(target=ask_stream)
    ts.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the request is running
        info = httpx.get(url + "/get_server_info", timeout=10).json()
        if info["running_requests"] == 2:
            break
        time.sleep(0.05)
    t0 = time.monotonic()
    os.killpg(ranks[1].proc.pid, signal.SIGKILL)
    t.join(30)
    ts.join(30)
    elapsed = time.monotonic() - t0
    assert not t.is_alive(), "the request hung after its follower died"
    r = box["r"]
    assert r.status_code == 500 and "lost follower rank 1 of 2" in r.json()["error"]["message"], (r.status_code, r.text)
    assert elapsed < 15, elapsed
    assert not ts.is_alive() and "lost follower rank 1 of 2" in box["stream"], box.get("stream", "")[-500:]
    assert ranks[0].proc.wait(30) != 0, ranks[0].text()
    assert "lost follower rank 1" in ranks[0].text()


def test_stopped_follower_fails_requests_naming_the_rank(model_dir, smollm2_path):
    """SIGSTOP on rank 1 during a long generation: it is alive and its connection stays open, but it never joins
    the next broadcast. With --dist-step-timeout 4 rank 0 declares it lost for want of its acknowledgement: a 500
    naming rank 1 within a bounded time, rank 0 exits non-zero, and (the stopped follower SIGKILLed at the end) no
    process is left."""
    import threading

    pair = running_pair(model_dir, smollm2_path, "--dist-step-timeout", "4")
    ranks, url = next(pair)
    try:
        box = {}

        def ask():
            with httpx.Client(base_url=url, timeout=120) as c:
                box["r"] = c.post(
                    "/generate",
                    json={
                        "text": PROMPT,
                        "sampling_params": {"max_new_tokens": 400, "temperature": 0.0, "ignore_eos": True},
                    },
                )

        # The same request's first steps once before, so that no step before the SIGSTOP compiles: a follower
        # compiling a new shape on a loaded machine can take longer than the 4 s to join the next broadcast
        with httpx.Client(base_url=url, timeout=120) as c:
            warm = c.post(
                "/generate",
                json={
                    "text": PROMPT,
                    "sampling_params": {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True},
                },
            )
        assert warm.status_code == 200, (warm.text, ranks[0].text())
        before = httpx.get(url + "/get_server_info", timeout=10).json()["generated_tokens"]
        t = threading.Thread(target=ask)
        t.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # decoding, past its first steps
            got = httpx.get(url + "/get_server_info", timeout=10)
            assert got.status_code == 200, (got.text, ranks[0].text())  # not lost before it was stopped
            info = got.json()
            if info["running_requests"] == 1 and info["generated_tokens"] >= before + 8:
                break
            time.sleep(0.05)
        t0 = time.monotonic()
        os.killpg(ranks[1].proc.pid, signal.SIGSTOP)
        t.join(60)
        elapsed = time.monotonic() - t0
        assert not t.is_alive(), "the request hung behind a stopped follower"
        r = box["r"]
        message = r.json()["error"]["message"]
        assert r.status_code == 500 and "lost follower rank 1 of 2" in message, (r.status_code, r.text)
        assert "--dist-step-timeout" in message, message
        assert 3 < elapsed < 20, elapsed
        assert ranks[0].proc.wait(30) != 0, ranks[0].text()
        assert ranks[1].proc.poll() is None  # only stopped: the cleanup's SIGKILL ends it
    finally:
        next(pair, None)  # SIGKILL to both groups; asserts that no process is left


def test_killed_leader_ends_the_follower(pair):
    """SIGKILL on rank 0: the follower sees its connection close without a STOP and exits non-zero at once."""
    ranks, _ = pair
    os.killpg(ranks[0].proc.pid, signal.SIGKILL)
    assert ranks[1].proc.wait(30) != 0, ranks[1].text()
    assert "lost the leader" in ranks[1].text()


def test_header_round_trip_and_flag_errors():
    import numpy as np

    from sgjax.engine import distributed
    from sgjax.engine.args import ServerArgs
    from sgjax.engine.sampler import Branches
    from sgjax.engine.step import StepShape
    from sgjax.model.batch import BatchShape

    for branches in (Branches(), Branches(draws=True, filters=False), Branches(draws=False, filters=True)):
        shape = StepShape(BatchShape(32, 4, 16, 8), 64, 2, 3, 16, branches)
        h = distributed._header(distributed.STEP, shape, np.zeros((16, 5), np.float32))
        assert h.dtype == np.int32 and len(h) == distributed.HEADER
        assert distributed._shape(h) == shape and h[distributed.FEATURES] == 5 and h[distributed.SIZE] == shape.size
        assert StepShape.from_words(shape.to_words()) == shape
    h = distributed._readout_header(1, 9)
    assert len(h) == distributed.HEADER and (h[distributed.OP], h[distributed.SIZE]) == (distributed.READOUT, 9)
    prompts = [[1, 2, 3], [7], [4, 5]]
    assert distributed.unpack_prompts(distributed.pack_prompts(prompts)) == prompts
    distributed.check_args(ServerArgs())
    with pytest.raises(ValueError, match="dist_step_timeout must be >= 0"):
        distributed.check_args(ServerArgs(nnodes=2, dist_init_addr="h:1", dist_step_timeout=-1))
    for kwargs, message in (
        (dict(nnodes=2), "dist-init-addr"),
        (dict(nnodes=2, node_rank=2, dist_init_addr="h:1"), "node_rank must be in"),
        (dict(nnodes=2, dist_init_addr="nohost"), "host:port"),
        (dict(nnodes=0), "nnodes"),
    ):
        with pytest.raises(ValueError, match=message):
            distributed.check_args(ServerArgs(**kwargs))


def test_acks_time_the_oldest_unacknowledged_op():
    from sgjax.engine.distributed import Acks

    acks = Acks([1, 2])
    assert acks.waiting(1, 10.0) == 0  # nothing owed
    acks.begin(1.0)
    assert acks.waiting(1, 5.0) == 0  # rank 1 is still starting (loading, compiling): not timed yet
    acks.ready(1, 3.0)
    acks.ready(2, 0.5)
    assert acks.waiting(1, 5.0) == 2.0 and acks.waiting(2, 5.0) == 4.0
    acks.ack(1)
    acks.begin(7.0)
    assert acks.waiting(1, 8.0) == 1.0 and acks.waiting(2, 8.0) == 7.0  # rank 2 still owes the first op
    acks.ack(2, 2)
    acks.ack(1)
    assert acks.waiting(1, 9.0) == acks.waiting(2, 9.0) == 0 and not acks._started  # acknowledged by all: dropped


def test_dp_size_with_nnodes_is_refused():
    from sgjax.cli import main

    with pytest.raises(SystemExit, match="--dp-size with --nnodes > 1 is not supported"):
        main(["serve", "--dp-size", "2", "--nnodes", "2", "--dist-init-addr", "127.0.0.1:1"])
