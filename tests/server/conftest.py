"""Fixtures for the server tests: a `specdec serve` process on a free loopback port, with tiny
random-weight models written for the test, or with the real default pair."""

import os
import pathlib
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SPECDEC = pathlib.Path(os.environ.get("SPECDEC_BIN", ROOT / "target/release/specdec"))
WRITE_TINY = ROOT / "target/release/examples/write_tiny"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, args, timeout=600):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="specdec-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [str(SPECDEC), "serve", "--port", str(self.port), *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.time() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"specdec serve exited with {self.proc.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except Exception:
                pass
            if time.time() > deadline:
                self.stop()
                raise RuntimeError(f"specdec serve was not healthy in {timeout}s:\n{self.output()}")
            time.sleep(0.2)

    def output(self):
        return pathlib.Path(self.log.name).read_text(errors="replace")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def tiny_models(tmp):
    if not WRITE_TINY.exists():
        raise RuntimeError(f"{WRITE_TINY} is missing: run cargo build --release --workspace --all-targets")
    target = tmp / "tiny-target.gguf"
    draft = tmp / "tiny-draft.gguf"
    subprocess.run([str(WRITE_TINY), str(target), "qwen2", "--dtype", "q8_0", "--ctx", "1024"], check=True)
    subprocess.run([str(WRITE_TINY), str(draft), "qwen2", "--dtype", "q4_0", "--ctx", "1024"], check=True)
    return target, draft


def have_default_pair():
    home = pathlib.Path(os.environ.get("SPECDEC_HOME", pathlib.Path.home() / ".cache/specdec"))
    models = home / "models"
    return all(
        (models / f).exists()
        for f in ["qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "qwen2.5-coder-0.5b-instruct.gguf"]
    )


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tiny")
    target, draft = tiny_models(tmp)
    s = Server(["--target", str(target), "--draft", str(draft), "--drafter", "hybrid",
                "--draft-len", "3", "--parallel", "4", "--queue", "8", "--ctx", "1024"])
    yield s
    assert s.stop() == 0, f"the server did not shut down cleanly:\n{s.output()}"


@pytest.fixture(scope="session")
def pair_server():
    if not have_default_pair():
        if os.environ.get("SPECDEC_REQUIRE_MODELS") == "1":
            pytest.fail("the default pair is missing and SPECDEC_REQUIRE_MODELS=1: run specdec fetch")
        pytest.skip("the default pair is not fetched: run `specdec fetch` (needs the real models)")
    s = Server(["--drafter", "hybrid", "--draft-len", "auto", "--parallel", "4"])
    yield s
    assert s.stop() == 0, f"the server did not shut down cleanly:\n{s.output()}"


@pytest.fixture(params=["tiny", "pair"])
def server(request):
    return request.getfixturevalue(f"{request.param}_server")
