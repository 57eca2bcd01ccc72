"""`python -m lossfx.selfcheck` without a loopback network fails fast and says why (issue 15 item 10).

Before, its gloo rendezvous on 127.0.0.1 retried for torch's default 30 minutes. Now a preflight
TCP connection to 127.0.0.1 fails at once (exit status 2, a message naming the loopback
network), and a rendezvous that does not complete fails after `--rendezvous-timeout` seconds.
"""

import os
import queue
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lossfx import selfcheck

ROOT = Path(__file__).resolve().parents[1]


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", "-n", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _unshare_works(), reason="needs `unshare -n` (a network namespace whose lo is down)")
def test_without_loopback_the_selfcheck_exits_within_a_minute_saying_why():
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = ["unshare", "-n", sys.executable, "-m", "lossfx.selfcheck", "--dtypes", "float64", "--backend", "eager"]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert time.monotonic() - start < 60
    assert proc.returncode == selfcheck.NO_NETWORK_EXIT, proc.stdout + proc.stderr
    assert "no loopback network" in proc.stderr and "127.0.0.1" in proc.stderr, proc.stderr
    assert "SELF-CHECK FAILED" in proc.stderr


def test_a_failed_loopback_connection_stops_main_before_any_rank_starts(monkeypatch, capsys):
    def unreachable(*args, **kwargs):
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(selfcheck.socket, "create_connection", unreachable)
    assert "Network is unreachable" in selfcheck.loopback_error()
    monkeypatch.setattr(selfcheck.mp, "get_context", lambda *a: pytest.fail("no rank may start"))
    assert selfcheck.main(["--dtypes", "float64", "--backend", "eager"]) == selfcheck.NO_NETWORK_EXIT
    assert "no loopback network" in capsys.readouterr().err


def test_loopback_available_here():
    assert selfcheck.loopback_error() is None


def test_a_rendezvous_that_never_completes_fails_after_its_timeout():
    """Rank 1 of 2 alone: nobody serves the store, so it reports after 3 s instead of 30 minutes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens there
    results: queue.Queue = queue.Queue()
    start = time.monotonic()
    selfcheck._worker(1, 2, port, ["float64"], "eager", results, rendezvous_s=3.0)
    rank, rows, error = results.get_nowait()
    assert time.monotonic() - start < 30
    assert rank == 1 and rows == [] and f"rendezvous on 127.0.0.1:{port} failed within 3 s" in error
