"""The README's Python example runs as written, on the embedded SmolLM2 and its shipped draft."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.optimized
def test_the_readme_python_example_runs(capsys, smollm2_gguf):
  code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
  exec(compile(code, "README.md", "exec"), {})
  text, stats = capsys.readouterr().out.strip().rsplit("\n", 1)
  assert text and stats.startswith("tau ")
