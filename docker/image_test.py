"""`make image-test`: build the CPU image from docker/Dockerfile and run the whole workbook inside it.

    python docker/image_test.py [--only 00,03] [--cold] [--torch-index URL]

1. Docker: the daemon that answers, else dockerd started here (root only) and stopped again at the end.
2. The base: Debian bookworm by debootstrap, from the mirror apt uses here, imported as
   local/debian:bookworm and kept (later runs reuse it).
3. A wheelhouse: everything the image installs, downloaded by this Python's pip (its find-links give the
   CPU torch), served on 127.0.0.1 to the build, which then needs no index and downloads no CUDA torch.
   From scratch on a bookworm host, it downloads while debootstrap runs (both wait on the network).
4. The image: docker/Dockerfile with docker/cpu.args, nothing else (BuildKit; cached layers reused).
5. `lab` detached: refused without the token, served with it, published on 127.0.0.1 only.
6. `test --no-check`: every chapter under papermill in the container as a non-root uid, the
   repo's build/ mounted; the ledgers and the report land on the host, owned by you (as root, build/ is
   given to the container's uid for the run and handed back).
7. Compose: compose.yaml and compose.cpu.yaml validated, the `test` service run with `check` (the image check,
   once per image test: with no compose tool, `docker run` runs it).
8. The GPU flavour, as far as a daemon with no registry allows: BuildKit reads the Dockerfile with its
   default arguments and asks for the CUDA bases.
Everything is timed and written to build/docker/image-test.json (logs beside it). Exit code 0: all
passed; 1: something failed; 77: Docker cannot run here (the report says why; the pytest test skips).
--cold removes the base, the image, the wheelhouse and the daemon's build cache first: a build from scratch.
--prepare stops after steps 1-4 (the base, the wheelhouse and the build wait on the network: debootstrap, pip
download, the build's apt), writing build/docker/image-prepare.json: CI runs it beside `make install` (.ci/run),
whose pip leaves a core free (152 s wall, 143 s of CPU on 2 cores). The next full run finds the base, the
wheelhouse and the image made, and counts the prepare run's times for them in its from-scratch budget. Measured on
a 2-core AVX2 machine: the build took 176 s beside `make install` (162 s alone, 446 s beside `make test`).
`test` runs two chapters at a time (--jobs 2; the timed ones alone) with their solutions, as the notebook tests do:
in CI those tests then check this run instead of executing every chapter again (tests/test_notebooks.py).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import functools
import hashlib
import http.server
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
BUILD = REPO / "build"
OUT = BUILD / "docker"
PREPARED = OUT / "image-prepare.json"
IMAGE = "llm-course:cpu"
BASE = "local/debian:bookworm"
DOCKERD_FLAGS = ["--storage-driver=overlay2", "--iptables=false", "--bridge=none"]
WHEEL_PORT = 38471  # fixed: it is part of the build arguments, so a new port would miss the layer cache
BUDGET_S = 20 * 60  # build + run, from scratch
JOBS = 2  # `test --jobs 2`: two chapters at a time on the cpu profile (course_lib/workbook/runner.py: the timed ones alone)
# `test --solutions`: every exercise filled in, as tests/test_notebooks.py runs them (which can then check this run)
SKIPPED = 77
NOISE = re.compile(r"\[IPKernelApp\] WARNING \| Kernel is running over TCP without encryption\..*?transport encryption\.")
report: dict = {"status": "running", "steps": {}, "checks": [], "failures": []}


class Skip(Exception):
    """Docker cannot run here (no daemon, no root, no tools): the report says why."""


REPORT = OUT / "image-test.json"  # --prepare writes PREPARED instead


def save() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(json.dumps(report, indent=1))


def made_by_prepare(name: str, rep: dict | None = None) -> dict | None:
    """The --prepare run's record of a step (base, wheelhouse, build) that it made and this run (or the run whose
    report is `rep`) found cached."""
    rep = rep or report
    made = rep.get("prepared", {}).get("steps", {}).get(name, {})
    return made if rep["steps"].get(name, {}).get("cached") and made and not made.get("cached") else None


def step_record(name: str, rep: dict | None = None) -> dict:
    """A step's record; for one made by --prepare, the prepare run's (its seconds, its build steps)."""
    return made_by_prepare(name, rep) or (rep or report)["steps"].get(name, {})


def step_seconds(name: str, rep: dict | None = None) -> float:
    return step_record(name, rep).get("seconds", 0)


def check(what: str, ok: bool, detail: object = "") -> bool:
    print(f"{'ok  ' if ok else 'FAIL'} {what}{f': {detail}' if detail != '' else ''}", flush=True)
    report["checks"].append({"what": what, "ok": bool(ok), "detail": str(detail)})
    if not ok:
        report["failures"].append(f"{what} ({detail})" if detail != "" else what)
    return bool(ok)


class step:
    """`with step("build") as s:` times a step into report["steps"]["build"] (s is that dict)."""

    def __init__(self, name: str):
        self.name = name

    def __enter__(self) -> dict:
        print(f"== {self.name}", flush=True)
        self.start = time.monotonic()
        report["steps"][self.name] = {}
        return report["steps"][self.name]

    def __exit__(self, *exc) -> None:
        report["steps"][self.name]["seconds"] = round(time.monotonic() - self.start, 1)
        save()


def quiet(cmd: list, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    """A short command (a docker query, a container's one-liner): over `timeout` s it is stuck and raises."""
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)


