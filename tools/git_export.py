"""Export a git revision's folders for a tool's ``--baseline REV`` run."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def export_revision(rev: str, dest: str | Path, paths: tuple[str, ...]) -> None:
    """Write revision ``rev``'s ``paths`` (folders of this repository) under ``dest``
    (``git archive | tar -x``)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, *paths], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
