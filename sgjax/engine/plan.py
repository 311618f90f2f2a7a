"""The step plan: how a run executes the checkpoint, resolved once from the flags, the platform, the model config and
the mesh, then read by everything that runs a step. Nothing else decides these.

`ModelConfig` says what the weights are (sizes, norms, RoPE, windows); the plan says how this run multiplies them:
the dtypes of the activations, the matrices and the KV pool, who multiplies (the CPU's native panel kernel or XLA's
dots), the layer loop, the attention backend, the step-shape ladder and the sampler's branches. `/server_info` and
the startup log print it (`describe`).

The rules (docs/engine.md, "The step plan"):
- An explicit setting wins. `--dtype float32|bfloat16` fixes the activations, the matrices and the pool unless
  `--weight-dtype` / `--kv-cache-dtype` say otherwise; only `auto` (the default everywhere) may choose.
- auto on one CPU, for a float32 model: a GGUF's Q4_0 / Q4_1 / Q8_0 blocks kept as int4 / int8 matrices where the
  CPU has int8 dot-product instructions, else bf16 matrices where it has bf16 ones; a bf16 KV pool beside narrowed
  matrices. On accelerators auto is the model's dtype.
- One CPU multiplies natively (kernels/cpu_matmul.cc) where the CPU has the weights' dot instructions: every row
  count through the same per-row arithmetic, so a request's tokens do not depend on the rest of its step
  (`batch_invariant`). `--enable-deterministic-inference` refuses a plan that is not.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from sgjax.engine.args import DTYPES, ServerArgs
from sgjax.model import kv_scales
from sgjax.model.config import ModelConfig
from sgjax.model.kv_scales import KvScales

WEIGHT_DTYPES = ("float32", "bfloat16", "int8", "int4", "fp8")
# SGLang's --quantization values built here -> the matrices' dtype (the activations: _fp8_activations)
QUANTIZATIONS = {"fp8": "fp8", "w8a8_fp8": "fp8", "w8a16_int8": "int8", "int8": "int8"}
KV_DTYPES = ("float32", "bfloat16")
BF16_POOL_BACKENDS = ("cpu", "ref")  # the attention backends that read a bf16 pool under float32 queries
FP8_KV_DTYPES = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}  # SGLang's names: the pool's dtype
# A GGUF's layer matrix types -> the weight dtype that holds them exactly (loading.block_dtype).
BLOCK_DTYPES = {
    frozenset({"Q4_0"}): "int4",
    frozenset({"Q4_1"}): "int4",
    frozenset({"Q4_0", "Q4_1"}): "int4",
    frozenset({"Q8_0"}): "int8",
}
# The CPU flags the native kernel's vector path needs for each matrix dtype (else its scalar path would run).
NATIVE_FLAGS = {
    "float32": {"avx512f"},
    "bfloat16": {"avx512f", "avx512_bf16"},
    "int8": {"avx512f", "avx512bw", "avx512_vnni"},
    "int4": {"avx512f", "avx512bw", "avx512_vnni"},
}
# The matrices' K each integer dtype needs (the kernel's groups; model/quant's int4 runs).
K_MULTIPLE = {"float32": 1, "bfloat16": 2, "int8": 32, "int4": 64}


@dataclass(frozen=True)
class Machine:
    """What the plan reads of the machine: the platform, the CPU's flags, whether the native kernels build."""

    platform: str
    cpu_flags: frozenset = frozenset()
    native: bool = False
    fp8_dots: bool = False  # a GPU whose matrix units multiply e4m3 (compute capability 8.9 and up)

    @classmethod
    def here(cls) -> "Machine":
        import jax

        device = jax.devices()[0]
        platform = device.platform
        if platform != "cpu":
            capability = getattr(device, "compute_capability", None)  # "9.0" on CUDA devices
            fp8 = platform in ("gpu", "cuda") and capability is not None and float(capability) >= 8.9
            return cls(platform, fp8_dots=fp8)
        from sgjax.kernels.cpu import available, cpu_flags

        return cls(platform, cpu_flags(), available())

    def has(self, *flags: str) -> bool:
        return set(flags) <= self.cpu_flags