def stream(cmd: list, log: Path, show=lambda line: True, env: dict | None = None, timeout: float = 600,
           stdin=None) -> tuple[int, str]:
    """Run `cmd`, every line to `log`, the lines `show` picks to stdout; (exit code, output). Killed after
    `timeout` s (the output then says so)."""
    lines, killed = [], threading.Event()
    with open(log, "w") as f:
        proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **(env or {})}, stdin=stdin, errors="replace")
        timer = threading.Timer(timeout, lambda: (killed.set(), proc.kill()))
        timer.start()
        for line in proc.stdout:
            f.write(line)
            lines.append(line)
            if show(line):
                print("   " + NOISE.sub("", line).rstrip(), flush=True)  # the log keeps every word
        rc = proc.wait()  # bounded: the timer kills it
        timer.cancel()
        if killed.is_set():
            lines.append(f"killed: still running after {timeout:.0f} s\n")
            f.write(lines[-1])
    return rc, "".join(lines)


# ---------------------------------------------------------------- Docker itself

def docker_cli() -> tuple[str, list[str], dict]:
    """(docker, its build command, that command's environment): a CLI that builds with BuildKit."""
    seen = []
    for cli in (shutil.which("docker"), "/usr/bin/docker"):
        if not cli or cli in seen or not os.access(cli, os.X_OK):
            continue
        seen.append(cli)
        if quiet([cli, "buildx", "version"]).returncode == 0:
            return cli, [cli, "buildx", "build", "--load"], {}
        version = quiet([cli, "version", "--format", "{{.Client.Version}}"]).stdout.strip()
        if re.match(r"\d+\.", version) and int(version.split(".")[0]) < 23:  # BuildKit built in, by env
            return cli, [cli, "build"], {"DOCKER_BUILDKIT": "1"}
    if not seen:
        raise Skip("no docker command here (apt-get install docker.io)")
    raise Skip(f"no docker CLI here builds with BuildKit ({', '.join(seen)}): Docker 23+ needs the buildx plugin")


def daemon_answers(cli: str) -> bool:
    return quiet([cli, "info", "--format", "{{.ServerVersion}}"], timeout=30).returncode == 0


def start_daemon(cli: str) -> subprocess.Popen | None:
    """None if a daemon answers already; else the dockerd started here (the caller stops it)."""
    if daemon_answers(cli):
        return None
    if os.geteuid() != 0:
        raise Skip("no Docker daemon answers, and starting dockerd needs root")
    dockerd = shutil.which("dockerd")
    if not dockerd:
        raise Skip("no Docker daemon answers, and there is no dockerd to start (apt-get install docker.io)")
    log = OUT / "dockerd.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([dockerd, *DOCKERD_FLAGS], stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if daemon_answers(cli):
            return proc
        time.sleep(1)
    stop_daemon(proc)
    tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-4:])
    raise Skip(f"dockerd {' '.join(DOCKERD_FLAGS)} did not start within 60 s: {tail}")


def stop_daemon(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)


# ---------------------------------------------------------------- the base, the wheelhouse

