"""`import lossfx` stays cheap: it pulls in nothing beyond torch, einops and the standard library.

(einops is a declared dependency: the sequence layouts' `rearrange` patterns; it imports in ~10 ms
and nothing heavy with it.)

The bound is on what is imported, not on a timing (which a loaded machine makes flaky): the one
heavy module lossfx used to import, `torch.distributed.tensor` (~0.5 s, more than the rest of
lossfx; benchmarks/bench_import.py measures it), must stay out, and DTensor inputs must still be
recognised when that module is imported after lossfx.
"""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_ADDED = r"""
import json, sys
import torch
before = set(sys.modules)
import lossfx
added = sorted(set(sys.modules) - before)
print(json.dumps({"added": added, "dtensor": "torch.distributed.tensor" in sys.modules}))
"""

_DTENSOR_AFTER_LOSSFX = r"""
import torch, lossfx
import torch.distributed as dist
from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
z = torch.randn(2, 5, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
ids = torch.tensor([[0, 6, 3, 2, 1], [5, 4, 4, 0, 6]])
dz = distribute_tensor(z, DeviceMesh("cpu", [0]), [Shard(-1)])
assert lossfx._boundary.dtensor.is_dtensor(dz)
got = lossfx.token_logprobs(dz, ids)
want = lossfx.reference.token_logprobs(z, ids)
torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
print("ok")
"""


def _python(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout.strip().splitlines()[-1]


def test_import_adds_only_lossfx_and_standard_library_modules():
    out = json.loads(_python(_ADDED))
    assert not out["dtensor"], "import lossfx imported torch.distributed.tensor (~0.5 s)"
    foreign = [m for m in out["added"] if m.split(".")[0] not in sys.stdlib_module_names | {"lossfx", "einops"}]
    assert foreign == [], f"import lossfx pulled in modules beyond torch: {foreign}"
    assert "lossfx.reference" in out["added"]  # the probe sees lossfx's own modules


def test_dtensor_imported_after_lossfx_is_recognised():
    assert _python(_DTENSOR_AFTER_LOSSFX) == "ok"


def test_bench_import_runs_and_records_the_environment(tmp_path):
    env_cmd = [sys.executable, "-m", "benchmarks.bench_import", "--runs", "1", "--out", str(tmp_path)]
    proc = subprocess.run(env_cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads((tmp_path / "import_time.json").read_text())
    assert {"date", "machine", "torch", "lossfx"} <= set(doc["environment"])
    assert doc["lossfx"]["median_s"] > 0
    assert {m.split(".")[0] for m in doc["modules_added_beyond_stdlib"]} <= {"einops"}
