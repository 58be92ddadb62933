"""examples/python/lessons.py runs to completion (its own asserts check each lesson's numbers)."""
import os
import subprocess
import sys

from conftest import ROOT


def test_lessons_script_runs():
    script = os.path.join(ROOT, "examples", "python", "lessons.py")
    r = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[[0.71 0.   0.71]" in r.stdout and "all lessons reproduced" in r.stdout