@dataclass(frozen=True)
class StepPlan:
    """How one run executes its model (see the module docstring). Frozen and hashable: a static argument of the
    jitted step."""

    platform: str  # cpu | gpu | tpu
    dtype: str  # activations, norms, residual stream, logits: float32 | bfloat16 (the params' float dtype)
    weight_dtype: str  # the matrices: float32 | bfloat16 | int8 | int4
    kv_dtype: str  # the KV pool
    matmul: str  # native (kernels/cpu_matmul.cc, matrices packed in panels) | xla (dots on [in, out] matrices)
    layer_loop: str  # scan (stacked layers; CPU: compile time flat in depth) | unrolled (accelerators)
    attention: str  # ref | cpu | pallas | pallas:triton | pallas:mgpu
    moe_kernel: str = "xla"  # a mixture of experts' grouped matmuls: xla | pallas
    buckets: str = "fine"  # fine (shapes fitted to each batch: CPU) | coarse (shapes follow T: accelerators)
    tp_size: int = 1
    expert_parallel: bool = False  # whole experts per device (--ep-size = --tp-size)
    batch_invariant: bool = False  # a row's result never depends on the other rows of its step
    fp8_activations: bool = False  # fp8 matrices' products quantize their rows to e4m3 per token (w8a8)
    kv_scales: KvScales | None = None  # an fp8 pool's scales per layer (model/kv_scales.py); None: 1.0
    auto: tuple[str, ...] = ()  # the settings auto chose, as "name=value"

    @property
    def static_sampler(self) -> bool:
        """Whether the sampler's optional parts are fixed in the step's shape (coarse) or decided on the device."""
        return self.buckets == "coarse"

    @property
    def matrix_layout(self) -> str:
        return "panels" if self.matmul == "native" else "[in, out]"

    def program(self) -> "StepPlan":
        """The plan reduced to what the step's program depends on (the jitted step's cache key): the weights, the
        pool and the shapes are its arguments, so engines differing only there share one program."""
        return StepPlan(
            platform=self.platform,
            dtype=self.dtype,
            weight_dtype="",
            kv_dtype="",
            matmul=self.matmul,
            layer_loop=self.layer_loop,
            attention=self.attention,
            moe_kernel=self.moe_kernel,
            expert_parallel=self.expert_parallel,
            fp8_activations=self.fp8_activations,
            kv_scales=self.kv_scales,  # constants of the program
        )

    def describe(self) -> dict:
        """The plan as /server_info and the startup log show it."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["kv_scales"] = self.kv_scales.describe() if self.kv_scales else None
        out["auto"] = list(self.auto)
        out["matrix_layout"] = self.matrix_layout
        out["sampler"] = "static" if self.static_sampler else "on_device"
        return out

    def line(self) -> str:
        return (
            "step plan: "
            + ", ".join(f"{k}={v}" for k, v in self.describe().items() if k != "auto")
            + (f" (auto chose {', '.join(self.auto)})" if self.auto else "")
        )


def explicit_dtype(args: ServerArgs) -> str | None:
    """--dtype as given (float32 | bfloat16), or None for auto; float16 refused by name."""
    if args.dtype is not None and args.dtype not in DTYPES:
        raise ValueError(f"dtype {args.dtype!r} is not one of {sorted(DTYPES)}")
    dtype = DTYPES.get(args.dtype) if args.dtype is not None else None
    if dtype == "float16":
        raise ValueError(f"dtype {args.dtype!r}: float16 is not supported (use bfloat16 or float32)")
    return dtype


def activation_dtype(args: ServerArgs, platform: str) -> str:
    """The dtype the model is loaded and run in: --dtype, else float32 on a CPU and bfloat16 on accelerators."""
    return explicit_dtype(args) or ("float32" if platform == "cpu" else "bfloat16")


def resolve(
    args: ServerArgs, cfg: ModelConfig, machine: Machine, *, block_dtype: str | None = None, given: str | None = None
) -> StepPlan:
    """The plan for `args` on `machine`. cfg: the checkpoint's config in the activation dtype; block_dtype: the
    dtype that holds a GGUF's layer blocks exactly (loading.block_dtype), if any; given: the matrices' dtype of
    weights handed in ready (Engine.from_weights), which auto keeps."""
    platform = machine.platform
    dtype = cfg.dtype
    if explicit_dtype(args) not in (None, dtype):
        raise ValueError(
            f"dtype {args.dtype!r}: the model is loaded in {dtype} (weights handed in ready keep "
            "theirs); load it in the dtype asked for"
        )
    chosen: list[str] = []
    weight_dtype = _weight_dtype(args, dtype, platform, machine, block_dtype, given, chosen)
    attention = args.attention_backend or _default_attention(platform, machine)
    kv_dtype = _kv_dtype(args, dtype, weight_dtype, attention, machine, chosen)
    one_device = args.tp_size == 1 and args.nnodes == 1
    native = (
        platform == "cpu"
        and one_device
        and machine.native
        and weight_dtype in NATIVE_FLAGS
        and machine.has(*NATIVE_FLAGS[weight_dtype])
        and _native_shapes(cfg, weight_dtype)
    )
    if weight_dtype in ("int8", "int4") and not one_device:
        raise ValueError(
            f"weight_dtype {weight_dtype} runs on one device: tensor parallelism shards float and fp8 matrices only"
        )
    if args.step_buckets not in (None, "fine", "coarse"):
        raise ValueError(f"step_buckets must be 'fine' or 'coarse', got {args.step_buckets!r}")
    invariant = native and attention == "cpu" and not cfg.is_moe
    plan = StepPlan(
        platform=platform,
        dtype=dtype,
        weight_dtype=weight_dtype,
        kv_dtype=kv_dtype,
        matmul="native" if native else "xla",
        layer_loop="scan" if platform == "cpu" else "unrolled",
        attention=attention,
        moe_kernel=args.moe_kernel or ("pallas" if platform in ("gpu", "cuda") else "xla"),
        buckets=args.step_buckets or ("fine" if platform == "cpu" else "coarse"),
        tp_size=args.tp_size,
        expert_parallel=cfg.is_moe and args.ep_size > 1,
        batch_invariant=invariant,
        fp8_activations=_fp8_activations(args, weight_dtype, machine, chosen),
        kv_scales=_kv_scales(args, cfg, kv_dtype),
        auto=tuple(chosen),
    )
    if args.enable_deterministic_inference and not invariant:
        raise ValueError(
            "enable_deterministic_inference: this run cannot promise batch-invariant outputs: "
            + _why_not_invariant(plan, cfg)
        )
    return plan


def _weight_dtype(args, dtype, platform, machine, block_dtype, given, chosen) -> str:
    if args.weight_dtype not in ("auto", *WEIGHT_DTYPES):
        raise ValueError(f"weight_dtype must be auto, {', '.join(WEIGHT_DTYPES)}, got {args.weight_dtype!r}")
    if args.quantization is not None:
        if args.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization {args.quantization!r} is not built in sgjax (built: {', '.join(QUANTIZATIONS)}); "
                "pre-quantized fp8 checkpoints (compressed-tensors, per-channel or per-tensor scales) are read as "
                "they are without the flag; awq, gptq and block-scaled fp8 are not read yet"
            )
        asked = QUANTIZATIONS[args.quantization]
        if args.weight_dtype not in ("auto", asked):
            raise ValueError(f"quantization {args.quantization!r} and weight_dtype {args.weight_dtype!r} disagree")
        return asked
    if args.weight_dtype != "auto":
        return args.weight_dtype
    if block_dtype == "fp8":  # a pre-quantized checkpoint is served as it is, whatever --dtype (SGLang's rule)
        chosen.append("weight_dtype=fp8 (the checkpoint's own fp8 matrices)")
        return "fp8"
    if explicit_dtype(args) is not None:  # --dtype fixes the matrices too
        return dtype
    if given is not None:  # weights handed in ready: as they are
        return given
    if platform == "cpu" and dtype == "float32" and args.tp_size == 1 and args.nnodes == 1:
        if block_dtype and machine.native and machine.has(*NATIVE_FLAGS[block_dtype]):
            chosen.append(f"weight_dtype={block_dtype} (the GGUF's own blocks)")
            return block_dtype
        if machine.has("avx512_bf16") or machine.has("amx_bf16"):
            chosen.append("weight_dtype=bfloat16 (bf16 dot instructions)")
            return "bfloat16"
    return dtype


def _fp8_activations(args, weight_dtype, machine, chosen) -> bool:
    """w8a8 or w8a16 for fp8 matrices: only --quantization w8a8_fp8 quantizes the activations. SGLang's fp8 is w8a8
    on a GPU with fp8 dots, but ours loses at decode there (an H100: 0.79-0.88x bf16 against w8a16's 1.04-1.42x,
    docs/journal/engine-h200.md): its per-token quantization is a pass of its own before each matmul."""
    if weight_dtype != "fp8":
        return False
    if args.quantization == "w8a8_fp8":
        return True
    if args.quantization == "fp8" and machine.fp8_dots:
        chosen.append("fp8_activations=False (w8a16: faster decode than our w8a8)")
    return False


def _kv_dtype(args, dtype, weight_dtype, attention, machine, chosen) -> str:
    given = args.kv_cache_dtype
    if given in FP8_KV_DTYPES:
        return FP8_KV_DTYPES[given]  # every backend widens an fp8 pool to the queries' dtype as it reads it
    if given not in ("auto", *KV_DTYPES):
        raise ValueError(f"kv_cache_dtype must be auto, float32, bfloat16, fp8_e4m3 or fp8_e5m2, got {given!r}")
    if given == "auto":
        if explicit_dtype(args) is not None:
            return dtype
        narrow = (
            machine.platform == "cpu"
            and dtype == "float32"
            and weight_dtype != "float32"
            and args.tp_size == 1
            and args.nnodes == 1
            and attention == "cpu"
            and (machine.has("avx512_bf16") or machine.has("amx_bf16"))
        )
        if narrow:
            chosen.append("kv_cache_dtype=bfloat16 (beside narrowed matrices)")
            return "bfloat16"
        return dtype
    if given != dtype:
        if dtype == "bfloat16":
            raise ValueError(
                "kv_cache_dtype 'float32': a float32 KV cache for a bfloat16 model is not supported; "
                "use auto or bfloat16"
            )
        if attention not in BF16_POOL_BACKENDS:
            raise ValueError(
                f"kv_cache_dtype 'bfloat16' under a float32 model needs an attention backend that reads "
                f"a bf16 pool with float32 queries ({', '.join(BF16_POOL_BACKENDS)}), not {attention!r}"
            )
    return given


def _kv_scales(args, cfg: ModelConfig, kv_dtype: str) -> KvScales | None:
    """An fp8 pool's scales: --quantization-param-path's, else the checkpoint's own (model/kv_scales.py)."""
    if kv_dtype not in FP8_KV_DTYPES.values():
        if args.quantization_param_path:
            raise ValueError(
                "quantization_param_path: KV cache scales need --kv-cache-dtype fp8_e4m3 or fp8_e5m2, "
                f"the pool is {kv_dtype}"
            )
        return None
    if args.quantization_param_path:
        return kv_scales.from_json(
            args.quantization_param_path, kv_dtype, cfg.num_layers, cfg.num_kv_heads, args.tp_size
        )
    from sgjax.model.paths import resolve_model_path

    try:
        path = resolve_model_path(args.model_path) if args.model_path else None
    except FileNotFoundError:  # the loader reports it
        return None
    return kv_scales.from_checkpoint(path, cfg.num_layers, cfg.num_kv_heads)


