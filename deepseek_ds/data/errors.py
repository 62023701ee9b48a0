"""The one exception type of the data pipeline."""


class DataError(ValueError):
    """Bad data input or a damaged/mismatched prepared dataset.

    Messages name the offending file and say how to fix it, so users can act without reading code.
    """
