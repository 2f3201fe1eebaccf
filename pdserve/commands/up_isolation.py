"""``pdserve up``'s ``isolate_services``: every service runs as a Unix user of its own.

Under one Unix user a service can read every file the others can: ``up``'s admin key (the
identity ``pdserve status`` uses), every other service's private key, and it can ptrace them
(``up`` included, whose memory holds the CA key). No file mode separates processes of one user,
so isolation needs other users. As root, ``up`` gives each service identity a user id of its
own (:data:`BASE_UID` upward, in start order; numeric ids that need no ``/etc/passwd`` entry;
all the masters share one, as they share one certificate) and starts the service as that user:

- its private key (and, for the masters, their etcd client key) is the only key it can read:
  ``<name>.key`` belongs to it, mode 0600, at every renewal too; ``admin.key`` stays root's,
  and the CA key never touches the disk (it lives in ``up``, which no service may ptrace);
- its state is its own: the master's state dir, a node's disk tier (``kvdisk/<node id>``),
  etcd's data dir, and a home (``<run_dir>/home/<name>``, ``$HOME``, for caches);
- the router's API key file is ``root:`` :data:`SHARED_GID` 0640 (the router reads it, and
  with a metrics key every service);
- storage segments in /dev/shm are 0600 and the node's: a worker cannot map them, so workers
  reach nodes over tcp, where every range needs the master's grant (the shm transport trusts
  whoever maps a segment).

Logs are files ``up`` opens and hands over; the run dir, the interpreter, the pdserve package
and the models' folders must be reachable by other users (their folders searchable).

The modes: ``auto``, the default, isolates whenever it can: as root, with store_backend
pdserve and every folder above reachable; otherwise every service runs as
``up``'s user and the banner says so, and why (:attr:`Isolation.note`, with the one-line fix).
``on`` refuses to start where it cannot isolate; ``off`` never does.
"""

from __future__ import annotations

import os
import re
import stat
import sys
from collections.abc import Sequence
from pathlib import Path

from pdserve.config import ConfigError
from pdserve.config_fields import auto_on_off
from pdserve.procs import SHARED_GID

#: The first service user id; one per service identity after it (the group that may read the
#: API key file, SHARED_GID, is the one below: :func:`pdserve.procs.spawn_service` adds it).
BASE_UID = SHARED_GID + 1
#: Most service identities (ids stay below 65534, nobody).
MAX_ACCOUNTS = 1000


def mode(value: object) -> str:
    """``isolate_services`` as auto, on or off (ConfigError for anything else)."""
    return auto_on_off(
        "isolate_services", value, "as root, whenever the services can reach their files"
    )


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

    def __init__(self, mode_: str, run_dir: str | Path) -> None:
        self.mode = mode(mode_)
        self.on = self.mode == "on"
        self.run_dir = Path(run_dir).resolve()
        #: Why the services are not isolated, for the banner ('' when they are, or when
        #: isolate_services is off: the user asked for that).
        self.note = ""
        self._uids: dict[str, int] = {}

    def check(self, models: Sequence[Path] = (), store_backend: str = "pdserve") -> None:
        """Decides whether the services run as users of their own (mode auto) or checks they
        can (on: ConfigError when not root, a Mooncake store, or a folder the services could
        not reach: the run dir, the interpreter, the pdserve package, ``models``)."""
        if self.mode == "off":
            self.on = False
            return
        why = self._obstacle(models, store_backend)
        if why is None:
            self.on = True
            self.run_dir.chmod(0o755)
            return
        if self.mode == "on":
            raise ConfigError(f"isolate_services: {why}")
        self.on = False
        self.note = (
            f"every service runs as your user and can read the others' keys: {why} "
            "(isolate_services off silences this)"
        )

    def _obstacle(self, models: Sequence[Path], store_backend: str) -> str | None:
        """What keeps the services from running as users of their own here (None: nothing)."""
        if os.geteuid() != 0:
            return "isolating the services takes root (run up as root to isolate them)"
        if store_backend == "mooncake":
            return (
                "store_backend mooncake's processes cannot run as users of their own (use "
                "store_backend pdserve to isolate them)"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        import pdserve

        for what, path in (
            ("their certificates in the run dir", self.run_dir),
            ("the Python interpreter", Path(os.path.realpath(sys.executable))),
            ("the pdserve package", Path(pdserve.__file__).resolve().parent),
            *(("the model", Path(m).resolve()) for m in models),
        ):
            blocked = unsearchable(path)
            if blocked is not None:
                return (
                    f"{blocked} is not searchable by other users, so the services could not "
                    f"reach {what} ({path}); `chmod o+x {blocked}` (or a path others can "
                    "reach) lets them"
                )
        return None

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
