"""The device count from NVML (csrc/backend/gpu_nvml.c) against a stand-in
libnvidia-ml built here: NVML counts physical GPUs, while CUDA enumerates a
MIG-mode GPU's instances, so NVML's count is used only when no GPU has MIG
mode on (else -1: the runtime counts). The stand-in reads its GPUs' MIG modes
from $FAKE_NVML_MIG ("0,1": two GPUs, the second in MIG mode; "ns": a GPU
whose NVML does not support MIG queries)."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FAKE_NVML = r"""
#include <stdlib.h>
#include <string.h>
static char modes[64][4];
static unsigned n;
int nvmlInit_v2(void)
{
    const char *v = getenv("FAKE_NVML_MIG");
    n = 0;
    while (v != NULL && *v && n < 64) {
        size_t k = strcspn(v, ",");
        memcpy(modes[n], v, k < 3 ? k : 3);
        modes[n++][k < 3 ? k : 3] = 0;
        v += k + (v[k] == ',');
    }
    return 0;
}
int nvmlShutdown(void) { return 0; }
int nvmlDeviceGetCount_v2(unsigned *c) { *c = n; return 0; }
int nvmlDeviceGetHandleByIndex_v2(unsigned i, void **d) { *d = (void *)(size_t)(i + 1); return i < n ? 0 : 2; }
int nvmlDeviceGetMigMode(void *d, unsigned *cur, unsigned *pend)
{
    const char *m = modes[(size_t)d - 1];
    if (strcmp(m, "ns") == 0)
        return 3;   /* NVML_ERROR_NOT_SUPPORTED */
    *cur = *pend = (unsigned)atoi(m);
    return 0;
}
"""

DRIVER = r"""
#include <stdio.h>
int dpc_nvml_device_count(const char *library);
int main(int argc, char **argv) { printf("%d\n", argc > 1 ? dpc_nvml_device_count(argv[1]) : -2); return 0; }
"""


@pytest.fixture(scope="module")
def count_program(tmp_path_factory):
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler: `cc` is not on PATH")
    tmp = tmp_path_factory.mktemp("nvml")
    (tmp / "fake.c").write_text(FAKE_NVML)
    (tmp / "driver.c").write_text(DRIVER)
    lib, exe = tmp / "libnvidia-ml.so.1", tmp / "count"
    for cmd in ([cc, "-shared", "-fPIC", "-o", str(lib), str(tmp / "fake.c")],
                [cc, "-std=c11", "-Wall", "-Wextra", "-Werror", "-Icsrc/backend", "-o", str(exe),
                 str(tmp / "driver.c"), "csrc/backend/gpu_nvml.c", "-ldl"]):
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr

    def run(mig, library=lib):
        env = dict(os.environ, FAKE_NVML_MIG=mig)
        out = subprocess.run([str(exe), str(library)], capture_output=True, text=True, env=env,
                             timeout=60)
        return int(out.stdout)
    return run


@pytest.mark.parametrize("mig, count", [("0,0", 2), ("0,0,0,0,0,0,0,0", 8), ("ns,ns", 2),
                                        ("", 0)])
def test_nvml_count_is_the_physical_gpus_without_mig(count_program, mig, count):
    assert count_program(mig) == count


@pytest.mark.parametrize("mig", ["1", "0,1", "1,0,0"])
def test_a_gpu_in_mig_mode_leaves_the_count_to_the_cuda_runtime(count_program, mig):
    assert count_program(mig) == -1


def test_missing_nvml_leaves_the_count_to_the_cuda_runtime(count_program, tmp_path):
    assert count_program("0", library=tmp_path / "absent.so") == -1
