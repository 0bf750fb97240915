"""The examples in docs/api.md run as written, so the documentation cannot drift from the code."""

from __future__ import annotations

import re
from pathlib import Path

API_DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"
BLOCK = re.compile(r"^```python( inside-ranks)?\n(.*?)^```", re.MULTILINE | re.DOTALL)


def test_api_examples_run():
    blocks = BLOCK.findall(API_DOC.read_text())
    assert len(blocks) >= 5
    namespace: dict = {}
    for inside_ranks, code in blocks:
        compiled = compile(code, str(API_DOC), "exec")
        if not inside_ranks:
            exec(compiled, namespace)  # noqa: S102 (our own documentation)
