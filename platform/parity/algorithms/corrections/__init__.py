"""Corrections for the train/inference mismatch, behind one registry (`algorithm.correction.name`).

Importing this package registers every built-in correction."""

from parity.algorithms.corrections import dual, icepop, mis, none, score_centering, tis  # noqa: F401  (registration)
from parity.algorithms.corrections.base import CORRECTIONS, Correction, CorrectionContext
from parity.algorithms.corrections.stack import CorrectionStack, build_corrections, parse_names

__all__ = ["CORRECTIONS", "Correction", "CorrectionContext", "CorrectionStack", "build_corrections", "parse_names"]
