"""Loading a model for an Engine: weights cached per process, the dtype default, the KV pool's size."""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING

import jax

from sgjax.model.config import ModelConfig, config_from_hf_dir
from sgjax.model.loader import load_model
from sgjax.model.vision import load_llava_dir
from sgjax.model.weights import dummy_weights, with_weight_dtype

if TYPE_CHECKING:
    from sgjax.engine.args import ServerArgs

MODELS: dict = {}
VISION: dict = {}  # the vision tower of a LLaVA checkpoint, beside its text model in MODELS


def default_dtype(args: ServerArgs) -> str:
    """The model's dtype from --dtype's spellings; the platform's default for auto / None."""
    from sgjax.engine.args import DTYPES

    if args.dtype not in DTYPES and args.dtype is not None:
        raise ValueError(f"dtype {args.dtype!r} is not one of {sorted(DTYPES)}")
    dtype = DTYPES.get(args.dtype) if args.dtype is not None else None
    if dtype == "float16":
        raise ValueError(f"dtype {args.dtype!r}: float16 is not supported (use bfloat16 or float32)")
    return dtype or ("float32" if jax.devices()[0].platform == "cpu" else "bfloat16")


# Set to 0, auto keeps a float32 model's matrices float32 on every CPU (the test suite does: HF parity, and the same
# numbers on every CI machine).
AUTO_BF16_ENV = "SGJAX_AUTO_BF16"
BF16_POOL_BACKENDS = ("cpu", "ref")  # the attention backends that take a bf16 pool under float32 queries


def cpu_has_bf16_dots() -> bool:
    """Whether this CPU has bf16 dot-product instructions (AVX512-BF16 or AMX-BF16), which XLA's CPU dots use."""
    from sgjax.kernels.cpu import cpu_flags

    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def cpu_has_int8_dots() -> bool:
    """Whether this CPU has the int8 dot-product instructions the native int8 / int4 products use (VNNI or AMX)."""
    from sgjax.kernels.cpu import cpu_flags

    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & cpu_flags())


BLOCK_DTYPES = {frozenset({"Q4_0"}): "int4", frozenset({"Q4_1"}): "int4", frozenset({"Q4_0", "Q4_1"}): "int4",
                frozenset({"Q8_0"}): "int8"}


def block_dtype(path: str | None) -> str | None:
    """The weight dtype that holds a GGUF's layer matrices exactly as its blocks, where they are all of such
    types: int4 for Q4_0 and Q4_1 (the default SmolLM2's: a scale and a low per 32 weights), int8 with a scale per
    32 for Q8_0 (tests/engine/test_weight_dtype.py); else None. With it the model runs the file's own weights,
    where bf16 rounds them."""
    from sgjax.model.gguf_meta import GGUFError, layer_matrix_types
    from sgjax.model.paths import resolve_model_path

    try:
        path = resolve_model_path(path)
        if not (path.endswith(".gguf") and os.path.isfile(path)):
            return None
        return BLOCK_DTYPES.get(layer_matrix_types(path))
    except (FileNotFoundError, GGUFError):  # the loader reports it
        return None


def default_weight_dtype(args: ServerArgs, model_dtype: str, platform: str | None = None) -> str:
    """--weight-dtype resolved. auto is the model's dtype, except for a float32 model on one CPU:
    - a Q4_0, Q4_1 or Q8_0 GGUF (block_dtype) where the native kernel and int8 dot instructions are: int4 or int8, the
      file's own weights at llama.cpp's bytes per weight (single-stream decode is bound by them: docs/engine.md);
    - else, with bf16 dot instructions: bf16 matrices (float32 activations, accumulation, norms and attention),
      about twice float32's decode speed, as SGLang's and vLLM's `--dtype auto` run a float32 checkpoint in half
      precision.
    `SGJAX_AUTO_BF16=0` or `--weight-dtype float32` keeps float32."""
    if args.weight_dtype not in ("auto", "float32", "bfloat16", "int8", "int4"):
        raise ValueError(f"weight_dtype must be auto, float32, bfloat16, int8 or int4, got {args.weight_dtype!r}")
    if args.weight_dtype in ("int8", "int4") and (args.tp_size > 1 or args.nnodes > 1):
        raise ValueError(f"weight_dtype {args.weight_dtype} runs on one device: tensor parallelism shards float "
                         "matrices only")
    if args.weight_dtype != "auto":
        return args.weight_dtype
    platform = platform or jax.devices()[0].platform
    if not (platform == "cpu" and model_dtype == "float32" and args.tp_size == 1 and args.nnodes == 1
            and os.environ.get(AUTO_BF16_ENV, "1") != "0"):
        return model_dtype
    kept = block_dtype(args.model_path) if args.load_format == "auto" else None
    if kept and cpu_has_int8_dots() and native_kernels():
        return kept
    return "bfloat16" if cpu_has_bf16_dots() else model_dtype


