"""``tools/profile_self_time.py``: shares by function from a py-spy raw profile."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RAW = """\
<module> (a.py:1);main (a.py:5);run (b.py:9);hot (c.py:3) 6
<module> (a.py:1);main (a.py:5);run (b.py:9) 2
<module> (a.py:1);main (a.py:5);run (b.py:9);helper (c.py:7);hot (c.py:4) 2
<module> (a.py:1);setup (a.py:2) 10
"""


def test_self_and_inclusive_shares_under_a_root(tmp_path):
    profile = tmp_path / "prof.txt"
    profile.write_text(RAW)
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "profile_self_time.py"), str(profile),
                          "--root", "run"], capture_output=True, text=True, check=True).stdout
    lines = [line.split() for line in out.splitlines()]
    assert lines[0][:3] == ["10", "samples", "under"]        # setup's 10 samples are not under run
    self_section = lines[2:lines.index(["---", "inclusive"])]
    assert self_section == [["80.0%", "hot", "(c.py)"], ["20.0%", "run", "(b.py)"]]
    assert ["80.0%", "hot", "(c.py)"] in lines and ["20.0%", "run", "(b.py)"] in lines
    assert ["100.0%", "run", "(b.py)"] in lines and ["20.0%", "helper", "(c.py)"] in lines