def apt_suites(root: Path = Path("/")) -> dict[str, str]:
    """{suite: mirror URI} from apt's sources here (one-line and deb822 files), first mention wins."""
    found: dict[str, str] = {}
    for path in [root / "etc/apt/sources.list", *sorted((root / "etc/apt/sources.list.d").glob("*"))]:
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        if path.suffix == ".sources":
            for stanza in re.split(r"\n\s*\n", text):
                fields = dict(re.findall(r"^([\w-]+):[ \t]*(.*)$", stanza, re.M))
                for uri in fields.get("URIs", "").split():
                    for suite in fields.get("Suites", "").split():
                        found.setdefault(suite, uri)
        else:
            for m in re.finditer(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+(\S+)", text, re.M):
                found.setdefault(m.group(2), m.group(1))
    return found


def base_sources(suites: dict[str, str]) -> list[str]:
    """The base image's apt lines: bookworm, its updates and security, from the mirrors apt uses here."""
    mirror = os.environ.get("DEBIAN_MIRROR") or suites.get("bookworm", "http://deb.debian.org/debian")
    lines = [f"deb {mirror} bookworm main"]
    lines += [f"deb {suites[s]} {s} main" for s in ("bookworm-updates", "bookworm-security") if s in suites]
    return lines


def make_base(cli: str) -> dict:
    for tool in ("debootstrap", "tar"):
        if not shutil.which(tool):
            raise Skip(f"no {tool} to make the Debian base (apt-get install {tool})")
    if os.geteuid() != 0:
        raise Skip("making the Debian base (debootstrap) needs root")
    sources = base_sources(apt_suites())
    mirror = sources[0].split()[1]
    with tempfile.TemporaryDirectory(prefix="llm-course-base-") as tmp:
        root = Path(tmp) / "rootfs"
        rc, out = stream(["debootstrap", "--variant=minbase", "bookworm", root, mirror], OUT / "base.log",
                         show=lambda _: False, timeout=2 * BUDGET_S)  # a long step: stuck past twice the whole budget
        if rc != 0:
            raise RuntimeError(f"debootstrap from {mirror} failed: {out.strip().splitlines()[-1:]}")
        (root / "etc/apt/sources.list").write_text("\n".join(sources) + "\n")
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for p in (root / junk).glob("*"):
                if p.is_file():
                    p.unlink()
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        imported = subprocess.run([cli, "import", "--change", 'CMD ["bash"]', "--change",
                                   f'LABEL org.opencontainers.image.description="debootstrap --variant=minbase bookworm {mirror}"',
                                   "-", BASE], stdin=tar.stdout, capture_output=True, text=True, timeout=600)
        tar.wait(60)  # import has read all it writes
        if imported.returncode != 0:
            raise RuntimeError(f"docker import failed: {imported.stderr.strip()}")
    return {"mirror": mirror, "sources": sources}


def cpu_args() -> dict[str, str]:
    lines = (DOCKER / "cpu.args").read_text().splitlines()
    return dict(ln.split("=", 1) for ln in (s.strip() for s in lines) if ln and not ln.startswith("#"))


def read_target(out: str, where: str) -> dict:
    """The target from TARGET_SH's output (machine, glibc, the Python's apt version)."""
    lines = out.split("\n")
    try:
        glibc = re.search(r"(\d+)\.(\d+)\s*$", lines[1]).groups()
        version = re.match(r"(\d+\.\d+\.\d+)", lines[2]).group(1)
    except (AttributeError, IndexError):
        raise RuntimeError(f"could not read {cpu_args()['PYTHON']}'s version and glibc's in {where}: {lines}") from None
    return {"python": version, "glibc": ".".join(glibc), "machine": lines[0].strip()}


TARGET_SH = "uname -m; ldd --version | head -1; apt-cache show --no-all-versions {} | sed -n 's/^Version: //p'"


def base_target(cli: str) -> dict:
    """What the wheelhouse is resolved for: the base's Python (apt's candidate), glibc and machine.
    Not the host's Python: bookworm's is 3.11.2, and some packages' latest releases want >= 3.11.5."""
    sh = "apt-get update -qq >/dev/null && " + TARGET_SH.format(cpu_args()["PYTHON"])
    return read_target(quiet([cli, "run", "--rm", "--network", "host", BASE, "bash", "-c", sh], timeout=300).stdout, BASE)


def host_target() -> dict | None:
    """The same read on a bookworm host (apt's candidate there, the host's glibc), None elsewhere: a from-scratch run
    downloads the wheelhouse for it while debootstrap makes the base (both wait on the network), and base_target
    confirms it once the base is there."""
    release = Path("/etc/os-release")
    if "VERSION_CODENAME=bookworm" not in (release.read_text() if release.is_file() else ""):
        return None
    done = subprocess.run(["bash", "-c", TARGET_SH.format(cpu_args()["PYTHON"])], capture_output=True, text=True,
                          timeout=60)
    try:
        return read_target(done.stdout, "this host")
    except RuntimeError:
        return None


def wheelhouse(target: dict, cold: bool, torch_index: str | None) -> tuple[Path, bool]:
    """(the folder, whether it was there already): every wheel the CPU image installs, for `target`'s
    Python and glibc, and DeepSpeed's sdist (the Dockerfile's deepspeed stage builds it)."""
    inputs = [REPO / "pyproject.toml", DOCKER / "build-requirements.txt", DOCKER / "cpu.args"]
    salt = json.dumps([target, torch_index]).encode()
    key = hashlib.sha256(b"".join(p.read_bytes() for p in inputs) + salt).hexdigest()[:12]
    dest = OUT / f"wheelhouse-{key}"
    if (dest / ".complete").is_file() and not cold:
        return dest, True
    for old in OUT.glob("wheelhouse-*"):
        shutil.rmtree(old)
    sys.path.insert(0, str(DOCKER))
    from requirements import COURSE_EXTRAS, requirements

    index = ["--extra-index-url", torch_index] if torch_index else []
    major, minor = (int(x) for x in target["glibc"].split("."))
    platforms = [f"manylinux_{major}_{m}_{target['machine']}" for m in range(minor, 16, -1)]
    platforms += [f"manylinux{tag}_{target['machine']}" for tag in ("2014", "2010", "1")]
    py = target["python"]
    build_system = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]
    abi = "cp" + "".join(py.split(".")[:2])
    with tempfile.TemporaryDirectory(prefix="llm-course-ds-") as tmp, open(OUT / "wheelhouse.log", "w") as log:
        def pip(*args) -> None:  # the torch and TensorFlow wheels: hundreds of MB from the index
            done = subprocess.run([sys.executable, "-m", "pip", *map(str, args)], stdout=log, stderr=subprocess.STDOUT,
                                  timeout=2 * BUDGET_S)
            if done.returncode != 0:
                raise RuntimeError(f"`pip {args[0]}` failed: see build/docker/wheelhouse.log")

        # DeepSpeed is published as an sdist only: keep it for the build, and make a wheel of it here
        # only so that pip can read its dependencies while it resolves for the image's Python.
        pip("download", "--no-deps", "--no-binary=:all:", "--dest", dest, *requirements(only=["deepspeed"]))
        pip("wheel", "--no-deps", "--wheel-dir", tmp, *dest.glob("deepspeed-*"))
        pip("download", "--only-binary=:all:", "--python-version", py, "--implementation", "cp", "--abi", abi,
            *sum([["--platform", p] for p in platforms], []), "--find-links", tmp, "--dest", dest,
            "-r", DOCKER / "build-requirements.txt", *requirements(["cpu", *COURSE_EXTRAS]), *build_system, *index)
    for wheel in dest.glob("deepspeed-*.whl"):
        wheel.unlink()
    torch = [p.name for p in dest.glob("torch-*.whl")]
    cuda = [p.name for p in dest.glob("nvidia_*")]
    if not torch or not all("+cpu" in t for t in torch) or cuda:
        raise RuntimeError(f"pip found PyPI's CUDA torch ({torch}, {len(cuda)} nvidia wheels): give it the CPU "
                           "build: make image-test TORCH_INDEX=https://download.pytorch.org/whl/cpu")
    (dest / ".complete").touch()
    return dest, False


