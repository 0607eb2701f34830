"""The one exception type users see: a message that fits on one line and says what to do."""


class TremulaError(Exception):
    """An error caused by the user's input (model, chip file, flags), reported as one line with exit status != 0."""
