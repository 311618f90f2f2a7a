"""The routes a training loop drives (engine/training.py, engine/adapters.py), with SGLang's request and response
shapes: weights swapped from a checkpoint, their version, generation paused and continued, the KV pool's memory
released and resumed, LoRA adapters loaded and unloaded."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request

from sgjax.errors import RequestError
from sgjax.server.fields import screener
from sgjax.server.protocol import (
    ApiError,
    LoadLoraAdapterRequest,
    MemoryOccupationRequest,
    PauseGenerationRequest,
    UnloadLoraAdapterRequest,
    UpdateWeightsFromDiskRequest,
    parse_body,
    read_body,
)

ROUTES = (
    "/update_weights_from_disk",
    "/get_weight_version",
    "/get_weights_version",
    "/pause_generation",
    "/continue_generation",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/load_lora_adapter",
    "/unload_lora_adapter",
)


async def _body(request: Request, model, route: str):
    raw = await read_body(request)
    return parse_body(raw or b"{}", model, screener(route))


def add_training_routes(app: FastAPI, serving) -> None:
    engine = serving.engine

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        req = await _body(request, UpdateWeightsFromDiskRequest, "/update_weights_from_disk")
        try:
            version = await asyncio.to_thread(
                engine.update_weights_from_disk,
                req.model_path,
                version=req.weight_version,
                flush_cache=req.flush_cache,
                abort_all_requests=req.abort_all_requests,
            )
        except RequestError as e:
            raise ApiError(str(e), param=e.field) from None
        return {"success": True, "message": "Succeeded to update model weights.", "weight_version": version}

    @app.get("/get_weight_version")
    @app.get("/get_weights_version")
    async def get_weight_version():
        return {"weight_version": engine.get_weights_version()}

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        req = await _body(request, PauseGenerationRequest, "/pause_generation")
        await asyncio.to_thread(engine.pause_generation, req.mode)
        return {"success": True, "message": "Generation paused."}

    @app.post("/continue_generation")
    async def continue_generation():
        await asyncio.to_thread(engine.continue_generation)
        return {"success": True, "message": "Generation continued."}

    @app.post("/release_memory_occupation")
    async def release_memory_occupation(request: Request):
        await _body(request, MemoryOccupationRequest, "/release_memory_occupation")
        await asyncio.to_thread(engine.release_memory_occupation)
        return {"success": True, "message": "KV cache memory released; generation paused."}

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(request: Request):
        await _body(request, MemoryOccupationRequest, "/resume_memory_occupation")
        await asyncio.to_thread(engine.resume_memory_occupation)
        return {"success": True, "message": "KV cache memory resumed; generation continues."}

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        req = await _body(request, LoadLoraAdapterRequest, "/load_lora_adapter")
        return await _lora_call(engine.load_lora_adapter, req.lora_name, req.lora_path)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        req = await _body(request, UnloadLoraAdapterRequest, "/unload_lora_adapter")
        return await _lora_call(engine.unload_lora_adapter, req.lora_name)


async def _lora_call(fn, *args) -> dict:
    """SGLang's LoRAUpdateOutput; a refusal is a 400 naming the field."""
    try:
        loaded = await asyncio.to_thread(fn, *args)
    except RequestError as e:
        raise ApiError(str(e), param=e.field) from None
    return {"success": True, "error_message": None, "loaded_adapters": loaded}
