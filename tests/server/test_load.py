"""Over real sockets on loopback: a bounded load test (32 streaming clients, overload answered with 429
and retried, nothing lost), garbage on the wire, a client that leaves mid-stream, and a graceful
shutdown on SIGTERM."""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from conftest import ROOT, WRITE_TINY, Server, tiny_models


def get(base, path):
    with urllib.request.urlopen(base + path, timeout=10) as r:
        return r.status, r.read().decode()


def metric(base, name):
    _, text = get(base, "/metrics")
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def test_bounded_load_with_429_and_nothing_lost(tiny_server):
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts/load_test.py"), "load", "--base", tiny_server.base,
         "--clients", "32", "--requests", "96", "--max-tokens", "24", "--expect-429", "--require-usage"],
        capture_output=True, text=True, timeout=900)
    print(out.stdout, out.stderr)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["ok"] == 96 and report["failed"] == 0
    assert report["rejected_429_then_retried"] > 0
    assert get(tiny_server.base, "/health")[0] == 200


def test_garbage_on_the_wire_does_not_stop_the_server(tiny_server):
    rng = random.Random(1)
    host, port = "127.0.0.1", tiny_server.port
    payloads = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400))) for _ in range(30)]
    payloads += [b"GET / HTTP/1.1\r\n", b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 999999\r\n\r\n{",
                 b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n{\"a\":"]
    for p in payloads:
        with socket.create_connection((host, port), timeout=5) as s:
            # The server may answer 400 and close before everything is sent: a reset is fine.
            try:
                s.sendall(p)
                s.shutdown(socket.SHUT_WR)
                s.recv(4096)
            except OSError:
                pass
    status, _ = get(tiny_server.base, "/health")
    assert status == 200
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}).encode()
    req = urllib.request.Request(tiny_server.base + "/v1/chat/completions", data=body)
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200


def test_a_client_that_leaves_mid_stream_frees_its_slot(tiny_server):
    body = json.dumps({"prompt": "abc", "max_tokens": 900, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", tiny_server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        assert b"200 OK" in s.recv(4096)
        s.recv(4096)
    deadline = time.time() + 30
    while metric(tiny_server.base, "specdec_active_sequences") != 0:
        assert time.time() < deadline, "the sequence was not cancelled after the client left"
        time.sleep(0.05)


def post_stream(port, request):
    """Sends a completion request on a raw socket (read the response with `recv`)."""
    body = json.dumps(request).encode()
    conn = socket.create_connection(("127.0.0.1", port), timeout=60)
    conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return conn


def test_sigterm_finishes_in_flight_requests_and_exits_cleanly(tmp_path):
    target, draft = tiny_models(tmp_path)
    s = Server(["--target", str(target), "--draft", str(draft), "--drafter", "model", "--ctx", "1024",
                "--shutdown-grace", "30"])
    try:
        conn = post_stream(s.port, {"prompt": "abc", "max_tokens": 300, "stream": True})
        got = conn.recv(4096)
        assert b"200 OK" in got
        s.proc.send_signal(signal.SIGTERM)
        while b"[DONE]" not in got:
            more = conn.recv(65536)
            assert more, "the stream ended without [DONE]"
            got += more
        assert b'"finish_reason":"length"' in got or b'"finish_reason":"stop"' in got
        conn.close()
        assert s.proc.wait(timeout=60) == 0, s.output()
    finally:
        s.stop()


def test_requests_cut_by_shutdown_end_with_an_error_after_their_text(tmp_path):
    # No grace period: a long request still running at SIGTERM is cancelled. OpenAI has no finish
    # reason for that, so the stream carries the text generated so far, then an error, then [DONE].
    target = tmp_path / "tiny-long.gguf"
    subprocess.run([str(WRITE_TINY), str(target), "qwen2", "--dtype", "q8_0", "--ctx", "8192"], check=True)
    s = Server(["--target", str(target), "--drafter", "ngram", "--ctx", "8192", "--ignore-eos",
                "--shutdown-grace", "0"])
    try:
        conn = post_stream(s.port, {"prompt": "abc", "max_tokens": 8000, "stream": True})
        got = b""
        while b'"text"' not in got:
            more = conn.recv(65536)
            assert more, "the stream ended before any text"
            got += more
        s.proc.send_signal(signal.SIGTERM)
        while b"[DONE]" not in got:
            more = conn.recv(65536)
            assert more, "the stream ended without [DONE]"
            got += more
        conn.close()
        assert b"finish_reason\":\"cancelled" not in got
        assert b"the server shut down before the request finished" in got, got[-600:]
        assert s.proc.wait(timeout=60) == 0, s.output()
    finally:
        s.stop()
