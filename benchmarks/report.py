"""What the benchmarks share besides the machine's limits (machine_limits.py): a command
line described by the script's own docstring, and figures saved the same way."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def parser_from_doc(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser whose --help opens with the first paragraph of `doc` and shows
    every option's default."""
    first = (doc or "").split("\n\n")[0].replace("\n", " ")
    return argparse.ArgumentParser(description=first, formatter_class=argparse.ArgumentDefaultsHelpFormatter)


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display on benchmark machines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> None:
    """Lays out, writes (110 dpi) and closes a figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
