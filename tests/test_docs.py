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


def test_names_keep_the_paths_earlier_api_docs_showed():
    """Code written against docs/api.md before the package was split by concern imports from these paths."""
    from mconvert.converters.megatron import Parallelism as OldParallelism
    from mconvert.converters.safetensors_io import HFCheckpoint as OldHFCheckpoint
    from mconvert.formats.hf_checkpoint import HFCheckpoint
    from mconvert.mcore.parallelism import Parallelism

    assert OldParallelism is Parallelism and OldHFCheckpoint is HFCheckpoint


QUICKSTART = API_DOC.parent / "quickstart.md"
SHELL_BLOCK = re.compile(r"^```bash(?: (\w+))?\n(.*?)^```", re.MULTILINE | re.DOTALL)
REPO = API_DOC.parents[1]


def test_quickstart_commands_run(tmp_path):
    """Every command of docs/quickstart.md, in order, in one empty directory. Blocks marked `install` are
    pip's dry run of the same request (no index: it builds the package's metadata, installs nothing); `hub`
    runs against a hub cache holding the small model under the hub id, offline; `gpu` (training) runs with
    stand-ins for nvidia-smi and the per-node python, and what torchrun was asked to run is checked."""
    import os
    import subprocess
    import sys

    from tests.test_hub import COMMIT, add_snapshot
    from tests.test_launch import STAND_INS, torchrun_args

    blocks = SHELL_BLOCK.findall(QUICKSTART.read_text())
    assert [kind for kind, _ in blocks].count("") >= 6
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env |= {"PATH": f"{Path(sys.executable).parent}:{env['PATH']}", "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}

    def run(script: str, cwd: Path = work, **extra: str) -> subprocess.CompletedProcess:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env={**env, **extra}, capture_output=True, text=True)
        assert done.returncode == 0, f"{script}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done

    for kind, script in blocks:
        if kind == "install":
            for line in script.strip().splitlines():
                assert line.startswith("pip install ")
                done = run(f"python -m pip install --dry-run --no-deps --no-build-isolation --no-index {line.removeprefix('pip install ')}", cwd=REPO)
                assert "Would install mconvert-" in done.stdout
        elif kind == "hub":
            add_snapshot(tmp_path / "hub", "Qwen/Qwen2.5-7B-Instruct", COMMIT, work / "qwen-hf")
            run(script, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
            assert (work / "qwen7b-mcore" / "release" / ".metadata").exists()
        elif kind == "gpu":
            stand_ins, record = tmp_path / "bin", tmp_path / "record"
            stand_ins.mkdir()
            record.mkdir()
            for name in ("nvidia-smi", "python"):
                (stand_ins / name).write_text("#!/bin/bash\n" + STAND_INS[name] + "\n")
                (stand_ins / name).chmod(0o755)
            run(script, PATH=f"{stand_ins}:/usr/bin:/bin", RECORD=str(record), COMPUTE_CAP="9.0")
            launcher = torchrun_args((record / "node-0.argv").read_text().splitlines())
            assert launcher.training_script == "/path/to/Megatron-LM/pretrain_gpt.py" and launcher.nproc_per_node == "8"
            pretrain = launcher.training_script_args
            assert pretrain[pretrain.index("--train-iters") + 1] == "10"
            assert pretrain[pretrain.index("--load") + 1] == str(work / "qwen-mcore")
        else:
            assert kind == "", kind
            run(script)
    assert (work / "qwen-hf-back" / "mconvert.sha256").exists()


MARKDOWN = [REPO / "README.md", REPO / "scripts" / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.MULTILINE)
HTML_ANCHOR = re.compile(r"<a (?:id|name)=\"([^\"]+)\"")


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings (lower case, punctuation but `-` and `_` dropped, spaces to
    `-`, a repeated one suffixed -1, -2, ...), and those of its `<a id=...>` tags."""
    text = FENCE.sub("", page.read_text())
    found: set[str] = set(HTML_ANCHOR.findall(text))
    seen: dict[str, int] = {}
    for heading in HEADING.findall(text):
        plain = LINK.sub(lambda link: link.group(0)[1 : link.group(0).index("](")], heading).replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", plain.lower()).replace(" ", "-")
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


def broken_links(pages: list[Path]) -> list[str]:
    """Each relative link of the pages whose file or anchor does not exist, as `page: target`."""
    broken = []
    for page in pages:
        for target in LINK.findall(FENCE.sub("", page.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists() or (anchor and (linked.suffix != ".md" or anchor not in anchors(linked))):
                broken.append(f"{page.relative_to(REPO)}: {target}")
    return broken


def test_relative_links_resolve():
    """Every relative link in README.md, scripts/README.md and docs/ names a file that exists, and an anchor
    that one of its headings (or `<a id>` tags) gives."""
    assert len(MARKDOWN) > 10
    assert broken_links(MARKDOWN) == []
