"""The chapters' computations and figures: one module per notebook (``chNN_<notebook stem>``), which the
notebook calls once for its results and once per figure, so that the notebooks hold only their parameters,
prose, figures and exercises."""
