"""The wait for an NCCL collective polls NCCL's own stream, not the copy
stream of slot 0 that other work shares (copy job 0, DLPack imports): a
collective must not wait for unrelated work queued there. The emulator's
_testing.emu_queue puts another library's kernel on a stream handle; a query of that
stream says "not ready" until it is synchronised."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import dpmini
from gpu_helpers import EMULATED, gpu, two_gpus

pytestmark = gpu
emulated = pytest.mark.skipif(not EMULATED, reason="uses the emulator's hooks")

# The emulator's handle of stream slot `slot` of device `dev` (cuda_emulate.c).
CHILD = textwrap.dedent("""
    import numpy as np, dpmini
    from dpmini import _testing
    _testing.emulated_nccl(1)
    x = np.arange(256, dtype="float32")
    src = dpmini.asarray(x, 0)
    spare = dpmini.empty((64,), np.uint8, device="cuda:0")
    slot0 = 0x1000 + 0 * 256 + 0
    _testing.emu_queue(0, slot0, spare.data_ptr, 64)   # unrelated work, unfinished
    outs = dpmini.comm.broadcast(src, [0, 1])
    np.testing.assert_array_equal(outs[1].numpy(), x)
    print("OK broadcast")
""")


@two_gpus
@emulated
def test_nccl_wait_ignores_unrelated_work_on_the_copy_stream():
    env = dict(os.environ, DPMINI_NCCL_TIMEOUT="3")
    here = Path(dpmini.__file__).resolve().parents[1]   # this dpmini first on sys.path
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                       timeout=120, env=env, cwd=here)
    assert r.returncode == 0 and "OK broadcast" in r.stdout, r.stdout + r.stderr
