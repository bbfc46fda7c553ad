"""A progress bar on stderr: tqdm when it is installed, else a plain counter."""

from __future__ import annotations

import sys


class _Counter:
    """"[12/180] label" on stderr: rewritten in place on a terminal, one line per point elsewhere."""

    def __init__(self, total: int):
        self.total, self.done = total, 0
        self.tty = sys.stderr.isatty()
        print("(tqdm is not installed: showing a plain counter)", file=sys.stderr)

    def set_description(self, label: str) -> None:
        self._label = label

    def update(self, n: int = 1) -> None:
        self.done += n
        line = f"[{self.done}/{self.total}] {getattr(self, '_label', '')}"
        print(f"\r{line:<100}" if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def write(self, text: str) -> None:
        print(("\n" if self.tty else "") + text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr)


def progress(total: int):
    """An object with ``set_description``, ``update``, ``write`` and ``close``."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _Counter(total)
    return tqdm(total=total, file=sys.stderr, dynamic_ncols=True, unit="pt")
