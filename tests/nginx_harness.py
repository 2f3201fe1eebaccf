"""A real nginx for a test: deploy/nginx/pdserve.conf with its ``${NAME}`` placeholders filled,
run in the foreground (``nginx -c FILE -g 'daemon off;'``) with its pid file, logs and temp
files in the test's folder (no root paths), on a free 127.0.0.1 port, stopped by its pid."""

from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parents[1] / "deploy" / "nginx" / "pdserve.conf"


def nginx_binary() -> str | None:
    """nginx on PATH, or Debian's /usr/sbin/nginx (not on a user's PATH)."""
    found = shutil.which("nginx")
    if found:
        return found
    return "/usr/sbin/nginx" if Path("/usr/sbin/nginx").is_file() else None


def render(template: str, values: dict[str, str]) -> str:
    """``template`` with each ``${NAME}`` of ``values`` replaced (envsubst's way); an
    AssertionError names a placeholder left without a value."""
    out = template
    for name, value in values.items():
        out = out.replace("${" + name + "}", value)
    left = sorted(set(re.findall(r"\$\{(\w+)\}", out)))
    assert not left, f"placeholders without a value: {left}"
    return out


class Nginx:
    """nginx running ``conf`` (the text of a whole config) from ``run_dir``; ``port`` is the
    one it listens on (the config's). Up once that port takes connections."""

    def __init__(self, conf: str, run_dir: Path, port: int, timeout: float = 30.0) -> None:
        binary = nginx_binary()
        assert binary is not None, "nginx is not installed (scripts/setup.sh installs it)"
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        self.port = port
        path = run_dir / "nginx.conf"
        path.write_text(conf)
        # -e: the error log from the start (before the config is read, nginx would open the
        # compiled-in /var/log/nginx/error.log); -p: relative paths under run_dir
        cmd = [binary, "-p", str(run_dir), "-e", str(run_dir / "error.log"), "-c", str(path)]
        self.proc = subprocess.Popen(
            [*cmd, "-g", "daemon off;"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + timeout
        while not self._listening():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                err = self.proc.stderr.read().decode() if self.proc.poll() is not None else ""
                self.stop()
                raise AssertionError(f"nginx did not start: {err}\n{self.error_log()}")
            time.sleep(0.05)

    def _listening(self) -> bool:
        with socket.socket() as s:
            s.settimeout(1.0)
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def error_log(self) -> str:
        path = self.run_dir / "error.log"
        return path.read_text()[-4000:] if path.exists() else ""

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (fast shutdown) to the master by its pid, SIGKILL if it lingers."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr is not None:
            self.proc.stderr.close()
