"""Evaluation of trained blocks: what a job taught and what it left alone."""

from resident_trainer.eval.locality import (
    CONTROL_PROMPTS,
    DEMO_FACTS,
    LocalityReport,
    TaughtFact,
    teach_and_check,
)

__all__ = ["CONTROL_PROMPTS", "DEMO_FACTS", "LocalityReport", "TaughtFact", "teach_and_check"]
