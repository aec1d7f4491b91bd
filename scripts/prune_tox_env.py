"""Free a finished tox env's disk when CI asks for it (``KVFSM_PRUNE_ENVS=1``; .ci/run sets it).

The vLLM envs (e2e, vllm, vllm034) each install several GB (a CUDA torch and vLLM, or vLLM's CPU build) and
unpack vLLM's sdist. On a CI machine with a small disk, three of them side by side ran out of space, so CI runs
them one after another (tox ``depends``) and each removes its installed packages and scratch files once its
commands have run. The env's ``log/`` stays: .ci/run prints the last line of every command log.

A developer's run (the variable unset) keeps the env, so the next ``tox -e vllm`` reuses it.

usage: prune_tox_env.py ENVDIR [ENVTMPDIR]
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

PRUNE_VARIABLE = "KVFSM_PRUNE_ENVS"

# What a venv holds besides the interpreter links and tox's logs: installed packages, headers, data, the e2e
# env's tiny models, and tox's record of what it installed (without it, a later run rebuilds the env rather than
# trusting packages that are gone).
_PRUNED = ("lib", "lib64", "include", "share", "kvfsm-e2e-models", ".tox-info.json")


def _size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += (Path(root) / name).lstat().st_size
            except OSError:
                pass
    return total


def main(argv: list[str]) -> int:
    if os.environ.get(PRUNE_VARIABLE) != "1":
        print(f"prune_tox_env: {PRUNE_VARIABLE} is not 1; keeping the env")
        return 0
    if not argv:
        print("prune_tox_env: usage: prune_tox_env.py ENVDIR [ENVTMPDIR]", file=sys.stderr)
        return 2
    envdir = Path(argv[0])
    targets = [envdir / name for name in _PRUNED]
    targets.extend(Path(extra) for extra in argv[1:])
    freed = 0
    for target in targets:
        if target.is_symlink():
            target.unlink()
        elif target.is_file():
            freed += target.stat().st_size
            target.unlink()
        elif target.exists():
            freed += _size(target)
            shutil.rmtree(target, ignore_errors=True)
    print(f"prune_tox_env: freed {freed / 2**30:.1f} GiB under {envdir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
