"""Loading a model for an Engine: its config, its weights in the form the step plan reads them (cached per process),
the KV pool's size."""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp

from sgjax.engine.args import ServerArgs
from sgjax.engine.plan import BLOCK_DTYPES, StepPlan
from sgjax.model.config import ModelConfig
from sgjax.model.loader import load_config, load_model
from sgjax.model.vision import load_llava_dir
from sgjax.model.weights import Weights, cast_matrices, dummy_weights, stack_layers, unstack_layers

MODELS: dict = {}  # (path, dtype, load format, mesh, expert_parallel) -> (cfg, stacked weights as loaded)
RUN_WEIGHTS: dict = {}  # MODELS' key + the plan's weights part -> (cfg, weights as the plan's step reads them)
VISION: dict = {}  # the vision tower of a LLaVA checkpoint, beside its text model in MODELS


def block_dtype(path: str | None) -> str | None:
    """The weight dtype that holds a checkpoint's layer matrices exactly as stored, where it is quantized: for a
    GGUF whose layer matrices are all of such types, int4 for Q4_0 and Q4_1 (the default SmolLM2's: a scale and a
    low per 32 weights), int8 with a scale per 32 for Q8_0 (tests/engine/test_weight_dtype.py); fp8 for an HF
    directory of fp8 weights (model/fp8_checkpoint.py; a quantization sgjax does not read raises ValueError naming
    it); else None. With it the model runs the file's own weights, where bf16 rounds them."""
    from sgjax.model.gguf_meta import GGUFError, layer_matrix_types
    from sgjax.model.loader import hf_quantization
    from sgjax.model.paths import resolve_model_path

    try:
        path = resolve_model_path(path)
        if os.path.isfile(os.path.join(path, "config.json")):
            return "fp8" if hf_quantization(path) else None
        if not (path.endswith(".gguf") and os.path.isfile(path)):
            return None
        return BLOCK_DTYPES.get(layer_matrix_types(path))
    except (FileNotFoundError, GGUFError):  # the loader reports it
        return None


def apply_process_settings(args: ServerArgs) -> None:
    """The settings an engine applies to its process (checked first): the GIL's switch interval and JAX's
    persistent compilation cache (unless the environment set one), every program cached however fast it compiled
    (unless the environment says otherwise)."""
    if args.gil_switch_interval_ms is not None:
        if not args.gil_switch_interval_ms > 0:
            raise ValueError(f"gil_switch_interval_ms must be positive or None, got {args.gil_switch_interval_ms}")
        sys.setswitchinterval(args.gil_switch_interval_ms / 1e3)
    if args.compilation_cache_dir and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(args.compilation_cache_dir))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        # JAX's default (1 s) skips the programs that compile faster: on a CPU nearly every step shape, compiled
        # again by every process
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def check_args(args: ServerArgs) -> None:
    """The settings that name something sgjax does not have: a one-line error naming the setting, before loading
    (the dtypes and kernels are the plan's: engine/plan.py)."""
    if args.load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {args.load_format!r}")
    if args.grammar_backend not in ("sgjax", "none"):
        raise ValueError(
            f"grammar_backend {args.grammar_backend!r} is not supported: sgjax compiles regexes and JSON "
            f"schemas with its own compressed FSM (grammar_backend 'sgjax', or 'none' to refuse them)"
        )


def load_model_cached(path, dtype, load_format="auto", mesh=None, plan: StepPlan | None = None):
    """(cfg, weights) as `plan`'s step reads them (run_weights; None: the stacked weights as loaded). Weights are
    immutable arrays: engines in one process (tests, ablation sweeps) share one copy of each form. With a mesh
    (tensor parallelism) they are placed on it as they are made: dummy weights generated sharded, a GGUF or HF
    checkpoint read into host memory and each device given its slice (engine/mesh.py), so no device holds the
    whole model. A GGUF whose blocks are the plan's weight dtype (block_dtype) is read into int4 / int8 matrices as
    it is: no float32 copy, nothing rounded."""
    ep = plan is not None and plan.expert_parallel
    key = (path, dtype, load_format) if mesh is None else (path, dtype, load_format, mesh, ep)
    if plan is None:
        return _loaded(key, path, dtype, load_format, mesh, ep)
    run_key = key + (plan.weight_dtype, plan.matmul, plan.layer_loop)
    if mesh is None and load_format == "auto" and plan.weight_dtype == block_dtype(path) == "fp8":
        _refuse_w8a8_blocks(path, plan)
    if run_key not in RUN_WEIGHTS:
        if mesh is None and load_format == "auto" and plan.weight_dtype == block_dtype(path):
            RUN_WEIGHTS[run_key] = read_for_plan(path, dtype, plan)
        else:
            cfg, weights = _loaded(key, path, dtype, load_format, mesh, ep)
            RUN_WEIGHTS[run_key] = cfg, run_weights(cfg, weights, plan, mesh)
    return RUN_WEIGHTS[run_key]


def forget(weights: Weights) -> None:
    """Stop caching `weights` (and the loaded form they were made from): an engine that serves others now
    (Engine.update_weights) must not leave a second copy behind. Engines still serving them keep theirs."""
    for run_key, (_, cached) in list(RUN_WEIGHTS.items()):
        if cached is weights:
            del RUN_WEIGHTS[run_key]
            MODELS.pop(run_key[:-3], None)  # RUN_WEIGHTS' key is MODELS' key and the plan's three weight fields
    for key, (_, cached) in list(MODELS.items()):
        if cached is weights:
            del MODELS[key]


