"""The step plan (engine/plan.py): (platform, flags, checkpoint) -> the resolved plan, explicit settings winning over
auto, the refusals by name, the plan in /server_info, and the one place that reads the run settings."""

import ast
import pathlib

import pytest

from sgjax.engine.args import ServerArgs
from sgjax.engine.plan import Machine, StepPlan, resolve
from sgjax.model.presets import TINY_LLAMA

ROOT = pathlib.Path(__file__).resolve().parents[2]
AVX512 = frozenset({"avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"})
ZEN4 = Machine("cpu", AVX512, native=True)  # int8 and bf16 dots: this CI machine's kind
NO_BF16 = Machine("cpu", frozenset({"avx512f", "avx512bw", "avx512_vnni"}), native=True)
OLD_CPU = Machine("cpu", frozenset({"avx2", "fma"}), native=True)  # native kernels build, but no AVX-512
NO_COMPILER = Machine("cpu", AVX512, native=False)
GPU = Machine("gpu")
F32 = TINY_LLAMA.replace(dtype="float32")
BF16 = TINY_LLAMA.replace(dtype="bfloat16")
MOE = F32.replace(architecture="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)


def plan(machine=ZEN4, cfg=F32, block=None, given=None, **flags) -> StepPlan:
    return resolve(ServerArgs(**flags), cfg, machine, block_dtype=block, given=given)


def fields(p: StepPlan, *names):
    return tuple(getattr(p, n) for n in names)


KEYS = ("weight_dtype", "kv_dtype", "matmul", "layer_loop", "attention", "batch_invariant")
TABLE = [
    # (machine, cfg, GGUF blocks, given, flags) -> (weight, kv, matmul, loop, attention, invariant)
    ((ZEN4, F32, "int4", None, {}), ("int4", "bfloat16", "native", "scan", "cpu", True)),  # the default SmolLM2
    ((ZEN4, F32, "int8", None, {}), ("int8", "bfloat16", "native", "scan", "cpu", True)),  # a Q8_0 GGUF
    ((ZEN4, F32, None, None, {}), ("bfloat16", "bfloat16", "native", "scan", "cpu", True)),  # an HF float32 dir
    ((NO_BF16, F32, "int4", None, {}), ("int4", "float32", "native", "scan", "cpu", True)),
    ((NO_BF16, F32, None, None, {}), ("float32", "float32", "native", "scan", "cpu", True)),
    ((OLD_CPU, F32, "int4", None, {}), ("float32", "float32", "xla", "scan", "cpu", False)),
    ((NO_COMPILER, F32, "int4", None, {}), ("bfloat16", "float32", "xla", "scan", "ref", False)),
    ((ZEN4, F32, "int4", None, {"dtype": "float32"}), ("float32", "float32", "native", "scan", "cpu", True)),
    ((ZEN4, F32, "int4", None, {"dtype": "float"}), ("float32", "float32", "native", "scan", "cpu", True)),
    ((ZEN4, F32, "int4", None, {"dtype": "auto"}), ("int4", "bfloat16", "native", "scan", "cpu", True)),
    (
        (ZEN4, F32, "int4", None, {"dtype": "float32", "weight_dtype": "int4"}),
        ("int4", "float32", "native", "scan", "cpu", True),
    ),
    (
        (ZEN4, F32, "int4", None, {"dtype": "float32", "kv_cache_dtype": "bfloat16"}),
        ("float32", "bfloat16", "native", "scan", "cpu", True),
    ),
    ((ZEN4, F32, "int4", None, {"weight_dtype": "float32"}), ("float32", "float32", "native", "scan", "cpu", True)),
    ((ZEN4, F32, "int4", None, {"attention_backend": "ref"}), ("int4", "float32", "native", "scan", "ref", False)),
    ((ZEN4, F32, None, "float32", {}), ("float32", "float32", "native", "scan", "cpu", True)),  # from_weights
    ((ZEN4, F32, None, "int8", {}), ("int8", "bfloat16", "native", "scan", "cpu", True)),
    ((ZEN4, F32, None, None, {"tp_size": 2}), ("float32", "float32", "xla", "scan", "cpu", False)),
    ((ZEN4, MOE, None, None, {}), ("bfloat16", "bfloat16", "native", "scan", "cpu", False)),
    ((ZEN4, BF16, None, None, {"dtype": "bfloat16"}), ("bfloat16", "bfloat16", "native", "scan", "cpu", True)),
    ((GPU, BF16, "int4", None, {}), ("bfloat16", "bfloat16", "xla", "unrolled", "pallas", False)),
    ((GPU, F32, None, None, {"dtype": "float32"}), ("float32", "float32", "xla", "unrolled", "pallas", False)),
]


@pytest.mark.parametrize("given,want", TABLE, ids=[str(i) for i in range(len(TABLE))])
def test_plan_table(given, want):
    machine, cfg, block, weights, flags = given
    assert fields(plan(machine, cfg, block, weights, **flags), *KEYS) == want


def test_auto_names_what_it_chose_and_explicit_settings_choose_nothing():
    assert plan(block="int4").auto == (
        "weight_dtype=int4 (the GGUF's own blocks)",
        "kv_cache_dtype=bfloat16 (beside narrowed matrices)",
    )
    assert plan(block="int4", dtype="float32").auto == ()
    p = plan(block="int4")
    assert p.describe()["matrix_layout"] == "panels" and "auto chose" in p.line()
    assert plan(GPU, BF16).buckets == "coarse" and plan(GPU, BF16).static_sampler
    assert plan().buckets == "fine" and not plan().static_sampler


def test_the_program_key_keeps_only_what_the_step_traces():
    a, b = plan(block="int4"), plan(block="int4", kv_cache_dtype="float32", step_buckets="coarse")
    assert a != b and a.program() == b.program()
    assert plan().program() != plan(attention_backend="ref").program()


def test_an_fp8_kv_cache_picks_a_backend_that_reads_it():
    p = plan(kv_cache_dtype="fp8_e4m3")  # auto attention on a CPU: the native kernel reads fp8 too
    assert fields(p, "kv_dtype", "attention") == ("float8_e4m3fn", "cpu")
    assert not any(a.startswith("attention_backend") for a in p.auto)
    assert plan(kv_cache_dtype="fp8_e5m2", attention_backend="ref").attention == "ref"  # an explicit ref stays
    assert fields(plan(GPU, BF16, kv_cache_dtype="fp8_e5m2"), "kv_dtype", "attention") == ("float8_e5m2", "pallas")
    for pinned in ("pallas:triton", "pallas:mgpu"):  # either prefill kernel reads it (test_pallas_mgpu.py)
        assert plan(GPU, BF16, kv_cache_dtype="fp8_e4m3", attention_backend=pinned).attention == pinned
    assert plan(NO_COMPILER, kv_cache_dtype="fp8_e4m3").attention == "ref"
    tpu = plan(Machine("tpu"), BF16, kv_cache_dtype="fp8_e4m3")  # jax's kernel and ours read it (test_pallas_tpu.py)
    assert fields(tpu, "kv_dtype", "attention") == ("float8_e4m3fn", "pallas")


def test_refusals_name_the_setting():
    with pytest.raises(ValueError, match="kv_cache_dtype 'bfloat16' under a float32 model needs"):
        plan(GPU, F32, kv_cache_dtype="bfloat16")
    with pytest.raises(ValueError, match="kv_cache_dtype 'float32': a float32 KV cache for a bfloat16 model"):
        plan(GPU, BF16, kv_cache_dtype="float32")
    with pytest.raises(ValueError, match="weight_dtype must be"):
        plan(weight_dtype="float16")
    with pytest.raises(ValueError, match="weight_dtype int8 runs on one device"):
        plan(weight_dtype="int8", tp_size=2)
    with pytest.raises(ValueError, match="step_buckets"):
        plan(step_buckets="huge")
    with pytest.raises(ValueError, match="dtype 'half': float16 is not supported"):
        plan(dtype="half")


def test_deterministic_inference_refuses_a_plan_that_is_not_batch_invariant():
    assert plan(enable_deterministic_inference=True, block="int4").batch_invariant
    for machine, cfg, flags, reason in [
        (GPU, BF16, {}, "on gpu the XLA GEMMs"),
        (ZEN4, MOE, {}, "a mixture of experts"),
        (OLD_CPU, F32, {}, "XLA's CPU dots"),
        (ZEN4, F32, {"attention_backend": "ref"}, "'ref' attention"),
    ]:
        with pytest.raises(ValueError, match=f"enable_deterministic_inference: .*{reason}"):
            plan(machine, cfg, enable_deterministic_inference=True, **flags)


# Run settings only the plan may read from the arguments (engine/plan.py); args.py defines them.
PLAN_SETTINGS = {
    "dtype",
    "weight_dtype",
    "kv_cache_dtype",
    "attention_backend",
    "moe_kernel",
    "step_buckets",
    "enable_deterministic_inference",
}


def test_only_the_plan_reads_the_run_settings_from_the_arguments():
    """No module but engine/plan.py reads args.<setting> for the settings the plan resolves (engine/args.py only
    declares them; the CLI only builds them)."""
    offenders = []
    for path in sorted((ROOT / "sgjax").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in ("sgjax/engine/plan.py", "sgjax/engine/args.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in PLAN_SETTINGS
                and isinstance(node.value, ast.Name)
                and node.value.id in ("args", "server_args", "engine_args")
            ):
                offenders.append(f"{rel}:{node.lineno}: {node.value.id}.{node.attr}")
    assert offenders == []


def test_the_engine_reports_its_plan(tiny):
    from tests.engine.conftest import tiny_engine

    with tiny_engine(tiny) as eng:
        info = eng.get_server_info()
    step_plan = info["step_plan"]
    assert step_plan["weight_dtype"] == info["weight_dtype"] == "float32"  # from_weights: as given
    assert step_plan["matmul"] == info["matmul"] and step_plan["layer_loop"] == "scan"
    assert set(step_plan) >= {"dtype", "kv_dtype", "attention", "buckets", "sampler", "batch_invariant", "auto"}
