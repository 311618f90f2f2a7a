"""Multi-LoRA through the real server (`sgjax serve --enable-lora --lora-paths ...`) and the unmodified openai client:
`lora_path` on /generate and through extra_body, SGLang's /load_lora_adapter and /unload_lora_adapter, and 400s
naming the field. The arithmetic is checked against HF + PEFT in tests/engine/test_lora.py."""

import json

import httpx
import openai
import pytest
import torch

from tests.conftest import TINY_CHECKPOINT, TINY_SERVE
from tests.server.conftest import serving


def write_adapter(path: str, seed: int, targets: list[str]) -> str:
    """A random PEFT LoRA adapter (written by `peft`) for the tiny checkpoint's shapes."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    conf = {k: v for k, v in TINY_CHECKPOINT.items() if k not in ("model_type", "architectures")}
    base = LlamaForCausalLM(LlamaConfig(**conf))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(2.0 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return {
        name: write_adapter(str(tmp_path_factory.mktemp(f"adapter-{name}")), seed, targets)
        for name, seed, targets in (("one", 1, ["q_proj", "v_proj", "down_proj"]), ("two", 2, ["o_proj", "up_proj"]))
    }


@pytest.fixture(scope="module")
def server(tiny_checkpoint, smollm2_path, adapters):
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in TINY_SERVE.items()]
    yield from serving(
        "--model-path",
        tiny_checkpoint,
        "--load-format",
        "dummy",
        "--tokenizer-path",
        smollm2_path,
        *flags,
        "--enable-lora",
        "--lora-paths",
        f"one={adapters['one']}",
        "--max-loras-per-batch",
        "2",
        "--lora-target-modules",
        "all",
    )


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


PARAMS = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def generate(client, **body):
    r = client.post("/generate", json={"text": "The capital of France is", "sampling_params": PARAMS, **body})
    return r


def test_lora_path_on_generate_and_through_the_openai_client(server, client):
    base = generate(client).json()["output_ids"]
    one = generate(client, lora_path="one").json()
    assert one["output_ids"] != base  # the adapter is applied
    both = generate(client, text=["The capital of France is"] * 2, lora_path=["one", None]).json()
    assert [o["output_ids"] for o in both] == [one["output_ids"], base]
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    model = oai.models.list().data[0].id
    out = oai.completions.create(
        model=model,
        prompt="The capital of France is",
        max_tokens=8,
        temperature=0,
        extra_body={"lora_path": "one", "ignore_eos": True},
    )
    assert out.choices[0].text == one["text"]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, extra_body={"lora_path": "nope"}
        )
    assert e.value.body["param"] == "lora_path" and "nope" in e.value.body["message"]


def test_adapters_loaded_and_unloaded_by_route(client, adapters):
    r = client.post("/load_lora_adapter", json={"lora_name": "two", "lora_path": adapters["two"]})
    assert r.status_code == 200, r.text
    assert r.json() == {
        "success": True,
        "error_message": None,
        "loaded_adapters": dict(one=adapters["one"], **{"two": adapters["two"]}),
    }
    outs = generate(client, text=["The capital of France is"] * 3, lora_path=["two", "one", None]).json()
    alone = generate(client, lora_path="two").json()
    assert outs[0]["output_ids"] == alone["output_ids"] != outs[1]["output_ids"]
    r = client.post("/load_lora_adapter", json={"lora_name": "two", "lora_path": adapters["two"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"  # the name is taken
    r = client.post("/load_lora_adapter", json={"lora_name": "three", "lora_path": "/nonexistent"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
    r = client.post("/unload_lora_adapter", json={"lora_name": "two"})
    assert r.status_code == 200 and set(r.json()["loaded_adapters"]) == {"one"}
    r = generate(client, lora_path="two")
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    r = client.post("/unload_lora_adapter", json={"lora_name": "two"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    r = generate(client, text=["a", "b"], lora_path=["one"])
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    info = client.get("/get_server_info").json()
    assert info["lora_adapters"] == ["one"] and json.dumps(info["lora_slots"])
