"""Old module paths that moved in the "one home per concept" layout keep importing.

``import cwcore.attention`` (and ``from cwcore import sink_claims``) load the module's new home and
register it under the old name too: one module object, two names, no second copy of any code.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

#: old dotted name -> new dotted name
MOVED = {
    "cwcore.attention": "cwcore.core.attention",
    "cwcore.architectures": "cwcore.core.architectures",
    "cwcore.decomposition": "cwcore.core.decomposition",
    "cwcore.geometry": "cwcore.core.geometry",
    "cwcore.interventions": "cwcore.core.interventions",
    "cwcore.ranking": "cwcore.faithfulness.ranking",
    "cwcore.sink_claims": "cwcore.sinks.claims",
    # the book wing (cwcore/book/): no module or notebook of the project uses these names
    "cwcore.findings": "cwcore.book.findings",
    "cwcore.notebook": "cwcore.book.notebook",
    "cwcore.faithfulness.evidence_slice": "cwcore.book.evidence_export",
}


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)  # the module keeps its own __name__ and __spec__

    def exec_module(self, module):  # already executed under its new name
        pass


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED:
            return importlib.util.spec_from_loader(fullname, _AliasLoader(MOVED[fullname]))
        return None


def install() -> None:
    if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())
