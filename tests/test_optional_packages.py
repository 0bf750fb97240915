"""A conversion-only install (`pip install .`: no megatron-core, no transformers) converts both ways, and the
commands that need those packages say in one line which to install (exit 2, a usage error), as do installs of
them too old for what mconvert uses. The child processes run with an import blocker (a sitecustomize that
refuses to import either package), or with an older release's metadata ahead of the installed one."""

from __future__ import annotations

import tomllib

import pytest
from cli_runner import REPO, assert_one_line_error, run_cli

from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.dependencies import VERIFY, VERIFY_INSTALL

BLOCKER = '''
import sys

class _NotInstalled:
    """Import nothing of the packages a conversion-only install lacks."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("megatron", "transformers"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NotInstalled())
'''


@pytest.fixture(scope="module")
def conversion_only(tmp_path_factory):
    directory = tmp_path_factory.mktemp("blocker")
    (directory / "sitecustomize.py").write_text(BLOCKER)
    return (directory,)


def old_release(tmp_path, distribution, version):
    """A directory whose metadata says `distribution` `version` is installed, to put ahead on the path."""
    info = tmp_path / f"{distribution.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
    return (tmp_path,)


@pytest.fixture(scope="module")
def models(hf_model_factory, tmp_path_factory):
    hf = hf_model_factory("qwen3-8b")
    mcore = tmp_path_factory.mktemp("mcore") / "ckpt"
    convert_hf_to_mcore(hf, mcore)
    return hf, mcore


def test_a_conversion_only_install_converts_both_ways(conversion_only, models, tmp_path):
    hf, _ = models
    there = run_cli("hf-to-mcore", "--load-dir", hf, "--save-dir", tmp_path / "mcore", "--tp", "2", python_path=conversion_only)
    assert there.returncode == 0, there.stderr
    back = run_cli("mcore-to-hf", "--load-dir", tmp_path / "mcore", "--save-dir", tmp_path / "hf", python_path=conversion_only)
    assert back.returncode == 0, back.stderr
    assert (tmp_path / "hf" / "config.json").exists()
    assert "not checked against transformers' class: transformers is not installed" in back.stdout


def test_verify_without_megatron_core_and_transformers(conversion_only, models, tmp_path):
    hf, mcore = models
    result = run_cli("verify", "--hf", hf, "--mcore", mcore, "--device", "cpu", "--json", tmp_path / "r.json", python_path=conversion_only)
    assert_one_line_error(
        result, "mconvert verify", "megatron-core>=0.13 (not installed)", "transformers>=4.56 (not installed)",
        VERIFY_INSTALL, code=2,
    )
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize(
    "distribution, version, needed", [("transformers", "4.45.0", "transformers>=4.56"), ("megatron-core", "0.12.0", "megatron-core>=0.13")]
)
def test_verify_with_a_release_too_old(models, tmp_path, distribution, version, needed):
    hf, mcore = models
    result = run_cli("verify", "--hf", hf, "--mcore", mcore, "--device", "cpu", python_path=old_release(tmp_path, distribution, version))
    err = assert_one_line_error(result, f"{needed} ({version} is installed)", VERIFY_INSTALL, code=2)
    assert "not installed" not in err  # the other one is


def test_the_checked_minimums_are_the_verify_extra():
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["verify"]
    assert {f"{r.distribution}>={r.minimum}" for r in VERIFY} <= set(extra)
