"""`pdserve up --isolate-services`: each service runs as a Unix user of its own and can read
its own private key only: not up's admin key, not another service's key (issue 35's probe 7
through the real processes)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from up_harness import complete, start_up, stop_up

import pdserve
from pdserve.commands.up_isolation import BASE_UID, unsearchable

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="isolate_services takes root")

READ = """
import sys
for path in sys.argv[1:]:
    try:
        open(path, "rb").read(1)
        print("read", path)
    except PermissionError:
        print("denied", path)
"""


@pytest.fixture
def reachable_python():
    """Lets other users enter the folders above this interpreter and pdserve (a pyenv under
    /root is 0700 here) for the test, as `up` asks an operator to; restores them after."""
    changed: dict[Path, int] = {}
    for path in (Path(os.path.realpath(sys.executable)), Path(pdserve.__file__).resolve().parent):
        while (blocked := unsearchable(path)) is not None:
            changed[blocked] = blocked.stat().st_mode & 0o7777
            blocked.chmod(changed[blocked] | 0o001)
    yield
    for folder, mode in changed.items():
        folder.chmod(mode)


def _uid(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^Uid:\s+(\d+)", status, re.M).group(1))


@pytest.mark.slow
def test_isolated_services_each_read_only_their_own_key_and_still_serve(reachable_python):
    base = Path(tempfile.mkdtemp(prefix="pdserve-isolated-"))
    base.chmod(0o755)  # the services must reach their certificates in the run dir
    proc, _banner, ports, run_dir = start_up(
        base, "--engine", "torch", "--model", "tiny", "--chunk-size", "16",
        "--segment-size", "64MiB", "--isolate-services",
    )  # fmt: skip
    try:
        while not (run_dir / "services.json").exists():
            assert proc.poll() is None
            time.sleep(0.1)
        services = {
            s["name"]: s for s in json.loads((run_dir / "services.json").read_text())["services"]
        }
        uids = {name: _uid(s["pid"]) for name, s in services.items()}
        assert all(uid >= BASE_UID for uid in uids.values()), uids
        assert len(set(uids.values())) == len(uids), uids  # one user each
        certs = run_dir / "certs"
        node_id = next(p.stem for p in certs.glob("node-*.key"))
        keys = {k.stem: str(k) for k in certs.glob("*.key")}
        assert {"admin", "meta", "kvstore-master", "router", "decode-0", node_id} <= set(keys)

        # the storage node's user reads its own key and no other, admin's included
        node_uid = uids["kvstore-node-0"]
        probe = subprocess.run(
            [sys.executable, "-c", READ, *keys.values()],
            user=node_uid, group=node_uid, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        seen = dict(line.split(" ", 1)[::-1] for line in probe.stdout.splitlines())
        assert seen == {
            path: "read" if name == node_id else "denied" for name, path in keys.items()
        }, probe.stdout + probe.stderr

        # and the cluster serves, its KV chunks in the store: the workers wrote them over tcp
        # with the master's grants (a worker's user may not map the node's 0600 segment)
        key = (run_dir / "api_key").read_text().strip()
        prompt = "isolated services share this prefix " * 4
        want = complete(ports["http"], prompt, key)["choices"][0]["text"]
        assert complete(ports["http"], prompt, key)["choices"][0]["text"] == want
        status = subprocess.run(
            [sys.executable, "-m", "pdserve.commands.cli", "status", "--run-dir", str(run_dir),
             "--json"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert status.returncode == 0, status.stderr  # up's admin key, root's, still works
        assert json.loads(status.stdout)["store"]["objects"] > 0, status.stdout
    finally:
        stop_up(proc)
        shutil.rmtree(base, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr.read()[-3000:]
