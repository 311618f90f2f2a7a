"""A training loop's routes on the session's real server (SmolLM2): the weights swapped from disk (the same
checkpoint, read as at start, so other tests on this server see the same model), their version, pause / continue,
memory release / resume, and the request policy's refusals."""

import threading

from tests.server.conftest import assert_no_leak

PROMPT = "Answer with one word.\n" + "".join(f"Q: What is {i} plus {i}?\nA: {2 * i}\n" for i in range(8)) + "Q: 9 + 9?"
BODY = {"text": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}


def _generate(client):
    r = client.post("/generate", json=BODY)
    assert r.status_code == 200, r.text
    return r.json()["text"], r.json()["meta_info"]["cached_tokens"]


def test_update_weights_from_disk_and_its_version(client, smollm2_path):
    text, _ = _generate(client)
    assert _generate(client)[1] > 0  # the prompt is cached
    r = client.post("/update_weights_from_disk", json={"model_path": smollm2_path, "weight_version": "v2"})
    assert r.status_code == 200 and r.json()["success"] and r.json()["weight_version"] == "v2", r.text
    assert client.get("/get_weight_version").json() == {"weight_version": "v2"}
    assert client.get("/get_weights_version").json() == {"weight_version": "v2"}
    assert _generate(client) == (text, 0)  # the same weights, and no prefix from before the update
    bad = client.post("/update_weights_from_disk", json={"model_path": "/nonexistent/model.gguf"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "model_path", bad.text
    fmt = client.post("/update_weights_from_disk", json={"model_path": smollm2_path, "load_format": "safetensors"})
    assert fmt.status_code == 400 and fmt.json()["error"]["code"] == "unsupported_parameter", fmt.text
    assert_no_leak(client)


def test_pause_in_place_holds_a_request_until_continue(client):
    assert client.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    box = {}
    thread = threading.Thread(target=lambda: box.update(out=_generate(client)))
    thread.start()
    thread.join(timeout=1.0)
    assert thread.is_alive()  # queued while paused
    assert client.post("/continue_generation").status_code == 200
    thread.join(timeout=60)
    assert box["out"][0]
    bad = client.post("/pause_generation", json={"mode": "sideways"})
    assert bad.status_code == 400 and "mode" in bad.text
    assert_no_leak(client)


def test_release_and_resume_memory_occupation(client):
    text, _ = _generate(client)
    refused = client.post("/release_memory_occupation", json={"tags": ["weights"]})
    assert refused.status_code == 400 and "tags" in refused.text
    assert client.post("/release_memory_occupation", json={}).status_code == 200
    info = client.get("/get_server_info").json()
    assert info["running_requests"] == 0
    assert client.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
    assert _generate(client)[0] == text
    assert_no_leak(client)