def serve(folder: Path) -> http.server.ThreadingHTTPServer:
    """The wheelhouse on http://127.0.0.1:WHEEL_PORT/ (a directory listing is what pip's find-links reads)."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    class Server(http.server.ThreadingHTTPServer):
        def handle_error(self, request, client_address):  # uv may close a download once it has what it reads
            if not isinstance(sys.exc_info()[1], ConnectionError):
                super().handle_error(request, client_address)

    try:
        server = Server(("127.0.0.1", WHEEL_PORT), functools.partial(Quiet, directory=str(folder)))
    except OSError as e:
        raise RuntimeError(f"cannot serve the wheelhouse on 127.0.0.1:{WHEEL_PORT} ({e}): is another image test running?") from e
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def pip_cert() -> str | None:
    """The CA bundle pip uses here (PIP_CERT or pip's `cert` setting): handed to the build as a secret, as a
    build that reaches an index through a TLS-inspecting proxy needs (with the wheelhouse, pip contacts none)."""
    cert = os.environ.get("PIP_CERT")
    if not cert:
        listed = quiet([sys.executable, "-m", "pip", "config", "list"]).stdout
        m = re.search(r"\.cert='([^']+)'", listed)
        cert = m.group(1) if m else None
    return cert if cert and Path(cert).is_file() else None


# ---------------------------------------------------------------- build

def build(build_cmd: list[str], build_env: dict, uid: int, gid: int) -> dict:
    args = {**cpu_args(), "COURSE_UID": uid, "COURSE_GID": gid, "PIP_NO_INDEX": 1,
            "PIP_FIND_LINKS": f"http://127.0.0.1:{WHEEL_PORT}/"}
    cmd = [*build_cmd, "--network", "host", "--progress", "plain", "-f", DOCKER / "Dockerfile", "-t", IMAGE]
    for name, value in args.items():
        cmd += ["--build-arg", f"{name}={value}"]
    cert = pip_cert()
    if cert:
        cmd += ["--secret", f"id=pip-cert,src={cert}"]
    rc, out = stream([*cmd, REPO], OUT / "build.log", env=build_env, timeout=2 * BUDGET_S,
                     show=lambda line: bool(re.match(r"#\d+ (\[|DONE \d{2,}|ERROR)", line)) or "FAIL" in line)
    if rc != 0:
        raise RuntimeError(f"the CPU image did not build (build/docker/build.log): {out.strip().splitlines()[-3:]}")
    steps = {n for n, k in re.findall(r"^#(\d+) \[[\w-]+ (\d+)/\d+\]", out, re.M) if k != "1"}  # instructions, not FROM
    cached = set(re.findall(r"^#(\d+) CACHED", out, re.M))
    return {"pip_cert_secret": bool(cert), "steps": len(steps), "cached_steps": len(cached & steps),
            "cached": bool(steps) and steps <= cached}


def image_facts(cli: str, uid: int) -> dict:
    info = json.loads(quiet([cli, "image", "inspect", IMAGE]).stdout)[0]
    env = dict(e.split("=", 1) for e in info["Config"]["Env"])
    facts = {"size_bytes": info["Size"], "user": info["Config"]["User"], "flavour": env.get("COURSE_FLAVOUR")}
    check("the image runs as a non-root uid", facts["user"].split(":")[0] == str(uid) != "0", facts["user"])
    check("the image is the CPU flavour", env.get("COURSE_FLAVOUR") == "cpu" and env.get("PROFILE") == "cpu",
          f"COURSE_FLAVOUR={env.get('COURSE_FLAVOUR')} PROFILE={env.get('PROFILE')}")
    leaked = sorted(k for k in env if k in ("PIP_CERT", "PIP_NO_INDEX", "PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"))
    check("no build-time pip setting is baked into the image", not leaked, ", ".join(leaked) or "none")
    found = quiet([cli, "run", "--rm", "--network", "none", "--entrypoint", "bash", IMAGE, "-c",
                   "id -u; find / -xdev -name pip-cert 2>/dev/null; ls -A /run/secrets 2>/dev/null"],
                  timeout=300).stdout.split()  # find walks every file of the image
    check("a container runs as that uid", found[:1] == [str(uid)], found[:1])
    check("the build's CA secret is not in the image", found[1:] == [], found[1:] or "not found")
    return facts


# ---------------------------------------------------------------- build/ for the container's uid

def _walk(root: Path):
    yield root
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            yield Path(folder) / name


def lend(root: Path, uid: int, gid: int) -> dict[Path, tuple[int, int]]:
    """Give `root` to uid:gid for a container run; returns the owners to hand it back to."""
    owners = {}
    for p in _walk(root):
        st = os.lstat(p)
        owners[p] = (st.st_uid, st.st_gid)
        os.lchown(p, uid, gid)
    return owners


def hand_back(root: Path, owners: dict[Path, tuple[int, int]]) -> None:
    """Every file as it was; what the container made goes to the invoking user."""
    for p in _walk(root):
        os.lchown(p, *owners.get(p, (os.getuid(), os.getgid())))


# ---------------------------------------------------------------- run it: check, lab, test

def request(url: str, token: str | None = None, method: str = "GET") -> tuple[int, str, str]:
    """(status, final URL, body); redirects followed; the token, if any, in the Authorization header."""
    headers = {"Authorization": f"token {token}"} if token else {}
    data = None
    if method == "POST":
        data, headers["Content-Type"] = b"{}", "application/json"
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=20) as r:
            return r.status, r.geturl(), r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.geturl(), e.read().decode(errors="replace")


def host_addresses() -> list[str]:
    """This host's IPv4 addresses other than loopback."""
    out = quiet(["hostname", "-I"]).stdout.split() if shutil.which("hostname") else []
    return list(dict.fromkeys(a for a in out if re.fullmatch(r"[\d.]+", a) and not a.startswith("127.")))


def run_lab(cli: str, uid: int) -> None:
    """`lab` detached on a bridge network, published on 127.0.0.1; checked from the host."""
    name, net, token = f"llm-course-lab-{os.getpid()}", f"llm-course-test-{os.getpid()}", secrets.token_hex(24)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    chapter = sorted((REPO / "notebooks").glob("00_*.ipynb"))[0].name
    made = quiet([cli, "network", "create", "--driver", "bridge", net])
    if not check("a bridge network for the published port", made.returncode == 0, made.stderr.strip()):
        return
    try:
        started = subprocess.run([cli, "run", "-d", "--name", name, "--network", net, "-p", f"127.0.0.1:{port}:8888",
                                  "-e", "JUPYTER_TOKEN", IMAGE, "lab"], capture_output=True, text=True, timeout=120,
                                 env={**os.environ, "JUPYTER_TOKEN": token})  # the token never on a command line
        if not check("`lab` starts detached", started.returncode == 0, started.stderr.strip()):
            return
        url, deadline, status = f"http://127.0.0.1:{port}", time.monotonic() + 120, 0
        while time.monotonic() < deadline and status == 0:
            try:
                status = request(f"{url}/api/status")[0]
            except OSError:
                time.sleep(1)
        if not check("JupyterLab answers on the published port", status != 0, f"within {120 - deadline + time.monotonic():.0f} s"):
            return
        refused = {what: request(f"{url}{path}", method=method)[0] for what, path, method in (
            ("a notebook", f"/api/contents/{chapter}", "GET"), ("the kernel list", "/api/kernels", "GET"),
            ("a new kernel", "/api/kernels", "POST"))}
        check("without the token: 403 for a notebook, the kernel list, a new kernel",
              set(refused.values()) == {403}, refused)
        status, final, body = request(f"{url}/lab")
        check("without the token: /lab sends you to the login page", "/login" in final and "jupyter-config-data" not in body, final)
        check("a wrong token is refused", request(f"{url}/api/contents/{chapter}", token="0" * 48)[0] == 403)
        status, _, body = request(f"{url}/api/contents/{chapter}", token=token)
        check("with the token: the notebook is served", status == 200 and '"cells"' in body, status)
        status, _, body = request(f"{url}/api/kernels", token=token, method="POST")
        check("with the token: a kernel starts", status in (200, 201) and '"id"' in body, status)
        if '"id"' in body:
            request(f"{url}/api/kernels/{json.loads(body)['id']}", token=token, method="DELETE")
        published = quiet([cli, "port", name, "8888/tcp"]).stdout.split()
        check("the port is published on 127.0.0.1 only", published == [f"127.0.0.1:{port}"], published)
        gateway = quiet([cli, "network", "inspect", net, "--format", "{{range .IPAM.Config}}{{.Gateway}} {{end}}"]).stdout.split()
        reached = []
        addresses = list(dict.fromkeys(host_addresses() + gateway))
        for address in addresses:
            try:
                socket.create_connection((address, port), timeout=3).close()
                reached.append(address)
            except OSError:
                pass
        check("the port answers on no other address of this host", not reached,
              f"tried {', '.join(addresses) or 'none'}; answered: {', '.join(reached) or 'none'}")
        who = quiet([cli, "exec", name, "id", "-u"]).stdout.strip()
        check("Lab runs as the non-root uid", who == str(uid) != "0", who)
        processes = quiet([cli, "top", name, "-eo", "uid,args"]).stdout
        check("the token is on no process's command line", token not in processes)
    finally:
        logs = quiet([cli, "logs", name], timeout=30)
        (OUT / "lab.log").write_text((logs.stdout + logs.stderr).replace(token, "<token>"))
        quiet([cli, "rm", "-f", name])
        quiet([cli, "network", "rm", net])


def chapters(only: str | None) -> list[str]:
    stems = [p.stem for p in sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))]
    wanted = [w.strip().zfill(2) for w in (only or "").split(",") if w.strip()]
    return [s for s in stems if not wanted or s[:2] in wanted]