def _refuse_w8a8_blocks(path, plan: StepPlan) -> None:
    from sgjax.model.loader import hf_quantization
    from sgjax.model.paths import resolve_model_path

    if plan.fp8_activations and hf_quantization(resolve_model_path(path)) == "block":
        raise ValueError(
            "quantization 'w8a8_fp8' quantizes activations per token against row scales; this checkpoint is "
            "block-scaled: serve it with --quantization fp8 (w8a16)"
        )


def read_for_plan(path, dtype, plan: StepPlan, mesh=None):
    """(cfg, weights as `plan`'s step reads them) read from `path` now, uncached (Engine.update_weights_from_disk):
    a GGUF whose blocks are the plan's weight dtype, or an fp8 checkpoint, kept as stored, as at start."""
    from sgjax.model.loader import load_gguf, load_hf_dir
    from sgjax.model.paths import resolve_model_path

    if mesh is None and plan.weight_dtype == block_dtype(path):
        if plan.weight_dtype == "fp8":  # an fp8 HF checkpoint's own matrices
            _refuse_w8a8_blocks(path, plan)
            cfg, weights = load_hf_dir(resolve_model_path(path), dtype, keep_fp8=True)
        else:
            cfg, weights = load_gguf(resolve_model_path(path), dtype, keep_blocks=True)
    else:
        cfg, weights = load_model(path, dtype, host=mesh is not None)
    return cfg, run_weights(cfg, weights, plan, mesh)


def _loaded(key, path, dtype, load_format, mesh, ep):
    if key not in MODELS:
        if load_format == "dummy":
            cfg = load_config(path, dtype, load_format)
            if mesh is not None:
                from sgjax.engine.mesh import check_model, tp_size
                from sgjax.engine.mesh import dummy_weights as sharded_dummy_weights

                check_model(cfg, tp_size(mesh), tp_size(mesh) if ep else 1)
                MODELS[key] = cfg, sharded_dummy_weights(cfg, mesh, expert_parallel=ep)
            else:
                MODELS[key] = cfg, dummy_weights(cfg)
        elif is_llava_dir(path):
            cfg, weights, vcfg, vweights = load_llava_dir(path, dtype)
            MODELS[key], VISION[key[:3]] = (cfg, weights), (vcfg, vweights)  # the engine looks it up without the mesh
        elif mesh is not None:
            from sgjax.engine.mesh import check_model, place_weights, tp_size

            cfg, weights = load_model(path, dtype, host=True)
            check_model(cfg, tp_size(mesh), tp_size(mesh) if ep else 1)
            MODELS[key] = cfg, place_weights(cfg, weights, mesh, expert_parallel=ep)
        else:
            MODELS[key] = load_model(path, dtype)
    return MODELS[key]


def run_weights(cfg: ModelConfig, weights: Weights, plan: StepPlan, mesh=None) -> Weights:
    """The weights as the plan's step reads them: matrices in its weight dtype (model/weights.cast_matrices),
    placed on the mesh, then packed for the native kernel (model/native.py) or split per layer for an unrolled
    forward."""
    weights = cast_matrices(weights, plan.weight_dtype)
    if mesh is not None:
        from sgjax.engine import mesh as tp

        weights = tp.place_weights(cfg, stack_layers(weights), mesh, expert_parallel=plan.expert_parallel)
        if plan.layer_loop != "unrolled":
            return weights
        spec = getattr(weights.embed.sharding, "spec", ())
        return tp.unstack_placed(
            weights, mesh, shard_vocab=len(spec) > 0 and spec[0] is not None, expert_parallel=plan.expert_parallel
        )
    if plan.matmul == "native":
        from sgjax.model.native import pack_weights

        return pack_weights(stack_layers(weights))
    return unstack_layers(weights) if plan.layer_loop == "unrolled" else weights


def is_llava_dir(path) -> bool:
    config = os.path.join(path, "config.json") if path and os.path.isdir(path) else None
    if config is None or not os.path.isfile(config):
        return False
    with open(config) as f:
        return json.load(f).get("model_type") == "llava"


def pool_pages(args: ServerArgs, cfg: ModelConfig, kv_dtype: str, draft_cfg: ModelConfig | None = None) -> int:
    """KV pool pages from max_total_tokens, or from mem_fraction_static of the device memory left after the
    weights (on CPU, where memory stats are missing, a default of 16k tokens); draft_cfg: a draft model whose pool
    shares the page numbers (STANDALONE speculation), so each page costs both models' bytes."""
    if args.page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {args.page_size}")
    if args.max_total_tokens is not None:
        if args.max_total_tokens < args.page_size:
            raise ValueError(f"max_total_tokens must be >= page_size, got {args.max_total_tokens}")
        return -(-args.max_total_tokens // args.page_size)
    itemsize = jnp.dtype(kv_dtype).itemsize
    # per device: with tensor parallelism each holds its share of the KV heads (args.tp_size divides them, mesh.py)
    bytes_per_token = cfg.num_layers * 2 * (cfg.num_kv_heads // args.tp_size) * cfg.head_dim * itemsize
    if draft_cfg is not None:
        bytes_per_token += draft_cfg.num_layers * 2 * draft_cfg.num_kv_heads * draft_cfg.head_dim * itemsize
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        return -(-16384 // args.page_size)
    free = limit * args.mem_fraction_static - stats.get("bytes_in_use", 0)
    return max(int(free // (bytes_per_token * args.page_size)), 2)
