"""`make lab`: JupyterLab with the course kernel, always behind a token, on 127.0.0.1 by default.

    python -m course_lib.workbook.lab [--port 8888] [--ip 127.0.0.1]

The token comes from JUPYTER_TOKEN (or the file JUPYTER_TOKEN_FILE names, e.g. a Docker secret)
or is generated, and is printed once. It reaches the server through the environment, never the
command line, where `ps` would show it to every user of the machine. The Docker image
(docker/entrypoint.sh) binds 0.0.0.0 inside its container, with the token, and compose publishes
the port on the host's 127.0.0.1 only. The browser test (tests/test_browser.py) starts the lab
with the same `lab_command`.
"""
from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path

from .results import REPO_ROOT


def lab_command(token: str, port: int = 8888, ip: str = "127.0.0.1",
                root: str | os.PathLike = REPO_ROOT / "notebooks") -> tuple[list[str], dict[str, str]]:
    """The command line and environment that start JupyterLab on `ip:port`, serving `root`, behind `token`."""
    if not token or len(token) < 16:
        raise ValueError("JupyterLab must not run without a token of at least 16 characters")
    argv = [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--ip={ip}", f"--port={port}",
            "--ServerApp.port_retries=0", f"--ServerApp.root_dir={root}"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # CI runners and bare containers run as root
        argv.append("--allow-root")
    # a learner drives the widgets here: whatever the calling process ran headless before is not inherited
    env = {k: v for k, v in os.environ.items() if k not in ("JUPYTER_TOKEN_FILE", "COURSE_HEADLESS")}
    env["JUPYTER_TOKEN"] = token
    return argv, env


def read_token() -> str:
    """JUPYTER_TOKEN, else the contents of JUPYTER_TOKEN_FILE, else a fresh random token."""
    token = os.environ.get("JUPYTER_TOKEN", "").strip()
    if not token and os.environ.get("JUPYTER_TOKEN_FILE"):
        token = Path(os.environ["JUPYTER_TOKEN_FILE"]).read_text().strip()
    return token or secrets.token_hex(24)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8888)
    parser.add_argument("--ip", default="127.0.0.1", help="address to listen on (the container uses 0.0.0.0)")
    parser.add_argument("--root", default=str(REPO_ROOT / "notebooks"), help="the folder JupyterLab serves")
    args = parser.parse_args(argv)
    try:
        command, env = lab_command(read_token(), args.port, args.ip, args.root)
    except ValueError as e:
        sys.exit(f"error: {e}")
    print(f"JupyterLab on http://127.0.0.1:{args.port}/lab?token={env['JUPYTER_TOKEN']}", flush=True)
    os.execve(command[0], command, env)


if __name__ == "__main__":
    main()