def native_kernels() -> bool:
    from sgjax.kernels.cpu import available

    return available()


def default_kv_dtype(args: ServerArgs, model_dtype: str, weight_dtype: str, attention: str,
                     platform: str | None = None) -> str:
    """--kv-cache-dtype resolved: the model's dtype, or bfloat16 for a float32 model (keys and values rounded to
    bf16 as written; scores and sums stay float32) where the attention backend reads such a pool (cpu, ref). auto
    is the model's dtype, except on a CPU where auto narrows the matrices (default_weight_dtype), the weights are
    not float32 and the native attention writes the pool: a bf16 pool there halves the bytes a decode step's
    attention reads (docs/engine.md), as vLLM's CPU backend keeps its cache in the model's bf16. fp8 is refused
    by name."""
    given = args.kv_cache_dtype
    if given in ("fp8_e4m3", "fp8_e5m2"):
        raise ValueError(f"kv_cache_dtype {given!r}: an fp8 KV cache is not supported; use auto, float32 or bfloat16")
    if given not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"kv_cache_dtype must be auto, float32 or bfloat16, got {given!r}")
    if given == "auto":
        platform = platform or jax.devices()[0].platform
        auto_bf16 = (platform == "cpu" and model_dtype == "float32" and weight_dtype != "float32"
                     and args.tp_size == 1 and args.nnodes == 1 and os.environ.get(AUTO_BF16_ENV, "1") != "0"
                     and cpu_has_bf16_dots() and attention == "cpu")  # ref's scatter would convert the pool
        return "bfloat16" if auto_bf16 else model_dtype
    if given != model_dtype:
        if model_dtype == "bfloat16":
            raise ValueError("kv_cache_dtype 'float32': a float32 KV cache for a bfloat16 model is not supported; "
                             "use auto or bfloat16")
        if attention not in BF16_POOL_BACKENDS:
            raise ValueError(f"kv_cache_dtype 'bfloat16' under a float32 model needs an attention backend that reads "
                             f"a bf16 pool with float32 queries ({', '.join(BF16_POOL_BACKENDS)}), not {attention!r}")
    return given


def apply_process_settings(args: ServerArgs) -> None:
    """The settings an engine applies to its process (checked first): the GIL's switch interval and JAX's
    persistent compilation cache (unless the environment set one), every program cached however fast it compiled
    (unless the environment says otherwise); step_buckets is checked here too."""
    if args.step_buckets not in (None, "fine", "coarse"):
        raise ValueError(f"step_buckets must be 'fine' or 'coarse', got {args.step_buckets!r}")
    if args.gil_switch_interval_ms is not None:
        if not args.gil_switch_interval_ms > 0:
            raise ValueError(f"gil_switch_interval_ms must be positive or None, got {args.gil_switch_interval_ms}")
        sys.setswitchinterval(args.gil_switch_interval_ms / 1e3)
    if args.compilation_cache_dir and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(args.compilation_cache_dir))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        # JAX's default (1 s) skips the programs that compile faster: on a CPU every step shape (~0.85 s for
        # SmolLM2's scanned step), compiled again by every process
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def check_args(args: ServerArgs, model_dtype: str) -> None:
    """The settings that name something sgjax does not have: a one-line error naming the setting, before loading."""
    if args.load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {args.load_format!r}")
    default_kv_dtype(args, model_dtype, model_dtype, "cpu", "cpu")  # the value alone; the engine resolves it
    if args.grammar_backend not in ("sgjax", "none"):
        raise ValueError(f"grammar_backend {args.grammar_backend!r} is not supported: sgjax compiles regexes and JSON "
                         f"schemas with its own compressed FSM (grammar_backend 'sgjax', or 'none' to refuse them)")