def run_workbook(cli: str, uid: int, only: str | None) -> float:
    """`test` with build/ mounted; the ledgers, executed notebooks and report checked on the host."""
    start, t0 = time.time(), time.monotonic()
    cmd = [cli, "run", "--rm", "--name", f"llm-course-test-{os.getpid()}", "--network", "none", "--shm-size", "2g",
           "-v", f"{BUILD}:/workspace/build", IMAGE, "test", "--no-check", "--jobs", str(JOBS), "--solutions"] + (["--only", only] if only else [])
    rc, out = stream(cmd, OUT / "test.log", show=lambda line: not line.startswith(("ok ", "I0000", "W0000")),
                     timeout=2 * BUDGET_S)
    seconds = time.monotonic() - t0
    names = chapters(only)
    runs = json.loads((BUILD / "runs.json").read_text()) if (BUILD / "runs.json").is_file() else {}
    bad = [n for n in names if runs.get(n, {}).get("status") != "ok" or runs[n].get("profile") != "cpu"]
    why = re.findall(r"^FAILED .*?(?=^  \d\d_|^book:|^\d+ of \d+ notebook|\Z)", out, re.M | re.S)  # runner's block
    check(f"`test`: {len(names)} chapter(s) pass in the container (cpu profile)", rc == 0 and not bad,
          f"exit {rc}; failed or missing: {', '.join(bad) or 'none'}" + "".join(f"\n     {w.strip()[:1500]}" for w in why))
    made = [BUILD / "results" / f"{n}.json" for n in names] + [BUILD / "executed" / f"{n}.ipynb" for n in names]
    made.append(BUILD / "report.html")
    stale = [str(p.relative_to(BUILD)) for p in made if not p.is_file() or p.stat().st_mtime < start]
    check("ledgers, executed notebooks and the report written to the host's build/", not stale,
          f"{len(made)} files; missing or old: {', '.join(stale) or 'none'}")
    owners = {p.stat().st_uid for p in made if p.is_file()}
    check("... by the container's non-root uid", owners == {uid} and uid != 0, owners)
    report["run"] = {"seconds": round(seconds, 1), "chapters": {n: runs.get(n, {}).get("seconds") for n in names}}
    return seconds


