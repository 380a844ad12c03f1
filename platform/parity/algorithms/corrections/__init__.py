"""Corrections for the train/inference mismatch, behind one registry (`algorithm.correction.name`).

Importing this package registers every built-in correction: each module here registers its own when imported,
and all of them are imported below (found with pkgutil), so a new correction is one new file
(docs/ADD_A_CORRECTION.md). Corrections defined outside the package register from the modules listed in
`algorithm.correction.modules` (imported by `build_corrections`)."""

import importlib
import pkgutil

from parity.algorithms.corrections.base import CORRECTIONS, Correction, CorrectionContext
from parity.algorithms.corrections.stack import (
    CorrectionStack,
    build_corrections,
    import_modules,
    parse_names,
)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["CORRECTIONS", "Correction", "CorrectionContext", "CorrectionStack", "build_corrections", "import_modules",
           "parse_names"]