def load_model_cached(path, dtype, load_format="auto", mesh=None, ep_size=1, weight_dtype=None):
    """Weights are immutable arrays: engines in one process (tests, ablation sweeps) share one copy. With a mesh
    (tensor parallelism) they are placed on it as they are made: dummy weights generated sharded, a GGUF or HF
    checkpoint read into host memory and each device given its slice (engine/mesh.py), so no device holds the whole
    model. LLaVA and orbax checkpoints load onto the default device and are placed by the engine. `weight_dtype`
    (None: the model's) casts the matrices (model/weights.with_weight_dtype); only the cast copy is kept then."""
    key = (path, dtype, load_format) if mesh is None else (path, dtype, load_format, mesh, ep_size)
    if weight_dtype not in (None, dtype):
        wkey = key + ("weight_dtype", weight_dtype)
        if (wkey not in MODELS and key not in MODELS and mesh is None and load_format == "auto"
                and weight_dtype == block_dtype(path)):
            # the file's Q4_1 / Q8_0 blocks become the int4 / int8 matrices as they are (no float32 copy, nothing
            # rounded)
            from sgjax.model.loader import load_gguf
            from sgjax.model.paths import resolve_model_path

            MODELS[wkey] = with_weight_dtype(*load_gguf(resolve_model_path(path), dtype, keep_blocks=True),
                                             weight_dtype)
        if wkey not in MODELS:
            had = key in MODELS
            MODELS[wkey] = with_weight_dtype(*load_model_cached(path, dtype, load_format, mesh, ep_size), weight_dtype)
            if not had:
                del MODELS[key]
        return MODELS[wkey]
    if key not in MODELS:
        if load_format == "dummy":
            if path is None or not os.path.isdir(path):
                raise ValueError(f"load_format 'dummy' needs an HF directory with config.json, got {path!r}")
            cfg = config_from_hf_dir(path, dtype)
            if mesh is not None:
                from sgjax.engine.mesh import check_model, dummy_weights as sharded_dummy_weights, ep_config, tp_size

                check_model(cfg, tp_size(mesh), ep_size)
                MODELS[key] = cfg, sharded_dummy_weights(ep_config(cfg, ep_size), mesh)
            else:
                MODELS[key] = cfg, dummy_weights(cfg)
        elif is_llava_dir(path):
            cfg, weights, vcfg, vweights = load_llava_dir(path, dtype)
            MODELS[key], VISION[key[:3]] = (cfg, weights), (vcfg, vweights)  # the engine looks it up without the mesh
        elif mesh is not None:
            from sgjax.engine.mesh import check_model, ep_config, place_weights, tp_size

            cfg, weights = load_model(path, dtype, host=True)
            check_model(cfg, tp_size(mesh), ep_size)
            MODELS[key] = cfg, place_weights(ep_config(cfg, ep_size), weights, mesh)
        else:
            MODELS[key] = load_model(path, dtype)
    return MODELS[key]


def is_llava_dir(path) -> bool:
    config = os.path.join(path, "config.json") if path and os.path.isdir(path) else None
    if config is None or not os.path.isfile(config):
        return False
    with open(config) as f:
        return json.load(f).get("model_type") == "llava"


def pool_pages(args: ServerArgs, cfg: ModelConfig, platform: str) -> int:
    """KV pool pages from max_total_tokens, or from mem_fraction_static of the device memory left after the
    weights (on CPU, where memory stats are missing, a default of 16k tokens)."""
    if args.page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {args.page_size}")
    if args.max_total_tokens is not None:
        if args.max_total_tokens < args.page_size:
            raise ValueError(f"max_total_tokens must be >= page_size, got {args.max_total_tokens}")
        return -(-args.max_total_tokens // args.page_size)
    itemsize = 2 if cfg.pool_dtype == "bfloat16" else 4
    # per device: with tensor parallelism each holds its share of the KV heads (args.tp_size divides them, mesh.py)
    bytes_per_token = cfg.num_layers * 2 * (cfg.num_kv_heads // args.tp_size) * cfg.head_dim * itemsize
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        return -(-16384 // args.page_size)
    free = limit * args.mem_fraction_static - stats.get("bytes_in_use", 0)
    return max(int(free // (bytes_per_token * args.page_size)), 2)
