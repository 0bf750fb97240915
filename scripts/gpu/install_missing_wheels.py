"""Install each wheel of a folder into a target folder where this Python lacks its distribution or has an older
version of it: no index, no dependencies (the folder carries what the machine lacks).

    python scripts/gpu/install_missing_wheels.py FOLDER TARGET     # then TARGET on PYTHONPATH

scripts/gpu/run_gpu_tests.sh runs it on build/qload: compressed-tensors and what it imports (pydantic, loguru), and
accelerate, for tests/gpu/test_quantized_exports.py. Made where pip reaches the index (Python 3.12, x86-64 Linux):
    pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d build/qload \\
        compressed-tensors==0.20.0 pydantic==2.14.4 pydantic-core==2.50.5 typing-inspection==0.4.5 \\
        annotated-types==0.8.0 typing-extensions==4.16.0 loguru==0.7.3 accelerate==1.15.0
"""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.utils import parse_wheel_filename
from packaging.version import Version


def main() -> int:
    folder, target = Path(sys.argv[1]), Path(sys.argv[2])
    wanted = []
    for wheel in sorted(folder.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(wheel.name)
        try:
            present = Version(metadata.version(name))
        except metadata.PackageNotFoundError:
            present = None
        if present is None or present < version:
            wanted.append(str(wheel))
        print(f"{name} {version}: {'install' if wanted and wanted[-1] == str(wheel) else 'keep'} (here: {present or 'none'})")
    if wanted:
        command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade", "--target", str(target)]
        return subprocess.run(command + wanted).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
