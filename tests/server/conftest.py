"""Fixtures of the dsv4 serve suite: tiny checkpoints with the real DeepSeek-V4 tokenizer and
`dsv4 serve` processes on loopback ports (port 0: the server picks a free one and prints it).

Environment: DSV4_CLI (the dsv4 binary, required), DSV4_TOKENIZER_DIR (default
<source>/../shared/tokenizer/deepseek-v4), DSV4_TEST_TIME_SCALE (multiplies every timeout, for
slow builds such as ThreadSanitizer's; default 1), DSV4_TEST_BACKEND (cpu or cuda: the backend of
every server and `dsv4 logits` run; default cpu; the pytest option --backend overrides it)."""

import json
import os
import pathlib
import queue
import re
import signal
import subprocess
import tempfile
import threading
import time

import pytest

SOURCE_DIR = pathlib.Path(__file__).resolve().parents[2]
TIME_SCALE = float(os.environ.get("DSV4_TEST_TIME_SCALE", "1"))
BACKENDS = ("cpu", "cuda")


def pytest_addoption(parser):
    parser.addoption("--backend", choices=BACKENDS, default=None,
                     help="the backend of the servers under test (default: $DSV4_TEST_BACKEND "
                          "or cpu)")


def pytest_configure(config):
    backend = config.getoption("--backend") or os.environ.get("DSV4_TEST_BACKEND", "cpu")
    if backend not in BACKENDS:
        raise pytest.UsageError(f"DSV4_TEST_BACKEND={backend}: not one of {BACKENDS}")
    os.environ["DSV4_TEST_BACKEND"] = backend  # backend() reads it, in every module


def backend():
    """The backend under test. CPU: every response equals its solo run token for token. CUDA
    (kernels not batch-invariant): support.check_near_solo's end-to-end tolerance instead."""
    return os.environ.get("DSV4_TEST_BACKEND", "cpu")


def cli_path():
    cli = os.environ.get("DSV4_CLI")
    if not cli or not os.access(cli, os.X_OK):
        pytest.exit("DSV4_CLI must name the dsv4 binary", returncode=2)
    return cli


def tokenizer_file():
    d = os.environ.get("DSV4_TOKENIZER_DIR",
                       str(SOURCE_DIR.parent / "shared" / "tokenizer" / "deepseek-v4"))
    return pathlib.Path(d) / "tokenizer.json"


# Every `dsv4 serve` started in this session, and the test that was running when it started
# (pytest_runtest_makereport attaches their stderr to a failure).
_servers = []
_current_test = None
STDERR_REPORT_CHARS = 200_000  # a ThreadSanitizer report with its stacks fits


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _current_test
    _current_test = item.nodeid
    yield
    _current_test = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test shows the stderr of every server it started, and of every server that has
    exited non-zero (a sanitizer's report, an abort) and was not shown yet: a server's exit
    status alone says nothing about why."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    for s in _servers:
        rc = s.proc.poll()
        crashed = rc is not None and rc != 0 and not s.stderr_shown
        if s.started_in != item.nodeid and not crashed:
            continue
        s.stderr_shown = s.stderr_shown or crashed
        state = "running" if rc is None else f"exit status {rc}"
        report.sections.append((f"dsv4 serve {' '.join(s.flags)} (pid {s.proc.pid}, {state}): "
                                f"stderr", s.stderr_text(STDERR_REPORT_CHARS) or "(empty)"))


def pytest_sessionfinish(session, exitstatus):
    """Servers a failed test left running are stopped (killed if SIGTERM does not end them)."""
    for s in _servers:
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGTERM)
            try:
                s.proc.wait(timeout=30 * TIME_SCALE)
            except subprocess.TimeoutExpired:
                s.proc.kill()
                s.proc.wait()


def run_cli(*args, timeout=300):
    r = subprocess.run([cli_path(), *map(str, args)], capture_output=True, text=True,
                       timeout=timeout)
    if r.returncode != 0:
        raise AssertionError(f"dsv4 {' '.join(map(str, args))} failed: {r.stderr.strip()}")
    return r.stdout


@pytest.fixture(scope="session")
def workdir():
    with tempfile.TemporaryDirectory(prefix="dsv4-server-test-") as d:
        yield pathlib.Path(d)


@pytest.fixture(scope="session")
def tiny_model(workdir):
    """A tiny flash checkpoint whose vocabulary is the real tokenizer's (129,280 ids)."""
    tok = tokenizer_file()
    if not tok.exists():
        pytest.skip(f"{tok} is missing (set DSV4_TOKENIZER_DIR)")
    out = workdir / "tiny-flash"
    run_cli("make-tiny", "--preset", "flash", "--seed", "3", "--out", out, "--tokenizer", tok)
    return str(out)


