"""Graders for the exercises: ``check_x(your_function)`` prints PASS, or FAIL with the first mismatch.

Each lesson's graders live in a module of their own (``llmedu.checks.hardware``,
``llmedu.checks.tokenizers``, ...) and are built on ``llmedu.checks.core.Grader``.
"""

from .core import CheckResult, Grader

__all__ = ["CheckResult", "Grader"]