# ---------------------------------------------------------------- compose, the GPU flavour

RESET = object()  # what `!reset` stands for


def load_override(path: Path) -> dict:
    """A compose file with Compose 2's `!reset` tags read as RESET."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!reset", lambda loader, node: RESET)
    return yaml.load(path.read_text(), Loader=Loader)


def compose_files(version: int, folder: Path) -> list[Path]:
    """compose.yaml + compose.cpu.yaml, as the compose tool here reads them. Compose 1.x (Debian's
    docker-compose) predates the top-level `name` and the `!reset` tag: for it, `name` goes, and each key
    the override resets is dropped from both files (what v2 does with `!reset`). It merges the rest itself."""
    files = [DOCKER / "compose.yaml", DOCKER / "compose.cpu.yaml"]
    if version >= 2:
        return files
    import yaml

    base = yaml.safe_load(files[0].read_text())
    override = load_override(files[1])
    base.pop("name", None)

    def drop_resets(node: dict, path: list[str]) -> None:
        for key, value in list(node.items()):
            if value is RESET:
                del node[key]
                target = base
                for part in path:
                    target = target.get(part, {})
                target.pop(key, None)
            elif isinstance(value, dict):
                drop_resets(value, path + [key])

    drop_resets(override, [])
    out = [folder / "compose.yaml", folder / "compose.cpu.yaml"]
    for path, data in zip(out, (base, override)):
        path.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def image_check_passed(out: str) -> None:
    """`check` once per image test (`test` runs with --no-check): through compose's `test` service, else docker run."""
    check("the image check passes in the container (torch, TensorFlow, 2 gloo ranks, DeepSpeed, torch.compile on the CPU)",
          "image check passed" in out and not re.search(r"^FAIL ", out, re.M), "see build/docker/compose.log")