class Server:
    """A `dsv4 serve` process. Its stdout is read in the background for the URL and readiness."""

    def __init__(self, model, *flags, wait_ready=True):
        # model None: the flags name the model (--random-weights ...).
        self.model = model
        self.flags = [str(f) for f in flags]
        self.api_key = None
        if "--api-key" in self.flags:
            self.api_key = self.flags[self.flags.index("--api-key") + 1]
        self.stderr = tempfile.TemporaryFile(mode="w+", errors="replace")
        self.started_in = _current_test
        self.stderr_shown = False
        self.proc = subprocess.Popen(
            [cli_path(), "serve", *(["--model", model] if model else []), "--port", "0",
             "--backend", backend(), *self.flags],
            stdout=subprocess.PIPE, stderr=self.stderr, text=True)
        _servers.append(self)
        self.lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.url = None
        self.listening_at = None
        line = self.expect("listening on", 30 * TIME_SCALE)
        self.url = re.search(r"http://[0-9.:]+", line).group(0)
        self.host, self.port = self.url[len("http://"):].split(":")
        self.port = int(self.port)
        if wait_ready:
            self.wait_ready()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def expect(self, text, timeout):
        deadline = time.time() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.time()))
            except queue.Empty:
                raise AssertionError(f"no '{text}' from dsv4 serve in {timeout}s: "
                                     f"{self.stderr_text()}") from None
            if line is None:
                raise AssertionError(f"dsv4 serve exited ({self.proc.wait()}) before '{text}': "
                                     f"{self.stderr_text()}")
            if text in line:
                return line

    def wait_ready(self, timeout=120):
        self.expect("ready", timeout * TIME_SCALE)

    def stderr_text(self, chars=4000):
        """The last `chars` characters the server wrote to stderr."""
        self.stderr.seek(0)
        return self.stderr.read()[-chars:]

    @property
    def base_url(self):
        return self.url + "/v1"

    def client(self, **kw):
        import openai
        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key or "unused",
                             max_retries=0, timeout=kw.pop("timeout", 120) * TIME_SCALE, **kw)

    def request(self, method, path, body=None, headers=None, timeout=120):
        """Raw HTTP: (status, headers, body bytes). `body`: bytes, str or a JSON value."""
        import http.client
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout * TIME_SCALE)
        h = dict(headers or {})
        if self.api_key and "Authorization" not in h:
            h["Authorization"] = f"Bearer {self.api_key}"
        if body is not None and not isinstance(body, (bytes, str)):
            body = json.dumps(body)
            h.setdefault("Content-Type", "application/json")
        conn.request(method, path, body=body, headers=h)
        r = conn.getresponse()
        data = r.read()
        conn.close()
        return r.status, dict(r.getheaders()), data

    def post(self, path, body, **kw):
        status, _, data = self.request("POST", path, body, **kw)
        return status, (json.loads(data) if data else None)

    def get_json(self, path):
        status, _, data = self.request("GET", path)
        assert status == 200, data
        return json.loads(data)

    def metrics(self):
        """{'name{labels}': value} of /metrics."""
        status, _, data = self.request("GET", "/metrics")
        assert status == 200
        out = {}
        for line in data.decode().splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
        return out

    def metric(self, name, **labels):
        m = self.metrics()
        want = {"model_name": self.served_name(), **labels}
        for key, value in m.items():
            n, _, rest = key.partition("{")
            got = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', rest))
            if n == name and got == want:
                return value
        raise KeyError(f"{name}{labels} not in /metrics")

    def served_name(self):
        if "--served-model-name" in self.flags:
            return self.flags[self.flags.index("--served-model-name") + 1]
        return self.model

    def wait_idle(self, timeout=30):
        """Until no request runs or waits and the cache is empty (asserts it gets there)."""
        deadline = time.time() + timeout * TIME_SCALE
        while time.time() < deadline:
            if (self.metric("vllm:num_requests_running") == 0
                    and self.metric("vllm:num_requests_waiting") == 0
                    and self.metric("vllm:kv_cache_usage_perc") == 0):
                return
            time.sleep(0.05)
        raise AssertionError("the server did not become idle: " + str(self.metrics()))

    def rss_bytes(self):
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def stop(self, timeout=60):
        """SIGTERM; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout * TIME_SCALE)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError("dsv4 serve did not exit after SIGTERM")


@pytest.fixture(scope="session")
def server(tiny_model):
    """The shared server: forced outputs enabled, 16 running, room for a 64-client load run."""
    s = Server(tiny_model, "--test-forced-output", "--served-model-name", "tiny",
               "--max-running", "16", "--max-waiting", "64", "--max-model-len", "1024")
    yield s
    assert s.stop() == 0, s.stderr_text()


@pytest.fixture(scope="session")
def vocab_bytes():
    """The id of each single byte (byte-level BPE), to force any chunking of a text."""
    tok = json.loads(tokenizer_file().read_text())
    # GPT-2's byte-to-character table.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    vocab = tok["model"]["vocab"]
    return {b: vocab[chr(c)] for b, c in zip(bs, cs)}
