"""The numbers behind each sink claim of the paper's section 'Value geometry of attention sinks', from the command line's tables."""

from __future__ import annotations

import numpy as np
import pandas as pd

from .analyses import REGISTRY

__all__ = ["summarize"]


def summarize(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """The numbers behind each sink claim of the paper's section 'Value geometry of attention sinks' from the CLI's tables.

    ``tables`` maps the CSV stems (``rates``, ``decomposition``, ``anti_alignment``, ``convexity``,
    ``semantic_cone``, ``semantic_cone-ppl``, ...) to their frames. Returns rows (claim, statistic, value),
    each registered analysis adding its own (in registration order) from the stems it finds.
    """
    out = []

    def add(claim, statistic, value):
        out.append({"claim": claim, "statistic": statistic, "value": float(value) if value is not None else np.nan})

    for analysis in REGISTRY.values():
        if analysis.summary is not None:
            analysis.summary(tables, add)
    return pd.DataFrame(out)
