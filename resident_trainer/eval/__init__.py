"""Evaluation of trained blocks: what a job taught and what it left alone
(docs/EVALUATION.md): the development set, the jobs, the report."""

from resident_trainer.eval.locality import CONTROL_PROMPTS, DEMO_FACTS, TaughtFact

__all__ = ["CONTROL_PROMPTS", "DEMO_FACTS", "TaughtFact"]