def run_compose(cli: str) -> dict:
    """Validate the compose files, then run the `test` service on the CPU image with the entrypoint's `check`."""
    if quiet([cli, "compose", "version"]).returncode == 0:
        tool, version = [cli, "compose"], 2
    elif shutil.which("docker-compose"):
        tool = [shutil.which("docker-compose")]
        v = quiet([*tool, "version", "--short"]).stdout.strip()
        version = int(v.split(".")[0]) if v[:1].isdigit() else 1
    else:
        rc, out = stream([cli, "run", "--rm", "--network", "none", IMAGE, "check"], OUT / "compose.log",
                         show=lambda line: line.startswith("FAIL"))
        image_check_passed(out)
        return {"checked": False, "why": "no compose tool here (docker compose, docker-compose): `check` ran by docker run"}
    with tempfile.TemporaryDirectory(prefix="llm-course-compose-") as tmp:
        files = compose_files(version, Path(tmp))
        (Path(tmp) / "models").mkdir()
        project = f"llm-course-image-test-{os.getpid()}"
        base = [*tool, "--project-directory", DOCKER, "-p", project]
        env = {**os.environ, "COURSE_MODELS": f"{tmp}/models"}
        alone = quiet([*base, "-f", files[0], "config", "-q"], env=env)
        check(f"compose {version}.x validates compose.yaml", alone.returncode == 0, alone.stderr.strip()[-300:])
        merged = quiet([*base, "-f", files[0], "-f", files[1], "config"], env=env)
        if not check(f"compose {version}.x validates compose.yaml + compose.cpu.yaml", merged.returncode == 0,
                     merged.stderr.strip()[-300:]):
            return {"checked": True, "tool": " ".join(tool), "version": version}
        import yaml

        services = yaml.safe_load(merged.stdout)["services"]
        check("the CPU override: image llm-course:cpu, no GPU reservation, Lab still on 127.0.0.1 only",
              all(s["image"] == IMAGE and "deploy" not in s for s in services.values())
              and all(str(p).startswith("127.0.0.1:") or (isinstance(p, dict) and p.get("host_ip") == "127.0.0.1")
                      for p in services["lab"].get("ports", [])), {k: s["image"] for k, s in services.items()})
        try:
            # the `test` service (its image, uid, mounts, environment) with the entrypoint's `check`: the chapters
            # themselves ran in the `test` step, and `test` = `check` + the chapters (docker/entrypoint.sh)
            rc, out = stream([*base, "-f", files[0], "-f", files[1], "run", "--rm", "-T", "test", "check"],
                             OUT / "compose.log", env={"COURSE_MODELS": f"{tmp}/models"},
                             show=lambda line: line.startswith("FAIL") or "error" in line.lower())
            check("the `test` service runs `check` on the CPU image through compose",
                  rc == 0 and "image check passed" in out, f"exit {rc}")
            image_check_passed(out)
        finally:
            quiet([*base, "-f", files[0], "-f", files[1], "down", "-v", "--remove-orphans"], env=env)
    return {"checked": True, "tool": " ".join(tool), "version": version,
            "not_checked": [] if version >= 2 else ["the top-level `name` and the `!reset` tag (Compose 2 features)"]}


def gpu_plan(build_cmd: list[str], build_env: dict) -> dict:
    """The GPU flavour with its default arguments, as far as a daemon with no registry goes: BuildKit
    parses the Dockerfile, expands the arguments and asks for the CUDA bases. Not tried where a registry
    answers (that would be a real, hour-long GPU build)."""
    text = (DOCKER / "Dockerfile").read_text()
    defaults = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))
    bases = [re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], defaults[k]) for k in ("BUILDER_IMAGE", "BASE_IMAGE")]
    try:
        socket.getaddrinfo("registry-1.docker.io", 443)
        return {"checked": False, "why": "a registry answers here: this would be a real GPU build"}
    except OSError:
        pass
    rc, out = stream([*build_cmd, "--progress", "plain", "-f", DOCKER / "Dockerfile", "-t", "llm-course:gpu-plan", REPO],
                     OUT / "gpu-plan.log", show=lambda line: False, env=build_env, timeout=300)
    asked = [b for b in bases if b in out]
    parse_error = re.search(r"(?i)parse error|unknown instruction|failed to process", out)
    check("GPU flavour: BuildKit reads the Dockerfile (default arguments) and asks the registry for its CUDA base",
          rc != 0 and asked and not parse_error, f"asked for {', '.join(asked) or 'nothing'}; then: "
          + (out.strip().splitlines() or [''])[-1][:200])
    return {"checked": True, "bases": bases, "asked": asked}


# ---------------------------------------------------------------- main

def summary() -> None:
    steps = report["steps"]
    seconds = step_seconds
    print(f"\n== image test: {report['status'].upper()}" + (f" ({report.get('reason')})" if report.get("reason") else ""))
    said = {n: "made by --prepare" if made_by_prepare(n) else "cached" if steps.get(n, {}).get("cached") else "made"
            for n in ("base", "wheelhouse", "build")}
    if "image" in steps and "size_bytes" in steps["image"]:
        b = step_record("build")
        print(f"   image {IMAGE}: {steps['image']['size_bytes'] / 1e9:.2f} GB; build {seconds('build'):.0f} s "
              f"({said['build']}, {b.get('cached_steps', 0)} of {b.get('steps', 0)} steps cached); base {seconds('base'):.0f} s "
              f"({said['base']}); wheelhouse {seconds('wheelhouse'):.0f} s ({said['wheelhouse']})")
    if "test" in steps:
        print(f"   run: `lab` {seconds('lab'):.0f} s, `test` {seconds('test'):.0f} s (every chapter), "
              f"compose {seconds('compose'):.0f} s (`test` service: `check`)")
        took = sorted(((t, n[:2]) for n, t in report.get("run", {}).get("chapters", {}).items() if t), reverse=True)
        if took:  # where `test`'s time went: a budget overrun names its chapters
            print(f"   chapters: {sum(t for t, _ in took):.0f} s ({JOBS} at a time): " + ", ".join(f"{n} {t:.0f} s" for t, n in took))
    for failure in report["failures"]:
        print(f"   FAILED: {failure}")
    print(f"   report: {REPORT}")


