"""What a newcomer meets first: the README's API snippet runs as printed, the license file
matches the declared license."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _readme_block(heading):
    text = (ROOT / "README.md").read_text()
    section = text[text.index(f"## {heading}\n"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_api_snippet_runs_as_printed():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["JAX_PLATFORMS"] = "cpu"  # a GPU host's default would be its GPUs
    out = subprocess.run([sys.executable, "-c", _readme_block("API")], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "(512, 256)"


def test_license_file_matches_the_declared_license():
    declared = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'license = \{ text = "Apache-2.0" \}', declared)
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
