"""The JupyterLab server behind the browser tests: its own port, token and private Jupyter folders.

Started from this venv, so notebooks run on the venv's kernel spec and the code under test; settings
switch off news, update checks and toasts and keep every cell in the DOM, so the UI is the same on
every machine and outputs can be read wherever they are.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

SERVER_START_S = 240.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))


def _quiet_lab_settings(settings: Path, config: Path) -> None:
    """User settings for a clean, deterministic UI: no news/update prompts, no toasts, all cells in the DOM."""
    _write_json(settings / "@jupyterlab/apputils-extension/notification.jupyterlab-settings",
                {"fetchNews": "false", "checkForUpdates": False, "doNotDisturbMode": True})
    # Windowing would detach off-screen cells, and their outputs could not be read.
    _write_json(settings / "@jupyterlab/notebook-extension/tracker.jupyterlab-settings",
                {"windowingMode": "none"})
    _write_json(config / "labconfig/page_config.json",
                {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}})


_THEME_SETTINGS = "@jupyterlab/apputils-extension/themes.jupyterlab-settings"


class _PortTaken(Exception):
    pass


class LabServer:
    """A JupyterLab server process in its own process group, with private Jupyter directories."""

    def __init__(self, base: Path) -> None:
        self.root = base / "root"
        self.token = secrets.token_hex(16)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = base / "jupyterlab.log"
        self._base = base
        self._proc: subprocess.Popen[bytes] | None = None

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        venv_bin = str(Path(sys.executable).parent)
        env.update({
            "PATH": venv_bin + os.pathsep + env.get("PATH", ""),
            # Private user-level Jupyter dirs: the kernel spec comes from this venv, not ~/.local.
            "JUPYTER_CONFIG_DIR": str(self._base / "config"),
            "JUPYTER_DATA_DIR": str(self._base / "data"),
            "JUPYTER_RUNTIME_DIR": str(self._base / "runtime"),
            "JUPYTERLAB_SETTINGS_DIR": str(self._base / "settings"),
            "JUPYTERLAB_WORKSPACES_DIR": str(self._base / "workspaces"),
            "IPYTHONDIR": str(self._base / "ipython"),
            "MPLCONFIGDIR": str(self._base / "mpl"),
            "PYTHONUNBUFFERED": "1",
        })
        env.pop("JUPYTER_PATH", None)
        return env

    def start(self) -> None:
        self.root.mkdir(parents=True)
        _quiet_lab_settings(self._base / "settings", self._base / "config")
        for _ in range(3):
            self._launch()
            try:
                self._wait_until_up()
                return
            except _PortTaken:
                # Another process took the free port between our probe and the server's bind.
                self.port = _free_port()
                self.url = f"http://127.0.0.1:{self.port}"
        raise RuntimeError(f"JupyterLab found no free port:\n{self.log_tail()}")

    def _launch(self) -> None:
        args = [
            sys.executable, "-m", "jupyterlab",
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={self.port}",
            "--ServerApp.port_retries=0",
            f"--ServerApp.token={self.token}",
            f"--ServerApp.root_dir={self.root}",
            "--ServerApp.terminals_enabled=False",
            "--LabApp.expose_app_in_browser=True",  # window.jupyterapp, to run commands and read state
            # Notebook 7 (the `notebook` server extension, /tree and /notebooks/<path>) from the same server.
            "--JupyterNotebookApp.expose_app_in_browser=True",
            "--LabApp.news_url=None",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LabApp.extension_manager=readonly",
            f"--LabApp.user_settings_dir={self._base / 'settings'}",
            f"--LabApp.workspaces_dir={self._base / 'workspaces'}",
        ]
        if os.geteuid() == 0:
            args.append("--allow-root")
        with self.log_path.open("wb") as log:
            self._proc = subprocess.Popen(args, cwd=self.root, env=self._env(), stdin=subprocess.DEVNULL,
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def _wait_until_up(self) -> None:
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                if "already in use" in self.log_tail():
                    raise _PortTaken()
                raise RuntimeError(f"JupyterLab exited with {self._proc.returncode}:\n{self.log_tail()}")
            try:
                self.api("GET", "/api/status")
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.5)
        raise RuntimeError(f"JupyterLab did not answer within {SERVER_START_S:.0f}s:\n{self.log_tail()}")

    def set_theme(self, theme: str | None) -> None:
        """The theme pages opened from now on load with (``None``: JupyterLab's default, light).

        A user setting, read by the server on each request, so no restart is needed."""
        path = self._base / "settings" / _THEME_SETTINGS
        if theme is None:
            path.unlink(missing_ok=True)
        else:
            _write_json(path, {"theme": theme, "adaptive-theme": False})

    def api(self, method: str, path: str) -> Any:
        req = urllib.request.Request(f"{self.url}{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            body = resp.read()
        return json.loads(body) if body else None

    def shutdown_kernels(self) -> None:
        """Stop every session and kernel, so one test's kernel does not hold memory in the next."""
        for session in self.api("GET", "/api/sessions"):
            self.api("DELETE", f"/api/sessions/{session['id']}")
        for kernel in self.api("GET", "/api/kernels"):
            self.api("DELETE", f"/api/kernels/{kernel['id']}")

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no server log)"

    def stop(self) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        try:
            self.shutdown_kernels()
        except Exception:  # the process group is killed below anyway
            pass
        # SIGTERM lets the server shut its kernels down; SIGKILL the group if it hangs.
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue
