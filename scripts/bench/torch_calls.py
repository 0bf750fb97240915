"""Which of torch's functions and tensor methods mconvert's own code calls while one command runs, from every thread
(the conversion's work runs in worker threads): what a conversion needs of torch at all.

    python scripts/bench/torch_calls.py hf-to-mcore --load-dir HF --save-dir OUT --tp 2 --quiet
    python scripts/bench/torch_calls.py mcore-to-hf --load-dir OUT --save-dir BACK --quiet

Prints one line a function (`name  <- the mconvert modules calling it`) on standard error, after the command's own
output. Profiling every call makes the command several times slower: a list, not a timing.
"""

from __future__ import annotations

import collections
import runpy
import sys
import threading

used: dict[str, set[str]] = collections.defaultdict(set)


def where(code) -> str:
    return code.co_filename.split("/mconvert/")[-1]


def record(frame, event, arg) -> None:
    if event == "c_call":  # a built-in called from mconvert's frame
        if "/mconvert/" not in frame.f_code.co_filename:
            return
        owner = type(getattr(arg, "__self__", None))
        module = getattr(arg, "__module__", None) or owner.__module__
        name = getattr(arg, "__qualname__", getattr(arg, "__name__", "?"))
        if "torch" in module or "Tensor" in name:
            used[f"{module}.{name}"].add(where(frame.f_code))
    elif event == "call" and "site-packages/torch/" in frame.f_code.co_filename:
        caller = frame.f_back
        if caller is not None and "/mconvert/" in caller.f_code.co_filename:
            used[f"{frame.f_code.co_filename.split('site-packages/')[-1]}:{frame.f_code.co_name}"].add(where(caller.f_code))


def main() -> None:
    threading.setprofile(record)
    sys.setprofile(record)
    sys.argv = ["mconvert", *sys.argv[1:]]
    try:
        runpy.run_module("mconvert", run_name="__main__")
    except SystemExit:
        pass
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        for name in sorted(used):
            print(f"{name}  <- {', '.join(sorted(used[name]))}", file=sys.stderr)


if __name__ == "__main__":
    main()
