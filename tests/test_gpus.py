"""``shmclient.gpus``: the GPU-UUID map asks torch only where torch could see a GPU (a
driver's device node), where it is loaded, or when asked to; an answer given without
torch is not kept. Each case runs in a fresh interpreter (this one has torch loaded)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

ROOT = __file__.rsplit("/tests/", 1)[0]
NO_NODE = "/nonexistent/shmclient-test-driver-node"


def _run(body: str) -> list:
    code = "import json, sys\nfrom shmclient import gpus\n" + textwrap.dedent(body)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_without_a_driver_node_torch_is_not_imported_and_the_answer_not_kept():
    got = _run(f"""
        gpus.DRIVER_NODES = ({NO_NODE!r},)
        first = [gpus.local_gpu_uuids(), "torch" in sys.modules, gpus._uuid_to_index]
        import torch
        seen = [str(torch.cuda.get_device_properties(i).uuid)
                for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
        # torch is loaded now: the next call asks it, and keeps its answer
        print(json.dumps([first, gpus.local_gpu_uuids() == seen,
                          gpus._uuid_to_index == {{u: i for i, u in enumerate(seen)}}]))
        """)
    assert got == [[[], False, None], True, True]


def test_a_driver_node_makes_it_ask_torch():
    got = _run("""
        gpus.DRIVER_NODES = ("/dev/null",)  # exists: stands in for /dev/nvidiactl
        gpus.local_gpu_uuids()
        print(json.dumps(["torch" in sys.modules, gpus._uuid_to_index is not None]))
        """)
    assert got == [True, True]


def test_ask_torch_asks_it_without_a_driver_node():
    got = _run(f"""
        gpus.DRIVER_NODES = ({NO_NODE!r},)
        gpus.local_gpu_uuids(ask_torch=True)
        print(json.dumps(["torch" in sys.modules, gpus._uuid_to_index is not None]))
        """)
    assert got == [True, True]