def _terminated(signum, frame):
    """SIGTERM (a CI time budget) ends the run like Ctrl-C: containers removed, build/ handed back, dockerd stopped."""
    raise KeyboardInterrupt("SIGTERM")


def main(argv: list[str] | None = None) -> int:
    global REPORT
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=os.environ.get("ONLY") or None, help="chapters for `test`, e.g. 00,03")
    parser.add_argument("--cold", action="store_true", default=bool(os.environ.get("IMAGE_TEST_COLD")),
                        help="build from scratch: remove the base, image, wheelhouse and the daemon's build cache")
    parser.add_argument("--torch-index", default=os.environ.get("TORCH_INDEX") or None,
                        help="an index with the CPU torch, where pip's own sources give the CUDA one")
    parser.add_argument("--prepare", action="store_true",
                        help="only the daemon, the base, the wheelhouse and the build (for a later full run): CI runs it beside make install")
    args = parser.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _terminated)
    report.update(started=time.strftime("%Y-%m-%d %H:%M:%S"), only=args.only, cold=args.cold, invoking_uid=os.getuid())
    if args.prepare:
        REPORT = PREPARED
        PREPARED.unlink(missing_ok=True)
    elif PREPARED.is_file():  # made by --prepare (beside make install, in CI): its base, wheelhouse and build times count here
        report["prepared"] = json.loads(PREPARED.read_text())
        PREPARED.unlink()
    save()
    daemon = None
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        with step("docker") as s:
            cli, build_cmd, build_env = docker_cli()
            daemon = start_daemon(cli)
            s.update(cli=cli, build=" ".join(build_cmd), started_here=daemon is not None,
                     server=quiet([cli, "version", "--format", "{{.Server.Version}}"]).stdout.strip())
        if args.cold:
            with step("cold"):
                quiet([cli, "image", "rm", "-f", IMAGE, BASE])
                quiet([cli, "builder", "prune", "-af"], timeout=600)  # gigabytes of layers
                for old in OUT.glob("wheelhouse-*"):
                    shutil.rmtree(old)
        early = None  # the wheelhouse, downloading beside debootstrap for the host's read of the target
        with step("base") as s:
            s["cached"] = quiet([cli, "image", "inspect", BASE]).returncode == 0
            if not s["cached"]:
                guess = host_target()
                if guess:
                    early = (guess, pool.submit(wheelhouse, guess, args.cold, args.torch_index))
                s.update(make_base(cli))
        with step("wheelhouse") as s:  # its seconds: what it took after the base, so base + wheelhouse is their wall time
            s["target"] = base_target(cli)
            if early and early[0] == s["target"]:
                (folder, s["cached"]), s["beside_base"] = early[1].result(), True
            else:
                if early:
                    early[1].result()
                folder, s["cached"] = wheelhouse(s["target"], args.cold, args.torch_index)
            files = [p for p in folder.iterdir() if not p.name.startswith(".")]
            s.update(files=len(files), bytes=sum(p.stat().st_size for p in files))
        uid, gid = (os.getuid(), os.getgid()) if os.getuid() != 0 else (1000, 1000)
        report["container_uid"] = uid
        with step("build") as s:
            server = serve(folder)
            try:
                s.update(build(build_cmd, build_env, uid, gid))
            finally:
                server.shutdown()
                server.server_close()
        if args.prepare:
            report["status"] = "prepared"
            return 0
        with step("image") as s:
            s.update(image_facts(cli, uid))
        with step("lab"):
            run_lab(cli, uid)
        BUILD.mkdir(exist_ok=True)
        owners = lend(BUILD, uid, gid) if os.getuid() == 0 else None
        try:
            with step("test"):
                run_workbook(cli, uid, args.only)
            with step("compose") as s:
                s.update(run_compose(cli))
        finally:
            if owners is not None:
                hand_back(BUILD, owners)
        mine = [BUILD / "runs.json", BUILD / "report.html", *(BUILD / "results").glob("*.json")]
        others = sorted(str(p.relative_to(BUILD)) for p in mine if p.is_file() and p.stat().st_uid != os.getuid())
        check(f"on the host, the ledgers and report are yours (uid {os.getuid()})", not others, others or "all")
        with step("gpu-plan") as s:
            s.update(gpu_plan(build_cmd, build_env))
        if not args.only:
            total = sum(step_seconds(n) for n in ("base", "wheelhouse", "build", "test"))
            check(f"base + wheelhouse + build + `test` within {BUDGET_S // 60} min", total <= BUDGET_S, f"{total:.0f} s")
        report["status"] = "failed" if report["failures"] else "passed"
    except Skip as e:
        report.update(status="skipped", reason=str(e))
        print(f"\n!!! SKIPPED: Docker cannot run here: {e}\n", flush=True)
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - recorded, and the exit code says it failed
        report["status"] = "failed"
        report["failures"].append(f"{type(e).__name__}: {e}" if str(e) else "interrupted")
    finally:
        pool.shutdown(cancel_futures=True)
        if daemon is not None:
            stop_daemon(daemon)
        save()
        summary()
    return {"passed": 0, "skipped": SKIPPED}.get(report["status"], 1)


if __name__ == "__main__":
    sys.exit(main())
