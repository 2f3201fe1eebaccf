"""``pdserve up --isolate-services``: every service runs as a Unix user of its own.

Under one Unix user a service can read every file the others can: ``up``'s admin key (the
identity ``pdserve status`` uses), every other service's private key, and it can ptrace them.
No file mode separates processes of one user, so isolation needs other users. As root, ``up``
gives each service identity a user id of its own (:data:`BASE_UID` upward, in start order;
numeric ids that need no ``/etc/passwd`` entry; all the masters share one, as they share one
certificate) and starts the service as that user:

- its private key (and, for the masters, their etcd client key) is the only key it can read:
  ``<name>.key`` belongs to it, mode 0600, at every renewal too; ``admin.key`` stays root's;
- its state is its own: the master's state dir, a node's disk tier (``kvdisk/<node id>``),
  etcd's data dir, and a home (``<run_dir>/home/<name>``, ``$HOME``, for caches);
- the router's API key file is ``root:`` :data:`SHARED_GID` 0640 (the router reads it, and
  with a metrics key every service);
- storage segments in /dev/shm are 0600 and the node's: a worker cannot map them, so workers
  reach nodes over tcp, where every range needs the master's grant (the shm transport trusts
  whoever maps a segment).

Logs are files ``up`` opens and hands over; the run dir and its parents must be searchable by
other users (``up`` checks, and says which to ``chmod o+x``).
"""

from __future__ import annotations

import os
import re
import stat
import sys
from pathlib import Path

from pdserve.config import ConfigError
from pdserve.procs import SHARED_GID

#: The first service user id; one per service identity after it (the group that may read the
#: API key file, SHARED_GID, is the one below: :func:`pdserve.procs.spawn_service` adds it).
BASE_UID = SHARED_GID + 1
#: Most service identities (ids stay below 65534, nobody).
MAX_ACCOUNTS = 1000


def unsearchable(path: Path) -> Path | None:
    """The first of ``path``'s folders (``path`` itself when it is one) that other users may
    not enter (no ``o+x``); None when they can reach it."""
    folders = [path, *path.parents] if path.is_dir() else list(path.parents)
    for d in reversed(folders):
        if not os.stat(d).st_mode & stat.S_IXOTH:
            return d
    return None


class Isolation:
    """The user each service runs as (none when off: all run as ``up``'s user)."""

    def __init__(self, on: bool, run_dir: str | Path) -> None:
        self.on = on
        self.run_dir = Path(run_dir).resolve()
        self._uids: dict[str, int] = {}

    def check(self) -> None:
        """ConfigError when isolation cannot work here: not root, or a run dir other users
        cannot reach."""
        if not self.on:
            return
        if os.geteuid() != 0:
            raise ConfigError(
                "isolate_services starts each service as a user of its own, which takes root: "
                "run up as root, or leave isolate_services off (every service then runs as "
                "your user and can read the others' keys)"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        import pdserve

        for what, path in (
            ("their certificates in the run dir", self.run_dir),
            ("the Python interpreter", Path(os.path.realpath(sys.executable))),
            ("the pdserve package", Path(pdserve.__file__).resolve().parent),
        ):
            blocked = unsearchable(path)
            if blocked is not None:
                raise ConfigError(
                    f"isolate_services: {blocked} is not searchable by other users, so the "
                    f"services could not reach {what} ({path}): chmod o+x {blocked}, or use a "
                    "path others can reach"
                )
        self.run_dir.chmod(0o755)

    def uid(self, account: str) -> int | None:
        """The user id of service identity ``account`` (None when off)."""
        if not self.on:
            return None
        if account not in self._uids:
            if len(self._uids) >= MAX_ACCOUNTS:
                raise ConfigError(f"isolate_services: more than {MAX_ACCOUNTS} service identities")
            self._uids[account] = BASE_UID + len(self._uids)
        return self._uids[account]

    @staticmethod
    def account(service: str, args: list[str]) -> str:
        """The identity a service runs as: its certificate's name (``--tls-cert .../NAME.crt``)
        when it has one, else its service name with a master's index dropped (the masters
        share one identity)."""
        if "--tls-cert" in args:
            return Path(args[args.index("--tls-cert") + 1]).stem
        return re.sub(r"^(kvstore-master)-\d+$", r"\1", service)

    def give(self, path: Path, account: str) -> None:
        """Makes ``path`` (created as a directory when missing; a tree: all of it) belong to
        ``account``."""
        uid = self.uid(account)
        if uid is None:
            return
        path.mkdir(parents=True, exist_ok=True)
        os.chown(path, uid, uid)
        for root, dirs, files in os.walk(path):
            for name in dirs + files:
                os.chown(os.path.join(root, name), uid, uid, follow_symlinks=False)

    def spawn(self, service: str, args: list[str]) -> tuple[int | None, dict[str, str]]:
        """(user id, environment additions) to start ``service`` with; its home is made."""
        account = self.account(service, args)
        uid = self.uid(account)
        if uid is None:
            return None, {}
        home = self.run_dir / "home" / account
        self.give(home, account)
        user = f"pdserve-{account}"
        return uid, {"HOME": str(home), "USER": user, "LOGNAME": user}

    def share(self, path: Path) -> None:
        """``path`` readable by every service (group :data:`SHARED_GID`), written by root."""
        if self.on:
            os.chown(path, 0, SHARED_GID)
            path.chmod(0o640)
