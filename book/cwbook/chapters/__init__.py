"""The computation behind each chapter of the book, one module per notebook (``chNN_<notebook stem>``): a
notebook sets its parameters, calls its chapter's ``run``, draws the figures with the module's figure
functions and glues the returned numbers and phrases into its prose."""
