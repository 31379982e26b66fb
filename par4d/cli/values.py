"""Number flags checked where argparse reads them: a value that makes no sense (not a number, out of range,
inf or nan) is one usage error, exit status 2, before anything is measured or started."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def count(low: int = 1) -> Callable[[str], int]:
    """An argparse ``type``: a whole number >= ``low``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value}: give {low} or more")
        return value
    return parse


def number(low: float = 0.0, *, above: bool = True) -> Callable[[str], float]:
    """An argparse ``type``: a finite number > ``low`` (``above``) or >= ``low``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or value < low or (above and value == low):
            raise argparse.ArgumentTypeError(f"{text}: give a finite number {'above' if above else 'of at least'} "
                                             f"{low:g}")
        return value
    return parse
