"""What ``pdserve up`` hands its services to prove who they are and to let users in: the
certificates (issued at start by a CA whose key stays in up's memory, renewed in place at
half their life) and the router's API key file."""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import secrets
import threading
import time
from pathlib import Path

from pdserve.commands import up_etcd
from pdserve.commands.up_isolation import Isolation
from pdserve.commands.up_settings import (
    API_KEY_FILE,
    CERTS_DIR,
    UpSettings,
    admin_tls,
    progress,
    tls_files,
)

#: Seconds before a failed certificate renewal is tried again.
RENEW_RETRY_S = 30.0
#: Longest sleep of the renewing thread (seconds).
RENEW_POLL_S = 5.0


class UpSecrets:
    """One run's certificates and API key (none of either when ``cfg`` turns them off)."""

    def __init__(self, cfg: UpSettings, isolation: Isolation) -> None:
        self.cfg = cfg
        self.isolation = isolation  # whose each key is
        self.issuer = None  # with TLS: the CA that issued and renews the certificates
        self.etcd_issuer = None  # with TLS and up's own etcd: the CA only that etcd trusts
        self.identities: list[tuple[str, str]] = []
        self.renew_at = math.inf  # monotonic time of the next renewal
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def secure(self, identities: list[str]) -> None:
        """With TLS on, issues every service's certificate and ``up``'s admin one from a new
        CA (its key never written) and makes ``up`` dial as admin; with it off,
        ``up`` dials plaintext (whatever PDSERVE_TLS_* says)."""
        from pdserve import identity
        from pdserve.commands import certs

        c = self.cfg
        if not c.tls:
            identity.configure_files(None)
            return
        # made anew each start from a new CA whose key stays in this process's memory: a
        # service (same Unix user) cannot mint identities, and a leaked certificate dies with
        # this run's CA or after cert_hours; leaf certificates follow a changed --host
        self.issuer = certs.Issuer.in_memory(Path(c.run_dir) / CERTS_DIR)
        self.identities = [certs.parse_identity(i) for i in identities]
        if up_etcd.embedded(c):  # up's etcd trusts a CA of its own: the masters' alone
            folder = Path(c.run_dir) / CERTS_DIR / up_etcd.ETCD_CERTS
            self.etcd_issuer = certs.Issuer.in_memory(folder)
        self._issue()
        identity.configure_files(admin_tls(c.run_dir))
        # a thread, not the supervision loop: a start can take longer than half a life
        self._renewer = threading.Thread(target=self._renew_loop, name="renew-certs", daemon=True)
        self._renewer.start()

    def _renew_loop(self) -> None:
        while not self._stop.wait(min(RENEW_POLL_S, max(0.0, self.renew_at - time.monotonic()))):
            self.renew()

    def stop(self) -> None:
        """Stops renewing (``up`` stops; the certificates then expire on their own)."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(10)

    def _issue(self) -> None:
        """Issues (or renews) every identity's certificate for ``cert_hours``."""
        c = self.cfg
        life = datetime.timedelta(hours=c.cert_hours)
        owner = self.isolation.uid
        for role, name in self.identities:
            # up's own (admin) key stays up's: no service can act as an admin
            self.issuer.issue(role, name, [c.host], life, None if role == "admin" else owner(name))
        if self.etcd_issuer is not None:
            for role, name in (up_etcd.ETCD_SERVER.split(":"), up_etcd.ETCD_CLIENT.split(":")):
                self.etcd_issuer.issue(role, name, [], life, owner(name))
        self.renew_at = time.monotonic() + life.total_seconds() / 2

    def renew(self) -> None:
        """Renews every certificate once half its life has passed (the renewing thread calls
        it); the services load the new files within a second (:mod:`pdserve.identity`). A
        failed renewal is retried."""
        if self.issuer is None or time.monotonic() < self.renew_at:
            return
        try:
            self._issue()
        except OSError as exc:
            self.renew_at = time.monotonic() + RENEW_RETRY_S
            progress(f"renewing the certificates failed ({exc}); again in {RENEW_RETRY_S:.0f}s")
            return
        progress(
            f"renewed {len(self.identities)} certificates for {self.cfg.cert_hours:g} h "
            f"(the next renewal in {self.renew_at - time.monotonic():.0f}s)"
        )

    def tls(self, name: str) -> dict[str, str]:
        """The tls_* flags of the service whose certificate is ``name`` (none: TLS off)."""
        return tls_files(self.cfg.run_dir, name) if self.cfg.tls else {}

    def metrics(self) -> dict[str, object]:
        """The metrics key flag of a service with a metrics port: beyond loopback with TLS on,
        a metrics port takes a key (:func:`pdserve.telemetry.configure_metrics`), and up gives
        every service the router's API key file (Prometheus then sends it:
        ``authorization: {credentials_file: <run_dir>/api_key}``); none on loopback."""
        from pdserve.identity import is_loopback

        c = self.cfg
        if not c.tls or is_loopback(c.host):
            return {}
        return {"metrics_key_file": self.key_file()}  # validate() made sure auth is on

    def key_file(self) -> Path | None:
        """With auth on, writes the router's API key to ``<run_dir>/api_key`` (0600; a file,
        not a flag: flags show in `ps`): api_key, else the key an earlier run left there,
        else a new one. Sets ``cfg.api_key`` to it."""
        c = self.cfg
        if not c.auth:
            return None
        path = Path(c.run_dir) / API_KEY_FILE
        if not c.api_key:
            with contextlib.suppress(OSError):
                c.api_key = path.read_text().partition("\n")[0].strip()
            c.api_key = c.api_key or secrets.token_urlsafe(32)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # O_CREAT's mode does not apply to a file that exists
        with os.fdopen(fd, "w") as f:
            f.write(c.api_key + "\n")
        self.isolation.share(path)
        return path
