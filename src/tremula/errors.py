"""What users see when something is wrong or worth knowing: one-line errors and one-line notices."""

from __future__ import annotations

import warnings


class TremulaError(Exception):
    """An error caused by the user's input (model, chip file, flags), reported as one line with exit status != 0."""


class NoFit(TremulaError):
    """The model does not fit the chip at the asked batch: a plan's peak overflows (compiler.DoesNotFit), or a lower
    bound already does before any planning (limits.TooBig). `max_batch`: the largest batch that could, 0 when not
    even batch 1, None when unknown."""

    max_batch: int | None = None


class TremulaNotice(UserWarning):
    """Something the user should know about an answer that is still given (a head left out, an input defaulted)."""


def notice(message: str) -> None:
    """Tell the user one line about their model or flags; the CLI prints it as `tremula: note: ...` on stderr.

    A warning (not a print) so library callers can filter, record or raise it like any other."""
    warnings.warn(message, TremulaNotice, stacklevel=2)
