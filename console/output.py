"""The console a command's report is printed on. Off a terminal (a file, a pipe) rich assumes 80 columns and
shrinks a wider table until its cells read '…' (bench's prediction-error table lost every number); there a table
is printed at its own natural width instead, while text keeps rich's wrapping. On a terminal nothing changes: its
width is all there is, and rich fits the table to it."""
from __future__ import annotations

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

MEASURING_WIDTH = 100_000  # room enough that measuring a table never shrinks it
# off a terminal a table gets the width it needs up to this: a cell longer than that (a 64-node tree's paths) wraps
# inside its column rather than stretching every line of the table across thousands of columns
MAX_REPORT_WIDTH = 200


class ReportConsole(Console):
    """rich's Console, printing each table off a terminal at the width it needs."""

    def natural_width(self, table: Table) -> int:
        return Measurement.get(self, self.options.update_width(MEASURING_WIDTH), table).maximum

    def print(self, *objects, **kwargs) -> None:
        tables = [o for o in objects if isinstance(o, Table)]
        natural = 0 if self.is_terminal else max((self.natural_width(t) for t in tables), default=0)
        if natural > MAX_REPORT_WIDTH:  # fold what does not fit into its column's lines (rich's default cuts it)
            for table in tables:
                for column in table.columns:
                    column.overflow = "fold"
        needed = min(natural, MAX_REPORT_WIDTH)
        if needed <= self.width:
            super().print(*objects, **kwargs)
            return
        Console(file=self.file, width=needed, no_color=self.no_color).print(*objects, **kwargs)


def report_console(stderr: bool = False) -> ReportConsole:
    return ReportConsole(stderr=stderr)


WARNING_PREFIX = "warning: "


def note_line(note: str) -> str:
    """A result's note as printed: 'note: ...', or a warning as it stands ('warning: ...', never 'note: warning:')."""
    return note if note.startswith(WARNING_PREFIX) else f"note: {note}"
