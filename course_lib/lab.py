"""`make lab`: JupyterLab with the course kernel, on 127.0.0.1 only, always behind a token.

The token comes from JUPYTER_TOKEN or is generated, and is printed once. The browser test
(tests/test_browser.py) starts the lab with the same `lab_command`.
"""
from __future__ import annotations

import argparse
import os
import secrets
import sys

from .results import REPO_ROOT


def lab_command(token: str, port: int = 8888, root: str | os.PathLike = REPO_ROOT / "notebooks") -> list[str]:
    if not token:
        raise ValueError("JupyterLab must not run without a token")
    return [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
            "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8888)
    args = parser.parse_args(argv)
    token = os.environ.get("JUPYTER_TOKEN") or secrets.token_hex(24)
    print(f"JupyterLab on http://127.0.0.1:{args.port}/lab?token={token}", flush=True)
    os.execv(sys.executable, lab_command(token, args.port))


if __name__ == "__main__":
    main()
