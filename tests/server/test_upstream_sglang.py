"""Conformance with upstream SGLang's own clients, unmodified: its frontend language (`import sglang as sgl`,
`sgl.RuntimeEndpoint`) and its `bench_serving` (`--backend sglang` and `sglang-oai`), from the `sglang==0.5.23`
wheel (Makefile's upstream step) in child processes, against the real `sgjax serve` on SmolLM2."""

import json
import os
import re
import subprocess
import sys

import jsonschema
import pytest

from tests.server.conftest import REPO

UPSTREAM = os.path.join(REPO, ".venv", "upstream")
STUB = os.path.join(os.path.dirname(__file__), "upstream_stub")


def upstream_env() -> dict:
    if not os.path.isdir(os.path.join(UPSTREAM, "sglang")):
        raise RuntimeError(f"upstream SGLang is not installed in {UPSTREAM}: run `make setup`")
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([UPSTREAM, STUB]),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
    }


def run_upstream(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    # cwd outside the repository: the child must import upstream's sglang, never this checkout's packages
    done = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=upstream_env(), cwd=UPSTREAM, timeout=timeout
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def results(url):
    done = run_upstream([os.path.join(os.path.dirname(__file__), "upstream_client.py"), url])
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def test_it_is_upstreams_frontend(results):
    assert results["sglang_file"].startswith(UPSTREAM)


def test_gen_regex_json_schema_and_select(results):
    assert results["gen"].strip()
    assert re.fullmatch(r"(19|20)[0-9]{2}", results["year"])
    jsonschema.validate(
        json.loads(results["person"]),
        {
            "type": "object",
            "required": ["name", "age"],
            "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
        },
    )
    assert results["select"] in (" blue", " green", " purple")


def test_fork_join_roles_stream_and_batch(results):
    assert len(results["fork"]) == 2 and all(isinstance(f, str) for f in results["fork"])
    roles = results["roles"]["messages"]
    assert [m["role"] for m in roles] == ["system", "user", "assistant"] and roles[2]["content"] == results["roles"][
        "reply"
    ]
    assert len(results["stream_chunks"]) > 1 and "".join(results["stream_chunks"]) == results["stream_final"]
    assert len(results["batch"]) == 3 and all(a.strip() for a in results["batch"])


def test_logprobs_and_housekeeping(results):
    lp = results["logprobs"]
    assert len(lp["output"]) == 3 and all(len(e) == 3 and e[0] <= 0 and isinstance(e[2], str) for e in lp["output"])
    assert all(len(row) == 2 and row[0][1] == out[1] for row, out in zip(lp["top"], lp["output"]))
    assert {"internal_states", "max_total_tokens", "version"} <= set(results["server_info_keys"])


@pytest.fixture(scope="module")
def sharegpt_file(tmp_path_factory, smollm2):
    from sgjax.data import sharegpt
    from sgjax.model.tokenizer import save_hf_dir

    d = tmp_path_factory.mktemp("upstream_bench")
    convs = [c for c in sharegpt(40) if len(c.get("conversations", [])) >= 2][:8]
    (d / "sharegpt.json").write_text(json.dumps(convs))
    save_hf_dir(smollm2[2], str(d / "tokenizer"))  # bench_serving's tokenizer: an HF directory
    return d


@pytest.mark.parametrize("backend", ["sglang", "sglang-oai"])
def test_upstream_bench_serving_finishes_and_prints_its_table(url, sharegpt_file, backend):
    done = run_upstream(
        [
            "-m",
            "sglang.bench_serving",
            "--backend",
            backend,
            "--base-url",
            url,
            "--dataset-name",
            "sharegpt",
            "--dataset-path",
            str(sharegpt_file / "sharegpt.json"),
            "--num-prompts",
            "4",
            "--tokenizer",
            str(sharegpt_file / "tokenizer"),
            "--model",
            "smollm2",
            "--sharegpt-output-len",
            "8",
            "--request-rate",
            "inf",
            "--disable-tqdm",
        ]
    )
    assert "Serving Benchmark Result" in done.stdout and re.search(r"Successful requests:\s+4\b", done.stdout), (
        done.stdout[-2000:]
    )