def _default_attention(platform: str, machine: Machine) -> str:
    if platform != "cpu":
        return "pallas"
    return "cpu" if machine.native else "ref"


def _native_shapes(cfg: ModelConfig, weight_dtype: str) -> bool:
    """Whether every dense matrix's K suits the native kernel for weight_dtype."""
    ks = {cfg.hidden_size, cfg.q_size, cfg.intermediate_size}
    return all(k % K_MULTIPLE[weight_dtype] == 0 for k in ks)


def _why_not_invariant(plan: StepPlan, cfg: ModelConfig) -> str:
    if plan.platform != "cpu":
        return (
            f"on {plan.platform} the XLA GEMMs choose their tiling (and split-K) by shape and the attention "
            "kernel splits long contexts by batch; the plan for it is in docs/engine.md"
        )
    if cfg.is_moe:
        return "a mixture of experts routes through XLA's ragged_dot, whose grouping depends on the batch"
    if plan.matmul != "native":
        return (
            "XLA's CPU dots change a row's summation order with the row count; the native kernel needs one device "
            f"and the CPU's dot instructions for {plan.weight_dtype} "
            f"({', '.join(sorted(NATIVE_FLAGS.get(plan.weight_dtype, {'no native kernel'})))})"
        )
    return f"the {plan.attention!r} attention backend's reductions depend on the step's page-table width (use cpu)"
