"""Tiny random-weight causal LMs of each supported architecture (no download)."""

from resident_trainer.models.toy import TOY_ARCHS, toy_model


def tiny_model(arch: str, layers: int = 4, seed: int = 0, vocab: int = 97):
    return toy_model(arch, layers=layers, seed=seed, vocab=vocab)


ARCHS = list(TOY_ARCHS)
