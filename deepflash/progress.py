"""Progress bars for long work, on stderr so that stdout stays clean for text and --json output."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

T = TypeVar("T")
stderr = Console(stderr=True)


def bar(*extra_columns, disable: bool = False) -> Progress:
    """A progress display; extra columns show task fields (e.g. loss and tokens/s in training). disable:
    shown nowhere (training workers other than the lead)."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), *extra_columns,
                    TimeRemainingColumn(), console=stderr, transient=True, disable=disable)


def progress(items: Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
    with bar() as display:
        yield from display.track(items, total=total, description=description)
