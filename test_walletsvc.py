"""Tests of walletsvc through its public surfaces: HTTP (webtest) and the Python API.

Grouped under banners that mirror the contract's sections. Time-dependent rules
run on a frozen clock.
"""

# Layout. The preamble (imports, the literal error catalog, the one signer written from the contract,
# spec_signature, fixtures and the helpers several sections share), then one banner per feature: a test
# sits under the banner of the feature it tests, and a helper only one section uses under that section's
# banner. The contract's rules first (docs/contract.md: envelope, page object,
# resources, endpoints, pagination, authentication, scopes, errors), then what walletsvc adds: the
# Python API (docs/embedding.md), the HTTP surfaces and resources (docs/reference.md), envelope and
# errors, authentication details (docs/signing.md), transfers, lists, the sandbox (docs/sandbox.md),
# serving, durability, storage that fails, --workers, replay protection and nothing lost under load
# (docs/operations.md).

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import decimal
import fcntl
import functools
import hashlib
import hmac
import inspect
import io
import itertools
import json
import logging
import multiprocessing
import os
import pathlib
import random
import re
import shlex
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable
from typing import Any

import bottle
import httpx
import hypothesis
import hypothesis.strategies as st
import pytest
import requests
import webtest

import walletsvc

NOW = 1_800_000_000  # a frozen epoch second
T0 = "2027-01-15T08:00:00.000Z"  # NOW as ISO-8601
CONTRACT_SCOPES = ["wallet:read", "transfer:read", "transfer:create"]  # docs/contract.md "Scopes"
EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"  # SHA-256 of b"", hex
TRANSFER_PATH = "/api/v1/transfer/command/create"
ADMIN = {"Authorization": "Bearer walletsvc-test-admin"}  # the Sandbox's admin token (README)


class FrozenClock:
    """A frozen clock the service reads instead of time.time()."""

    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def spec_signature(secret: str, method: str, path: str, timestamp: str, nonce: str, body: bytes) -> str:
    """The contract's signature computation (docs/contract.md, Signing), written from it:
    Base64(HMAC-SHA256(the five components joined by LF, the secret)), the body hashed as lowercase hex
    SHA-256 of its exact bytes."""
    message = "\n".join((method, path, timestamp, nonce, hashlib.sha256(body).hexdigest()))
    # (a path on the wire is ASCII: a test that puts other characters in one cannot sign it)
    return base64.b64encode(hmac.new(secret.encode(), message.encode("ascii"),
                                     hashlib.sha256).digest()).decode()


def _signed(method: str, path: str, key: str, secret: str, body: bytes = b"", timestamp: int | None = None,
            nonce: str | None = None) -> dict:
    """The four headers of docs/contract.md, signed by spec_signature (no walletsvc import): a captured
    request is these headers sent again."""
    ts, nonce = str(int(time.time()) if timestamp is None else timestamp), nonce or str(uuid.uuid4())
    headers = {"X-Api-Key": key, "X-Timestamp": ts, "X-Nonce": nonce,
               "X-Signature": spec_signature(secret, method, path, ts, nonce, body)}
    return {**headers, "Content-Type": "application/json"} if body else headers


class Api:
    """Signs and sends requests to a webtest app the way a client would."""

    def __init__(self, app: webtest.TestApp, key: dict, clock: FrozenClock, prefix: str = "") -> None:
        self.app, self.key, self.clock, self.prefix = app, key, clock, prefix

    def headers(self, method: str, path: str, body: bytes = b"", **overrides: str | None) -> dict:
        """Signed headers; an overridden timestamp or nonce is signed as given."""
        timestamp = overrides.get("X-Timestamp") or str(int(self.clock()))
        nonce = overrides.get("X-Nonce") or str(uuid.uuid4())
        try:
            signature = spec_signature(self.key["secret"], method, (self.prefix + path).split("?")[0],
                                       timestamp, nonce, body)
        except UnicodeEncodeError:
            signature = "unsignable"
        headers = {"X-Api-Key": self.key["apiKey"], "X-Timestamp": timestamp, "X-Nonce": nonce,
                   "X-Signature": signature, **overrides}
        return {name: value for name, value in headers.items() if value is not None}

    def request(self, method: str, path: str, body: bytes = b"", query: str = "",
                headers: dict | None = None, **environ: str) -> webtest.TestResponse:
        url = self.prefix + path + (f"?{query}" if query else "")
        return self.app.request(url, method=method, body=body, headers=headers or {},
                                environ=environ, expect_errors=True)

    def get(self, path: str, query: str = "", **overrides: str) -> webtest.TestResponse:
        return self.request("GET", path, query=query, headers=self.headers("GET", path, **overrides))

    def transfer(self, body: dict | bytes, **overrides: str) -> webtest.TestResponse:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **self.headers("POST", TRANSFER_PATH, raw)}
        headers.update({name: value for name, value in overrides.items() if value is not None})
        return self.request("POST", TRANSFER_PATH, raw, headers=headers)


# docs/contract.md's error catalog, copied literally (code: name, HTTP status), plus the
# codes of the admin surface that README documents. Tests take expected names and
# statuses from here, never from walletsvc: a typo in the module must fail them.
CATALOG = {
    "GA2001": ("API_KEY_MISSING", 401),
    "GA2011": ("API_KEY_NOT_FOUND", 401),
    "GA2021": ("API_KEY_DISABLED", 403),
    "GA2032": ("WORKSPACE_NOT_FOUND", 404),
    "GA2034": ("NOT_WORKSPACE_MEMBER", 403),
    "GA2013": ("REQUEST_EXPIRED", 401),
    "GA2012": ("SIGNATURE_INVALID", 401),
    "GA2022": ("IP_NOT_WHITELISTED", 403),
    "GA2024": ("SCOPE_REQUIRED", 403),
    "50090201": ("API_ACCESS_DENIED", 403),
    "S012": ("INVALID_PARAMETER", 400),
    "S404": ("NOT_FOUND", 404),
    "S413": ("PAYLOAD_TOO_LARGE", 413),
    "S415": ("UNSUPPORTED_MEDIA_TYPE", 415),
    "S500": ("INTERNAL_ERROR", 500),
    "S503": ("SERVICE_BUSY", 503),
    "W1001": ("WALLET_NOT_FOUND", 404),
    "W1002": ("WALLET_NOT_ACTIVE", 422),
    "T1001": ("TRANSFER_NOT_FOUND", 404),
    "T2001": ("INSUFFICIENT_BALANCE", 422),
    "T2002": ("CURRENCY_MISMATCH", 422),
    "T2003": ("SAME_WALLET", 422),
    "T2004": ("IDEMPOTENCY_CONFLICT", 409),
}
ADMIN_CATALOG = {"S401": ("UNAUTHORIZED", 401), "S403": ("FORBIDDEN", 403),
                 "S405": ("METHOD_NOT_ALLOWED", 405)}
ENVELOPE_HEADERS = {"Content-Type": "application/json; charset=utf-8", "Cache-Control": "no-store"}


def usd(cents: int) -> str:
    """An amount of USD (2 decimals, docs/reference.md) from its cents."""
    return f"{cents // 100}.{cents % 100:02d}"


def data(response: webtest.TestResponse) -> dict:
    assert response.status_int == 200, response.text
    assert response.json["success"] is True
    return response.json["data"]


def error(response: webtest.TestResponse, code: str, status: int) -> dict:
    """Assert an error envelope with this code and status; return it."""
    body = response.json
    assert (response.status_int, body["code"]) == (status, code), response.text
    assert body["success"] is False and body["data"] is None
    assert (body["message"], status) == {**CATALOG, **ADMIN_CATALOG}[code]
    for name, value in ENVELOPE_HEADERS.items():
        assert response.headers[name] == value
    return body


@pytest.fixture
def clock() -> FrozenClock:
    return FrozenClock()


@pytest.fixture
def make_service():
    """``make_service(database=":memory:", **settings)`` builds a WalletService as walletsvc.WalletService
    does (on walletsvc's own clock unless ``clock=`` is given, e.g. the frozen ``clock``); each one built is
    closed at teardown."""
    built: list[walletsvc.WalletService] = []

    def make(database: str = ":memory:", **settings: Any) -> walletsvc.WalletService:
        built.append(walletsvc.WalletService(database, **settings))
        return built[-1]

    yield make
    for service in built:
        service.close()


@pytest.fixture
def svc(make_service, clock: FrozenClock) -> walletsvc.WalletService:
    return make_service(clock=clock)


@pytest.fixture
def world(svc: walletsvc.WalletService):
    """A workspace with a full-scope key, two USD wallets (one funded) and a JPY wallet."""
    return make_world(svc)


def make_world(svc: walletsvc.WalletService) -> dict:
    ws = svc.create_workspace("Acme")
    key = svc.create_api_key(ws["id"], CONTRACT_SCOPES)
    usd_a = svc.create_wallet(ws["id"], "USD", name="a")
    usd_b = svc.create_wallet(ws["id"], "USD", name="b")
    jpy = svc.create_wallet(ws["id"], "JPY", name="yen")
    svc.deposit(usd_a["id"], "100.00")
    svc.deposit(jpy["id"], "5000")
    return {"ws": ws, "key": key, "a": usd_a["id"], "b": usd_b["id"], "jpy": jpy["id"]}


@pytest.fixture
def app(svc: walletsvc.WalletService) -> webtest.TestApp:
    return webtest.TestApp(walletsvc.create_app(svc, debug_signatures=True))


@pytest.fixture
def api(app: webtest.TestApp, world: dict, clock: FrozenClock) -> Api:
    return Api(app, world["key"], clock)


@pytest.fixture
def many(svc, world, clock):
    """25 transfers a->b of 1.00 .. 25.00 cents, one per second."""
    for n in range(1, 26):
        clock.advance(1)
        svc.create_transfer(world["ws"]["id"], source_wallet_id=world["a"],
                            target_wallet_id=world["b"], amount=f"0.{n:02d}" if n < 100 else "1",
                            currency="USD", biz_id=f"biz-{n:02d}")
    clock.advance(1)
    return world


def key_api(api: Api, key: dict) -> Api:
    return Api(api.app, key, api.clock, api.prefix)


def balances(svc: walletsvc.WalletService, *wallet_ids: str) -> list[str]:
    return [svc.get_wallet(wallet_id)["balance"] for wallet_id in wallet_ids]


def transfer_body(world: dict, **changes) -> dict:
    body = {"sourceWalletId": world["a"], "targetWalletId": world["b"], "amount": "25.50",
            "currency": "USD"}
    body.update(changes)
    return {name: value for name, value in body.items() if value is not ...}


def order_in_another_workspace(svc: walletsvc.WalletService, biz_id: str) -> dict:
    other = svc.create_workspace("Other")
    source, target = (svc.create_wallet(other["id"], "USD") for _ in range(2))
    svc.deposit(source["id"], "5.00")
    return svc.create_transfer(other["id"], source_wallet_id=source["id"], target_wallet_id=target["id"],
                               amount="1.00", currency="USD", biz_id=biz_id)


def ledger_invariants(path: str) -> dict:
    """Check conservation, non-negativity, sum(flows) == balance and the ledger's commit
    order (docs/contract.md) from the file, then walletsvc's own audit."""
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute(
            "SELECT w.id, w.balance, coalesce(sum(CASE f.direction WHEN 'CREDIT' THEN f.amount"
            " ELSE -f.amount END), 0) FROM wallets w LEFT JOIN flows f ON f.wallet_id = w.id"
            " GROUP BY w.id").fetchall()
        for wallet_id, balance, flow_sum in rows:
            assert balance >= 0, wallet_id
            assert flow_sum == balance, wallet_id
        deposits = conn.execute("SELECT coalesce(sum(amount), 0) FROM flows WHERE type = 'DEPOSIT'"
                                ).fetchone()[0]
        assert sum(balance for _, balance, _ in rows) == deposits
        transfers = conn.execute("SELECT count(*), count(DISTINCT biz_id) FROM transfers").fetchone()
        assert transfers[0] == transfers[1]
        assert conn.execute("SELECT count(*) FROM flows WHERE transfer_id IS NOT NULL").fetchone()[0] == (
            2 * transfers[0])
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        for wallet_id, balance, _ in rows:
            assert running_balance_breaks(conn, wallet_id) == [], wallet_id
    finally:
        conn.close()
    svc = walletsvc.WalletService(path)
    try:
        assert svc.audit() == []
    finally:
        svc.close()
    return {"transfers": transfers[0], "total": deposits}


def running_balance_breaks(conn: sqlite3.Connection, wallet_id: str) -> list:
    """Flows of a wallet oldest first (createdAt, then id) whose balanceAfter is not the previous
    one ± the amount, or a last one that is not the balance."""
    breaks, before = [], 0
    for flow_id, direction, amount, after in conn.execute(
            "SELECT id, direction, amount, balance_after FROM flows WHERE wallet_id = ?"
            " ORDER BY created_at, id", (wallet_id,)):
        if before + (amount if direction == "CREDIT" else -amount) != after:
            breaks.append((flow_id, before, direction, amount, after))
        before = after
    if before != conn.execute("SELECT balance FROM wallets WHERE id = ?", (wallet_id,)).fetchone()[0]:
        breaks.append(("newest flow", before))
    return breaks


def _shared_ledger(tmp_path) -> tuple[str, str, list]:
    path = str(tmp_path / "bank.db")
    svc = walletsvc.WalletService(path)
    ws = svc.create_workspace("Bank")
    wallets = [svc.create_wallet(ws["id"], "USD")["id"] for _ in range(4)]
    for wallet_id in wallets:
        svc.deposit(wallet_id, "1000.00")
    svc.close()
    return path, ws["id"], wallets


def _trace_writes(svc: walletsvc.WalletService) -> list[str]:
    """The writes of this thread's batches from now on (a batch writes through its leader's own
    connection), each cut at its first parenthesis, with each PRAGMA synchronous that changes the
    durability of the commits after it (from NORMAL: no disk sync); reads and other pragmas left out."""
    statements: list[str] = []

    def trace(sql: str) -> None:
        if not sql.lstrip().startswith(("SELECT", "PRAGMA")) or "synchronous" in sql:
            statements.append(sql.split(" (")[0])

    svc.db.write([lambda conn: conn.set_trace_callback(trace)], durable=False)
    statements.clear()
    return statements


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = walletsvc.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def required_tools(*names: str) -> None:
    """Skip the test when a program it runs is missing; fail instead under WALLETSVC_LANGUAGES=required
    (.ci/run installs them all)."""
    missing = [name for name in names if not shutil.which(name)]
    if missing:
        if os.environ.get("WALLETSVC_LANGUAGES") == "required":
            raise AssertionError(f"{', '.join(missing)} not installed (WALLETSVC_LANGUAGES=required)")
        pytest.skip(f"{', '.join(missing)} not installed; .ci/run installs them")


def _cli(*argv: str, cwd: pathlib.Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "walletsvc", *argv], capture_output=True, text=True,
                          timeout=60, check=False, cwd=cwd, env=env)


def admin_app(svc, token: str | None = "s3cret") -> webtest.TestApp:
    return webtest.TestApp(walletsvc.create_app(svc, admin_token=token))


@pytest.fixture
def live(tmp_path, svc, world):
    """The app on waitress on a free port, in a thread, stopped afterwards (closing the listener
    under waitress's loop left a "Bad file descriptor" thread exception now and then: LiveServer
    stops in the loop's own thread)."""
    server = walletsvc.LiveServer(walletsvc.create_app(svc, admin_token="tok"))
    yield server.url
    server.stop()


README = pathlib.Path(__file__).parent / "README.md"
# README and the pages of docs/: every ```python, ```sh... block in them runs in this suite as printed.
DOC_PAGES = (README, *sorted((README.parent / "docs").glob("*.md")))


def doc_section(title: str) -> str:
    """The text of the one section titled ``## TITLE``, on whichever page of README and docs/ holds it."""
    heading = f"\n## {title}\n"
    texts = [page.read_text(encoding="utf-8") for page in DOC_PAGES]
    found = [text.split(heading, 1)[1].split("\n## ", 1)[0] for text in texts if heading in text]
    assert len(found) == 1, f"the section {title!r} is on {len(found)} pages of README and docs/"
    return found[0]


def doc_blocks(section: str, language: str) -> list[str]:
    """The ```language blocks of one section of README or docs/, as printed."""
    return [block.split("```", 1)[0] for block in doc_section(section).split(f"```{language}\n")[1:]]


def printed_shell_env(tmp_path: pathlib.Path, **variables: str) -> dict:
    """The environment a printed shell block runs in without an activated virtualenv: the commands
    it names (python, pip, walletsvc, flask, django-admin, uvicorn, gunicorn) are this interpreter's,
    as ``sys.executable -m ...``; pip never reaches an index (the packages are installed already)."""
    shims = tmp_path / "printed-bin"
    shims.mkdir(exist_ok=True)
    for command, module in (("python", ""), ("python3", ""), ("pip", "-m pip"), ("walletsvc", "-m walletsvc"),
                            ("flask", "-m flask"), ("django-admin", "-m django"), ("uvicorn", "-m uvicorn"),
                            ("gunicorn", "-m gunicorn")):
        shim = shims / command
        shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {module} "$@"\n')
        shim.chmod(0o755)
    env = {name: value for name, value in os.environ.items() if not name.startswith("WALLETSVC_")}
    return {**env, "PATH": f"{shims}{os.pathsep}{os.environ.get('PATH', '')}", "PIP_NO_INDEX": "1",
            **variables}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """One ``walletsvc serve`` child on a port of its own: kill -9, restart."""

    def __init__(self, db_path: str, log_path: pathlib.Path, *options: str) -> None:
        self.db_path, self.log_path, self.port, self.options = db_path, log_path, _free_port(), options
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.command = [sys.executable, "-m", "walletsvc"]  # (or -c, with a limit lowered first)

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [*self.command, "serve", "--db", self.db_path, "--port", str(self.port), *self.options],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log_path.read_text()[-2000:]
            try:
                if requests.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                time.sleep(0.05)
        raise AssertionError(f"{self.url} did not start")

    def kill(self) -> None:
        self.process.kill()  # SIGKILL: no cleanup, no rollback but SQLite's own
        self.process.wait()

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)


@pytest.fixture
def demo_server(tmp_path):
    """``walletsvc serve --demo`` and the environment a user has after reading its banner."""
    server = ServerProcess(str(tmp_path / "demo.db"), tmp_path / "demo.log", "--demo")
    server.start()
    printed = _printed_banner(tmp_path / "demo.log")
    exported = dict(word.split("=", 1) for word in shlex.split(re.search(r"^export .*$", printed,
                                                                           re.MULTILINE).group(0))[1:])
    env = {**os.environ, **exported}  # README's four names: WALLETSVC_URL, _KEY, _SECRET, _ADMIN_TOKEN
    yield server, env
    server.stop()


def _keyed_database(path: str) -> dict:
    """A database file with one workspace and a full-scope key, closed again."""
    svc = walletsvc.WalletService(path)
    key = svc.create_api_key(svc.create_workspace("Acme")["id"])
    svc.close()
    return key


def _list_wallets(server: ServerProcess, key: dict, skew: int = 0) -> requests.Response:
    headers = walletsvc.sign_request("GET", "/api/v1/wallets", b"", key["apiKey"], key["secret"],
                                     timestamp=int(time.time()) + skew)
    return requests.get(server.url + "/api/v1/wallets", headers=headers, timeout=10)


def _printed_banner(log_path: pathlib.Path) -> str:
    """What `serve --demo` printed, once its banner is whole: with --workers the workers may answer
    /healthz before the parent has printed it (the flake of ...swapped_file[wal-replaced] under -n 2)."""
    deadline = time.monotonic() + 30
    while "print(walletsvc.Client()" not in (printed := log_path.read_text()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return printed


def _demo_of(log_path: pathlib.Path) -> tuple[str, str, dict, list[str]]:
    """Key, secret, admin headers and wallet ids, as `serve --demo` printed them."""
    printed = _printed_banner(log_path)
    exported = dict(word.split("=", 1) for word in shlex.split(re.search(r"^export .*$", printed,
                                                                           re.MULTILINE).group(0))[1:])
    wallets = re.search(r"wallets\s*: (.+)", printed).group(1).strip()  # "alice wal_…, bob wal_…, yen wal_…"
    return (exported["WALLETSVC_KEY"], exported["WALLETSVC_SECRET"],
            {"Authorization": f"Bearer {exported['WALLETSVC_ADMIN_TOKEN']}"},
            [named.split()[-1] for named in wallets.split(", ")])


@contextlib.contextmanager
def demo_process(tmp_path: pathlib.Path, name: str, *options: str):
    """`walletsvc serve --demo` on tmp_path/NAME.db, logging to NAME.log, stopped at the end:
    the server, and the key, secret, admin headers and wallet ids it printed."""
    server = ServerProcess(str(tmp_path / f"{name}.db"), tmp_path / f"{name}.log", "--demo", *options)
    server.start()
    try:
        yield server, _demo_of(tmp_path / f"{name}.log")
    finally:
        server.stop()


@pytest.fixture
def two_servers(tmp_path):
    """Two `walletsvc serve --demo` processes on one database file."""
    path = str(tmp_path / "shared.db")
    servers = [ServerProcess(path, tmp_path / f"server{n}.log", "--demo") for n in range(2)]
    try:
        for server in servers:  # one after the other: the first seeds the demo, the second finds it
            server.start()
        yield servers, _demo_of(tmp_path / "server0.log")
    finally:
        for server in servers:
            server.stop()


def _balances_over_http(url: str, key: str, secret: str, timestamp: int | None = None) -> dict:
    answer = requests.get(url + "/api/v1/wallets", headers=_signed("GET", "/api/v1/wallets", key, secret,
                                                                   timestamp=timestamp), timeout=10).json()
    return {wallet["name"]: wallet["balance"] for wallet in answer["data"]["content"]}


def _clock(url: str, admin: dict, **change: Any) -> dict:
    if change:
        return requests.post(url + "/_admin/clock", json=change, headers=admin, timeout=10).json()["data"]
    return requests.get(url + "/_admin/clock", headers=admin, timeout=10).json()["data"]


def _transfer_of(sandbox, amount: str, biz_id: str, **headers: str) -> None:
    body = json.dumps({"sourceWalletId": sandbox.wallets["alice"]["id"],
                       "targetWalletId": sandbox.wallets["bob"]["id"],
                       "amount": amount, "currency": "USD", "bizId": biz_id}).encode()
    webtest.TestApp(sandbox.app).post(TRANSFER_PATH + "?trace=on", body, expect_errors=True, headers={
        **sandbox.headers("POST", TRANSFER_PATH, body), "Content-Type": "application/json", **headers})


###############################################################################
# Response envelope ############################################################
###############################################################################


def test_success_envelope_has_every_field(api: Api, world: dict, clock: FrozenClock) -> None:
    response = api.get(f"/api/v1/wallets/{world['a']}")
    assert response.headers["Content-Type"] == "application/json; charset=utf-8"
    body = response.json
    assert body == {"version": "v1", "timestamp": NOW * 1000, "success": True, "code": "2000",
                    "message": "SUCCESS", "data": body["data"]}
    assert body["data"]["id"] == world["a"]


def test_error_envelope_has_every_field_and_a_detail(api: Api) -> None:
    response = api.get("/api/v1/wallets", **{"X-Api-Key": "ak_nope"})
    assert response.json == {"version": "v1", "timestamp": NOW * 1000, "success": False,
                             "code": "GA2011", "message": "API_KEY_NOT_FOUND", "data": None,
                             "detail": "The API key does not exist."}
    assert response.headers["Content-Language"] == "en-US"


def test_bottle_404_and_405_use_the_envelope(app: webtest.TestApp) -> None:
    error(app.get("/nothing/here", expect_errors=True), "S404", 404)
    error(app.post("/healthz", expect_errors=True), "S405", 405)


def test_every_envelope_carries_the_same_headers(svc, api: Api, world, monkeypatch) -> None:
    answers = {
        "success": api.get(f"/api/v1/wallets/{world['a']}"),
        "WalletError": api.get("/api/v1/wallets/wal_missing"),
        "bottle 404": api.app.get("/nowhere", expect_errors=True),
        "bottle 405": api.app.post("/healthz", expect_errors=True),
        "public": api.app.get("/healthz"),
    }
    monkeypatch.setattr(walletsvc.WalletService, "get_wallet", lambda *args, **kwargs: 1 / 0)
    answers["S500"] = api.get(f"/api/v1/wallets/{world['a']}")
    expected = {**ENVELOPE_HEADERS, "Content-Language": "en-US"}
    for name, response in answers.items():
        assert {header: response.headers.get(header) for header in expected} == expected, name
        assert int(response.headers["Content-Length"]) == len(response.body), name
    assert [answers[name].json["code"] for name in ("bottle 404", "bottle 405", "S500")] == [
        "S404", "S405", "S500"]


###############################################################################
# Page object ##################################################################
###############################################################################


def test_empty_collection_has_accurate_page_metadata(svc, api: Api, world: dict) -> None:
    page = data(api.get("/api/v1/transfer/query/orders"))
    assert page == {"content": [], "page": {"size": 20, "number": 0, "totalElements": 0,
                                            "totalPages": 0}}


###############################################################################
# Transfer order ###############################################################
###############################################################################


def test_create_transfer_moves_money_and_returns_the_order(svc, api: Api, world: dict) -> None:
    order = data(api.transfer(transfer_body(world, bizId="inv-7", description="rent")))
    assert order == {"transferId": order["transferId"], "bizId": "inv-7", "sourceWalletId": world["a"],
                     "targetWalletId": world["b"], "amount": "25.50", "currency": "USD",
                     "status": "COMPLETED", "description": "rent", "createdAt": T0, "updatedAt": T0,
                     "completedAt": T0}
    assert order["transferId"].startswith("tr_")
    assert balances(svc, world["a"], world["b"]) == ["74.50", "25.50"]


def test_order_without_biz_id_is_addressed_by_its_transfer_id(api: Api, world: dict) -> None:
    order = data(api.transfer(transfer_body(world)))
    assert order["bizId"] == order["transferId"]
    assert data(api.get(f"/api/v1/transfer/query/orders/{order['bizId']}")) == order


###############################################################################
# Wallet, balance and flow #####################################################
###############################################################################


def test_wallet_endpoint_shape(api: Api, world: dict) -> None:
    assert data(api.get(f"/api/v1/wallets/{world['a']}")) == {
        "id": world["a"], "workspaceId": world["ws"]["id"], "name": "a", "currency": "USD",
        "status": "ACTIVE", "balance": "100.00", "createdAt": T0, "updatedAt": T0}


def test_balance_endpoint_shape(api: Api, world: dict) -> None:
    assert data(api.get(f"/api/v1/wallets/{world['jpy']}/balance")) == {
        "walletId": world["jpy"], "currency": "JPY", "balance": "5000", "available": "5000",
        "pending": "0", "updatedAt": T0}


def test_flow_endpoint_shape_and_balance_after(api: Api, world: dict) -> None:
    order = data(api.transfer({"sourceWalletId": world["a"], "targetWalletId": world["b"],
                               "amount": "30.00", "currency": "USD", "bizId": "inv-1"}))
    flows = data(api.get(f"/api/v1/wallets/{world['a']}/flows", query="sort=createdAt,asc"))
    deposit, out = flows["content"]
    assert deposit == {"id": deposit["id"], "walletId": world["a"], "type": "DEPOSIT",
                       "direction": "CREDIT", "amount": "100.00", "balanceAfter": "100.00",
                       "transferId": None, "bizId": None, "counterpartyWalletId": None, "createdAt": T0}
    assert out == {"id": out["id"], "walletId": world["a"], "type": "TRANSFER_OUT",
                   "direction": "DEBIT", "amount": "30.00", "balanceAfter": "70.00",
                   "transferId": order["transferId"], "bizId": "inv-1",
                   "counterpartyWalletId": world["b"], "createdAt": T0}
    (incoming,) = data(api.get(f"/api/v1/wallets/{world['b']}/flows"))["content"]
    assert (incoming["type"], incoming["direction"], incoming["balanceAfter"],
            incoming["counterpartyWalletId"]) == ("TRANSFER_IN", "CREDIT", "30.00", world["a"])


def test_list_wallets_shape(api: Api, world: dict) -> None:
    page = data(api.get("/api/v1/wallets"))
    assert page["page"] == {"size": 20, "number": 0, "totalElements": 3, "totalPages": 1}
    assert sorted(w["id"] for w in page["content"]) == sorted([world["a"], world["b"], world["jpy"]])


###############################################################################
# Endpoints ####################################################################
###############################################################################


@pytest.mark.parametrize("path, code", [
    # the completion check of the order "wallet": "completed" is no wallet id (docs/contract.md, Endpoints)
    ("/api/v1/transfer/query/orders/wallet/completed", "T1001"),
    ("/api/v1/transfer/query/orders/wallet", "T1001"),  # the order whose bizId is "wallet"
    ("/api/v1/transfer/query/orders/completed", "T1001"),
    ("/api/v1/wallets/balance", "W1001"),  # the wallet whose id is "balance"
])
def test_ambiguous_paths_go_to_the_first_route_declared(svc, world: dict, clock: FrozenClock, path: str,
                                                        code: str) -> None:
    """The direct path's route table answers as bottle's router does (bottle as the control)."""
    plugged = walletsvc.create_app(svc)
    plugged.add_hook("before_request", lambda: None)  # no direct path: bottle routes
    for app in (walletsvc.create_app(svc), plugged):
        error(Api(webtest.TestApp(app), world["key"], clock).get(path), code, 404)


###############################################################################
# Create transfer order ########################################################
###############################################################################


BAD_TRANSFERS = [  # (case, changes, code, status, field named in the detail)
    ("missing source", {"sourceWalletId": ...}, "S012", 400, "sourceWalletId"),
    ("missing target", {"targetWalletId": ...}, "S012", 400, "targetWalletId"),
    ("missing amount", {"amount": ...}, "S012", 400, "amount"),
    ("missing currency", {"currency": ...}, "S012", 400, "currency"),
    ("null amount", {"amount": None}, "S012", 400, "amount"),
    ("unknown field", {"memo": "x"}, "S012", 400, "memo"),
    ("numeric amount", {"amount": 25.5}, "S012", 400, "amount"),
    ("integer amount", {"amount": 25}, "S012", 400, "amount"),
    ("zero amount", {"amount": "0.00"}, "S012", 400, "amount"),
    ("negative amount", {"amount": "-1.00"}, "S012", 400, "amount"),
    ("exponent", {"amount": "1e2"}, "S012", 400, "amount"),
    ("too many decimals", {"amount": "1.005"}, "S012", 400, "amount"),
    ("decimals on JPY", {"amount": "1.5", "currency": "JPY"}, "S012", 400, "amount"),
    ("too many digits", {"amount": "1234567890123456.00"}, "S012", 400, "amount"),
    ("unknown currency", {"currency": "ABC"}, "S012", 400, "currency"),
    ("lowercase currency", {"currency": "usd"}, "S012", 400, "currency"),
    ("numeric wallet id", {"sourceWalletId": 7}, "S012", 400, "sourceWalletId"),
    ("bad bizId", {"bizId": "has space"}, "S012", 400, "bizId"),
    ("long bizId", {"bizId": "b" * 65}, "S012", 400, "bizId"),
    ("long description", {"description": "d" * 256}, "S012", 400, "description"),
    ("numeric description", {"description": 5}, "S012", 400, "description"),
    ("same wallet", {"targetWalletId": "@a"}, "T2003", 422, None),
    ("unknown source", {"sourceWalletId": "wal_nope"}, "W1001", 404, "wal_nope"),
    ("unknown target", {"targetWalletId": "wal_nope"}, "W1001", 404, "wal_nope"),
    ("other workspace's wallet", {"targetWalletId": "@other"}, "W1001", 404, None),
    ("frozen target", {"targetWalletId": "@frozen"}, "W1002", 422, None),
    ("currency mismatch with both", {"currency": "EUR"}, "T2002", 422, None),
    ("currency mismatch with target", {"targetWalletId": "@jpy"}, "T2002", 422, None),
    ("insufficient balance", {"amount": "100.01"}, "T2001", 422, None),
]


@pytest.mark.parametrize("case, changes, code, status, field", BAD_TRANSFERS,
                         ids=[row[0] for row in BAD_TRANSFERS])
def test_rejected_transfer_leaves_no_trace(svc, api, world, case, changes, code, status, field) -> None:
    other = svc.create_wallet(svc.create_workspace("Other")["id"], "USD")
    frozen = svc.create_wallet(world["ws"]["id"], "USD", name="frozen")
    svc.set_wallet_status(frozen["id"], "FROZEN")
    named = {"@a": world["a"], "@other": other["id"], "@frozen": frozen["id"], "@jpy": world["jpy"]}
    changes = {k: named.get(v, v) if isinstance(v, str) else v for k, v in changes.items()}
    before = balances(svc, world["a"], world["b"], world["jpy"])
    body = error(api.transfer(transfer_body(world, **changes)), code, status)
    if field:
        assert field in body["detail"]
    assert balances(svc, world["a"], world["b"], world["jpy"]) == before
    assert data(api.get("/api/v1/transfer/query/orders"))["page"]["totalElements"] == 0
    for wallet in (world["a"], world["b"]):
        assert data(api.get(f"/api/v1/wallets/{wallet}/flows"))["page"]["totalElements"] == (
            1 if wallet == world["a"] else 0)


@pytest.mark.parametrize("amount", ["1" * 5000, "0" * 5000 + "1", "1" * 4301 + ".5", "1" * 16])
def test_an_amount_of_too_many_digits_is_s012_however_many(api: Api, world: dict, amount: str) -> None:
    body = error(api.transfer(transfer_body(world, amount=amount)), "S012", 400)
    assert "'amount'" in body["detail"]


@pytest.mark.parametrize("raw", [b"", b"not json", b"[1, 2]", b'"text"', b"\xff\xfe",
                                 b'{"amount": "1.00", "amount": "2.00"}', b"{" * 5000])
def test_unparsable_body_is_s012(api: Api, raw: bytes) -> None:
    error(api.transfer(raw), "S012", 400)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", ""])
def test_non_json_content_type_is_s415_after_authentication(api, world, content_type) -> None:
    body = transfer_body(world)
    error(api.transfer(body, **{"Content-Type": content_type}), "S415", 415)
    error(api.transfer(body, **{"Content-Type": content_type, "X-Signature": "AAAA"}), "GA2012", 401)


def test_json_content_type_with_charset_is_accepted(api: Api, world: dict) -> None:
    data(api.transfer(transfer_body(world), **{"Content-Type": "application/json; charset=utf-8"}))


###############################################################################
# Query endpoints ##############################################################
###############################################################################


def test_get_order_and_completion_check(api: Api, world: dict) -> None:
    order = data(api.transfer(transfer_body(world, bizId="inv-9")))
    assert data(api.get("/api/v1/transfer/query/orders/inv-9")) == order
    assert data(api.get("/api/v1/transfer/query/orders/inv-9/completed")) == {
        "bizId": "inv-9", "transferId": order["transferId"], "status": "COMPLETED", "completed": True}


def test_transfers_of_a_wallet_cover_both_sides(svc, api: Api, many: dict) -> None:
    svc.deposit(many["b"], "5.00")
    svc.create_transfer(many["ws"]["id"], source_wallet_id=many["b"], target_wallet_id=many["a"],
                        amount="2.00", currency="USD", biz_id="back")
    page = data(api.get(f"/api/v1/transfer/query/orders/wallet/{many['b']}", query="size=3"))
    assert page["page"] == {"size": 3, "number": 0, "totalElements": 26, "totalPages": 9}
    assert [o["bizId"] for o in page["content"]] == ["back", "biz-25", "biz-24"]
    filtered = data(api.get(f"/api/v1/transfer/query/orders/wallet/{many['b']}",
                            query="bizIdPrefix=back"))
    assert filtered["page"]["totalElements"] == 1
    assert data(api.get(f"/api/v1/transfer/query/orders/wallet/{many['jpy']}"))["page"]["totalElements"] == 0


###############################################################################
# Pagination rules #############################################################
###############################################################################


@pytest.mark.parametrize("query, size, number, count", [
    ("", 20, 0, 20),
    ("page=1", 20, 1, 5),
    ("size=5&page=4", 5, 4, 5),
    ("size=5&page=5", 5, 5, 0),  # beyond the last page: empty, totals accurate
    ("page=999999999999", 20, 999999999999, 0),
    ("size=100", 100, 0, 25),
    ("size=101", 100, 0, 25),  # capped silently
    ("size=100000", 100, 0, 25),
    ("size=1", 1, 0, 1),
    ("page=0&size=20", 20, 0, 20),
])
def test_pagination_table(api: Api, many: dict, query: str, size: int, number: int, count: int) -> None:
    page = data(api.get("/api/v1/transfer/query/orders", query=query))
    assert page["page"] == {"size": size, "number": number, "totalElements": 25,
                            "totalPages": -(-25 // size)}
    assert len(page["content"]) == count


@pytest.mark.parametrize("query", ["page=-1", "size=-1", "size=0", "size=abc", "page=1.5",
                                   "size=", "page=", "page=1e2", "size=+5", "page=0x1"])
@pytest.mark.parametrize("path", ["/api/v1/wallets", "/api/v1/transfer/query/orders",
                                  "/api/v1/wallets/{a}/flows", "/api/v1/transfer/query/orders/wallet/{a}"])
def test_bad_page_or_size_is_s012(api: Api, world: dict, path: str, query: str) -> None:
    body = error(api.get(path.format(a=world["a"]), query=query), "S012", 400)
    assert query.split("=")[0] in body["detail"]


@pytest.mark.parametrize("page", ["9223372036854775808", "1" + "0" * 40, "0" * 30 + "1"])
def test_page_numbers_have_no_upper_bound(api: Api, world, page: str) -> None:
    body = data(api.get("/api/v1/wallets", query=f"page={page}&size=2"))
    assert body == {"content": [] if int(page) > 1 else body["content"],
                    "page": {"size": 2, "number": int(page), "totalElements": 3, "totalPages": 2}}


@pytest.mark.parametrize("sort, expected", [
    (["createdAt,asc"], ["biz-01", "biz-02", "biz-03"]),
    (["createdAt,desc"], ["biz-25", "biz-24", "biz-23"]),
    (["createdAt"], ["biz-01", "biz-02", "biz-03"]),  # direction defaults to asc
    (["amount,desc"], ["biz-25", "biz-24", "biz-23"]),
    (["amount,ASC"], ["biz-01", "biz-02", "biz-03"]),
    (["status,asc", "amount,desc"], ["biz-25", "biz-24", "biz-23"]),  # second key breaks ties
    (["updatedAt,asc", "amount,desc"], ["biz-01", "biz-02", "biz-03"]),
])
def test_sort_keys_primary_first(api: Api, many: dict, sort: list, expected: list) -> None:
    query = "&".join(f"sort={s}" for s in sort) + "&size=3"
    biz_ids = [o["bizId"] for o in data(api.get("/api/v1/transfer/query/orders", query=query))["content"]]
    assert biz_ids == expected


@pytest.mark.parametrize("path, sort", [
    ("/api/v1/wallets", "amount,asc"),  # sortable for transfers, not wallets
    ("/api/v1/transfer/query/orders", "balance,asc"),
    ("/api/v1/transfer/query/orders", "bizId,asc"),
    ("/api/v1/wallets/{a}/flows", "status,asc"),
    ("/api/v1/transfer/query/orders", "createdAt,sideways"),
    ("/api/v1/transfer/query/orders", ""),
    ("/api/v1/transfer/query/orders", "createdat,asc"),  # field names are exact
    ("/api/v1/transfer/query/orders/wallet/{a}", "id,asc"),
    ("/api/v1/transfer/query/orders", "createdAt, desc"),  # no spaces, as the document's pattern says
    ("/api/v1/transfer/query/orders", "createdAt,"),
])
def test_unsortable_field_or_bad_direction_is_s012(api: Api, world: dict, path: str, sort: str) -> None:
    body = error(api.get(path.format(a=world["a"]), query=f"sort={sort}"), "S012", 400)
    assert "sort" in body["detail"]


LISTS = ["/api/v1/wallets", "/api/v1/wallets/{a}/flows", "/api/v1/transfer/query/orders",
         "/api/v1/transfer/query/orders/wallet/{a}"]


@pytest.mark.parametrize("path", LISTS)
def test_more_than_ten_sort_keys_is_s012_on_every_list(api: Api, world: dict, path: str) -> None:
    """Defect: 2,000 repeated sort parameters answered S500 (SQLite's "too many terms in ORDER BY")."""
    field = "type" if path.endswith("flows") else "createdAt"
    many = "&".join([f"sort={field},asc"] * 2000)
    body = error(api.get(path.format(a=world["a"]), query=many), "S012", 400)
    assert "'sort'" in body["detail"] and "at most 10 sort keys" in body["detail"]
    data(api.get(path.format(a=world["a"]), query="&".join([f"sort={field},asc"] * 10)))  # ten: taken


###############################################################################
# Authentication: request headers ##############################################
###############################################################################


@pytest.mark.parametrize("skew", [-61, 61, -3600, 3600])
def test_timestamp_outside_60_seconds_is_ga2013(api: Api, skew: int) -> None:
    response = api.get("/api/v1/wallets", **{"X-Timestamp": str(NOW + skew)})
    error(response, "GA2013", 401)


@pytest.mark.parametrize("skew", [-60, 60, 0])
def test_timestamp_exactly_60_seconds_away_passes(api: Api, world: dict, skew: int) -> None:
    path = "/api/v1/wallets"
    data(api.request("GET", path, headers=api.headers("GET", path, **{"X-Timestamp": str(NOW + skew)})))


@pytest.mark.parametrize("timestamp", [None, "", "abc", "1.5", "-1", "1800000000000000", " 1800000000"])
def test_missing_or_malformed_timestamp_is_ga2013(api: Api, timestamp: str | None) -> None:
    error(api.get("/api/v1/wallets", **{"X-Timestamp": timestamp}), "GA2013", 401)


def test_reused_nonce_is_ga2013(api: Api) -> None:
    headers = api.headers("GET", "/api/v1/wallets")
    data(api.request("GET", "/api/v1/wallets", headers=headers))
    error(api.request("GET", "/api/v1/wallets", headers=headers), "GA2013", 401)


@pytest.mark.parametrize("nonce", [None, "", "has space", "x" * 129, "é"])
def test_missing_or_malformed_nonce_is_ga2013(api: Api, nonce: str | None) -> None:
    error(api.get("/api/v1/wallets", **{"X-Nonce": nonce}), "GA2013", 401)


def test_nonces_are_unique_per_key(svc, api: Api, world: dict) -> None:
    other = svc.create_api_key(world["ws"]["id"], ["wallet:read"])
    data(api.get("/api/v1/wallets", **{"X-Nonce": "shared-nonce"}))
    data(key_api(api, other).get("/api/v1/wallets", **{"X-Nonce": "shared-nonce"}))


MALFORMED_VALUES = {
    "empty": "",
    "non-ascii": "clé-ünï",
    "very long": "k" * 20000,
    "non-numeric": "12ab",
    "invalid base64": "@@@==",
    "control characters": "a\tb",
}


@pytest.mark.parametrize("header", ["X-Api-Key", "X-Timestamp", "X-Nonce", "X-Signature",
                                    "X-LOCALE", "Accept-Language", "X-Forwarded-For",
                                    "Content-Type", "Idempotency-Key"])
@pytest.mark.parametrize("value_name", list(MALFORMED_VALUES))
def test_malformed_headers_never_cause_a_500(api: Api, world, header, value_name) -> None:
    value = MALFORMED_VALUES[value_name]
    body = json.dumps({"sourceWalletId": world["a"], "targetWalletId": world["b"],
                       "amount": "1.00", "currency": "USD"}).encode()
    for method, path, payload in (("GET", "/api/v1/wallets", b""), ("POST", TRANSFER_PATH, body)):
        headers = {"Content-Type": "application/json", **api.headers(method, path, payload)}
        headers[header] = value
        environ = {"HTTP_" + header.upper().replace("-", "_"): value}
        if header == "Content-Type":
            environ = {"CONTENT_TYPE": value}
        response = api.request(method, path, payload, headers={k: v for k, v in headers.items()
                                                               if k != header}, **environ)
        assert response.status_int < 500, response.text
        assert response.json["code"] in set(CATALOG) | {"2000"}


###############################################################################
# Authentication: signature computation ########################################
###############################################################################


def test_wrong_signature_is_ga2012(api: Api) -> None:
    wrong = base64.b64encode(b"x" * 32).decode()
    error(api.get("/api/v1/wallets", **{"X-Signature": wrong}), "GA2012", 401)


@pytest.mark.parametrize("signature", [None, "", "not base64!", "AAA"])
def test_missing_or_undecodable_signature_is_ga2012(api: Api, signature: str | None) -> None:
    error(api.get("/api/v1/wallets", **{"X-Signature": signature}), "GA2012", 401)


def test_signature_with_another_secret_is_ga2012(svc, api: Api, world: dict) -> None:
    other = svc.create_api_key(world["ws"]["id"], ["wallet:read"])
    forged = {**world["key"], "secret": other["secret"]}
    error(key_api(api, forged).get("/api/v1/wallets"), "GA2012", 401)


def test_signature_matches_spec_recipe_computed_by_hand(api: Api, world: dict) -> None:
    path, nonce = "/api/v1/wallets", str(uuid.uuid4())
    headers = {"X-Api-Key": world["key"]["apiKey"], "X-Timestamp": str(NOW), "X-Nonce": nonce,
               "X-Signature": spec_signature(world["key"]["secret"], "GET", path, str(NOW), nonce, b"")}
    data(api.request("GET", path, headers=headers))


@pytest.mark.parametrize("secret", ["", "s", "é" * 31, "k" * 63, "k" * 64, "k" * 65, "ü" * 100])
def test_sign_request_is_standard_hmac_sha256_for_any_secret(secret: str) -> None:
    # keys longer than the SHA-256 block are hashed first (RFC 2104), which hmac does
    headers = walletsvc.sign_request("POST", "/api/v1/x", b'{"a":1}', "ak", secret, timestamp=NOW, nonce="n")
    assert headers["X-Signature"] == spec_signature(secret, "POST", "/api/v1/x", str(NOW), "n", b'{"a":1}')


@pytest.mark.parametrize("body_hash", [
    hashlib.sha256(b"{}").hexdigest(),  # any other value than the empty hash
    "",  # left out of the message
    hashlib.sha256(b"").hexdigest().upper(),  # not lowercase
])
def test_get_must_sign_the_empty_body_hash(api: Api, world: dict, body_hash: str) -> None:
    path, nonce = "/api/v1/wallets", "n-empty"
    parts = ["GET", path, str(NOW), nonce] + ([body_hash] if body_hash else [])
    # A variant on purpose: another body hash, or none, in the message, which spec_signature (it hashes
    # the body itself) cannot sign; so its HMAC is computed here.
    mac = hmac.new(world["key"]["secret"].encode(), "\n".join(parts).encode(), hashlib.sha256).digest()
    headers = {"X-Api-Key": world["key"]["apiKey"], "X-Timestamp": str(NOW), "X-Nonce": nonce,
               "X-Signature": base64.b64encode(mac).decode()}
    body = error(api.request("GET", path, headers=headers), "GA2012", 401)
    assert "Canonical message: GET\\n/api/v1/wallets\\n" in body["detail"]
    assert world["key"]["secret"] not in body["detail"]


def test_trailing_line_feed_in_the_message_is_ga2012(api: Api, world: dict) -> None:
    message = f"GET\n/api/v1/wallets\n{NOW}\nn-lf\n{EMPTY_SHA256}\n".encode()
    # A variant on purpose: a line feed after the contract's message, which spec_signature cannot sign; so
    # its HMAC is computed here.
    mac = hmac.new(world["key"]["secret"].encode(), message, hashlib.sha256).digest()
    headers = {"X-Api-Key": world["key"]["apiKey"], "X-Timestamp": str(NOW), "X-Nonce": "n-lf",
               "X-Signature": base64.b64encode(mac).decode()}
    error(api.request("GET", "/api/v1/wallets", headers=headers), "GA2012", 401)


def test_reserialized_body_fails_verification(api: Api, world: dict) -> None:
    compact = json.dumps({"sourceWalletId": world["a"], "targetWalletId": world["b"],
                          "amount": "1.00", "currency": "USD"}, separators=(",", ":")).encode()
    spaced = json.dumps(json.loads(compact), indent=2).encode()
    headers = {"Content-Type": "application/json", **api.headers("POST", TRANSFER_PATH, compact)}
    error(api.request("POST", TRANSFER_PATH, spaced, headers=headers), "GA2012", 401)
    data(api.request("POST", TRANSFER_PATH, compact, headers=headers))


def test_query_string_is_not_signed(api: Api) -> None:
    data(api.get("/api/v1/wallets", query="page=0&size=5"))
    path = "/api/v1/wallets"
    headers = api.headers("GET", path + "?size=5")  # sign_request drops the query too
    data(api.request("GET", path, query="size=5", headers=headers))
    with_query = spec_signature(api.key["secret"], "GET", path + "?size=5", str(NOW), "q-1", b"")
    headers = {**api.headers("GET", path, **{"X-Nonce": "q-1"}), "X-Signature": with_query}
    error(api.request("GET", path, query="size=5", headers=headers), "GA2012", 401)


###############################################################################
# Authentication: the validation pipeline ######################################
###############################################################################


def test_missing_api_key_is_ga2001(api: Api) -> None:
    error(api.get("/api/v1/wallets", **{"X-Api-Key": None}), "GA2001", 401)


def test_empty_api_key_is_ga2001(api: Api) -> None:
    error(api.get("/api/v1/wallets", **{"X-Api-Key": ""}), "GA2001", 401)


def test_unknown_api_key_is_ga2011(api: Api) -> None:
    error(api.get("/api/v1/wallets", **{"X-Api-Key": "ak_unknown"}), "GA2011", 401)


def test_disabled_key_is_ga2021_and_reenabled_key_works(svc, api: Api, world: dict) -> None:
    svc.set_api_key_enabled(world["key"]["apiKey"], False)
    error(api.get("/api/v1/wallets"), "GA2021", 403)
    svc.set_api_key_enabled(world["key"]["apiKey"], True)
    data(api.get("/api/v1/wallets"))


def test_deleted_workspace_is_ga2032(svc, api: Api, world: dict) -> None:
    svc.delete_workspace(world["ws"]["id"])
    error(api.get("/api/v1/wallets"), "GA2032", 404)


def test_removed_member_is_ga2034(svc, api: Api, world: dict) -> None:
    member = svc.add_member(world["ws"]["id"], "alice")
    key = svc.create_api_key(world["ws"]["id"], ["wallet:read"], member_id=member["id"])
    data(key_api(api, key).get("/api/v1/wallets"))
    svc.remove_member(world["ws"]["id"], member["id"])
    error(key_api(api, key).get("/api/v1/wallets"), "GA2034", 403)
    data(api.get("/api/v1/wallets"))  # the owner's key is unaffected


@pytest.mark.parametrize("whitelist, remote, allowed", [
    (["203.0.113.7"], "203.0.113.7", True),
    (["203.0.113.7"], "203.0.113.8", False),
    (["10.1.0.0/16"], "10.1.255.3", True),
    (["10.1.0.0/16"], "10.2.0.1", False),
    (["2001:db8::1"], "2001:db8::1", True),
    (["2001:db8::/32"], "2001:db8:ffff::9", True),
    (["2001:db8::/32"], "2001:db9::1", False),
    (["192.0.2.0/24"], "::ffff:192.0.2.5", True),  # IPv4-mapped IPv6 peer
    (["192.0.2.0/24"], "2001:db8::1", False),
])
def test_ip_whitelist(svc, api: Api, world: dict, whitelist, remote, allowed) -> None:
    key = svc.create_api_key(world["ws"]["id"], ["wallet:read"], ip_whitelist=whitelist)
    client = key_api(api, key)
    path = "/api/v1/wallets"
    response = client.request("GET", path, headers=client.headers("GET", path), REMOTE_ADDR=remote)
    if allowed:
        data(response)
    else:
        error(response, "GA2022", 403)


# Pipeline order: each row fails at its step and would fail at every later one
# too; the first failure must win (docs/contract.md: "the first failure ends processing").
PIPELINE_ORDER = [
    ("key missing beats everything", "no_key", "GA2001", 401),
    ("unknown key beats a disabled state and a stale timestamp", "unknown_key", "GA2011", 401),
    ("disabled key wins over a stale timestamp", "disabled", "GA2021", 403),
    ("deleted workspace wins over a stale timestamp", "deleted_workspace", "GA2032", 404),
    ("removed member wins over a stale timestamp", "removed_member", "GA2034", 403),
    ("stale timestamp wins over a bad signature", "stale", "GA2013", 401),
    ("reused nonce wins over a bad signature", "reused_nonce", "GA2013", 401),
    ("bad signature wins over the whitelist", "bad_signature", "GA2012", 401),
    ("whitelist wins over a missing scope", "not_whitelisted", "GA2022", 403),
    ("missing scope last", "no_scope", "GA2024", 403),
]


@pytest.mark.parametrize("case, failing_step, code, status", PIPELINE_ORDER,
                         ids=[row[0] for row in PIPELINE_ORDER])
def test_pipeline_order(svc, api, world, case, failing_step, code, status) -> None:
    steps = [row[1] for row in PIPELINE_ORDER]
    fails = set(steps[steps.index(failing_step):])
    member = svc.add_member(world["ws"]["id"], "m")
    key = svc.create_api_key(world["ws"]["id"], ["wallet:read"], member_id=member["id"],
                             ip_whitelist=["203.0.113.0/24"] if "not_whitelisted" in fails else None)
    client = key_api(api, key)
    path = "/api/v1/transfer/query/orders" if "no_scope" in fails else "/api/v1/wallets"
    overrides = {}
    if "reused_nonce" in fails:
        first = client.headers("GET", "/api/v1/wallets", **{"X-Nonce": "used"})
        data(client.request("GET", "/api/v1/wallets", headers=first, REMOTE_ADDR="203.0.113.5"))
        overrides["X-Nonce"] = "used"
    if "stale" in fails:
        overrides["X-Timestamp"] = str(NOW - 120)
    if "bad_signature" in fails:
        overrides["X-Signature"] = base64.b64encode(b"0" * 32).decode()
    if "unknown_key" in fails:
        overrides["X-Api-Key"] = "ak_missing"
    if "no_key" in fails:
        overrides["X-Api-Key"] = None
    if "disabled" in fails:
        svc.set_api_key_enabled(key["apiKey"], False)
    if "removed_member" in fails:
        svc.remove_member(world["ws"]["id"], member["id"])
    if "deleted_workspace" in fails:
        svc.delete_workspace(world["ws"]["id"])
    headers = client.headers("GET", path, **overrides)
    error(client.request("GET", path, headers=headers, REMOTE_ADDR="198.51.100.1"), code, status)


###############################################################################
# Authentication: scopes #######################################################
###############################################################################


ENDPOINTS = [  # (method, path template, required scope)
    ("GET", "/api/v1/wallets", "wallet:read"),
    ("GET", "/api/v1/wallets/{a}", "wallet:read"),
    ("GET", "/api/v1/wallets/{a}/balance", "wallet:read"),
    ("GET", "/api/v1/wallets/{a}/flows", "wallet:read"),
    ("GET", "/api/v1/transfer/query/orders", "transfer:read"),
    ("GET", "/api/v1/transfer/query/orders/wallet/{a}", "transfer:read"),
    ("GET", "/api/v1/transfer/query/orders/{biz}", "transfer:read"),
    ("GET", "/api/v1/transfer/query/orders/{biz}/completed", "transfer:read"),
    ("POST", TRANSFER_PATH, "transfer:create"),
]


@pytest.mark.parametrize("scope", CONTRACT_SCOPES)
@pytest.mark.parametrize("method, template, required", ENDPOINTS)
def test_each_scope_grants_exactly_its_endpoints(svc, api, world, scope, method, template,
                                                 required) -> None:
    svc.create_transfer(world["ws"]["id"], source_wallet_id=world["a"], target_wallet_id=world["b"],
                        amount="1.00", currency="USD", biz_id="order-1")
    client = key_api(api, svc.create_api_key(world["ws"]["id"], [scope]))
    path = template.format(a=world["a"], biz="order-1")
    if method == "POST":
        response = client.transfer({"sourceWalletId": world["a"], "targetWalletId": world["b"],
                                    "amount": "1.00", "currency": "USD"})
    else:
        response = client.get(path)
    if scope == required:
        data(response)
    else:
        body = error(response, "GA2024", 403)
        assert required in body["detail"]


@pytest.mark.parametrize("method, path", [
    ("GET", "/api/v1/admin/keys"),
    ("GET", "/api/v2/wallets"),
    ("GET", "/api/"),
    ("GET", "/api"),
    ("GET", "/api/v1/wallets/"),  # no normalisation of a trailing slash
    ("DELETE", "/api/v1/wallets"),
    ("POST", "/api/v1/wallets"),
    ("PUT", TRANSFER_PATH),
    ("GET", TRANSFER_PATH),
    ("HEAD", "/api/v1/wallets"),
])
def test_undeclared_endpoint_is_denied_by_default(api: Api, method: str, path: str) -> None:
    response = api.request(method, path, headers=api.headers(method, path))
    assert response.status_int == 403
    if method != "HEAD":
        error(response, "50090201", 403)


@pytest.mark.parametrize("path", ["/", "/_admin/", "/nothing/here"])
def test_a_path_nothing_serves_says_where_the_api_and_the_console_are(svc, path: str) -> None:
    """Issue 45, item 6: `/` and `/_admin/` answered a bare S404 though the banner's first line is the bare
    URL: the detail points at the API and the console."""
    app = webtest.TestApp(walletsvc.create_app(svc, admin_token="t"))
    detail = error(app.get(path, expect_errors=True), "S404", 404)["detail"]
    assert "/api/v1/" in detail and "/openapi.json" in detail and "/_admin/console" in detail


def test_undeclared_endpoint_still_authenticates_first(api: Api) -> None:
    error(api.get("/api/v1/admin/keys", **{"X-Signature": "AAAA"}), "GA2012", 401)
    error(api.get("/api/v1/admin/keys", **{"X-Api-Key": None}), "GA2001", 401)


def test_an_undeclared_path_is_50090201_whatever_the_keys_scopes(svc, api, world) -> None:
    narrow = key_api(api, svc.create_api_key(world["ws"]["id"], ["wallet:read"]))
    error(narrow.get("/api/v1/nowhere"), "50090201", 403)  # not GA2024: no scope would open it
    error(api.get("/api/v1/nowhere"), "50090201", 403)  # every scope


###############################################################################
# Authentication: workspace isolation ##########################################
###############################################################################


@pytest.mark.parametrize("path", ["/api/v1/wallets/{x}", "/api/v1/wallets/{x}/balance",
                                  "/api/v1/wallets/{x}/flows",
                                  "/api/v1/transfer/query/orders/wallet/{x}"])
def test_wallet_of_another_workspace_is_w1001(svc, api: Api, path: str) -> None:
    other = svc.create_wallet(svc.create_workspace("Other")["id"], "USD")
    error(api.get(path.format(x=other["id"])), "W1001", 404)
    error(api.get(path.format(x="wal_does_not_exist")), "W1001", 404)


@pytest.mark.parametrize("path", ["/api/v1/transfer/query/orders/{biz}",
                                  "/api/v1/transfer/query/orders/{biz}/completed"])
def test_order_of_another_workspace_is_t1001(svc, api: Api, path: str) -> None:
    order_in_another_workspace(svc, "theirs")
    body = error(api.get(path.format(biz="theirs")), "T1001", 404)
    assert body == error(api.get(path.format(biz="never-existed")), "T1001", 404) | {
        "detail": body["detail"], "timestamp": body["timestamp"]}
    assert data(api.get("/api/v1/transfer/query/orders"))["page"]["totalElements"] == 0
    assert data(api.get("/api/v1/transfer/query/orders", query="bizIdPrefix=the"))["content"] == []


###############################################################################
# Errors: the catalog, row by row (docs/contract.md, docs/contract.md) #########
###############################################################################


def _disabled_key(svc, api: Api, world: dict, monkeypatch) -> webtest.TestResponse:
    svc.set_api_key_enabled(world["key"]["apiKey"], False)
    return api.get("/api/v1/wallets")


def _deleted_workspace(svc, api: Api, world: dict, monkeypatch) -> webtest.TestResponse:
    svc.delete_workspace(world["ws"]["id"])
    return api.get("/api/v1/wallets")


def _removed_member(svc, api: Api, world: dict, monkeypatch) -> webtest.TestResponse:
    member = svc.add_member(world["ws"]["id"], "bea")
    api.key = svc.create_api_key(world["ws"]["id"], CONTRACT_SCOPES, member_id=member["id"])
    svc.remove_member(world["ws"]["id"], member["id"])
    return api.get("/api/v1/wallets")


def _key_with(**made: Any) -> Callable[..., webtest.TestResponse]:
    def request(svc, api: Api, world: dict, monkeypatch) -> webtest.TestResponse:
        api.key = svc.create_api_key(world["ws"]["id"], **made)
        return api.get("/api/v1/wallets")
    return request


def _failing_handler(svc, api: Api, world: dict, monkeypatch) -> webtest.TestResponse:
    monkeypatch.setattr(walletsvc.WalletService, "get_wallet", lambda *args, **kwargs: 1 / 0)
    return api.get(f"/api/v1/wallets/{world['a']}")


def _frozen_target(svc, api: Api, world: dict, monkeypatch) -> webtest.TestResponse:
    svc.set_wallet_status(world["b"], "FROZEN")
    return api.transfer(transfer_body(world))


def _changed_replay(svc, api: Api, world: dict, monkeypatch) -> webtest.TestResponse:
    data(api.transfer(transfer_body(world, bizId="twice")))
    return api.transfer(transfer_body(world, bizId="twice", amount="1.00"))


# For each code of the catalog, a real request that must answer it (svc, api, world, monkeypatch).
_CATALOG_TRIGGERS: dict[str, Callable[..., webtest.TestResponse]] = {
    "GA2001": lambda svc, api, world, mp: api.get("/api/v1/wallets", **{"X-Api-Key": None}),
    "GA2011": lambda svc, api, world, mp: api.get("/api/v1/wallets", **{"X-Api-Key": "ak_nope"}),
    "GA2021": _disabled_key,
    "GA2032": _deleted_workspace,
    "GA2034": _removed_member,
    "GA2013": lambda svc, api, world, mp: api.get("/api/v1/wallets", **{"X-Timestamp": str(NOW - 61)}),
    "GA2012": lambda svc, api, world, mp: api.get(
        "/api/v1/wallets", **{"X-Signature": base64.b64encode(b"\0" * 32).decode()}),
    "GA2022": _key_with(scopes=CONTRACT_SCOPES, ip_whitelist=["203.0.113.7"]),
    "GA2024": _key_with(scopes=["transfer:read"]),
    "50090201": lambda svc, api, world, mp: api.get("/api/v1/admin/keys"),
    "S012": lambda svc, api, world, mp: api.get("/api/v1/wallets", query="size=0"),
    "S404": lambda svc, api, world, mp: api.app.get("/nowhere", expect_errors=True),
    "S413": lambda svc, api, world, mp: api.transfer(b"{" + b" " * 70000 + b"}"),
    "S415": lambda svc, api, world, mp: api.transfer(transfer_body(world), **{"Content-Type": "text/plain"}),
    "S500": _failing_handler,
    "S503": lambda svc, api, world, mp: api.get("/api/v1/wallets/wal_magic_busy"),
    "W1001": lambda svc, api, world, mp: api.get("/api/v1/wallets/wal_missing"),
    "W1002": _frozen_target,
    "T1001": lambda svc, api, world, mp: api.get("/api/v1/transfer/query/orders/never"),
    "T2001": lambda svc, api, world, mp: api.transfer(transfer_body(world, amount="100.01")),
    "T2002": lambda svc, api, world, mp: api.transfer(transfer_body(world, targetWalletId=world["jpy"])),
    "T2003": lambda svc, api, world, mp: api.transfer(transfer_body(world, targetWalletId=world["a"])),
    "T2004": _changed_replay,
}


@pytest.mark.parametrize("code", list(CATALOG))
def test_every_catalog_row_is_what_a_real_response_carries(code, clock, make_service, monkeypatch) -> None:
    svc = make_service(clock=clock, magic_values=True)
    world_ = make_world(svc)
    api = Api(webtest.TestApp(walletsvc.create_app(svc)), world_["key"], clock)
    response = _CATALOG_TRIGGERS[code](svc, api, world_, monkeypatch)
    name, status = CATALOG[code]
    assert (response.status_int, response.json["code"], response.json["message"]) == (status, code, name)


###############################################################################
# Python API (docs/embedding.md) ###############################################
###############################################################################


def test_admin_api_returns_camel_case_dicts(svc) -> None:
    ws = svc.create_workspace("Acme")
    assert ws == {"id": ws["id"], "name": "Acme", "ownerMemberId": ws["ownerMemberId"],
                  "createdAt": "2027-01-15T08:00:00.000Z"}
    assert ws["id"].startswith("ws_") and ws["ownerMemberId"].startswith("mem_")
    member = svc.add_member(ws["id"], "alice")
    assert member == {"id": member["id"], "workspaceId": ws["id"], "name": "alice", "role": "MEMBER",
                      "createdAt": "2027-01-15T08:00:00.000Z"}
    key = svc.create_api_key(ws["id"], ["wallet:read"], member_id=member["id"],
                             ip_whitelist=["10.0.0.1", "2001:db8::/48"])
    assert key == {"apiKey": key["apiKey"], "secret": key["secret"], "workspaceId": ws["id"],
                   "memberId": member["id"], "scopes": ["wallet:read"], "enabled": True,
                   "ipWhitelist": ["10.0.0.1/32", "2001:db8::/48"],
                   "createdAt": "2027-01-15T08:00:00.000Z"}
    listed = svc.list_api_keys(ws["id"])
    assert [k["apiKey"] for k in listed] == [key["apiKey"]]
    assert "secret" not in listed[0]  # returned once, at creation
    wallet = svc.create_wallet(ws["id"], "EUR", name="ops")
    assert wallet == {"id": wallet["id"], "workspaceId": ws["id"], "name": "ops", "currency": "EUR",
                      "status": "ACTIVE", "balance": "0.00", "createdAt": "2027-01-15T08:00:00.000Z",
                      "updatedAt": "2027-01-15T08:00:00.000Z"}


def test_default_key_belongs_to_the_owner(svc) -> None:
    ws = svc.create_workspace("Acme")
    assert svc.create_api_key(ws["id"])["memberId"] == ws["ownerMemberId"]
    assert [m["role"] for m in svc.list_members(ws["id"])] == ["OWNER"]


@pytest.mark.parametrize("call, code, status", [
    (lambda svc, ws: svc.create_wallet("ws_missing", "USD"), "GA2032", 404),
    (lambda svc, ws: svc.create_wallet(ws["id"], "XYZ"), "S012", 400),
    (lambda svc, ws: svc.create_api_key(ws["id"], ["wallet:write"]), "S012", 400),
    (lambda svc, ws: svc.create_api_key(ws["id"], []), "S012", 400),
    (lambda svc, ws: svc.create_api_key(ws["id"], ip_whitelist=["10.0.0.300"]), "S012", 400),
    (lambda svc, ws: svc.create_api_key(ws["id"], member_id="mem_missing"), "S404", 404),
    (lambda svc, ws: svc.set_api_key_enabled("ak_missing", False), "S404", 404),
    (lambda svc, ws: svc.remove_member(ws["id"], "mem_missing"), "S404", 404),
    (lambda svc, ws: svc.delete_workspace("ws_missing"), "GA2032", 404),
    (lambda svc, ws: svc.create_workspace(""), "S012", 400),
    (lambda svc, ws: svc.set_wallet_status("wal_missing", "FROZEN"), "W1001", 404),
    (lambda svc, ws: svc.deposit("wal_missing", "1.00"), "W1001", 404),
])
def test_admin_errors_carry_the_catalog_code(svc, call, code: str, status: int) -> None:
    ws = svc.create_workspace("Acme")
    with pytest.raises(walletsvc.WalletError) as raised:
        call(svc, ws)
    assert (raised.value.code, raised.value.status) == (code, status)


def test_deleted_workspace_is_gone_from_the_admin_api(svc) -> None:
    ws = svc.create_workspace("Acme")
    svc.delete_workspace(ws["id"])
    assert svc.list_workspaces() == []
    with pytest.raises(walletsvc.WalletError, match="workspace does not exist"):
        svc.create_wallet(ws["id"], "USD")


def test_service_takes_amounts_as_str_or_decimal_and_refuses_floats(svc, world) -> None:
    import decimal

    ws = world["ws"]["id"]
    order = svc.create_transfer(ws, world["a"], world["b"], decimal.Decimal("1.25"), "USD")
    assert order["amount"] == "1.25"
    assert svc.create_transfer(ws, world["a"], world["b"], "0.75", "USD")["amount"] == "0.75"
    with pytest.raises(walletsvc.WalletError) as refused:
        svc.create_transfer(ws, world["a"], world["b"], 1.5, "USD")
    assert (refused.value.code, "'amount'" in str(refused.value)) == ("S012", True)
    assert svc.get_balance(world["b"])["balance"] == "2.00"


def test_python_api_transfer_matches_http(svc, world: dict) -> None:
    order = svc.create_transfer(world["ws"]["id"], source_wallet_id=world["a"],
                                target_wallet_id=world["b"], amount="1.25", currency="USD")
    assert svc.get_transfer(world["ws"]["id"], order["bizId"]) == order
    assert svc.transfer_completion(world["ws"]["id"], order["bizId"])["completed"] is True
    assert svc.list_transfers(world["ws"]["id"], {"size": 1})["content"] == [order]


def test_two_services_in_one_process_share_nothing(clock: FrozenClock, make_service) -> None:
    first_svc = make_service(clock=clock)
    second_svc = make_service(clock=clock)
    key = first_svc.create_api_key(first_svc.create_workspace("one")["id"], ["wallet:read"])
    second = Api(webtest.TestApp(walletsvc.create_app(second_svc)), key, clock)
    error(second.get("/api/v1/wallets"), "GA2011", 401)
    assert second_svc.list_workspaces() == []


def test_in_memory_service_works_from_many_threads(svc, world) -> None:
    def deposit_many() -> None:
        for _ in range(25):
            svc.deposit(world["b"], "0.01")
    threads = [threading.Thread(target=deposit_many) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert balances(svc, world["b"]) == ["2.00"]


# The languages of the blocks the suite runs; a ```text or ```json block is shown, not run.
DOC_LANGUAGES = ("python", "bash", "sh", "console", "toml", "js", "java")


def test_every_code_block_of_readme_and_docs_runs_in_the_suite() -> None:
    """A new block in README or docs/ needs a test that runs it: these are the sections whose blocks
    the tests below run, with how many blocks of each language."""
    found, fences = {}, []
    for page in DOC_PAGES:
        text = page.read_text(encoding="utf-8")
        fences += [(page.name, label) for label in re.findall(r"^ *```(\w*)$", text, flags=re.MULTILINE)[::2]]
        assert not any(f"```{language}\n" in text.split("\n## ", 1)[0] for language in DOC_LANGUAGES), page
        for title in re.findall(r"^## (.+)$", text, flags=re.MULTILINE):
            counts = {language: len(doc_blocks(title, language)) for language in DOC_LANGUAGES}
            if any(counts.values()):
                found[f"{page.name}: {title}"] = {language: n for language, n in counts.items() if n}
    assert [fence for fence in fences if fence[1] not in (*DOC_LANGUAGES, "text", "json")] == []
    assert found == {
        "README.md: Prerequisites": {"sh": 1},
        "README.md: The two commands": {"sh": 2},
        "README.md: Your first request": {"sh": 1},
        "README.md: A test with the pytest plugin": {"python": 1},
        "README.md: Embedding": {"python": 1},
        "contributing.md: Adding an endpoint": {"python": 1},
        "embedding.md: The Python API": {"python": 1},
        "embedding.md: A key for your app": {"python": 1, "sh": 1},
        "embedding.md: Flask": {"python": 1, "sh": 2},
        "embedding.md: Django": {"python": 1, "sh": 3},
        "embedding.md: Starlette": {"python": 1, "sh": 2},
        "operations.md: When things go wrong": {"sh": 1},
        "reference.md: Command line": {"bash": 1},
        "sandbox.md: Serving the sandbox": {"sh": 1},
        "sandbox.md: Driving the sandbox from any language": {"sh": 1},
        "sandbox.md: Scenarios": {"toml": 1},
        "sandbox.md: One sandbox, however many processes": {"python": 1},
        "signing.md: Signing with curl": {"sh": 2},
        "signing.md: Signing in Python": {"python": 1},
        "signing.md: Signing in JavaScript": {"js": 1},
        "signing.md: Signing in Java": {"java": 1},
        "signing.md: Clients": {"python": 1},
        "testing.md: The pytest plugin": {"python": 2},
        "testing.md: Other languages": {"sh": 1, "js": 1, "java": 1},
    }


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_readme_and_docs_resolve_and_no_page_cites_a_file_the_repository_lacks() -> None:
    root = README.parent
    for source in [*DOC_PAGES, *(root / name for name in ("walletsvc.py", "test_walletsvc.py",
                                                          "bench_walletsvc.py", "schema.sql"))]:
        cited = set(re.findall(r"\b([\w/-]+\.md)\b", source.read_text(encoding="utf-8")))
        missing = [name for name in cited if not ((root / name).exists() or (root / "docs" / name).exists())]
        assert missing == [], (source.name, missing)  # every file cited is in the repository
    for page in DOC_PAGES:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            assert linked.exists(), f"{page.name}: {target}"
            if anchor:
                headings = re.findall(r"^#+ (.+)$", linked.read_text(encoding="utf-8"), flags=re.MULTILINE)
                assert anchor in {_slug(heading) for heading in headings}, f"{page.name}: {target}"


def test_what_users_of_the_peers_expect_is_there_and_no_page_rots() -> None:
    """Issue 38: no LICENSE though setup.cfg said MIT, no changelog, platforms unstated, py.typed unexplained;
    sandbox.md stopped mid-sentence; `serve --help` cited README sections README lacks; three pages gave
    three different GET rates (one run, one place: docs/operations.md's Benchmarks)."""
    import argparse
    import itertools

    root = README.parent
    assert (root / "LICENSE").read_text().startswith("MIT License\n")
    setup = (root / "setup.cfg").read_text()
    assert "license = MIT\nlicense_files = LICENSE\n" in setup
    assert f"\n## {walletsvc.__version__}\n" in (root / "CHANGELOG.md").read_text()
    assert "Linux or macOS (Windows: in WSL)" in doc_section("Prerequisites")
    assert "walletsvc ships no `py.typed`" in doc_section("The Python API")
    for page in DOC_PAGES:  # a paragraph or list item ends its sentence before a blank line
        lines = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL).splitlines()
        unfinished = [line for line, after in itertools.pairwise(lines) if line.strip() and not after.strip()
                      and not line.lstrip().startswith(("#", "|")) and not re.search(r"[.:;!?)`*>\]]$", line)]
        assert unfinished == [], (page.name, unfinished)
    serve_help = next(action.choices["serve"] for action in walletsvc.build_parser()._actions
                      if isinstance(action, argparse._SubParsersAction)).format_help()
    cited = re.findall(r"(README|docs/\w+\.md), ([A-Z][\w ]*\w)", " ".join(serve_help.split()))
    assert len(cited) == 2  # the scenarios and the settings
    for page, title in cited:
        assert f"\n## {title}\n" in (root / ("README.md" if page == "README" else page)).read_text(), title
    rate = r"\d,\d{3} (signed )?GETs|\d,\d{3} a second"
    rates = [page.name for page in DOC_PAGES for _ in re.finditer(rate, page.read_text(encoding="utf-8"))]
    assert rates == []  # figures live in the Benchmarks table alone


def test_readme_is_a_first_screen_of_short_sentences() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    prose = " ".join(line for line in prose.splitlines() if not line.startswith(("|", "#")))
    long = [sentence for sentence in re.split(r"(?<=[.!?:])\s+", prose) if len(sentence.split()) > 40]
    assert long == []


def test_readme_prerequisites_make_the_virtualenv_of_a_clone(tmp_path) -> None:
    """README, "Prerequisites": the clone (of this checkout here), then its block as printed."""
    subprocess.run(["git", "clone", "-q", str(README.parent), str(tmp_path / "walletsvc")], check=True,
                   timeout=120, capture_output=True)
    (block,) = doc_blocks("Prerequisites", "sh")
    script = block + "\npython -c 'import sys; print(sys.prefix)'"
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path,
                          env=printed_shell_env(tmp_path), capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "walletsvc" / ".venv")  # activated
    assert "python_requires = >=3.11" in (README.parent / "setup.cfg").read_text()  # "Python 3.11 or later"


def test_readme_two_commands_are_what_ci_and_this_suite_run() -> None:
    serve, test = doc_blocks("The two commands", "sh")
    assert test.strip() == (README.parent / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert serve.strip() == "pip install . && walletsvc serve --demo"  # demo_server: serve --demo
    (serving,) = doc_blocks("Serving the sandbox", "sh")
    assert serving.strip() == "walletsvc serve --demo"
    # "Five tests skip when their tools are missing": two browser tests, one JavaScript and Java test, and
    # the two OpenAPI tests that run npm's tools
    source = pathlib.Path(__file__).read_text(encoding="utf-8")
    assert len(re.findall(r"^def test_\w+\(browser\b", source, flags=re.MULTILINE)) == 2
    assert source.count('pytest.skip(f"{\', \'.join(missing)} not installed') == 1
    assert len(re.findall(r"^def test_\w+\([^)]*\bnpm_tools\b", source, flags=re.MULTILINE)) == 2
    assert "Five tests skip" in doc_section("The two commands")


def test_a_teams_test_extra_brings_only_what_the_plugin_needs() -> None:
    """Issue 45, item 4: `[test]` brought Schemathesis and Hypothesis, whose pytest plugins made collecting
    one test of a team's own take 9-11 s. A team's `walletsvc[test]` is pytest alone; this project's own
    tools live in `[dev]`, which .ci/run installs."""
    import configparser

    config = configparser.ConfigParser()
    config.read(README.parent / "setup.cfg")
    extras = {name: value.split() for name, value in config["options.extras_require"].items()}
    assert extras["test"] == ["pytest>=8"]
    assert {"pytest>=8", "webtest>=3.0"} <= set(extras["dev"])
    assert any(tool.startswith("schemathesis") for tool in extras["dev"])
    assert "'.[dev]'" in (README.parent / ".ci" / "run").read_text()


def test_readme_first_request_needs_nothing_filled_in(tmp_path) -> None:
    """README, "Your first request": `walletsvc request GET /api/v1/wallets` after `serve --demo`, with
    no WALLETSVC_ variable; on 127.0.0.1:8080 when it is free, else with WALLETSVC_URL only."""
    import socket

    server = ServerProcess(str(tmp_path / "walletsvc.db"), tmp_path / "demo.log", "--demo")
    variables = {}
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", 8080))
            server.port, server.url = 8080, "http://127.0.0.1:8080"
        except OSError:
            variables["WALLETSVC_URL"] = server.url
    (block,) = doc_blocks("Your first request", "sh")
    server.start()
    try:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path,
                              env=printed_shell_env(tmp_path, **variables), capture_output=True, text=True,
                              timeout=60, check=False)
        assert done.returncode == 0 and "\nHTTP 200 OK\n" in done.stderr, done.stderr
        if not variables:  # it says that it took the demo's defaults (issue 38)
            assert done.stderr.startswith("walletsvc: WALLETSVC_URL, WALLETSVC_KEY, WALLETSVC_SECRET not set")
        wallets = json.loads(done.stdout)["data"]["content"]
        assert sorted((w["name"], w["balance"]) for w in wallets) == [
            ("alice", "1000.00"), ("bob", "1000.00"), ("yen", "100000")]
        (shown,) = re.findall(r"```text\n(export .*)…\n```", doc_section("Your first request"))
        printed = re.search(r"^export .*$", (tmp_path / "demo.log").read_text(), re.MULTILINE).group(0)
        assert printed.startswith(shown.replace("http://127.0.0.1:8080", server.url))
    finally:
        server.stop()


def test_signing_curl_blocks_and_walletsvc_sign_run_as_printed(demo_server, tmp_path) -> None:
    import shutil

    if not all(shutil.which(tool) for tool in ("bash", "curl", "openssl", "sha256sum")):
        pytest.skip("the curl blocks need bash, curl, openssl and sha256sum")
    server, env = demo_server
    env = printed_shell_env(tmp_path, **{name: value for name, value in env.items()
                                         if name.startswith("WALLETSVC_")})
    get, post = doc_blocks("Signing with curl", "sh")
    (sign,) = doc_blocks("Command line", "bash")

    def run(block: str) -> dict:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    admin = {"Authorization": f"Bearer {env['WALLETSVC_ADMIN_TOKEN']}"}
    for change in ({}, {"freeze": True, "at": "2030-01-01T00:00:00Z"}, {"freeze": False, "advance": -7200}):
        if change:  # every block signs at the server's time: a frozen or moved clock is no matter
            _clock(server.url, admin, **change)
        assert run(get)["data"]["page"] == {"size": 5, "number": 0, "totalElements": 3, "totalPages": 1}
        assert run(sign)["data"]["page"]["totalElements"] == 3
        created = run(post)["data"]
        assert created["status"] == "COMPLETED"
        if change.get("freeze"):
            assert created["createdAt"] == "2030-01-01T00:00:00.000Z"
    journal = requests.get(server.url + "/_admin/journal", params={"size": 100}, headers=admin,
                           timeout=10).json()["data"]["content"]
    assert {entry["code"] for entry in journal} == {"2000"}  # not one refused request on the way


def test_the_soak_command_selects_the_six_slow_tests(tmp_path) -> None:
    (soak,) = doc_blocks("When things go wrong", "sh")
    assert "The six marked `slow`" in doc_section("When things go wrong")
    done = subprocess.run(["bash", "-c", soak.strip() + " --collect-only -q -p no:cacheprovider"],
                          cwd=README.parent, env=printed_shell_env(tmp_path), capture_output=True, text=True,
                          timeout=120, check=False)
    assert re.search(r"^(6/\d+ tests collected|test_walletsvc.py: 6$)", done.stdout, flags=re.MULTILINE), (
        done.stdout[-2000:] + done.stderr[-2000:])


def test_the_error_catalog_of_the_reference_is_the_codes() -> None:
    row = r"^\| (\w+) \| ([A-Z_]+) \| (\d{3}) \|"
    rows = re.findall(row, doc_section("Error catalog"), flags=re.MULTILINE)

    def classes(root: type) -> list[type]:
        return [root, *(c for sub in root.__subclasses__() for c in classes(sub))]

    raised = {(error.code, error.name, str(error.status)) for error in classes(walletsvc.WalletError)}
    assert sorted(rows) == sorted(raised)
    # walletsvc.ERRORS (public) is the catalog too: each row once, a subclass of a subclass included.
    assert sorted(rows) == sorted((error.code, error.name, str(error.status)) for error in walletsvc.ERRORS)


def test_the_command_line_reference_names_every_verb() -> None:
    import argparse

    (verbs,) = [action.choices for action in walletsvc.build_parser()._actions
                if isinstance(action, argparse._SubParsersAction)]
    section = doc_section("Command line")
    assert [verb for verb in verbs if f"walletsvc {verb}" not in section] == []


def test_the_states_are_str_enums_equal_to_the_contracts_strings(make_service) -> None:
    """docs/embedding.md: statuses, flow types, directions, roles and settlement modes are StrEnums that
    compare equal to the strings of docs/contract.md, and go into JSON as those strings."""
    assert list(walletsvc.WalletStatus) == ["ACTIVE", "FROZEN", "CLOSED"]
    assert list(walletsvc.TransferStatus) == ["PENDING", "COMPLETED", "FAILED"]
    assert list(walletsvc.FlowType) == ["DEPOSIT", "WITHDRAWAL", "TRANSFER_OUT", "TRANSFER_IN"]
    assert list(walletsvc.Direction) == ["DEBIT", "CREDIT"]
    assert list(walletsvc.Role) == ["OWNER", "MEMBER"]
    assert list(walletsvc.Settlement) == ["immediate", "manual", "delayed"]
    directions = {flow_type: walletsvc.FlowType(flow_type).direction
                  for flow_type in ("DEPOSIT", "WITHDRAWAL", "TRANSFER_OUT", "TRANSFER_IN")}
    assert directions == {"DEPOSIT": "CREDIT", "WITHDRAWAL": "DEBIT", "TRANSFER_OUT": "DEBIT",
                          "TRANSFER_IN": "CREDIT"}
    svc = make_service()
    ws = svc.create_workspace("Acme")
    wallet = svc.create_wallet(ws["id"], "USD")
    flow = svc.deposit(wallet["id"], "1.00")
    shown = json.loads(json.dumps([wallet, flow, svc.list_members(ws["id"])]))
    assert (shown[0]["status"], shown[1]["type"], shown[1]["direction"], shown[2][0]["role"]) == (
        "ACTIVE", "DEPOSIT", "CREDIT", "OWNER")


def test_the_python_api_raises_only_wallet_errors_for_bad_values(make_service) -> None:
    """Defect: create_transfer(None, ...) raised sqlite3.IntegrityError, a page of 10**5000 ValueError, a list
    as the query AttributeError; and deposit took an int that a transfer refuses. Service methods take
    Python values the same way everywhere, and raise WalletError (docs/embedding.md)."""
    svc = make_service()
    ws = svc.create_workspace("Acme")["id"]
    a, b = (svc.create_wallet(ws, "USD")["id"] for _ in range(2))
    svc.deposit(a, "5.00")
    refused = [(lambda: svc.create_transfer(None, a, b, "1.00", "USD"), "GA2032", ""),
               (lambda: svc.list_wallets(ws, {"page": 10**5000}), "S012", "'page'"),
               (lambda: svc.list_wallets(ws, [("page", "1")]), "S012", "'query'"),
               (lambda: svc.list_flows(a, "page=1"), "S012", "'query'"),
               (lambda: svc.list_transfers(ws, ["size"]), "S012", "'query'")]
    refused += [(lambda method=method, amount=amount: method(a, amount), "S012", "'amount'")
                for method in (svc.deposit, svc.withdraw) for amount in (1, 1.5, True)]
    refused += [(lambda: svc.create_transfer(ws, a, b, 1, "USD"), "S012", "'amount'")]
    for call, code, named in refused:
        with pytest.raises(walletsvc.WalletError) as raised:
            call()
        assert raised.value.code == code and named in str(raised.value), (code, named, raised.value)
    assert svc.get_balance(a)["balance"] == "5.00" and svc.get_balance(b)["balance"] == "0.00"
    assert svc.deposit(a, decimal.Decimal("1.50"))["amount"] == "1.50"  # str or Decimal, as everywhere


###############################################################################
# Python API: settings (docs/embedding.md) #####################################
###############################################################################


def test_unknown_setting_is_an_error(svc) -> None:
    with pytest.raises(ValueError, match="unknown setting"):
        walletsvc.create_app(svc, timestamp_tolerence=30)
    with pytest.raises(ValueError, match="unknown setting"):
        walletsvc.WalletService(":memory:", bogus=True)


@pytest.mark.parametrize("name, value", [("timestamp_tolerance", 0), ("max_body_bytes", -1),
                                         ("default_locale", "fr-FR"), ("debug_signatures", "maybe"),
                                         ("trusted_proxies", "not-an-ip"), ("busy_timeout", 0)])
def test_invalid_setting_values_are_errors(name: str, value) -> None:
    with pytest.raises(ValueError, match=name):
        walletsvc.Settings(**{name: value})


def test_settings_convert_strings() -> None:
    settings = walletsvc.Settings(timestamp_tolerance="30", debug_signatures="true",
                                  trusted_proxies="10.0.0.0/8, ::1")
    assert settings.timestamp_tolerance == 30 and settings.debug_signatures is True
    assert [str(net) for net in settings.trusted_proxies] == ["10.0.0.0/8", "::1/128"]


def test_create_app_takes_only_http_settings_and_the_service_only_its_own(make_service) -> None:
    svc = make_service()
    for name, value in [("settlement", "manual"), ("magic_values", True), ("journal_size", 5)]:
        with pytest.raises(ValueError, match=r"WalletService\(path"):
            walletsvc.create_app(svc, **{name: value})
    for name, value in [("admin_token", "t"), ("debug_signatures", True), ("max_body_bytes", 10)]:
        with pytest.raises(ValueError, match=r"create_app\(svc"):
            walletsvc.WalletService(":memory:", **{name: value})


def test_timestamp_tolerance_setting_changes_the_window(svc, world, clock) -> None:
    strict = Api(webtest.TestApp(walletsvc.create_app(svc, timestamp_tolerance=5)), world["key"], clock)
    error(strict.get("/api/v1/wallets", **{"X-Timestamp": str(NOW - 6)}), "GA2013", 401)
    data(strict.get("/api/v1/wallets", **{"X-Timestamp": str(NOW - 5)}))


def test_the_settings_table_of_the_reference_lists_every_setting() -> None:
    section = doc_section("Settings")
    rows = re.findall(r"^\| `(\w+)` \| (service|HTTP) \|", section, flags=re.MULTILINE)
    assert sorted(name for name, _ in rows) == sorted(walletsvc.Settings.names())
    for name, layer in rows:
        assert walletsvc.Settings.names("http" if layer == "HTTP" else "service").count(name) == 1, name
    for name, low, high in re.findall(r"^\| `(\w+)` \| \w+ \| [^|]* \| ([\d.,]+) to ([\d.,]+) \|", section,
                                      flags=re.MULTILINE):  # each range the table states is the one refused
        value = float(high.replace(",", "")) * 10 + 1
        with pytest.raises(ValueError, match=f"from {re.escape(low)} to {re.escape(high)}"):
            walletsvc.Settings().replace(**{name: value})


###############################################################################
# Python API: storage (docs/embedding.md) ######################################
###############################################################################


def test_file_database_uses_wal_and_a_schema_version(tmp_path) -> None:
    path = str(tmp_path / "wallet.db")
    first = walletsvc.WalletService(path)
    ws = first.create_workspace("Acme")
    first.close()
    second = walletsvc.WalletService(path)  # schema applied again: idempotent, data kept
    assert [w["id"] for w in second.list_workspaces()] == [ws["id"]]
    with second.db.connection() as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
        assert [tuple(row) for row in conn.execute("SELECT version FROM schema_version")] == [(7,)]


def test_schema_sql_applies_idempotently(tmp_path) -> None:
    schema = (pathlib.Path(walletsvc.__file__).parent / "schema.sql").read_text()
    with sqlite3.connect(tmp_path / "raw.db") as conn:
        conn.executescript(schema)
        conn.executescript(schema)
        assert conn.execute("SELECT count(*) FROM schema_version").fetchone()[0] == 1


def test_database_of_another_schema_version_is_refused(tmp_path) -> None:
    path = str(tmp_path / "wallet.db")
    walletsvc.WalletService(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE schema_version SET version = 99")
    with pytest.raises(RuntimeError, match="schema version 99"):
        walletsvc.WalletService(path)


@pytest.mark.parametrize("statement", [
    "UPDATE wallets SET balance = -1",
    "UPDATE wallets SET balance = 1.5",
    "UPDATE wallets SET pending = balance + 1",
])
def test_schema_checks_are_the_last_line_of_defence(svc, world, statement: str) -> None:
    with pytest.raises(sqlite3.IntegrityError):
        svc.db.write([lambda conn: conn.execute(statement)])
    assert balances(svc, world["a"]) == ["100.00"]


###############################################################################
# Python API: Client, HmacAuth, sign_request (docs/embedding.md) ###############
###############################################################################


@pytest.mark.parametrize("target", ["live", "wsgi"])
def test_client_covers_the_nine_endpoints(svc, world, live, clock, target) -> None:
    import time as real_time

    clock.now = real_time.time()
    app = walletsvc.create_app(svc)
    client = walletsvc.Client(live if target == "live" else app, world["key"]["apiKey"],
                              world["key"]["secret"])
    order = client.create_transfer(world["a"], world["b"], "2.00", "USD", biz_id="c-1", description="x")
    assert client.create_transfer(world["a"], world["b"], "2.00", "USD", biz_id="c-1",
                                  description="x") == order
    assert client.last_headers["Idempotent-Replayed"] == "true"
    assert client.list_wallets(size=1, sort=["name,asc"])["content"][0]["name"] == "a"
    assert client.get_wallet(world["a"])["balance"] == "98.00"
    assert client.get_balance(world["b"])["available"] == "2.00"
    assert client.list_flows(world["a"], type="TRANSFER_OUT")["page"]["totalElements"] == 1
    assert client.list_transfers(status="COMPLETED")["content"] == [order]
    assert client.list_wallet_transfers(world["b"])["content"] == [order]
    assert client.get_transfer("c-1") == order
    assert client.transfer_completed("c-1")["completed"] is True
    with pytest.raises(walletsvc.WalletError) as raised:
        client.create_transfer(world["a"], world["b"], "1000.00", "USD")
    assert (type(raised.value).__name__, raised.value.code, raised.value.status) == (
        "InsufficientBalance", "T2001", 422)
    assert "below the amount" in str(raised.value)
    with pytest.raises(walletsvc.WalletError) as raised:
        client.get_transfer("no-such-order")
    assert raised.value.code == "T1001"


def camel_case(name: str) -> str:
    """wallet_id -> walletId: a path parameter as the contract (and the document) writes it."""
    return re.sub(r"_([a-z])", lambda letter: letter[1].upper(), name)


def snake_case(name: str) -> str:
    """walletId -> wallet_id: a name of the document (camelCase, as the contract writes it) in Python."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def test_client_methods_match_the_declarations(make_service) -> None:
    """Client's methods are written out: each takes what its operation in the served /openapi.json takes
    (path parameters, then the body's required fields, its optional ones by keyword, then the query's as
    keywords), and says its method and path."""
    import inspect

    document = webtest.TestApp(walletsvc.create_app(make_service())).get("/openapi.json").json
    kind = inspect.Parameter
    checked = []
    for path, operations in document["paths"].items():
        for verb, operation in operations.items() if path.startswith("/api/") else ():
            if verb == "head":  # HEAD is GET's, without the body: no method of its own
                continue
            parameters = operation.get("parameters", [])
            expected = [("self", kind.POSITIONAL_OR_KEYWORD)]
            expected += [(snake_case(parameter["name"]), kind.POSITIONAL_OR_KEYWORD)
                         for parameter in parameters if parameter["in"] == "path"]
            if "requestBody" in operation:
                reference = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
                schema = document["components"]["schemas"][reference.rsplit("/", 1)[1]]
                snake = {name: snake_case(name) for name in schema["properties"]}
                expected += [(snake[name], kind.POSITIONAL_OR_KEYWORD) for name in schema["required"]]
                expected += [(snake[name], kind.KEYWORD_ONLY) for name in schema["properties"]
                             if name not in schema["required"]]
            if any(parameter["in"] == "query" for parameter in parameters):
                expected.append(("query", kind.VAR_KEYWORD))
            method = getattr(walletsvc.Client, operation["operationId"])
            assert [(parameter.name, parameter.kind)
                    for parameter in inspect.signature(method).parameters.values()] == expected, method
            declared = verb.upper() + " " + re.sub(r"{(\w+)}", lambda name: f"<{snake_case(name[1])}>", path)
            assert declared in " ".join(method.__doc__.split()), method
            checked.append(operation["operationId"])
    assert len(checked) == 9


def test_the_client_takes_a_decimal_amount(walletsvc_sandbox) -> None:
    import decimal

    sandbox = walletsvc_sandbox
    order = sandbox.client.create_transfer(sandbox.wallets["alice"]["id"], sandbox.wallets["bob"]["id"],
                                           decimal.Decimal("1.50"), "USD")
    assert order["amount"] == "1.50"
    assert sandbox.service.get_wallet(sandbox.wallets["bob"]["id"])["balance"] == "1001.50"


def test_clients_sign_the_prefix_of_their_base_url(svc, world, clock, capsys, monkeypatch) -> None:
    import time as real_time

    clock.now = real_time.time()
    parent = bottle.Bottle()
    parent.mount("/payments/", walletsvc.create_app(svc))
    key, secret = world["key"]["apiKey"], world["key"]["secret"]
    in_process = walletsvc.Client(parent, key, secret, prefix="/payments", clock=clock)
    assert in_process.get_wallet(world["a"])["id"] == world["a"]
    server = walletsvc.LiveServer(parent)
    try:
        over_http = walletsvc.Client(server.url + "/payments/", key, secret)
        assert over_http.create_transfer(world["a"], world["b"], "1.00", "USD")["status"] == "COMPLETED"
        monkeypatch.setenv("WALLETSVC_KEY", key)
        monkeypatch.setenv("WALLETSVC_SECRET", secret)
        code, out, _ = run_cli(capsys, "request", "GET", f"/api/v1/wallets/{world['b']}",
                               "--url", server.url + "/payments")
        assert code == 0 and json.loads(out)["data"]["balance"] == "1.00"
    finally:
        server.stop()


def test_hmac_auth_signs_requests_and_httpx(svc, live, world, clock) -> None:
    import time as real_time

    import httpx
    import requests

    clock.now = real_time.time()
    auth = walletsvc.HmacAuth(world["key"]["apiKey"], world["key"]["secret"])
    response = requests.get(live + "/api/v1/wallets", params={"size": 1}, auth=auth, timeout=5)
    assert response.json()["data"]["page"]["size"] == 1
    body = {"sourceWalletId": world["a"], "targetWalletId": world["b"], "amount": "1.00", "currency": "USD"}
    assert requests.post(live + TRANSFER_PATH, json=body, auth=auth, timeout=5).json()["success"] is True
    with httpx.Client(auth=auth, timeout=5) as client:
        assert client.get(live + "/api/v1/wallets", params={"size": 2}).json()["data"]["page"]["size"] == 2
        assert client.post(live + TRANSFER_PATH, json=body).json()["success"] is True
    assert balances(svc, world["b"]) == ["2.00"]


def test_hmac_auth_follows_a_moved_live_sandbox_clock_without_a_refused_request(walletsvc_live) -> None:
    """docs/signing.md, Clients: after `sandbox.clock.advance(3600)`,
    `requests.get(url, auth=HmacAuth(key, secret))`
    answered GA2013. It reads the server's time from /healthz beside the URL first (not journaled);
    httpx too; clock= signs at a given clock (an in-process transport, with no server to ask)."""
    import httpx
    import requests

    sandbox = walletsvc_live
    sandbox.clock.advance(3600)
    key, secret = sandbox.key["apiKey"], sandbox.key["secret"]
    url = sandbox.url + "/api/v1/wallets"
    assert requests.get(url, auth=walletsvc.HmacAuth(key, secret), timeout=10).json()["code"] == "2000"
    assert httpx.get(url, auth=walletsvc.HmacAuth(key, secret), timeout=10).json()["code"] == "2000"
    in_process = walletsvc.HmacAuth(key, secret, clock=sandbox.clock)  # no server to ask: the clock itself
    transport = httpx.WSGITransport(app=sandbox.app)
    with httpx.Client(transport=transport, base_url="http://wallets.test") as local:
        assert local.get("/api/v1/wallets", auth=in_process).json()["code"] == "2000"
    sandbox.clock.freeze()
    sandbox.clock.advance(-86400)  # frozen, a day back
    given = walletsvc.HmacAuth(key, secret, clock=sandbox.clock)  # no extra request
    assert requests.get(url, auth=given, timeout=10).json()["code"] == "2000"
    assert requests.get(url, auth=walletsvc.HmacAuth(key, secret), timeout=10).json()["code"] == "2000"
    sandbox.assert_called("GET", "/api/v1/wallets", times=5)
    assert {entry["code"] for entry in sandbox.journal.entries()} == {"2000"}
    wall = requests.get(url, auth=walletsvc.HmacAuth(key, secret, clock=time.time), timeout=10).json()
    assert wall["code"] == "2000"  # (the machine's clock, as an app in production signs: accepted too)


def test_request_says_when_it_falls_back_to_the_demo_and_what_it_needs(tmp_path) -> None:
    """Issue 38: with no variable, `walletsvc request` quietly reached the demo on 8080 in place of the app
    meant; a POST without --data said S415; a server that is not there said only "Connection refused"."""
    port = _free_port()  # nothing listens there
    env = {name: value for name, value in os.environ.items() if not name.startswith("WALLETSVC_")}
    fell_back = _cli("request", "GET", "/api/v1/wallets", env=env)
    assert "WALLETSVC_URL, WALLETSVC_KEY, WALLETSVC_SECRET not set: the demo's http://127.0.0.1:8080 with" \
           " key ak_demo" in fell_back.stderr
    gone = _cli("request", "GET", "/api/v1/wallets", "--url", f"127.0.0.1:{port}", env={
        **env, "WALLETSVC_KEY": "ak_x", "WALLETSVC_SECRET": "sk_x"})
    assert gone.returncode == 2 and "not set" not in gone.stderr
    assert f"cannot reach http://127.0.0.1:{port}" in gone.stderr and "Traceback" not in gone.stderr
    bodiless = _cli("request", "POST", "/api/v1/transfer/command/create", "--url", f"127.0.0.1:{port}",
                    env={**env, "WALLETSVC_KEY": "ak_x", "WALLETSVC_SECRET": "sk_x"})
    assert bodiless.returncode == 2 and "POST needs a JSON body: --data" in bodiless.stderr
    signed = _cli("sign", "GET", "/api/v1/wallets", "--url", f"127.0.0.1:{port}", env=env)
    assert signed.returncode == 0 and "signed at this machine's clock" in signed.stderr


def test_a_fault_with_a_code_outside_the_catalog_says_its_status_is_needed(walletsvc_sandbox) -> None:
    """Issue 38: {"action": "error", "code": "NOPE"} said "'status' is required", with nothing on why."""
    admin = webtest.TestApp(walletsvc_sandbox.app)
    refused = admin.post_json("/_admin/faults", {"action": "error", "code": "NOPE"}, expect_errors=True,
                              headers={"Authorization": f"Bearer {walletsvc_sandbox.admin_token}"}).json
    assert refused["code"] == "S012"
    assert "NOPE is not a code of the error catalog, so give the HTTP status" in refused["detail"]


def test_a_failed_assert_called_shows_the_tests_line_not_walletsvcs_frames(tmp_path) -> None:
    (tmp_path / "test_miss.py").write_text(
        "def test_miss(walletsvc_sandbox):\n    walletsvc_sandbox.assert_called('GET', '/api/v1/wallets')\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_miss.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1 and "expected a request with" in done.stdout, done.stdout
    assert "walletsvc.py" not in done.stdout.split("short test summary")[0], done.stdout


@pytest.mark.parametrize("section", ["Signing in Python", "Clients"])
def test_signing_python_blocks_run_as_printed_against_the_demo(demo_server, section, tmp_path) -> None:
    server, env = demo_server  # WALLETSVC_URL, _KEY, _SECRET as the banner exports them
    admin = {"Authorization": f"Bearer {env['WALLETSVC_ADMIN_TOKEN']}"}
    moves = [{"freeze": True, "at": "2030-01-01T00:00:00Z"}]  # the Clients block once, at a frozen clock
    if section == "Signing in Python":  # this one at real time, frozen, and moved
        moves = [{}, *moves, {"freeze": False, "advance": -7200}]
    for change in moves:
        if change:
            _clock(server.url, admin, **change)
        for block in doc_blocks(section, "python"):
            done = subprocess.run([sys.executable, "-c", block], env=env, capture_output=True, text=True,
                                  timeout=60, cwd=tmp_path, check=False)
            assert done.returncode == 0, done.stdout + done.stderr
    if section == "Signing in Python":
        assert done.stdout == "3 wallets\n"
    else:  # 1.00 by requests, 10.00 by the Client: bob's balance from the demo's 1000.00
        client = walletsvc.Client(server.url, env["WALLETSVC_KEY"], env["WALLETSVC_SECRET"])
        reply = client.list_wallets(sort=["name,asc"])
        assert [wallet["balance"] for wallet in reply["content"]] == ["989.00", "1011.00", "100000"]


###############################################################################
# HTTP surfaces: /healthz and the admin surface (docs/reference.md) ############
###############################################################################


def test_healthz_answers_without_auth(app: webtest.TestApp) -> None:
    import importlib.metadata

    assert data(app.get("/healthz")) == {"status": "ok", "version": importlib.metadata.version("walletsvc")}


def admin_routes(svc) -> list[tuple[str, str]]:
    """Every admin (method, path) an app with a token documents, parameters filled with "x"."""
    document = admin_app(svc).get("/openapi.json").json
    routes = [(method.upper(), re.sub(r"\{\w+\}", "x", path))
              for path, operations in document["paths"].items()
              for method in operations if path.startswith("/_admin/") and method != "head"]
    assert len(routes) >= 27
    return routes


def test_admin_surface_is_404_without_a_token(svc) -> None:
    app = admin_app(svc, None)
    for method, path in admin_routes(svc):
        response = app.request(path, method=method, headers={"Authorization": "Bearer anything"},
                               expect_errors=True)
        error(response, "S404", 404)


@pytest.mark.parametrize("authorization", [None, "", "Bearer", "Bearer wrong", "Basic czNjcmV0",
                                           "Bearer s3cret-and-more", "bearer s3cre"])
def test_admin_surface_refuses_a_wrong_token(svc, authorization) -> None:
    app = admin_app(svc)
    headers = {"Authorization": authorization} if authorization is not None else {}
    for method, path in admin_routes(svc):
        if path == "/_admin/console":  # the console's login form (docs/sandbox.md), tested below
            continue
        response = app.request(path, method=method, headers=headers, expect_errors=True)
        error(response, "S401", 401)


def test_admin_surface_mirrors_the_python_api(svc, clock, make_service) -> None:
    app = admin_app(svc)
    auth = {"Authorization": "Bearer s3cret"}

    def call(method: str, path: str, body: dict | None = None):
        response = app.request(path, method=method, headers=auth, expect_errors=True,
                               body=json.dumps(body).encode() if body is not None else b"",
                               content_type="application/json")
        return data(response)

    ws = call("POST", "/_admin/workspaces", {"name": "Acme"})
    assert call("GET", f"/_admin/workspaces/{ws['id']}") == ws
    member = call("POST", f"/_admin/workspaces/{ws['id']}/members", {"name": "bob"})
    assert len(call("GET", f"/_admin/workspaces/{ws['id']}/members")) == 2
    key = call("POST", f"/_admin/workspaces/{ws['id']}/keys",
               {"scopes": ["wallet:read"], "memberId": member["id"]})
    assert key["secret"] and call("GET", f"/_admin/workspaces/{ws['id']}/keys")[0]["apiKey"] == key["apiKey"]
    assert call("POST", f"/_admin/keys/{key['apiKey']}/disable")["enabled"] is False
    assert call("POST", f"/_admin/keys/{key['apiKey']}/enable")["enabled"] is True
    a = call("POST", f"/_admin/workspaces/{ws['id']}/wallets", {"currency": "USD", "name": "a"})
    b = call("POST", f"/_admin/workspaces/{ws['id']}/wallets", {"currency": "USD"})
    assert call("POST", f"/_admin/wallets/{a['id']}/deposit", {"amount": "9.00"})["balanceAfter"] == "9.00"
    assert call("POST", f"/_admin/wallets/{a['id']}/withdraw", {"amount": "1.00"})["balanceAfter"] == "8.00"
    assert call("POST", f"/_admin/wallets/{b['id']}/status", {"status": "FROZEN"})["status"] == "FROZEN"
    assert call("GET", f"/_admin/wallets/{a['id']}")["balance"] == "8.00"
    assert call("GET", f"/_admin/workspaces/{ws['id']}/wallets")["page"]["totalElements"] == 2
    call("POST", f"/_admin/wallets/{b['id']}/status", {"status": "ACTIVE"})
    manual = make_service(settlement="manual")
    svc.settings = manual.settings  # the same service, now settling manually
    svc.create_transfer(ws["id"], source_wallet_id=a["id"], target_wallet_id=b["id"], amount="1.00",
                        currency="USD", biz_id="t-1")
    svc.create_transfer(ws["id"], source_wallet_id=a["id"], target_wallet_id=b["id"], amount="1.00",
                        currency="USD", biz_id="t-2")
    assert call("POST", "/_admin/transfers/t-1/complete")["status"] == "COMPLETED"
    assert call("POST", "/_admin/transfers/t-2/fail", {"workspaceId": ws["id"]})["status"] == "FAILED"
    assert call("GET", f"/_admin/wallets/{a['id']}/balance")["available"] == "7.00"  # 9 - 1 - t-1
    balances = call("GET", f"/_admin/workspaces/{ws['id']}/balances?sort=createdAt,asc&size=1")
    assert (balances["content"], balances["page"]["totalElements"]) == (
        [{"walletId": a["id"], "currency": "USD", "balance": "7.00", "available": "7.00", "pending": "0.00",
          "updatedAt": balances["content"][0]["updatedAt"]}], 2)
    flows = call("GET", f"/_admin/wallets/{a['id']}/flows?size=2")
    assert flows["page"]["totalElements"] == 3 and flows["content"][0]["balanceAfter"] == "7.00"
    assert [order["bizId"] for order in call("GET", f"/_admin/workspaces/{ws['id']}/transfers?status=FAILED")[
        "content"]] == ["t-2"]
    assert call("DELETE", f"/_admin/workspaces/{ws['id']}/members/{member['id']}") is None
    assert call("DELETE", f"/_admin/workspaces/{ws['id']}") is None
    assert call("GET", "/_admin/workspaces") == []
    assert call("POST", "/_admin/reset") is None


@pytest.mark.parametrize("path, body, code", [
    ("/_admin/workspaces", {"nam": "x"}, "S012"),
    ("/_admin/workspaces", {}, "S012"),
    ("/_admin/workspaces", [], "S012"),
    ("/_admin/workspaces/ws_missing/wallets", {"currency": "USD"}, "GA2032"),
    ("/_admin/wallets/wal_missing/deposit", {"amount": "1.00"}, "W1001"),
    ("/_admin/transfers/none/complete", {}, "T1001"),
])
def test_admin_errors_use_the_envelope(svc, path, body, code) -> None:
    response = admin_app(svc).post(path, json.dumps(body), headers={"Authorization": "Bearer s3cret"},
                                   content_type="application/json", expect_errors=True)
    assert response.json["code"] == code and response.json["success"] is False


ADMIN_INPUTS = [
    ("POST", "/_admin/workspaces", {"name": 5}, "name"),
    ("POST", "/_admin/workspaces/{ws}/keys", {"scopes": 5}, "scopes"),
    ("POST", "/_admin/workspaces/{ws}/keys", {"scopes": [5]}, "scopes"),
    ("POST", "/_admin/workspaces/{ws}/keys", {"ipWhitelist": 5}, "ipWhitelist"),
    ("POST", "/_admin/workspaces/{ws}/keys", {"memberId": [1]}, "memberId"),
    ("POST", "/_admin/transfers/x/complete", {"workspaceId": [1]}, "workspaceId"),
    ("POST", "/_admin/transfers/x/fail", {"workspaceId": [1]}, "workspaceId"),
    ("POST", "/_admin/clock", {"at": None}, "at"),
    ("POST", "/_admin/clock", {"at": 1e308}, "at"),
    ("POST", "/_admin/clock", {"at": -1e308}, "at"),
    ("POST", "/_admin/clock", {"advance": 1e308}, "advance"),
    ("POST", "/_admin/clock", {"advance": -1e308}, "advance"),
    ("POST", "/_admin/clock", {"at": "0001-01-01T00:00:00"}, "at"),
    ("POST", "/_admin/faults", {"latency": "slow"}, "latency"),
    ("POST", "/_admin/faults", {"times": True}, "times"),
    ("POST", "/_admin/wallets/{wallet}/deposit", {"amount": 5}, "amount"),
    ("POST", "/_admin/wallets/{wallet}/deposit", {"amount": "007.50"}, "amount"),  # no leading zero
    # an address or a CIDR block, as the document's pattern states: no netmask, no spaces, no zone
    ("POST", "/_admin/workspaces/{ws}/keys", {"ipWhitelist": ["10.0.0.1/255.0.0.0"]}, "ipWhitelist"),
    ("POST", "/_admin/workspaces/{ws}/keys", {"ipWhitelist": [" 10.0.0.1"]}, "ipWhitelist"),
    ("POST", "/_admin/workspaces/{ws}/keys", {"ipWhitelist": ["fe80::1%eth0"]}, "ipWhitelist"),
    ("POST", "/_admin/workspaces/{ws}/keys", {"ipWhitelist": ["10.0.0.0/33"]}, "ipWhitelist"),
    ("POST", "/_admin/ids", {}, "seed"),  # required, though it may be null
    ("POST", "/_admin/faults", {"code": "X999"}, "status"),  # a code of its own needs a status
    ("POST", "/_admin/faults", {"times": 1.5}, "times"),
    ("POST", "/_admin/faults", {"code": ""}, "code"),
    ("POST", "/_admin/faults", {"code": "X" * 65, "status": 400}, "code"),
    ("POST", "/_admin/scenarios", {"scenario": "demo", "workspaces": []}, "scenario"),
]


def test_json_integers_may_be_written_with_a_zero_fraction_and_nullable_fields_take_null(
        walletsvc_sandbox) -> None:
    """JSON Schema (the document's language): 3.0 is an integer; a required field whose type allows null
    may be null."""
    app = webtest.TestApp(walletsvc_sandbox.app)
    rule = app.post_json("/_admin/faults", {"code": "X999", "status": 418.0, "times": 3.0},
                         headers=ADMIN).json["data"]
    assert (rule["status"], rule["times"]) == (418, 3)
    assert app.post_json("/_admin/ids", {"seed": None}, headers=ADMIN).json["success"] is True
    keys = [app.post_json(f"/_admin/workspaces/{walletsvc_sandbox.workspace['id']}/keys",
                          {"ipWhitelist": [entry]}, headers=ADMIN).json["data"]["ipWhitelist"]
            for entry in ("10.0.0.0/8", "2001:db8::/32", "::1")]
    assert keys == [["10.0.0.0/8"], ["2001:db8::/32"], ["::1/128"]]


@pytest.mark.parametrize("method, path, body, field", ADMIN_INPUTS)
def test_the_admin_surface_answers_bad_input_with_s012(walletsvc_sandbox, method, path, body, field) -> None:
    sandbox = walletsvc_sandbox
    app = webtest.TestApp(sandbox.app)
    auth = {"Authorization": f"Bearer {sandbox.service and 'walletsvc-test-admin'}"}
    url = path.format(ws=sandbox.workspace["id"], wallet=sandbox.wallets["alice"]["id"])
    response = app.request(url, method=method, body=json.dumps(body).encode(), headers=auth,
                           content_type="application/json", expect_errors=True)
    refused = error(response, "S012", 400)
    assert f"'{field}'" in refused["detail"]
    assert error(app.get("/api/v1/wallets", expect_errors=True), "GA2001", 401)  # every surface still answers
    assert app.get("/_admin/clock", headers=auth).json["data"]["now"].startswith("20")


@pytest.mark.parametrize("path", ["/_admin/workspaces", "/_admin/workspaces/{ws}/members",
                                  "/_admin/workspaces/{ws}/wallets"])
def test_names_with_nul_are_refused_with_s012(walletsvc_sandbox, path: str) -> None:
    app = webtest.TestApp(walletsvc_sandbox.app)
    auth = {"Authorization": "Bearer walletsvc-test-admin"}
    body = {"name": "a\x00b", **({"currency": "USD"} if path.endswith("wallets") else {})}
    response = app.post_json(path.format(ws=walletsvc_sandbox.workspace["id"]), body, headers=auth,
                             expect_errors=True)
    assert "'name'" in error(response, "S012", 400)["detail"]


@pytest.mark.parametrize("body", [b'{"name": "\\ud800"}', b'{"\\udfff": 1}', b'{"name": "a\\udc00b"}'])
def test_a_lone_surrogate_is_s012_not_a_failure(walletsvc_sandbox, body: bytes) -> None:
    app = webtest.TestApp(walletsvc_sandbox.app)
    answer = app.post("/_admin/workspaces", body, headers=ADMIN, content_type="application/json",
                      expect_errors=True)
    assert "surrogate" in error(answer, "S012", 400)["detail"]
    pair = app.post("/_admin/workspaces", b'{"name": "\\ud83d\\ude00"}', headers=ADMIN,
                    content_type="application/json")
    assert pair.json["data"]["name"] == "\U0001F600"  # a pair is one character


def test_a_wrong_signature_over_a_lone_surrogate_is_diagnosed_as_ga2012(walletsvc_sandbox) -> None:
    """Defect: under debug_signatures, the diagnosis of a wrong signature over a body holding "\\ud800"
    failed, and the answer was S500 instead of GA2012."""
    app, key = webtest.TestApp(walletsvc_sandbox.app), walletsvc_sandbox.key
    body = b'{"description": "\\ud800"}'
    headers = _signed("POST", TRANSFER_PATH, key["apiKey"], "not-the-secret", body=body)
    answer = app.post(TRANSFER_PATH, body, headers={**headers, "Content-Type": "application/json"},
                      expect_errors=True)
    assert "Canonical message" in error(answer, "GA2012", 401)["detail"]


def test_a_405_says_which_methods_are_allowed(walletsvc_sandbox) -> None:
    app = webtest.TestApp(walletsvc_sandbox.app)
    refused = app.put("/healthz", expect_errors=True)
    error(refused, "S405", 405)
    assert refused.headers["Allow"] == "GET"
    assert app.delete("/_admin/clock", headers=ADMIN, expect_errors=True).headers["Allow"] == "GET,POST"


###############################################################################
# HTTP surfaces: /openapi.json (docs/reference.md) #############################
###############################################################################


def test_openapi_document_is_valid_and_covers_every_route(svc) -> None:
    from openapi_spec_validator import validate

    app = walletsvc.create_app(svc, admin_token="s3cret")
    document = webtest.TestApp(app).get("/openapi.json").json  # the bare document (docs/reference.md)
    validate(document)
    documented = {(method.upper(), path) for path, operations in document["paths"].items()
                  for method in operations}
    served = {(route.method, re.sub(r"<(\w+)>", lambda name: "{" + camel_case(name[1]) + "}", route.rule))
              for route in app.routes if route.rule != "/api<rest:re:(/.*)?>"}
    # HEAD wherever GET is, but under /api/ (issue 43, item 6: the server refuses it there, 403 50090201)
    assert documented == served | {("HEAD", path) for method, path in served
                                   if method == "GET" and not path.startswith("/api/")}
    create = document["paths"][TRANSFER_PATH]["post"]
    assert create["security"] == [{"ApiKey": [], "Timestamp": [], "Nonce": [], "Signature": []}]
    described = " ".join(response["description"] for operations in document["paths"].values()
                         for operation in operations.values() for response in operation["responses"].values())
    answered = {**CATALOG, **ADMIN_CATALOG}
    # what a path answers to a method, or /api/ to a path, it does not serve
    for code in ("S405", "50090201"):
        del answered[code]
    assert all(f"{code} {name}" in described for code, (name, _) in answered.items())
    for name in ("Wallet", "Balance", "Flow", "TransferOrder", "Completion", "Workspace", "Member", "ApiKey"):
        assert name in document["components"]["schemas"]


def test_each_operation_states_every_error_it_answers(svc) -> None:
    """docs/reference.md: every status an operation can answer, with its error codes (Schemathesis then checks
    each answer against them)."""
    document = webtest.TestApp(walletsvc.create_app(svc, admin_token="s3cret")).get("/openapi.json").json

    def errors(path: str, method: str) -> dict:
        answers = document["paths"][path][method]["responses"]
        return {status: sorted(answer["content"]["application/json"]["examples"])
                for status, answer in answers.items() if status != "200"}

    signed = {"401": ["GA2001", "GA2011", "GA2012", "GA2013"],
              "403": ["GA2021", "GA2022", "GA2024", "GA2034"]}
    # any request: a Content-Length that is no number, an oversized body, a failure, the database; and what
    # the HTTP server refuses itself: headers over 64 KiB (431), an unsupported Transfer-Encoding (400)
    always = {"400": ["S012"], "413": ["S413"], "500": ["S500"], "503": ["S503"], "431": ["S012"]}
    assert errors(TRANSFER_PATH, "post") == {
        **signed, **always, "404": ["GA2032", "W1001"], "409": ["T2004"], "415": ["S415"],
        "422": ["T2001", "T2002", "T2003", "W1002"]}
    assert errors("/api/v1/wallets/{walletId}", "get") == {**signed, **always, "404": ["GA2032", "W1001"]}
    assert errors("/api/v1/wallets", "get") == {**signed, **always, "404": ["GA2032"]}
    assert errors("/api/v1/transfer/query/orders/{bizId}", "get") == {**signed, **always,
                                                                       "404": ["GA2032", "T1001"]}
    assert errors("/_admin/wallets/{walletId}/withdraw", "post") == {
        **always, "401": ["S401"], "403": ["S403"], "404": ["W1001"], "422": ["T2001", "W1002"]}
    assert errors("/healthz", "get") == always


def test_openapi_without_admin_token_documents_only_what_is_served(svc) -> None:
    document = webtest.TestApp(walletsvc.create_app(svc)).get("/openapi.json").json
    assert not [path for path in document["paths"] if path.startswith("/_admin")]


def test_openapi_command_prints_what_a_server_with_the_admin_surface_serves(capsys, make_service) -> None:
    code, out, _ = run_cli(capsys, "openapi", "--url", "http://127.0.0.1:9999")
    printed = json.loads(out)
    served = webtest.TestApp(walletsvc.create_app(make_service(), admin_token="t")).get(
        "/openapi.json").json
    assert code == 0 and printed["openapi"] == "3.1.0"
    assert printed["servers"] == [{"url": "http://127.0.0.1:9999"}]
    cookie = printed["components"]["securitySchemes"].pop("ConsoleSession")
    assert cookie["name"] == "walletsvc_console_9999"  # as the console names it on that port
    served["components"]["securitySchemes"].pop("ConsoleSession")
    assert {**printed, "servers": None} == {**served, "servers": None}


def test_the_document_states_what_the_server_enforces(walletsvc_sandbox) -> None:
    """docs/reference.md: patterns, lengths, enums, ranges and required bodies, as the server \
checks them."""
    document = webtest.TestApp(walletsvc_sandbox.app).get("/openapi.json").json
    schemas, paths = document["components"]["schemas"], document["paths"]
    transfer = schemas["CreateTransfer"]["properties"]
    assert transfer["bizId"] == {"$ref": "#/components/schemas/BizId"}
    assert schemas["BizId"]["pattern"] == "^[A-Za-z0-9._:-]{1,64}$"
    assert transfer["description"]["maxLength"] == 255
    assert transfer["currency"] == {"$ref": "#/components/schemas/Currency"}
    currencies = schemas["Currency"]["enum"]
    assert {"USD", "JPY", "KWD"} <= set(currencies) and "ABC" not in currencies

    def resolved(schema: dict) -> dict:
        return schemas[schema["$ref"].rsplit("/", 1)[1]] if "$ref" in schema else schema

    def query(path: str) -> dict:
        return {p["name"]: resolved(p["schema"]) for p in paths[path]["get"]["parameters"]
                if p["in"] == "query"}
    orders, flows, wallets = (query(path) for path in ("/api/v1/transfer/query/orders",
                                                       "/api/v1/wallets/{walletId}/flows",
                                                       "/api/v1/wallets"))
    assert orders["status"]["enum"] == ["PENDING", "COMPLETED", "FAILED"]
    direction = "(,([aA][sS][cC]|[dD][eE][sS][cC]))?$"  # asc or desc, in any case (docs/contract.md)
    assert orders["sort"]["items"]["pattern"] == "^(createdAt|updatedAt|amount|status)" + direction
    assert wallets["sort"]["items"]["pattern"] == (
        "^(createdAt|updatedAt|name|currency|status|balance)" + direction)
    assert orders["bizIdPrefix"]["pattern"] == "^[A-Za-z0-9._:-]{1,64}$"
    assert flows["type"]["enum"] == ["DEPOSIT", "WITHDRAWAL", "TRANSFER_OUT", "TRANSFER_IN"]
    assert flows["direction"]["enum"] == ["DEBIT", "CREDIT"]
    assert (wallets["status"]["enum"] == ["ACTIVE", "FROZEN", "CLOSED"]
            and "EUR" in wallets["currency"]["enum"])
    fault = schemas["FaultBody"]["properties"]
    assert (fault["status"]["minimum"], fault["status"]["maximum"]) == (400, 599)
    assert (fault["latency"]["minimum"], fault["latency"]["maximum"], fault["times"]["minimum"]) == (0, 60, 1)
    assert schemas["NewKeyBody"]["properties"]["scopes"]["minItems"] == 1
    assert paths["/_admin/workspaces"]["post"]["requestBody"]["required"] is True  # {"name"} is required
    assert paths["/_admin/transfers/{bizId}/complete"]["post"]["requestBody"]["required"] is False


def _transfer_schema(document: dict) -> dict:
    return document["components"]["schemas"]["CreateTransfer"]


@hypothesis.settings(max_examples=300, deadline=None, database=None,
                     suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.given(currency=st.sampled_from(["JPY", "USD", "BHD", "CLF"]),  # ISO 4217: 0, 2, 3 and 4 decimals
                  amount=st.one_of(st.text("0123456789.", max_size=22),
                                   st.from_regex(r"[0-9]{1,16}(\.[0-9]{1,5})?", fullmatch=True)))
def test_the_document_states_each_currencys_amounts(app: webtest.TestApp, api: Api, currency: str,
                                                    amount: str) -> None:
    """docs/reference.md: an amount the document's pattern for its currency allows is taken (the transfer then
    fails on its unknown wallets, W1001), and one it does not is S012 naming the amount."""
    document = app.get("/openapi.json").json
    pattern = next(rule["then"]["properties"]["amount"]["pattern"]
                   for rule in _transfer_schema(document)["allOf"]
                   if currency in rule["if"]["properties"]["currency"]["enum"])
    answer = api.transfer({"sourceWalletId": "wal_nope", "targetWalletId": "wal_nope2", "amount": amount,
                           "currency": currency}).json
    allowed = re.fullmatch(pattern.strip("^$"), amount) is not None
    assert (answer["code"], "'amount'" in answer.get("detail", "")) == (
        ("W1001", False) if allowed else ("S012", True))
    if allowed:  # and the pattern is what docs/reference.md says: positive, at most the currency's decimals
        whole, _, fraction = amount.partition(".")
        assert 0 < float(amount) < 10**18 / 10**{"JPY": 0, "USD": 2, "BHD": 3, "CLF": 4}[currency]
        assert len(fraction) <= {"JPY": 0, "USD": 2, "BHD": 3, "CLF": 4}[currency]
        assert whole == "0" or not whole.startswith("0")  # no leading zero


def test_the_document_links_answers_to_later_requests_and_states_the_console_login(walletsvc_sandbox) -> None:
    """docs/reference.md: a created transfer's bizId to the order queries, a wallet's id to its balance and
    flows; the console's form login, its 303 and its HTML."""
    document = webtest.TestApp(walletsvc_sandbox.app).get("/openapi.json").json
    operations = {operation["operationId"]: operation for methods in document["paths"].values()
                  for operation in methods.values()}
    links = {(source, name): (link["operationId"], link["parameters"])
             for source, operation in operations.items()
             for name, link in operation["responses"]["200"].get("links", {}).items()}
    assert links == {
        ("create_transfer", "Order"): ("get_transfer", {"bizId": "$response.body#/data/bizId"}),
        ("create_transfer", "Completed"): ("transfer_completed", {"bizId": "$response.body#/data/bizId"}),
        ("get_wallet", "Balance"): ("get_balance", {"walletId": "$response.body#/data/id"}),
        ("get_wallet", "Flows"): ("list_flows", {"walletId": "$response.body#/data/id"}),
        ("list_wallets", "Wallet"): ("get_wallet", {"walletId": "$response.body#/data/content/0/id"}),
        ("list_transfers", "Order"): ("get_transfer", {"bizId": "$response.body#/data/content/0/bizId"}),
        **{("admin_create_workspace", name): (f"admin_{name}", {"workspaceId": "$response.body#/data/id"})
           for name in ("get_workspace", "list_members", "create_api_key", "create_wallet")},
        **{("admin_create_wallet", name): (f"admin_{name}", {"walletId": "$response.body#/data/id"})
           for name in ("get_wallet", "deposit", "withdraw", "set_wallet_status")}}
    for target, parameters in links.values():  # each names a real operation and its real parameters
        assert set(parameters) <= {p["name"] for p in operations[target]["parameters"]}
    login = document["paths"]["/_admin/console"]["post"]
    assert login["requestBody"]["content"]["application/x-www-form-urlencoded"]["schema"]["required"] == [
        "token"]
    assert "Set-Cookie" in login["responses"]["303"]["description"]
    assert list(login["responses"]["401"]["content"]) == ["text/html"]


SIGN_ME = "sign-me"  # the X-Signature Schemathesis sends; SchemathesisSigner puts the real one in its place


class SchemathesisSigner:
    """WSGI middleware in front of the app on a live server. Schemathesis sends the sandbox's key with
    ``X-Signature: sign-me``; this signs the request as it arrived (the raw path, the exact body bytes,
    the sandbox clock, a fresh nonce). Requests without the placeholder (its probes with missing or
    wrong credentials) pass as they are."""

    def __init__(self, app: Callable, key: dict, clock: Callable[[], float]) -> None:
        self.app, self.key, self.clock = app, key, clock

    def __call__(self, environ: dict, start_response: Callable) -> Any:
        if environ.get("HTTP_X_SIGNATURE") == SIGN_ME and environ.get("HTTP_X_API_KEY") == self.key["apiKey"]:
            body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
            environ["wsgi.input"] = io.BytesIO(body)
            timestamp, nonce = str(int(self.clock())), str(uuid.uuid4())
            environ.update(HTTP_X_TIMESTAMP=timestamp, HTTP_X_NONCE=nonce, HTTP_X_SIGNATURE=spec_signature(
                self.key["secret"], environ["REQUEST_METHOD"], environ["REQUEST_URI"].split("?")[0],
                timestamp, nonce, body))
        return self.app(environ, start_response)


# What a request the document allows may still answer, and why no JSON Schema can say so in advance.
# Everything else Schemathesis generates as valid must be accepted (docs/reference.md).
BUSINESS_RULES = {  # 422, whatever the operation
    "T2001": "the source's available balance is below the amount: the ledger decides, not the request",
    "T2002": "the wallet holds another currency: the wallet decides, not the request",
    "T2003": "the source and the target are the same wallet: JSON Schema cannot compare two fields",
    "W1002": "the wallet is FROZEN or CLOSED: its state decides, not the request",
}
# Fields each operation states, in the served document's description, that a body its schema allows
# may still be refused for (S012 naming the field): read from /openapi.json before Schemathesis runs.
STATED_RULES: dict[str, set[str]] = {}


def stated_rules(document: dict) -> dict[str, set[str]]:
    """Per operation ("POST /path"), the fields of its "Beyond the schema" list."""
    return {f"{method.upper()} {path}": set(re.findall(r"^- `([^`]+)`", operation.get("description", ""),
                                                       re.MULTILINE))
            for path, operations in document["paths"].items() for method, operation in operations.items()}


def test_the_document_states_the_rules_beyond_its_schemas(make_service) -> None:
    """Issue: Schemathesis found valid-looking bodies refused by rules the document never stated. Each
    is now in its operation's description, with its code and field, and each refusal is one of them."""
    app = webtest.TestApp(walletsvc.create_app(make_service(), admin_token="t"))
    stated = stated_rules(app.get("/openapi.json").json)
    assert {"faults"} <= stated["POST /_admin/faults"]  # the 101st rule
    assert {"status"} <= stated["POST /_admin/wallets/{walletId}/status"]  # CLOSED is final
    assert {"id", "member", "ipWhitelist"} <= stated["POST /_admin/scenarios"]
    assert {"ipWhitelist"} <= stated["POST /_admin/workspaces/{workspaceId}/keys"]
    assert {"Idempotency-Key"} <= stated["POST /api/v1/transfer/command/create"]
    admin = {"Authorization": "Bearer t"}
    twice = {"workspaces": [{"name": "w", "wallets": [{"id": "wal_x", "name": "a", "currency": "USD"},
                                                      {"id": "wal_x", "name": "b", "currency": "USD"}]}]}
    refused = app.post_json("/_admin/scenarios", twice, headers=admin, expect_errors=True).json
    assert refused["code"] == "S012" and ".id'" in refused["detail"]


def positive_data_accepted_or_a_stated_rule(ctx: Any, response: Any, case: Any) -> None:
    """Schemathesis's positive_data_acceptance, with BUSINESS_RULES and the rules each operation states
    beyond its schema (STATED_RULES, from the document) as its only exceptions."""
    if case.meta is None or not case.meta.generation.mode.is_positive or response.status_code in (
            200, 303, 401, 403, 404, 409):  # its defaults: credentials and resources the document cannot know
        return
    try:
        answer = response.json()
    except ValueError:
        answer = {}
    code, detail = answer.get("code"), answer.get("detail", "")
    if response.status_code == 422 and code in BUSINESS_RULES:
        return
    named = re.search(r"'(?:[\w\[\]]+\.)*([\w-]+)'", detail)
    if code != "S012" or not named or named.group(1) not in STATED_RULES.get(case.operation.label, ()):
        raise AssertionError(f"a request the document allows was refused: {response.status_code} {code} "
                             f"{detail}")


def error_code_listed(ctx: Any, response: Any, case: Any) -> None:
    """An error answer's code is one its operation lists for that status (docs/reference.md: the one Error
    schema, the codes of each operation as its examples)."""
    if response.status_code < 400 or case.method.upper() != case.operation.method.upper():
        return  # (a method the path does not serve: Schemathesis's own check wants its 405 and Allow)
    try:
        code = response.json().get("code")
    except (ValueError, AttributeError):
        return
    answer = case.operation.definition.raw["responses"].get(str(response.status_code), {})
    listed = answer.get("content", {}).get("application/json", {}).get("examples", {})
    if code not in listed:
        raise AssertionError(f"{response.status_code} {code}: not listed by {case.operation.label} "
                             f"(it lists {', '.join(listed) or 'none'})")


# Examples per operation (the API's 21 get more than the admin surface's 55, HEADs included), and a fixed
# seed, so that CI is repeatable: about 30 s together.
SCHEMATHESIS_EXAMPLES, SCHEMATHESIS_SEED = {"api": 25, "admin": 6}, 1


@pytest.mark.parametrize("surface", ["api", "admin"])
def test_schemathesis_finds_no_gap_between_the_document_and_the_server(tmp_path, surface: str) -> None:
    """docs/reference.md, judged by Schemathesis (all its phases and checks): every response matches the
    document (statuses, headers, bodies: no ST108; each error's code one its operation lists:
    error_code_listed), the server refuses nothing the document allows but BUSINESS_RULES and the rules
    the document states, and accepts nothing it forbids (no ST201: empty ids, an empty fault code). The
    admin surface runs on a sandbox of its own: its fault rules and clock would otherwise reach the API's
    requests."""
    import click.testing
    import schemathesis
    import schemathesis.cli

    for check in (positive_data_accepted_or_a_stated_rule, error_code_listed):
        if check.__name__ not in schemathesis.checks.CHECKS.get_all_names():
            schemathesis.check(check)
    sandbox = walletsvc.Sandbox.create()
    server = walletsvc.LiveServer(SchemathesisSigner(sandbox.app, sandbox.key, sandbox.clock))
    STATED_RULES.update(stated_rules(requests.get(server.url + "/openapi.json", timeout=10).json()))
    wallets = sandbox.wallets
    (tmp_path / "schemathesis.toml").write_text(f"""
[cache]
enabled = false
[auth.openapi.ApiKey]
api_key = "{sandbox.key['apiKey']}"
[auth.openapi.Timestamp]
api_key = "0"
[auth.openapi.Nonce]
api_key = "n"
[auth.openapi.Signature]
api_key = "{SIGN_ME}"
[auth.openapi.AdminToken]
bearer = "{sandbox.admin_token}"
# The demo's wallets, so that requests reach them and not only W1001, and transfers between them that
# can succeed (alice to bob, USD). The currency and the amount are bound together, always: bound apart,
# one would break the rule tying the amount's decimals to the currency, which
# test_the_document_states_each_currencys_amounts checks instead.
[dictionaries.wallets]
values = {json.dumps([wallet["id"] for wallet in wallets.values()])}
[dictionaries.sources]
values = ["{wallets['alice']['id']}"]
[dictionaries.targets]
values = ["{wallets['bob']['id']}"]
[dictionaries.currencies]
values = ["USD"]
[dictionaries.amounts]
values = ["0.01", "1.00", "10", "250.50", "999999999999999.99"]
# A query string carries text only: a value GET /_admin/journal's query[NAME] or header[NAME] forbids (an
# array or an object) reaches the server as the empty text the document allows, so Schemathesis's negative
# cases for them (its deepObject serialization, 4.32.5) cannot be told from positive ones; its other
# parameters keep every other check.
[[operations]]
include-path = "/_admin/journal"
include-method = "GET"
checks.negative_data_rejection.enabled = false
[parameters]
"body.currency" = {{ dictionary = "currencies", probability = 1.0 }}
"body.amount" = {{ dictionary = "amounts", probability = 1.0 }}
"path.walletId" = {{ dictionary = "wallets", probability = 0.7 }}
"body.sourceWalletId" = {{ dictionary = "sources", probability = 0.8 }}
"body.targetWalletId" = {{ dictionary = "targets", probability = 0.8 }}
""")
    tags = ["api", "public"] if surface == "api" else ["admin", "console"]
    report = tmp_path / "report.json"
    try:
        result = click.testing.CliRunner().invoke(schemathesis.cli.schemathesis, [
            "--no-color", "--config-file", str(tmp_path / "schemathesis.toml"), "run",
            f"{server.url}/openapi.json", "--exclude-checks", "positive_data_acceptance",
            "--max-examples", str(SCHEMATHESIS_EXAMPLES[surface]), "--seed", str(SCHEMATHESIS_SEED),
            "--workers", "1", "--report", "json", "--report-json-path", str(report),
            *(option for tag in tags for option in ("--include-tag", tag))])
    finally:
        server.stop()
    assert result.exit_code == 0, result.output[-30000:]
    figures = json.loads(report.read_text())
    print(json.dumps(figures["valid_rates"]))
    print(f"Schemathesis, {surface}: {figures['operations']['tested']} operations, "
          f"{figures['test_cases']['generated']} cases, {figures['running_time']:.1f} s")
    assert figures["operations"]["tested"] == figures["operations"]["selected"] > 10
    assert all(phase["status"] == "success" for phase in figures["phases"].values()), figures["phases"]
    sandbox.audit()  # and the money held


# The document as client generators and validators read it (docs/reference.md, "The OpenAPI document").


def _served_document(svc) -> dict:
    return webtest.TestApp(walletsvc.create_app(svc, admin_token="t")).get("/openapi.json").json


def _schemas_in(node: Any, where: str = "#") -> Any:
    """Every (where, schema) of the document: each object under a schema keyword, recursively."""
    if isinstance(node, dict):
        if "type" in node or "$ref" in node or "enum" in node:
            yield where, node
        for key, value in node.items():
            yield from _schemas_in(value, f"{where}/{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _schemas_in(value, f"{where}/{index}")


def _operations(document: dict) -> list[tuple[str, str, dict]]:
    return [(method, path, operation) for path, methods in document["paths"].items()
            for method, operation in methods.items()]


def test_orders_wallet_completed_is_the_completion_check_of_the_order_wallet(walletsvc_sandbox) -> None:
    """Issue 37, item 1: /orders/wallet/completed was the wallet "completed"'s orders (404 W1001, a code the
    operation does not list). A wallet id starts wal_ (the document's WalletId), so "completed" is none:
    the path is the completion check of the order whose bizId is "wallet" (docs/contract.md, Endpoints)."""
    sandbox = walletsvc_sandbox
    alice, bob = sandbox.wallets["alice"]["id"], sandbox.wallets["bob"]["id"]
    sandbox.client.create_transfer(alice, bob, "1.00", "USD", biz_id="wallet")
    api = Api(webtest.TestApp(sandbox.app), sandbox.key, lambda: sandbox.clock())
    orders = "/api/v1/transfer/query/orders"
    assert data(api.get(f"{orders}/wallet/completed")) == {
        "bizId": "wallet", "transferId": data(api.get(f"{orders}/wallet"))["transferId"],
        "status": "COMPLETED", "completed": True}
    assert [order["bizId"] for order in data(api.get(f"{orders}/wallet/{alice}"))["content"]] == ["wallet"]
    schemas = webtest.TestApp(sandbox.app).get("/openapi.json").json["components"]["schemas"]
    assert not re.search(schemas["WalletId"]["pattern"], "completed")
    assert re.search(schemas["BizId"]["pattern"], "wallet")
    assert re.search(schemas["WalletId"]["pattern"], alice)


def test_a_body_is_one_object_schema_with_its_currency_rule_as_if_then(svc) -> None:
    """Issue 37, item 2: anyOf branches that each listed part of the transfer body made generators lose its
    fields. Each body is one object with every field; the amount's decimals follow the currency through
    allOf of if/then, which a validator still applies (JPY 1.5 refused, 15 taken)."""
    import jsonschema
    import referencing

    document = _served_document(svc)
    schemas = document["components"]["schemas"]
    registry = referencing.Registry().with_resource(
        "urn:walletsvc", referencing.Resource.from_contents(document, referencing.jsonschema.DRAFT202012))
    for name in ("CreateTransfer", "FaultBody", "ScenarioBody", "AmountBody"):
        assert "anyOf" not in json.dumps(schemas[name]), name
    transfer = schemas["CreateTransfer"]
    assert set(transfer["properties"]) == {"sourceWalletId", "targetWalletId", "amount", "currency", "bizId",
                                           "description"}
    assert all(set(rule) == {"if", "then"} for rule in transfer["allOf"])
    assert "anyOf" not in json.dumps(schemas["NewKeyBody"]) and "anyOf" not in json.dumps(schemas["World"])

    def valid(amount: str, currency: str) -> bool:
        body = {"sourceWalletId": "wal_a", "targetWalletId": "wal_b", "amount": amount, "currency": currency}
        validator = jsonschema.Draft202012Validator(
            {"$ref": "urn:walletsvc#/components/schemas/CreateTransfer"}, registry=registry)
        return validator.is_valid(body)
    assert (valid("15", "JPY"), valid("1.5", "JPY"), valid("1.50", "USD"), valid("1.500", "KWD")) == (
        True, False, True, True)
    wallet = schemas["ScenarioBody"]["properties"]["workspaces"]["items"]["properties"]["wallets"]["items"]
    assert {"id", "name", "currency", "balance"} <= set(wallet["properties"]) and "allOf" in wallet


def test_shared_things_are_named_once(svc) -> None:
    """Issue 37, item 3: every error answer was an inline allOf with its own enums (335 error classes, six
    Currency enums in the generated client). One Error, one Currency, one of each status, referenced."""
    document = _served_document(svc)
    enums = [json.dumps(sorted(schema["enum"])) for _, schema in _schemas_in(document) if "enum" in schema]
    for values in (["USD", "JPY"], ["ACTIVE", "FROZEN", "CLOSED"], ["PENDING", "COMPLETED", "FAILED"],
                   ["DEPOSIT", "WITHDRAWAL", "TRANSFER_OUT", "TRANSFER_IN"], ["DEBIT", "CREDIT"]):
        holding = [enum for enum in enums if set(values) <= set(json.loads(enum))]
        assert len(holding) == 1, (values, len(holding))
    errors = [answer["content"]["application/json"]["schema"] for _, _, operation in _operations(document)
              for status, answer in operation["responses"].items()
              if status >= "400" and "content" in answer and "text/html" not in answer["content"]]
    assert errors and all(schema == {"$ref": "#/components/schemas/Error"} for schema in errors)
    assert {"Error", "Currency", "WalletStatus", "TransferStatus", "FlowType", "FlowDirection", "Scope",
            "BizId", "WalletId"} <= set(document["components"]["schemas"])


def test_path_parameters_are_named_as_the_contract_writes_them_and_refuse_an_empty_id(svc) -> None:
    """Issue 37, items 4 and 11: path parameters were {wallet_id}, {biz_id}, any string (so an empty id,
    which answers 403 50090201 or 404 S404, was allowed). They are {walletId}, {bizId}... each with its
    id's pattern."""
    document = _served_document(svc)
    schemas = document["components"]["schemas"]
    assert "/api/v1/wallets/{walletId}/balance" in document["paths"]
    assert "/api/v1/transfer/query/orders/{bizId}/completed" in document["paths"]
    named = set()
    for _, path, operation in _operations(document):
        for parameter in operation["parameters"]:
            if parameter["in"] == "path":
                schema = schemas[parameter["schema"]["$ref"].rsplit("/", 1)[1]]
                assert not re.search(schema["pattern"], ""), (path, parameter["name"])
                assert "{" + parameter["name"] + "}" in path and "_" not in parameter["name"]
                named.add(parameter["name"])
    assert named == {"walletId", "bizId", "workspaceId", "memberId", "apiKey", "faultId"}


def test_a_fault_rule_with_an_empty_code_is_s012_whatever_its_action(walletsvc_sandbox) -> None:
    """Issue 37, item 5: {"code": ""} (the document: minLength 1) was taken unless the action was error."""
    sandbox = walletsvc_sandbox
    admin = webtest.TestApp(sandbox.app)
    for action in ("latency", "error", "commit_then_fail"):
        answer = admin.post_json("/_admin/faults", {"action": action, "code": ""}, expect_errors=True,
                                 headers={"Authorization": f"Bearer {sandbox.admin_token}"})
        assert (answer.status_int, answer.json["code"], "'code'" in answer.json["detail"]) == (
            400, "S012", True)
    assert sandbox.service.faults.rules() == []


def test_every_header_a_client_sends_or_receives_is_declared(walletsvc_sandbox) -> None:
    """Issue 37, item 6: X-LOCALE (the contract's) and Accept-Language on every operation; Content-Language
    and Cache-Control on every answer, Idempotent-Replayed on a created transfer; and a real answer
    carries no header its operation does not declare."""
    sandbox = walletsvc_sandbox
    app = webtest.TestApp(sandbox.app)
    document = app.get("/openapi.json").json
    for method, path, operation in _operations(document):
        assert {("X-LOCALE", "header"), ("Accept-Language", "header")} <= {
            (parameter["name"], parameter["in"]) for parameter in operation["parameters"]}, (method, path)
        for status, answer in operation["responses"].items():
            if status in ("200", "400", "401", "404"):
                assert {"Content-Language", "Cache-Control"} <= set(answer["headers"]), (method, path, status)
    create = document["paths"][TRANSFER_PATH]["post"]["responses"]["200"]["headers"]
    assert "Idempotent-Replayed" in create
    declared = {name.lower() for name in create} | {"content-type", "content-length"}
    api = Api(app, sandbox.key, lambda: sandbox.clock())
    body = {"sourceWalletId": sandbox.wallets["alice"]["id"], "targetWalletId": sandbox.wallets["bob"]["id"],
            "amount": "1.00", "currency": "USD", "bizId": "declared-headers"}
    api.transfer(body)
    again = api.transfer(body, **{"X-LOCALE": "zh-CN"})
    assert again.headers["Idempotent-Replayed"] == "true" and again.headers["Content-Language"] == "zh-CN"
    assert {name.lower() for name in again.headers} <= declared
    assert "Allow" in document["info"]["description"]  # a 405's, outside /api/ (see the next test)


def test_every_status_the_server_answers_is_listed(demo_server) -> None:
    """Issue 37, item 7: headers over 64 KiB and an unsupported Transfer-Encoding, which serve's HTTP server
    refuses itself; HEAD, answered wherever GET is; and 405 with Allow outside /api/ (info says so)."""
    import http.client

    server, _ = demo_server
    document = requests.get(server.url + "/openapi.json", timeout=10).json()

    def raw(method: str, path: str, **headers: str) -> tuple[int, dict]:
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        connection.putrequest(method, path, skip_accept_encoding=True)
        for name, value in headers.items():
            connection.putheader(name, value)
        connection.endheaders()
        answer = connection.getresponse()
        payload = answer.read()
        connection.close()
        return answer.status, json.loads(payload) if payload else {}

    seen = set()
    for path, method in (("/healthz", "get"), (TRANSFER_PATH, "post")):
        answers = document["paths"][path][method]["responses"]
        for status, envelope in (raw(method.upper(), path, **{"X-Big": "x" * 70000}),
                                 raw(method.upper(), path, **{"Transfer-Encoding": "gzip"})):
            assert envelope["code"] in answers[str(status)]["content"]["application/json"]["examples"], (
                path, status)
            seen.add(status)
    assert 431 in seen and len(seen) == 2  # (the other: the Transfer-Encoding's, whichever it is)
    status, _ = raw("HEAD", "/healthz")
    assert status == 200 and "200" in document["paths"]["/healthz"]["head"]["responses"]
    refused = requests.delete(server.url + "/healthz", timeout=10)
    assert (refused.status_code, refused.json()["code"], refused.headers["Allow"]) == (405, "S405", "GET")
    assert "405 S405 METHOD_NOT_ALLOWED with an Allow header" in document["info"]["description"]


def test_the_document_alone_says_how_to_sign_and_names_the_console_cookie_as_sent(walletsvc_sandbox) -> None:
    """Issue 37, item 8: the recipe was one line, and the cookie was named walletsvc_console_PORT. The
    Signature scheme says all that docs/signing.md says a signer needs; the cookie is named as sent."""
    sandbox = walletsvc_sandbox
    app = webtest.TestApp(sandbox.app, extra_environ={"HTTP_HOST": "127.0.0.1:57437"})
    document = app.get("/openapi.json").json
    recipe = document["components"]["securitySchemes"]["Signature"]["description"]
    for fact in ("without the query string", "mounted under", "/payments/api/v1/wallets",
                 hashlib.sha256(b"").hexdigest(), "joined with LF", "no trailing LF", "Base64",
                 "standard alphabet", "UTF-8", "upper case", "lowercase hex", "service's time",
                 "`timestamp`", "unique per key"):
        assert fact in recipe, fact
    assert document["externalDocs"]["url"]
    login = app.post("/_admin/console", {"token": sandbox.admin_token})
    cookie = login.headers["Set-Cookie"].split("=", 1)[0]
    assert cookie == document["components"]["securitySchemes"]["ConsoleSession"]["name"] == (
        "walletsvc_console_57437")


def test_free_form_objects_say_what_they_hold(svc) -> None:
    """Issue 37, item 9: an object schema with neither properties nor additionalProperties (the journal's
    headers, a fault rule's query, headers and body, a violation's rows) is Record<string, never> to
    openapi-typescript: each says what it holds."""
    document = _served_document(svc)
    def objects(schema: dict) -> bool:
        kinds = schema.get("type")
        return "object" in (kinds if isinstance(kinds, list) else [kinds])

    silent = [where for where, schema in _schemas_in(document)
              if objects(schema) and "properties" not in schema and "additionalProperties" not in schema]
    assert silent == []
    entry = document["components"]["schemas"]["JournalEntry"]["properties"]["headers"]
    assert entry["additionalProperties"] == {"type": "string"}


def test_the_journals_query_and_header_filters_are_declared_and_work(walletsvc_sandbox) -> None:
    """Issue 37, item 10: query.NAME and header.NAME worked but were not declared. They are the declared
    deepObject parameters query and header (query[NAME]=VALUE); the dotted form still works."""
    sandbox = walletsvc_sandbox
    app = webtest.TestApp(sandbox.app)
    admin = {"Authorization": f"Bearer {sandbox.admin_token}"}
    journal = app.get("/openapi.json").json["paths"]["/_admin/journal"]["get"]
    parameters = {parameter["name"]: parameter for parameter in journal["parameters"]}
    assert {parameters[name]["style"] for name in ("query", "header")} == {"deepObject"}
    sandbox.client.list_wallets(size="1")
    sandbox.client.list_wallets(size="2")
    key = sandbox.key["apiKey"]
    for query in ("query[size]=2", "query.size=2", f"header[X-Api-Key]={key}&query[size]=2"):
        entries = data(app.get(f"/_admin/journal?{query}", headers=admin))["content"]
        assert [entry["query"] for entry in entries] == ["size=2"], query
    # deepObject's a[b][c] is a nested object, which the document's string map refuses: so does the server
    for query in ("header[X-Api-Key][x]=1", "query[size][0]=2"):
        answer = app.get(f"/_admin/journal?{query}", headers=admin, expect_errors=True)
        assert (answer.status_int, answer.json["code"]) == (400, "S012"), query


def test_every_operation_is_described_tagged_and_licensed(svc) -> None:
    """Issue 37, item 11: 41 of 51 operations and 70 of 89 parameters had no description, no schema one,
    tags were not declared, no license or contact."""
    document = _served_document(svc)
    assert document["info"]["license"]["identifier"] == "MIT" and document["info"]["contact"]
    used = {tag for _, _, operation in _operations(document) for tag in operation["tags"]}
    assert used == {tag["name"] for tag in document["tags"]}
    assert all(tag["description"] for tag in document["tags"])
    for method, path, operation in _operations(document):
        assert operation["description"] and all(parameter.get("description")
                                                 for parameter in operation["parameters"]), (method, path)
        ok = operation["responses"]["200"]
        assert method == "head" or "example" in next(iter(ok["content"].values())), (method, path)
        if "requestBody" in operation and "application/json" in operation["requestBody"]["content"]:
            assert "example" in operation["requestBody"]["content"]["application/json"], (method, path)
    assert all(schema.get("description") for schema in document["components"]["schemas"].values())


def test_every_example_validates_against_its_schema(svc) -> None:
    """docs/reference.md: each example of the document (request and response bodies, each error's, each
    schema's own) is valid against its schema."""
    import jsonschema
    import referencing

    document = _served_document(svc)
    registry = referencing.Registry().with_resource(
        "urn:walletsvc", referencing.Resource.from_contents(document, referencing.jsonschema.DRAFT202012))

    def check(schema: dict, value: Any, where: str) -> None:
        pointer = json.dumps(schema)
        resolved = json.loads(pointer.replace('"#/components', '"urn:walletsvc#/components'))
        errors = list(jsonschema.Draft202012Validator(resolved, registry=registry,
                                                      format_checker=jsonschema.FormatChecker()).iter_errors(value))
        assert not errors, (where, value, errors[0].message)

    checked = 0
    for method, path, operation in _operations(document):
        bodies = [("request", operation.get("requestBody", {}).get("content", {}))]
        bodies += [(status, answer.get("content", {})) for status, answer in operation["responses"].items()]
        for status, content in bodies:
            for media in content.values():
                if "example" in media:
                    check(media["schema"], media["example"], f"{method} {path} {status}")
                    checked += 1
                for example in media.get("examples", {}).values():
                    value = document["components"]["examples"][example["$ref"].rsplit("/", 1)[1]]["value"]
                    check(media["schema"], value, f"{method} {path} {status}")
                    checked += 1
    for where, schema in _schemas_in(document["components"]["schemas"]):
        for value in schema.get("examples", []):
            check(schema, value, where)
            checked += 1
    assert checked > 500


# The outsiders' tools, run on the served document: pinned, installed once into a cache folder this suite
# owns (WALLETSVC_TOOLS_CACHE, else ~/.cache/walletsvc), and required where WALLETSVC_LANGUAGES=required.
NPM_TOOLS = {"openapi-typescript": "7.13.0", "typescript": "5.9.3", "@redocly/cli": "2.77.0"}
# Redocly's recommended rules, but one that cannot read this document: no-ambiguous-paths compares path
# templates, not the patterns of their parameters (/orders/wallet/{walletId} and /orders/{bizId}/completed
# meet only where walletId is "completed", which WalletId's pattern refuses: docs/contract.md).
REDOCLY_CONFIG = """\
extends:
  - recommended
rules:
  no-ambiguous-paths: off
"""


@pytest.fixture(scope="session")
def npm_tools() -> pathlib.Path:
    """The folder of NPM_TOOLS' commands, installed on first use (about 10 s), then reused."""
    required_tools("node", "npm")
    pins = sorted(f"{name}@{version}" for name, version in NPM_TOOLS.items())
    cache = pathlib.Path(os.environ.get("WALLETSVC_TOOLS_CACHE")
                         or pathlib.Path.home() / ".cache" / "walletsvc")
    folder = cache / ("npm-" + hashlib.sha256(" ".join(pins).encode()).hexdigest()[:12])
    if not (folder / "node_modules" / ".bin" / "tsc").exists():
        building = cache / f"{folder.name}.{os.getpid()}"  # renamed when whole: parallel workers see all
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--no-save", "--prefix", str(building),
                        *pins], check=True, capture_output=True, timeout=600)
        with contextlib.suppress(OSError):  # (another worker got there first)
            building.rename(folder)
    return folder / "node_modules" / ".bin"


class DocumentSigner(httpx.Auth):
    """An httpx.Auth written from the served document's Signature scheme alone: the raw path without the
    query, the exact body (b"" when none), LF-joined, Base64 HMAC-SHA256, at the service's time (an
    envelope's timestamp)."""

    requires_request_body = True

    def __init__(self, key: dict, service_ms: int) -> None:
        self.key, self.offset = key, service_ms / 1000 - time.time()

    def auth_flow(self, request: Any) -> Any:
        timestamp, nonce = str(int(time.time() + self.offset)), str(uuid.uuid4())
        path = request.url.raw_path.split(b"?", 1)[0].decode("ascii")
        request.headers.update({
            "X-Api-Key": self.key["apiKey"], "X-Timestamp": timestamp, "X-Nonce": nonce,
            "X-Signature": spec_signature(self.key["secret"], request.method, path, timestamp, nonce,
                                          request.content)})
        yield request


def test_openapi_python_client_makes_one_transfer_model_and_parses_every_real_answer(tmp_path,
                                                                                     monkeypatch) -> None:
    """Issue 37: the transfer body is one model with its six fields, and a client generated from the served
    document (signed by DocumentSigner) creates a transfer and parses the real answers of the nine API
    operations, their errors into the one Error model."""
    import importlib

    generator = shutil.which("openapi-python-client", path=os.path.dirname(sys.executable)) or shutil.which(
        "openapi-python-client")
    assert generator, "openapi-python-client is a test dependency (setup.cfg)"
    sandbox = walletsvc.Sandbox.create()
    server = walletsvc.LiveServer(sandbox.app)
    try:
        made = subprocess.run([generator, "generate", "--url", server.url + "/openapi.json", "--meta", "none",
                               "--output-path", str(tmp_path / "walletsvc_client")],
                              capture_output=True, text=True, timeout=120, check=False)
        assert made.returncode == 0 and "Warning" not in made.stdout, made.stdout + made.stderr
        monkeypatch.syspath_prepend(str(tmp_path))
        for name in [name for name in sys.modules if name.startswith("walletsvc_client")]:
            monkeypatch.delitem(sys.modules, name)
        generated = importlib.import_module("walletsvc_client")
        models = importlib.import_module("walletsvc_client.models")
        api = {name: importlib.import_module(f"walletsvc_client.api.api.{name}") for name in (
            "list_wallets", "get_wallet", "get_balance", "list_flows", "create_transfer", "list_transfers",
            "list_wallet_transfers", "get_transfer", "transfer_completed")}
        fields = {field.name for field in __import__("attrs").fields(models.CreateTransfer)}
        assert fields == {"source_wallet_id", "target_wallet_id", "amount", "currency", "biz_id",
                          "description"}
        assert not [name for name in dir(models) if name.startswith("CreateTransferType")]

        service_ms = httpx.get(server.url + "/healthz").json()["timestamp"]
        client = generated.Client(base_url=server.url, raise_on_unexpected_status=True,
                                  httpx_args={"auth": DocumentSigner(sandbox.key, service_ms)})
        alice, bob = sandbox.wallets["alice"]["id"], sandbox.wallets["bob"]["id"]
        body = models.CreateTransfer(source_wallet_id=alice, target_wallet_id=bob, amount="2.50",
                                     currency=models.Currency.USD, biz_id="wallet", description="generated")
        created = api["create_transfer"].sync(client=client, body=body).data
        assert (created.status, created.amount, created.biz_id) == (models.TransferStatus.COMPLETED, "2.50",
                                                                    "wallet")
        answers = {
            "list_wallets": api["list_wallets"].sync(client=client, sort=["name,asc"]).data.content[0].name,
            "get_wallet": api["get_wallet"].sync(alice, client=client).data.status,
            "get_balance": api["get_balance"].sync(alice, client=client).data.available,
            "list_flows": api["list_flows"].sync(alice, client=client).data.content[0].direction,
            "list_transfers": api["list_transfers"].sync(client=client).data.page.total_elements,
            "list_wallet_transfers": api["list_wallet_transfers"].sync(bob, client=client).data.content[0]
            .biz_id,
            "get_transfer": api["get_transfer"].sync("wallet", client=client).data.description,
            "transfer_completed": api["transfer_completed"].sync("wallet", client=client).data.completed}
        assert answers == {"list_wallets": "alice", "get_wallet": models.WalletStatus.ACTIVE,
                           "get_balance": "997.50", "list_flows": models.FlowDirection.DEBIT,
                           "list_transfers": 1, "list_wallet_transfers": "wallet",
                           "get_transfer": "generated", "transfer_completed": True}
        missing = api["get_wallet"].sync("wal_missing", client=client, x_locale="zh-CN")
        assert (type(missing), missing.code, missing.message) == (models.Error, "W1001", "WALLET_NOT_FOUND")
        replayed = api["create_transfer"].sync_detailed(client=client, body=body)
        assert replayed.headers["Idempotent-Replayed"] == "true" and replayed.parsed.data.biz_id == "wallet"
    finally:
        server.stop()


def _recorded_answers(sandbox: walletsvc.Sandbox) -> dict[str, tuple[str, str, int, Any]]:
    """Real answers of the nine API operations (successes and an error each), and of the journal."""
    app = webtest.TestApp(sandbox.app)
    api = Api(app, sandbox.key, lambda: sandbox.clock())
    alice, bob = sandbox.wallets["alice"]["id"], sandbox.wallets["bob"]["id"]
    orders = "/api/v1/transfer/query/orders"
    created = api.transfer({"sourceWalletId": alice, "targetWalletId": bob, "amount": "3.00",
                            "currency": "USD", "bizId": "typed"})
    calls = {
        "create_transfer": ("post", TRANSFER_PATH, created),
        "list_wallets": ("get", "/api/v1/wallets", api.get("/api/v1/wallets")),
        "get_wallet": ("get", "/api/v1/wallets/{walletId}", api.get(f"/api/v1/wallets/{alice}")),
        "get_balance": ("get", "/api/v1/wallets/{walletId}/balance",
                        api.get(f"/api/v1/wallets/{alice}/balance")),
        "list_flows": ("get", "/api/v1/wallets/{walletId}/flows", api.get(f"/api/v1/wallets/{alice}/flows")),
        "list_transfers": ("get", orders, api.get(orders)),
        "list_wallet_transfers": ("get", orders + "/wallet/{walletId}", api.get(f"{orders}/wallet/{bob}")),
        "get_transfer": ("get", orders + "/{bizId}", api.get(f"{orders}/typed")),
        "transfer_completed": ("get", orders + "/{bizId}/completed", api.get(f"{orders}/typed/completed")),
        "get_wallet (W1001)": ("get", "/api/v1/wallets/{walletId}", api.get("/api/v1/wallets/wal_gone")),
        "get_transfer (T1001)": ("get", orders + "/{bizId}", api.get(f"{orders}/gone")),
        "create_transfer (T2001)": ("post", TRANSFER_PATH, api.transfer({
            "sourceWalletId": alice, "targetWalletId": bob, "amount": "99999.00", "currency": "USD"})),
        "journal": ("get", "/_admin/journal", app.get("/_admin/journal", headers={
            "Authorization": f"Bearer {sandbox.admin_token}"})),
    }
    return {name: (method, path, answer.status_int, answer.json)
            for name, (method, path, answer) in calls.items()}


def test_openapi_typescript_types_every_recorded_answer(walletsvc_sandbox, npm_tools, tmp_path) -> None:
    """Issue 37: the types openapi-typescript makes of the served document hold real answers (the nine API
    operations, errors, the journal's entries with their headers): tsc --strict finds 0 errors, and an
    answer with a field the document lacks is one."""
    sandbox = walletsvc_sandbox
    (tmp_path / "openapi.json").write_text(json.dumps(webtest.TestApp(sandbox.app).get("/openapi.json").json))
    subprocess.run([str(npm_tools / "openapi-typescript"), "openapi.json", "-o", "schema.d.ts"], cwd=tmp_path,
                   check=True, capture_output=True, timeout=120)
    answers = _recorded_answers(sandbox)
    lines = ['import type { paths } from "./schema";']
    for number, (method, path, status, body) in enumerate(answers.values()):
        lines.append(f'export const answer{number}: paths["{path}"]["{method}"]["responses"][{status}]'
                     f'["content"]["application/json"] = {json.dumps(body)};')
    (tmp_path / "answers.ts").write_text("\n".join(lines) + "\n")
    broken = dict(answers["get_wallet"][3], data={**answers["get_wallet"][3]["data"], "colour": "red"})
    (tmp_path / "broken.ts").write_text(
        'import type { paths } from "./schema";\n'
        'export const wrong: paths["/api/v1/wallets/{walletId}"]["get"]'
        f'["responses"][200]["content"]["application/json"] = {json.dumps(broken)};\n')

    def tsc(file: str) -> subprocess.CompletedProcess:
        options = ["--noEmit", "--strict", "--target", "es2022", "--module", "esnext",
                   "--moduleResolution", "bundler"]
        return subprocess.run([str(npm_tools / "tsc"), *options, file], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120, check=False)
    typed = tsc("answers.ts")
    assert typed.returncode == 0, typed.stdout[-5000:]
    wrong = tsc("broken.ts")
    assert "TS2353" in wrong.stdout and "colour" in wrong.stdout  # an unknown property
    assert len(answers) == 13 and answers["journal"][3]["data"]["content"][0]["headers"]


def test_redocly_lint_finds_nothing_in_the_served_document(npm_tools, tmp_path) -> None:
    """Issue 37: @redocly/cli lint (its recommended rules, REDOCLY_CONFIG) reports 0 errors and 0 warnings
    on the document a server serves (both surfaces)."""
    sandbox = walletsvc.Sandbox.create()
    server = walletsvc.LiveServer(sandbox.app)
    try:
        (tmp_path / "openapi.json").write_text(requests.get(server.url + "/openapi.json", timeout=10).text)
    finally:
        server.stop()
    (tmp_path / "redocly.yaml").write_text(REDOCLY_CONFIG)
    quiet = {"REDOCLY_TELEMETRY": "off", "REDOCLY_SUPPRESS_UPDATE_NOTICE": "true"}
    linted = subprocess.run([str(npm_tools / "redocly"), "lint", "openapi.json", "--config", "redocly.yaml",
                             "--format", "json"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={**os.environ, **quiet}, check=False)
    report = json.loads(linted.stdout)
    assert report["totals"] == {"errors": 0, "warnings": 0, "ignored": 0}, [
        (problem["ruleId"], problem["message"][:200]) for problem in report["problems"]][:20]


###############################################################################
# HTTP surfaces: one request path, whatever hosts the app (docs/reference.md) ###
###############################################################################


def test_hooks_and_plugins_added_to_the_app_see_api_requests(svc, world: dict, clock: FrozenClock) -> None:
    """/api/ GET and POST skip bottle's request objects unless someone else needs them."""
    seen: list = []

    class Recorder:
        api = 2

        def apply(self, callback, route):
            def wrapper(*args, **kwargs):
                seen.append(("plugin", route.rule))
                return callback(*args, **kwargs)
            return wrapper

    apps = {"direct": walletsvc.create_app(svc), "hooked": walletsvc.create_app(svc),
            "plugged": walletsvc.create_app(svc)}
    apps["hooked"].add_hook("after_request", lambda: seen.append(("hook", bottle.request.path)))
    apps["plugged"].install(Recorder())
    answers = {}
    for name, app in apps.items():
        api = Api(webtest.TestApp(app), world["key"], clock)
        answers[name] = (data(api.get(f"/api/v1/wallets/{world['a']}")),
                         error(api.get("/api/v1/wallets/wal_missing"), "W1001", 404),
                         error(api.transfer(b"{"), "S012", 400)["detail"])
    assert answers["direct"] == answers["hooked"] == answers["plugged"]
    assert ("hook", f"/api/v1/wallets/{world['a']}") in seen
    assert ("plugin", "/api/v1/wallets/<wallet_id>") in seen
    assert len(seen) == 6


def test_a_route_added_after_create_app_takes_its_place_among_the_api_routes(svc, world: dict,
                                                                             clock: FrozenClock) -> None:
    """A plain bottle route someone adds is bottle's to serve, as bottle serves it."""
    app = walletsvc.create_app(svc)
    app.route("/api/v1/wallets/special", "GET", lambda: {"special": True})  # static: before <wallet_id>
    api = Api(webtest.TestApp(app), world["key"], clock)
    assert api.get("/api/v1/wallets/special").json == {"special": True}
    assert data(api.get(f"/api/v1/wallets/{world['a']}"))["id"] == world["a"]


def test_an_incomplete_declaration_fails_when_the_app_is_created(svc, monkeypatch) -> None:
    def handler(self, call):
        return None

    for declaration, complaint in [
        (walletsvc.endpoint("GET", "/api/v1/thing", "A thing", response="Wallet"), "needs a scope"),
        (walletsvc.endpoint("GET", "/api/v1/thing", "", scope="wallet:read", response="Wallet"),
         "no summary"),
        (walletsvc.endpoint("GET", "/api/v1/thing", "A thing", scope="wallet:read", response="Walet"),
         "'Walet'"),
        (walletsvc.endpoint("GET", "/api/v1/thing/<thing_id>", "A thing", scope="wallet:read", response=None),
         "path names ['thing_id']"),

        (walletsvc.endpoint("GET", "/api/v1/thing/<thing_id>", "A thing", scope="wallet:read", response=None),
         "'thing_id' is not in PATH_PARAMETERS"),  # the document names it and gives its schema
    ]:
        monkeypatch.setattr(walletsvc.WalletApi, "thing", declaration(handler), raising=False)
        with pytest.raises(ValueError, match=re.escape(complaint)):
            walletsvc.create_app(svc)


def test_readme_adding_an_endpoint_block_serves_an_endpoint(svc, world, clock, monkeypatch) -> None:
    """README, "Adding an endpoint": the three pieces, as printed, are all the HTTP layer needs."""
    import textwrap

    (block,) = doc_blocks("Adding an endpoint", "python")
    handler, service, resource = (textwrap.dedent(piece.split("\n", 1)[1])
                                  for piece in re.split(r"^# \d\. ", block, flags=re.MULTILINE)[1:])
    resource, schema = resource.split("\n\n")
    pieces, scope = {}, dict(vars(walletsvc))  # as if written in walletsvc.py
    for name, piece in (("handler", handler), ("service", service), ("resource", resource)):
        exec(compile(piece, f"README.md (Adding an endpoint: {name})", "exec"), scope)  # noqa: S102 - ours
        pieces[name] = scope["limits_resource" if name == "resource" else "get_limits"]
    monkeypatch.setattr(walletsvc.WalletApi, "get_limits", pieces["handler"], raising=False)
    monkeypatch.setattr(walletsvc.WalletService, "get_limits", pieces["service"], raising=False)
    monkeypatch.setattr(walletsvc, "limits_resource", pieces["resource"], raising=False)
    monkeypatch.setattr(walletsvc, "SCHEMAS",
                        {**walletsvc.SCHEMAS, **eval("{" + schema + "}", vars(walletsvc))})

    app = webtest.TestApp(walletsvc.create_app(svc))
    assert data(Api(app, world["key"], clock).get(f"/api/v1/wallets/{world['a']}/limits")) == {
        "walletId": world["a"], "largestTransfer": "100.00"}
    reader = Api(app, svc.create_api_key(world["ws"]["id"], ["transfer:read"]), clock)
    error(reader.get(f"/api/v1/wallets/{world['a']}/limits"), "GA2024", 403)
    operation = app.get("/openapi.json").json["paths"]["/api/v1/wallets/{walletId}/limits"]["get"]
    assert operation["summary"] == "Get a wallet's limits"
    assert "largestTransfer" in json.dumps([operation, app.get("/openapi.json").json["components"]])


def _hosted(kind: str, app) -> tuple:
    """(the WSGI app a host hands requests to, the prefix it mounts walletsvc under)."""
    if kind == "direct WSGI call":
        return app, ""
    if kind == "bottle mount('/payments/') (routes merged)":
        parent = bottle.Bottle()
        parent.mount("/payments/", app)
        return parent, "/payments"
    if kind == "bottle mount('/payments') (WSGI)":
        parent = bottle.Bottle()
        with pytest.deprecated_call():
            parent.mount("/payments", app)
        return parent, "/payments"
    from werkzeug.exceptions import NotFound
    from werkzeug.middleware.dispatcher import DispatcherMiddleware

    if kind == "werkzeug DispatcherMiddleware":
        return DispatcherMiddleware(NotFound(), {"/payments": app}), "/payments"
    import flask

    flask_app = flask.Flask("host")
    flask_app.wsgi_app = DispatcherMiddleware(flask_app.wsgi_app, {"/payments": app})
    return flask_app, "/payments"


IN_PROCESS_HOSTS = ["direct WSGI call", "bottle mount('/payments/') (routes merged)",
                    "bottle mount('/payments') (WSGI)", "werkzeug DispatcherMiddleware", "Flask"]


@pytest.mark.parametrize("kind", IN_PROCESS_HOSTS)
def test_every_host_signs_reads_the_body_limits_it_and_documents_its_base_url(svc, world, clock,
                                                                              kind) -> None:
    host, prefix = _hosted(kind, walletsvc.create_app(svc, max_body_bytes=4096))
    api = Api(webtest.TestApp(host), world["key"], clock, prefix=prefix)
    order = data(api.transfer(transfer_body(world, bizId="hosted")))
    assert (order["bizId"], order["status"]) == ("hosted", "COMPLETED")
    assert svc.get_balance(world["b"])["balance"] == "25.50"
    error(api.transfer(b"{" + b" " * 5000 + b"}"), "S413", 413)
    error(api.get("/api/v1/wallets", **{"X-Signature": base64.b64encode(b"\0" * 32).decode()}), "GA2012", 401)
    if prefix:  # the prefix is part of the signed path
        unprefixed = Api(api.app, world["key"], clock).headers("GET", "/api/v1/wallets")
        error(api.request("GET", "/api/v1/wallets", headers=unprefixed), "GA2012", 401)
    document = api.app.get(prefix + "/openapi.json")
    assert document.json["servers"] == [{"url": "http://localhost:80" + prefix}]
    assert "success" not in document.json and document.headers["Cache-Control"] == "no-store"


def _signed_checks(base_url: str, key: dict) -> None:
    """A signed transfer, an over-limit body and a bad signature against a live server."""
    auth = walletsvc.HmacAuth(key["apiKey"], key["secret"])
    wallets = requests.get(base_url + "/api/v1/wallets", auth=auth, params={"sort": "name,asc"}, timeout=10)
    a, b = (wallet["id"] for wallet in wallets.json()["data"]["content"][:2])
    body = json.dumps({"sourceWalletId": a, "targetWalletId": b, "amount": "1.00", "currency": "USD"})
    answer = requests.post(base_url + TRANSFER_PATH, data=body, auth=auth, timeout=10,
                           headers={"Content-Type": "application/json"})
    assert answer.json()["data"]["status"] == "COMPLETED", answer.text
    too_big = requests.post(base_url + TRANSFER_PATH, data=b"{" + b" " * 70000 + b"}", auth=auth, timeout=10,
                            headers={"Content-Type": "application/json"})
    assert (too_big.status_code, too_big.json()["code"]) == (413, "S413")
    headers = walletsvc.sign_request("GET", "/api/v1/wallets", b"", key["apiKey"], "not the secret")
    refused = requests.get(base_url + "/api/v1/wallets", headers=headers, timeout=10)
    assert (refused.status_code, refused.json()["code"]) == (401, "GA2012")
    assert requests.get(base_url + "/openapi.json", timeout=10).json()["servers"] == [{"url": base_url}]


def _funded_database(path: str) -> dict:
    svc = walletsvc.WalletService(path)
    ws = svc.create_workspace("hosted")
    key = svc.create_api_key(ws["id"])
    for name in ("a", "b"):
        svc.deposit(svc.create_wallet(ws["id"], "USD", name=name)["id"], "10.00")
    svc.close()
    return key


def _hosted_checks(base_url: str, key: dict) -> None:
    """``_signed_checks``, and a bizId with ``:`` and ``.`` created and read back by Client."""
    _signed_checks(base_url, key)
    client = walletsvc.Client(base_url, key["apiKey"], key["secret"])
    a, b = (wallet["id"] for wallet in client.list_wallets(sort="name,asc")["content"][:2])
    client.create_transfer(a, b, "1.00", "USD", biz_id="inv:1.a")
    assert client.get_transfer("inv:1.a")["bizId"] == "inv:1.a"
    assert client.transfer_completed("inv:1.a")["completed"] is True


def _wait_for(url: str, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert process is None or process.poll() is None, "the host exited"
        with contextlib.suppress(requests.RequestException):
            if requests.get(url, timeout=1).status_code == 200:
                return
        time.sleep(0.1)
    raise AssertionError(f"{url} never answered")


def test_wsgiref_which_gives_no_raw_path_serves_the_same(tmp_path, make_service) -> None:
    """bottle's own run() is wsgiref: the app sees only the decoded path."""
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    class Quiet(WSGIRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

    path = str(tmp_path / "wsgiref.db")
    key = _funded_database(path)
    server = make_server("127.0.0.1", 0, walletsvc.create_app(make_service(path)),
                         handler_class=Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{server.server_port}"
    try:
        _hosted_checks(base_url, key)
        over = walletsvc.sign_request("GET", "/api/v1/transfer/query/orders/inv%3A1.a", b"", key["apiKey"],
                                      key["secret"])  # signed as a client that encodes ':' sends it
        refused = requests.get(base_url + "/api/v1/transfer/query/orders/inv%3A1.a", headers=over, timeout=10)
        assert refused.json()["code"] == "GA2012"  # (debug_signatures is off: no diagnosis)
        debug = walletsvc.create_app(make_service(path), debug_signatures=True)
        answer = webtest.TestApp(debug).get("/api/v1/transfer/query/orders/inv%3A1.a", headers=over,
                                            expect_errors=True)
        assert ("the path was percent-encoded where this server cannot see the encoding"
                in answer.json["detail"])
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def _printed_server(command: str, cwd: pathlib.Path, env: dict):
    """A server started by a printed shell command, in a process group of its own (a development
    server's reloader is a child), stopped with the whole group."""
    import signal

    process = subprocess.Popen(["bash", "-c", command], cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=10)


@pytest.mark.parametrize("recipe, server", [("Flask", 0), ("Django", 0), ("Django", 1), ("Starlette", 0)],
                         ids=["flask", "django-runserver", "django-gunicorn", "starlette"])
def test_an_embedding_recipe_goes_from_an_empty_folder_to_a_signed_200(tmp_path, recipe, server) -> None:
    """docs/embedding.md as printed: the packages, make_key.py, the app's files, the server, then
    `walletsvc request` in a second shell (the port 8000 of the page is a free one here)."""
    port = str(_free_port())
    env = printed_shell_env(tmp_path)
    (make_key,) = doc_blocks("A key for your app", "python")
    (tmp_path / "make_key.py").write_text(make_key.replace("8000", port))
    setup, *servers = doc_blocks(recipe, "sh")
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", setup], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    for block in doc_blocks(recipe, "python"):
        name = block.split("\n", 1)[0].removeprefix("# ").split(":", 1)[0]  # "# app.py: ..." names its file
        (tmp_path / name).write_text(block)
    env_file = (tmp_path / "payments.env").read_text()
    key = dict(re.findall(r"WALLETSVC_(KEY|SECRET)=(\S+)", env_file))
    with _printed_server(servers[server].replace("8000", port), tmp_path, env) as process:
        base_url = f"http://127.0.0.1:{port}/payments"
        _wait_for(base_url + "/healthz", process)
        (request,) = doc_blocks("A key for your app", "sh")
        answer = subprocess.run(["bash", "-euo", "pipefail", "-c", request], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=60, check=False)
        assert answer.returncode == 0 and answer.stderr.startswith("HTTP 200"), answer.stdout + answer.stderr
        assert json.loads(answer.stdout)["data"]["page"]["totalElements"] == 2
        _hosted_checks(base_url, {"apiKey": key["KEY"], "secret": key["SECRET"]})
        if recipe != "Starlette":  # the host's own pages are still its own
            assert requests.get(f"http://127.0.0.1:{port}/elsewhere", timeout=10).status_code == 404


def test_waitress_serves_the_same_path(tmp_path, make_service) -> None:
    path = str(tmp_path / "waitress.db")
    key = _funded_database(path)
    server = walletsvc.LiveServer(walletsvc.create_app(make_service(path)))
    try:
        _signed_checks(server.url, key)
    finally:
        server.stop()


def test_gunicorn_serves_the_same_path(tmp_path) -> None:
    import socket

    path = str(tmp_path / "gunicorn.db")
    key = _funded_database(path)
    (tmp_path / "hosted.py").write_text("import walletsvc\n"
                                        f"app = walletsvc.create_app(walletsvc.WalletService({path!r}))\n")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "gunicorn", "-b", f"127.0.0.1:{port}", "--chdir",
                                str(tmp_path), "hosted:app"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                requests.get(base_url + "/healthz", timeout=1)
                break
            except requests.ConnectionError:
                time.sleep(0.1)
        _signed_checks(base_url, key)
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_the_python_api_block_runs_as_printed(tmp_path, monkeypatch) -> None:
    (block,) = doc_blocks("The Python API", "python")
    monkeypatch.chdir(tmp_path)  # it opens wallet.db
    scope: dict = {}
    exec(compile(block, "docs/embedding.md (The Python API)", "exec"), scope)  # noqa: S102 - the page is ours
    manual, ws = scope["manual"], scope["ws"]
    assert [manual.get_transfer(ws["id"], biz)["status"] for biz in ("invoice-1", "invoice-2")] == [
        "COMPLETED", "FAILED"]
    assert manual.audit() == []


def test_readme_embedding_block_runs_as_printed(tmp_path) -> None:
    (block,) = doc_blocks("Embedding", "python")
    done = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, check=False)
    assert (done.returncode, done.stdout) == (0, "100.00\n"), done.stderr


def _twin_app(tmp_path: pathlib.Path, name: str) -> tuple[walletsvc.WalletApp, dict, dict]:
    """A service made the same way each time (seeded ids, frozen clock): its answers match byte for byte."""
    svc = walletsvc.WalletService(str(tmp_path / f"{name}.db"), clock=walletsvc.Clock(NOW), id_seed=7)
    workspace = svc.create_workspace("twins")
    key = svc.create_api_key(workspace["id"], scopes=CONTRACT_SCOPES)
    wallets = {name: svc.create_wallet(workspace["id"], "USD", name=name)["id"] for name in ("a", "b")}
    svc.deposit(wallets["a"], "100.00")
    return walletsvc.create_app(svc, admin_token="t" * 32), key, wallets


def _environ(method: str, path: str, body: bytes = b"", headers: dict | None = None) -> dict:
    environ = {"REQUEST_METHOD": method, "PATH_INFO": path, "QUERY_STRING": "", "SCRIPT_NAME": "",
               "SERVER_NAME": "localhost", "SERVER_PORT": "80", "SERVER_PROTOCOL": "HTTP/1.1",
               "REMOTE_ADDR": "127.0.0.1", "wsgi.input": io.BytesIO(body), "wsgi.url_scheme": "http",
               "wsgi.errors": sys.stderr, "CONTENT_LENGTH": str(len(body))}
    for name, value in (headers or {}).items():
        if name == "Content-Type":
            environ["CONTENT_TYPE"] = value
        else:
            environ["HTTP_" + name.upper().replace("-", "_")] = value
    return environ


def test_the_fast_path_answers_as_bottles_own_dispatch(tmp_path) -> None:
    """WalletApp.__call__ skips bottle's _handle for speed; every kind of request must get bottle's answer."""
    fast, key, wallets = _twin_app(tmp_path, "fast")
    slow, _, _ = _twin_app(tmp_path, "slow")
    slow.add_hook("before_request", lambda: None)  # a hook someone added: bottle's own dispatch
    transfer = json.dumps({"sourceWalletId": wallets["a"], "targetWalletId": wallets["b"], "amount": "1.00",
                           "currency": "USD", "bizId": "twin-1"}).encode()

    def signed(method: str, path: str, body: bytes = b"", nonce: str = "n") -> dict:
        return {"X-Api-Key": key["apiKey"], "X-Timestamp": str(NOW), "X-Nonce": nonce,
                "X-Signature": spec_signature(key["secret"], method, path, str(NOW), nonce, body),
                "Content-Type": "application/json"}
    wallet = f"/api/v1/wallets/{wallets['a']}"
    requests_made = [
        ("GET", wallet, b"", signed("GET", wallet, nonce="n1")),
        ("GET", wallet, b"", signed("GET", wallet, nonce="n1")),  # a replay: GA2013
        ("GET", "/api/v1/wallets", b"", {}),  # GA2001
        ("POST", TRANSFER_PATH, transfer, signed("POST", TRANSFER_PATH, transfer, nonce="n2")),
        ("POST", TRANSFER_PATH, transfer, signed("POST", TRANSFER_PATH, transfer, nonce="n3")),  # replayed
        ("GET", "/api/v1/nowhere", b"", signed("GET", "/api/v1/nowhere", nonce="n4")),  # 50090201
        ("GET", "/nowhere", b"", {}),  # 404
        ("DELETE", "/healthz", b"", {}),  # 405 with Allow
        ("GET", "/api/v1/wallets/wal_\xc3\xa9", b"",  # UTF-8 in the path, as WSGI hands it over: W1001
         signed("GET", "/api/v1/wallets/wal_%C3%A9", nonce="n5")),
        ("GET", "/api/v1/wallets/wal_\xff", b"", {}),  # not UTF-8
        ("GET", "/healthz", b"", {}),
        ("GET", "/openapi.json", b"", {}),
        ("GET", "/_admin/workspaces", b"", {"Authorization": "Bearer " + "t" * 32}),
        ("GET", "/_admin/workspaces", b"", {}),  # S401
        ("POST", "/_admin/workspaces", b"{" * 70_000, {"Content-Type": "application/json"}),  # S413
    ]
    for method, path, body, headers in requests_made:
        answers = []
        for app in (fast, slow):
            started: list = []

            def start_response(status: str, pairs: list, exc_info: Any = None,
                               started: list = started) -> None:
                started.extend((status, sorted(pairs)))
            chunks = app(_environ(method, path, body, headers), start_response)
            answers.append((*started, b"".join(chunks)))
        assert answers[0] == answers[1], (method, path)
    assert fast.hooks_added == [] and slow.hooks_added == ["before_request"]


###############################################################################
# Envelope and errors: language, failures, body size (docs/contract.md) ########
###############################################################################


@pytest.mark.parametrize("locale_headers, expected", [
    ({"X-LOCALE": "zh-CN"}, "zh-CN"),
    ({"X-LOCALE": "zh"}, "zh-CN"),
    ({"X-LOCALE": "zh_CN"}, "zh-CN"),
    ({"Accept-Language": "fr-FR, zh-CN;q=0.9, en;q=0.5"}, "zh-CN"),
    ({"X-LOCALE": "en-US", "Accept-Language": "zh-CN"}, "en-US"),
    ({"X-LOCALE": "tlh"}, "en-US"),
    ({}, "en-US"),
])
def test_error_detail_is_localized(api: Api, locale_headers: dict, expected: str) -> None:
    response = api.get("/api/v1/wallets", **{"X-Api-Key": "ak_nope"}, **locale_headers)
    assert response.headers["Content-Language"] == expected
    detail = response.json["detail"]
    assert detail == ("API 密钥不存在。" if expected == "zh-CN" else "The API key does not exist.")


def test_default_locale_setting_applies_without_a_language(svc, world, clock) -> None:
    zh_app = webtest.TestApp(walletsvc.create_app(svc, default_locale="zh-CN"))
    response = Api(zh_app, world["key"], clock).get("/api/v1/wallets/wal_missing")
    assert error(response, "W1001", 404)["detail"] == "钱包 wal_missing 不存在。"


def test_unexpected_failure_is_s500_without_traceback(svc, api: Api, monkeypatch) -> None:
    def explode(*args, **kwargs):
        raise RuntimeError("secret internals")
    monkeypatch.setattr(svc, "list_wallets", explode)
    body = error(api.get("/api/v1/wallets"), "S500", 500)
    assert "secret" not in json.dumps(body) and "Traceback" not in json.dumps(body)


def test_body_over_the_limit_is_413_before_authentication(app: webtest.TestApp) -> None:
    response = app.post(TRANSFER_PATH, b"x" * 65537, expect_errors=True)
    assert error(response, "S413", 413)["detail"] == "The request body exceeds 65536 bytes."


def test_body_limit_is_a_setting(svc, api: Api, world: dict) -> None:
    small = Api(webtest.TestApp(walletsvc.create_app(svc, max_body_bytes=10)), world["key"], api.clock)
    error(small.transfer({"sourceWalletId": world["a"]}), "S413", 413)
    data(small.get("/api/v1/wallets"))


@pytest.mark.parametrize("method, path",
                         [("POST", "/nowhere"), ("PUT", "/healthz"), ("POST", "/api/nowhere")])
def test_an_oversized_body_is_s413_whatever_the_path(app: webtest.TestApp, method: str, path: str) -> None:
    """docs/contract.md: the size limit is checked before anything else, a 404 or a 405 too."""
    answer = app.request(path, method=method, body=b"x" * 70_000,
                         headers={"Content-Type": "application/json"}, expect_errors=True)
    error(answer, "S413", 413)


def test_a_content_length_that_is_no_number_is_s012_as_the_document_says(walletsvc_sandbox) -> None:
    from wsgiref.util import setup_testing_defaults

    environ = {"PATH_INFO": "/healthz", "CONTENT_LENGTH": "abc", "wsgi.input": io.BytesIO(b"")}
    setup_testing_defaults(environ)  # (webtest will not send such a header; a WSGI host may pass it on)
    started = []
    answer = json.loads(b"".join(walletsvc_sandbox.app(
        environ, lambda status, headers: started.append(status))))
    assert ((started, answer["code"]) == (["400 Bad Request"], "S012")
            and "'Content-Length'" in answer["detail"])
    app = webtest.TestApp(walletsvc_sandbox.app)
    documented = app.get("/openapi.json").json["paths"]["/healthz"]["get"]["responses"]["400"]
    assert "S012 INVALID_PARAMETER" in documented["description"]


###############################################################################
# Authentication details: path, client IP, nonces, time (docs/signing.md) ######
###############################################################################


def test_signed_path_is_the_raw_path_the_client_sent(api: Api, world: dict) -> None:
    raw = f"/api/v1/wallets/{world['a']}".replace("_", "%5F")
    headers = api.headers("GET", raw)
    data(api.request("GET", f"/api/v1/wallets/{world['a']}", headers=headers, REQUEST_URI=raw))
    decoded_signature = api.headers("GET", f"/api/v1/wallets/{world['a']}")
    error(api.request("GET", f"/api/v1/wallets/{world['a']}", headers=decoded_signature,
                      REQUEST_URI=raw + "?x=1"), "GA2012", 401)


def test_app_mounted_under_a_prefix_signs_the_full_path(svc, world: dict, clock: FrozenClock) -> None:
    parent = bottle.Bottle()
    parent.mount("/payments/", walletsvc.create_app(svc))
    client = webtest.TestApp(parent)
    mounted = Api(client, world["key"], clock, prefix="/payments")
    assert data(mounted.get(f"/api/v1/wallets/{world['a']}"))["id"] == world["a"]
    unprefixed = Api(client, world["key"], clock).headers("GET", f"/api/v1/wallets/{world['a']}")
    response = mounted.request("GET", f"/api/v1/wallets/{world['a']}", headers=unprefixed)
    error(response, "GA2012", 401)


@pytest.mark.parametrize("trusted, forwarded, allowed", [
    (True, "198.51.100.9", True),  # believed: the client is whitelisted
    (False, "198.51.100.9", False),  # an untrusted peer cannot claim an address
    (True, "198.51.100.9, 127.0.0.1", True),  # trusted hops on the right are skipped
    (True, "198.51.100.9, 203.0.113.50", False),  # the first untrusted hop from the right decides
    (True, "garbage", False),
])
def test_x_forwarded_for_only_from_trusted_proxies(svc, world, clock, trusted, forwarded,
                                                   allowed) -> None:
    app = webtest.TestApp(walletsvc.create_app(svc, trusted_proxies="127.0.0.0/8" if trusted else ""))
    key = svc.create_api_key(world["ws"]["id"], ["wallet:read"], ip_whitelist=["198.51.100.0/24"])
    client = Api(app, key, clock)
    path = "/api/v1/wallets"
    headers = {**client.headers("GET", path), "X-Forwarded-For": forwarded}
    response = client.request("GET", path, headers=headers, REMOTE_ADDR="127.0.0.1")
    if allowed:
        data(response)
    else:
        error(response, "GA2022", 403)


def test_bad_signature_does_not_burn_the_nonce(api: Api) -> None:
    error(api.get("/api/v1/wallets", **{"X-Nonce": "n-1", "X-Signature": "AAAA"}), "GA2012", 401)
    data(api.get("/api/v1/wallets", **{"X-Nonce": "n-1"}))


def test_a_recorded_nonce_is_refused_whatever_the_clock_does(svc, api: Api, clock: FrozenClock) -> None:
    """docs/contract.md, Replay protection: records are kept exactly, not by the clock: a nonce used once
    is refused for
    its key a day later, after the clock went back, and signed at another time."""
    data(api.get("/api/v1/wallets", **{"X-Nonce": "once"}))
    for move in (86400, -2 * 86400, 121):
        clock.advance(move)
        error(api.get("/api/v1/wallets", **{"X-Nonce": "once"}), "GA2013", 401)
    other = svc.create_api_key(api.key["workspaceId"])
    headers = walletsvc.sign_request("GET", "/api/v1/wallets", b"", other["apiKey"], other["secret"],
                                     timestamp=int(clock()), nonce="once")
    data(api.request("GET", "/api/v1/wallets", headers=headers))  # unique per key: another key may use it


def test_a_second_forgotten_between_the_lookup_and_the_record_says_forgotten(tmp_path, clock,
                                                                              make_service) -> None:
    """Issue 43, item 5: the first refusal past the frozen-clock bound said "X-Nonce was already used." for a
    fresh nonce (its second was forgotten after its lookup, before its record). The detail is exact: here
    another process forgets the second while a latency rule holds the request between the two."""
    svc = make_service(str(tmp_path / "race.db"), clock=clock)
    world_ = make_world(svc)
    app = webtest.TestApp(walletsvc.create_app(svc))
    svc.faults.add(action="latency", latency=0.5, method="GET", times=1)
    key, stamp = world_["key"], int(clock())
    answers = []
    request = threading.Thread(target=lambda: answers.append(app.get(
        "/api/v1/wallets", headers=walletsvc.sign_request("GET", "/api/v1/wallets", b"", key["apiKey"],
                                                          key["secret"], timestamp=stamp),
        expect_errors=True)))
    request.start()
    time.sleep(0.2)  # looked up, waiting
    with contextlib.closing(sqlite3.connect(tmp_path / "race.db")) as other, other:
        other.execute("INSERT INTO nonces_forgotten (api_key, lo, hi) VALUES (?, ?, ?)",
                      (key["apiKey"], stamp, stamp))
    request.join(10)
    detail = error(answers[0], "GA2013", 401)["detail"]
    assert "were forgotten" in detail and "already used" not in detail


def test_past_the_bound_only_the_forgotten_seconds_of_that_key_are_refused(tmp_path, clock,
                                                                            make_service) -> None:
    """docs/contract.md, Replay protection: the records stay bounded by a count (here the least, 1000), past
    it the oldest are kept as digests (ten times as many), and only past those forgotten: a forgotten second
    refuses only requests signed in that second for that key."""
    svc = make_service(str(tmp_path / "bounded.db"), clock=clock)
    world_ = make_world(svc)
    app = webtest.TestApp(walletsvc.create_app(svc, nonce_records=1000))
    key, other = world_["key"], svc.create_api_key(world_["ws"]["id"])
    first = int(clock())
    sign = functools.partial(walletsvc.sign_request, "GET", "/api/v1/wallets", b"")
    for n in range(12_000):
        if n == 700:
            clock.advance(5)  # the oldest 700 were signed in the first second, the rest five seconds later
        assert app.get("/api/v1/wallets", headers=sign(key["apiKey"], key["secret"],
                                                       timestamp=int(clock()))).json["success"], n
    with svc.db.connection() as conn:
        kept = conn.execute("SELECT count(*) FROM nonce_records").fetchone()[0]
        digests = conn.execute("SELECT count(*) FROM nonce_digests").fetchone()[0]
        runs = conn.execute("SELECT lo, hi FROM nonces_forgotten WHERE api_key = ?",
                            (key["apiKey"],)).fetchall()
    assert 1000 <= kept < 1000 + 256 and 10_000 <= digests <= 10_000 + 256
    assert [tuple(run) for run in runs] == [(first, first)]  # one row for what was forgotten of that second
    clock.now = first
    refused = app.get("/api/v1/wallets", headers=sign(key["apiKey"], key["secret"], timestamp=first),
                      expect_errors=True)
    assert "forgotten" in error(refused, "GA2013", 401)["detail"]
    assert app.get("/api/v1/wallets", headers=sign(other["apiKey"], other["secret"],
                                                   timestamp=first)).json["success"]  # another key: no
    for second in (first - 1, first + 1, first + 5):  # the seconds around it: nothing was forgotten there
        clock.now = second
        assert app.get("/api/v1/wallets", headers=sign(key["apiKey"], key["secret"],
                                                       timestamp=second)).json["success"]


def test_a_frozen_clock_refuses_no_fresh_request_before_eleven_times_the_bound(svc, world, clock) -> None:
    """Defect: with the clock frozen, from request nonce_records + ~100 on every fresh request was GA2013
    "forgotten". docs/contract.md, Replay protection: records kept exactly up to the bound, then as digests
    up to ten times it; only past that is the key's second forgotten, with a detail saying to move the clock
    or raise the bound; a used nonce stays refused as used all along."""
    app = webtest.TestApp(walletsvc.create_app(svc, nonce_records=1000))
    key, other = world["key"], svc.create_api_key(world["ws"]["id"])
    frozen = int(clock())  # never moves: every request below is signed in this one second

    def get(api_key: dict, nonce: str) -> webtest.TestResponse:
        headers = walletsvc.sign_request("GET", "/api/v1/wallets", b"", api_key["apiKey"], api_key["secret"],
                                         timestamp=frozen, nonce=nonce)
        return app.get("/api/v1/wallets", headers=headers, expect_errors=True)

    for n in range(11_000):  # eleven times the bound, fresh: every one answered
        assert get(key, f"fresh-{n}").json["success"], n
    for n in (0, 5000, 10_500):  # a digest, or still a record: refused as used
        assert "already used" in error(get(key, f"fresh-{n}"), "GA2013", 401)["detail"]
    n = 11_000
    while get(key, f"fresh-{n}").json["success"]:
        n += 1
        assert n <= 11_000 + 512  # forgetting works in batches of 256
    detail = error(get(key, "fresh-again"), "GA2013", 401)["detail"]
    assert "forgotten" in detail and "POST /_admin/clock" in detail and "nonce_records" in detail
    assert get(other, "fresh-other").json["success"]  # another key of that very second: answered
    clock.advance(1)
    frozen += 1
    assert get(key, "fresh-moved").json["success"]  # the clock moved: answered again


def test_time_is_compared_in_whole_seconds(svc, api: Api, clock: FrozenClock) -> None:
    clock.now = NOW + 0.3
    data(api.get("/api/v1/wallets", **{"X-Timestamp": str(NOW - 60)}))
    data(api.get("/api/v1/wallets", **{"X-Timestamp": str(NOW + 60)}))
    error(api.get("/api/v1/wallets", **{"X-Timestamp": str(NOW - 61)}), "GA2013", 401)
    clock.now = NOW + 0.999
    error(api.get("/api/v1/wallets", **{"X-Timestamp": str(NOW + 61)}), "GA2013", 401)


@pytest.mark.parametrize("later", [0.0, 60.0, 119.999, 120.0, 120.5, 120.999])
def test_no_replay_at_any_edge_of_the_window(svc, api: Api, clock: FrozenClock, later: float) -> None:
    """Signed with ts = T+60 and first used at T: refused at every later moment it would pass step 4."""
    headers = api.headers("GET", "/api/v1/wallets", **{"X-Timestamp": str(NOW + 60)})
    data(api.request("GET", "/api/v1/wallets", headers=headers))
    clock.now = NOW + later
    error(api.request("GET", "/api/v1/wallets", headers=headers), "GA2013", 401)


###############################################################################
# Authentication details: what a refusal says (docs/signing.md) ################
###############################################################################


def _mistaken_signature(key: dict, mistake: str, method: str, path: str, timestamp: str, nonce: str,
                        body: bytes, query: str, prefix: str) -> str:
    """X-Signature as a client making ``mistake`` computes it (the test's own HMAC, not walletsvc's):
    spec_signature over the inputs the mistake changes, or its output re-encoded; a mistake in the recipe
    itself is the one variant below."""
    signed_path, secret = prefix + path, key["secret"]
    if mistake == "query string signed":
        signed_path += "?" + query
    elif mistake == "mount prefix left out":
        signed_path = path
    elif mistake == "body re-serialised":
        body = json.dumps(json.loads(body)).encode()
    elif mistake == "empty-body hash on a POST":
        body = b""
    elif mistake == "trailing line feed":
        # A variant on purpose: a line feed after the contract's message, which spec_signature cannot
        # sign; so its HMAC is computed here.
        message = f"{method}\n{signed_path}\n{timestamp}\n{nonce}\n{hashlib.sha256(body).hexdigest()}\n"
        return base64.b64encode(hmac.new(secret.encode(), message.encode(), hashlib.sha256).digest()).decode()
    elif mistake == "lowercase method":
        method = method.lower()
    elif mistake == "secret with surrounding whitespace":
        secret = secret + "\n"
    signature = spec_signature(secret, method, signed_path, timestamp, nonce, body)
    return base64.b64decode(signature).hex() if mistake == "hex instead of Base64" else signature


@pytest.mark.parametrize("mistake, named, named_zh", [
    ("query string signed", "the query string was signed", "签名包含了查询字符串"),
    ("mount prefix left out", "the mount prefix '/payments' was left out", "签名路径缺少挂载前缀"),
    ("body re-serialised", "the body was re-serialised after hashing", "请求体被重新序列化"),
    ("empty-body hash on a POST", "the empty-body hash was signed on a request with a body",
     "空请求体的哈希"),
    ("trailing line feed", "the canonical message ended with a line feed", "末尾多了换行符"),
    ("lowercase method", "the method was signed in lower case", "方法名以小写签名"),
    ("hex instead of Base64", "the signature is hex, not Base64", "十六进制"),
    ("secret with surrounding whitespace", "the secret was used with surrounding whitespace", "首尾空白"),
])
def test_a_signing_mistake_is_named_in_the_ga2012_detail(svc, world, clock, mistake, named, named_zh) -> None:
    parent = bottle.Bottle()
    parent.mount("/payments/", walletsvc.create_app(svc, debug_signatures=True))
    app = webtest.TestApp(parent)
    body = b'{"sourceWalletId":"%s","targetWalletId":"%s","amount":"1.00","currency":"USD"}' % (
        world["a"].encode(), world["b"].encode())  # compact: json.dumps would re-serialise it with spaces
    timestamp, nonce, query = str(NOW), str(uuid.uuid4()), "trace=1"
    signature = _mistaken_signature(world["key"], mistake, "POST", TRANSFER_PATH, timestamp, nonce, body,
                                    query, "/payments")
    headers = {"X-Api-Key": world["key"]["apiKey"], "X-Timestamp": timestamp, "X-Nonce": nonce,
               "X-Signature": signature, "Content-Type": "application/json"}
    for locale, expected in (("en-US", named), ("zh-CN", named_zh)):
        headers["X-Nonce"] = str(uuid.uuid4()) if locale == "zh-CN" else nonce
        if locale == "zh-CN":
            headers["X-Signature"] = _mistaken_signature(world["key"], mistake, "POST", TRANSFER_PATH,
                                                         timestamp, headers["X-Nonce"], body, query,
                                                         "/payments")
        response = app.post(f"/payments{TRANSFER_PATH}?{query}", body,
                            headers={**headers, "X-LOCALE": locale}, expect_errors=True)
        detail = error(response, "GA2012", 401)["detail"]
        assert expected in detail, detail
        assert world["key"]["secret"] not in detail
    assert svc.get_balance(world["b"])["balance"] == "0.00"


def test_a_right_signature_with_a_wrong_secret_names_no_mistake(api: Api, world) -> None:
    detail = error(api.get("/api/v1/wallets", **{"X-Signature": base64.b64encode(b"\1" * 32).decode()}),
                   "GA2012", 401)["detail"]
    assert "Canonical message: GET\\n/api/v1/wallets\\n" in detail and "0 body bytes received" in detail
    assert "common mistake" not in detail


def test_a_timestamp_in_milliseconds_is_named(api: Api) -> None:
    detail = error(api.get("/api/v1/wallets", **{"X-Timestamp": str(NOW * 1000)}), "GA2013", 401)["detail"]
    assert "looks like milliseconds" in detail


def test_a_signature_over_a_millisecond_timestamp_is_diagnosed(api: Api, world: dict) -> None:
    """docs/signing.md: the header in seconds, the signed message in milliseconds."""
    nonce = str(uuid.uuid4())
    in_milliseconds = spec_signature(world["key"]["secret"], "GET", "/api/v1/wallets", f"{NOW}123", nonce,
                                     b"")
    detail = error(api.get("/api/v1/wallets", **{"X-Nonce": nonce, "X-Signature": in_milliseconds}),
                   "GA2012", 401)["detail"]
    assert "timestamp was signed in milliseconds" in detail


def test_signature_detail_hides_canonical_message_unless_debug(svc, world, clock) -> None:
    quiet = Api(webtest.TestApp(walletsvc.create_app(svc)), world["key"], clock)
    body = error(quiet.get("/api/v1/wallets", **{"X-Signature": "AAAA"}), "GA2012", 401)
    assert body["detail"] == "The request signature is invalid."


def test_a_stale_timestamp_says_the_servers_time(api: Api) -> None:
    detail = error(api.get("/api/v1/wallets", **{"X-Timestamp": str(NOW - 300)}), "GA2013", 401)["detail"]
    assert f"the server's time is {NOW} (2027-01-15T08:00:00.000Z)" in detail and "-300 s" in detail


###############################################################################
# Resources: amounts and wallet states (docs/reference.md) #####################
###############################################################################


@pytest.mark.parametrize("currency, amount, shown", [
    ("USD", "10", "10.00"),
    ("USD", "10.5", "10.50"),
    ("USD", "0.01", "0.01"),
    ("USD", "999999999999999.99", "999999999999999.99"),
    ("JPY", "10", "10"),
    ("KWD", "1.234", "1.234"),
    ("CLF", "1.0001", "1.0001"),
])
def test_amounts_are_exact_in_the_currency_exponent(svc, currency, amount, shown) -> None:
    wallet = svc.create_wallet(svc.create_workspace("Acme")["id"], currency)
    flow = svc.deposit(wallet["id"], amount)
    assert (flow["amount"], flow["balanceAfter"], svc.get_wallet(wallet["id"])["balance"]) == (
        shown, shown, shown)


@pytest.mark.parametrize("currency, amount", [
    ("USD", "10.001"), ("JPY", "10.5"), ("KWD", "1.2345"), ("USD", "1e3"), ("USD", "-1.00"),
    ("USD", "0"), ("USD", "0.00"), ("USD", "+1"), ("USD", " 1"), ("USD", "1,000"), ("USD", ""),
    ("USD", "1."), ("USD", ".5"), ("USD", "1234567890123456"), ("USD", "NaN"), ("USD", 1.5),
    ("USD", True), ("USD", None), ("USD", "１"),
])
def test_bad_amounts_are_refused_never_rounded(svc, currency, amount) -> None:
    wallet = svc.create_wallet(svc.create_workspace("Acme")["id"], currency)
    with pytest.raises(walletsvc.WalletError) as raised:
        svc.deposit(wallet["id"], amount)
    assert raised.value.code == "S012" and "amount" in str(raised.value)
    assert svc.get_wallet(wallet["id"])["balance"] in ("0", "0.00", "0.000", "0.0000")


def test_withdraw_never_goes_below_zero(svc, world) -> None:
    with pytest.raises(walletsvc.WalletError) as raised:
        svc.withdraw(world["a"], "100.01")
    assert raised.value.code == "T2001"
    assert svc.withdraw(world["a"], "100.00")["balanceAfter"] == "0.00"


def test_frozen_wallet_moves_no_money(svc, world) -> None:
    svc.set_wallet_status(world["a"], "FROZEN")
    for move in (svc.deposit, svc.withdraw):
        with pytest.raises(walletsvc.WalletError) as raised:
            move(world["a"], "1.00")
        assert (raised.value.code, raised.value.status) == ("W1002", 422)


def test_a_closed_wallet_stays_closed(tmp_path, walletsvc_sandbox, make_service) -> None:
    """docs/reference.md: ACTIVE and FROZEN go back and forth; CLOSED is final."""
    app = webtest.TestApp(walletsvc_sandbox.app)
    wallet = walletsvc_sandbox.wallets["yen"]["id"]
    app.post_json(f"/_admin/wallets/{wallet}/status", {"status": "CLOSED"}, headers=ADMIN)
    for status in ("ACTIVE", "FROZEN"):
        refused = app.post_json(f"/_admin/wallets/{wallet}/status", {"status": status}, headers=ADMIN,
                                expect_errors=True)
        assert "CLOSED" in error(refused, "S012", 400)["detail"]
    assert app.post_json(f"/_admin/wallets/{wallet}/status", {"status": "CLOSED"},
                         headers=ADMIN).json["success"]
    path = str(tmp_path / "cli.db")
    svc = make_service(path)
    closed = svc.create_wallet(svc.create_workspace("w")["id"], "USD")["id"]
    svc.set_wallet_status(closed, "CLOSED")
    svc.close()
    done = subprocess.run([sys.executable, "-m", "walletsvc", "wallet", "unfreeze", closed, "--db", path],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1 and "CLOSED" in done.stderr and "Traceback" not in done.stderr
    assert make_service(path).get_wallet(closed)["status"] == "CLOSED"


###############################################################################
# Transfers: idempotency (docs/contract.md) ####################################
###############################################################################


def test_idempotent_replay_moves_money_once(svc, api: Api, world: dict) -> None:
    body = transfer_body(world, bizId="pay-1")
    first = api.transfer(body)
    assert "Idempotent-Replayed" not in first.headers
    second = api.transfer(body)
    assert second.headers["Idempotent-Replayed"] == "true"
    assert data(second) == data(first)
    assert balances(svc, world["a"], world["b"]) == ["74.50", "25.50"]
    assert data(api.get("/api/v1/transfer/query/orders"))["page"]["totalElements"] == 1


def test_replay_returns_the_original_even_when_it_could_not_run_again(svc, api, world) -> None:
    body = transfer_body(world, bizId="pay-2", amount="100.00")
    original = data(api.transfer(body))
    svc.set_wallet_status(world["a"], "FROZEN")
    assert data(api.transfer(body)) == original


@pytest.mark.parametrize("changes", [{"amount": "1.00"}, {"targetWalletId": "@jpy"},
                                     {"description": "other"}])
def test_biz_id_reused_with_different_parameters_is_t2004(svc, api, world, changes) -> None:
    data(api.transfer(transfer_body(world, bizId="pay-3")))
    changes = {k: world["jpy"] if v == "@jpy" else v for k, v in changes.items()}
    error(api.transfer(transfer_body(world, bizId="pay-3", **changes)), "T2004", 409)
    assert balances(svc, world["a"], world["b"]) == ["74.50", "25.50"]


def test_idempotency_key_header_is_accepted_only_equal_to_the_signed_biz_id(svc, api: Api,
                                                                            world: dict) -> None:
    """docs/contract.md: the header is outside the signature, so it can never change what a request does."""
    original = data(api.transfer(transfer_body(world, bizId="rent-2026-10")))
    data(api.transfer(transfer_body(world, bizId="hdr-1"), **{"Idempotency-Key": "hdr-1"}))
    for body, key in [(transfer_body(world), "rent-2026-10"),  # would have replayed the older order
                      (transfer_body(world), "hdr-2"), (transfer_body(world, bizId="hdr-3"), "hdr-1"),
                      (transfer_body(world), "bad key!")]:
        refused = error(api.transfer(body, **{"Idempotency-Key": key}), "S012", 400)
        assert "'Idempotency-Key'" in refused["detail"] and "bizId in the signed body" in refused["detail"]
    data(api.transfer(transfer_body(world, amount="1.00"), **{"Idempotency-Key": ""}))  # empty: as if absent
    assert balances(svc, world["a"]) == ["48.00"]  # 100.00 - 2 x 25.50 - 1.00: nothing else written
    assert svc.list_transfers(world["ws"]["id"])["page"]["totalElements"] == 3
    assert original["bizId"] == "rent-2026-10"


def test_biz_ids_are_unique_per_workspace_not_globally(svc, api: Api, world: dict) -> None:
    order_in_another_workspace(svc, "shared")
    assert data(api.transfer(transfer_body(world, bizId="shared")))["amount"] == "25.50"


###############################################################################
# Transfers: settlement modes (docs/contract.md) ###############################
###############################################################################


@pytest.fixture
def manual(clock, make_service):
    svc = make_service(clock=clock, settlement="manual")
    ws = svc.create_workspace("Acme")
    key = svc.create_api_key(ws["id"])
    a, b = (svc.create_wallet(ws["id"], "USD")["id"] for _ in range(2))
    svc.deposit(a, "100.00")
    api = Api(webtest.TestApp(walletsvc.create_app(svc)), key, clock)
    return svc, api, {"ws": ws, "a": a, "b": b}


def test_manual_settlement_holds_then_completes(manual) -> None:
    svc, api, w = manual
    order = data(api.transfer(transfer_body(w, bizId="m-1", amount="30.00")))
    assert (order["status"], order["completedAt"]) == ("PENDING", None)
    balance = data(api.get(f"/api/v1/wallets/{w['a']}/balance"))
    assert (balance["balance"], balance["available"], balance["pending"]) == ("100.00", "70.00", "30.00")
    assert data(api.get("/api/v1/transfer/query/orders/m-1/completed"))["completed"] is False
    assert data(api.get(f"/api/v1/wallets/{w['a']}/flows"))["page"]["totalElements"] == 1
    # held money is not available
    error(api.transfer(transfer_body(w, bizId="m-2", amount="70.01")), "T2001", 422)
    done = svc.complete_transfer("m-1")
    assert (done["status"], done["completedAt"]) == ("COMPLETED", T0)
    balance = data(api.get(f"/api/v1/wallets/{w['a']}/balance"))
    assert (balance["balance"], balance["available"], balance["pending"]) == ("70.00", "70.00", "0.00")
    assert balances(svc, w["b"]) == ["30.00"]
    assert data(api.get("/api/v1/transfer/query/orders/m-1/completed"))["completed"] is True
    assert data(api.get(f"/api/v1/wallets/{w['a']}/flows"))["content"][0]["type"] == "TRANSFER_OUT"
    with pytest.raises(walletsvc.WalletError, match="COMPLETED"):
        svc.fail_transfer("m-1")


def test_manual_settlement_failure_releases_the_hold(manual) -> None:
    svc, api, w = manual
    data(api.transfer(transfer_body(w, bizId="m-3", amount="100.00")))
    failed = svc.fail_transfer("m-3", workspace_id=w["ws"]["id"])
    assert (failed["status"], failed["completedAt"]) == ("FAILED", None)
    balance = data(api.get(f"/api/v1/wallets/{w['a']}/balance"))
    assert (balance["balance"], balance["available"], balance["pending"]) == ("100.00", "100.00", "0.00")
    assert data(api.get("/api/v1/transfer/query/orders", query="status=FAILED"))["page"]["totalElements"] == 1
    assert data(api.get("/api/v1/transfer/query/orders",
                        query="status=PENDING"))["page"]["totalElements"] == 0
    assert data(api.get(f"/api/v1/wallets/{w['b']}/flows"))["page"]["totalElements"] == 0


def test_delayed_settlement_completes_on_the_service_clock(clock, make_service) -> None:
    svc = make_service(clock=clock, settlement="delayed", settlement_delay=10)
    ws = svc.create_workspace("Acme")
    a, b = (svc.create_wallet(ws["id"], "USD")["id"] for _ in range(2))
    svc.deposit(a, "5.00")
    order = svc.create_transfer(ws["id"], source_wallet_id=a, target_wallet_id=b, amount="5.00",
                                currency="USD")
    assert order["status"] == "PENDING"
    clock.advance(9.999)
    assert svc.get_transfer(ws["id"], order["bizId"])["status"] == "PENDING"
    clock.advance(0.001)
    assert svc.transfer_completion(ws["id"], order["bizId"])["completed"] is True
    assert balances(svc, a, b) == ["0.00", "5.00"]


@pytest.mark.walletsvc(settlement="delayed", settlement_delay=5)
def test_delayed_settlement_counts_from_the_clock_reading_after_the_clock_moved(walletsvc_sandbox) -> None:
    """Defect: after the clock was a day ahead and came back, a 5 s order stayed PENDING a minute later."""
    sandbox = walletsvc_sandbox
    svc = sandbox.service
    alice, bob = sandbox.wallets["alice"]["id"], sandbox.wallets["bob"]["id"]
    sandbox.clock.freeze(at=NOW)
    sandbox.clock.advance(86400)
    svc.deposit(alice, "1.00")  # the ledger's time is now a day ahead
    sandbox.clock.advance(-86400)
    order = svc.create_transfer(sandbox.workspace["id"], alice, bob, "1.00", "USD")
    assert order["status"] == "PENDING"
    sandbox.clock.advance(4.9)
    assert svc.get_transfer(sandbox.workspace["id"], order["bizId"])["status"] == "PENDING"
    sandbox.clock.advance(0.1)
    assert svc.get_transfer(sandbox.workspace["id"], order["bizId"])["status"] == "COMPLETED"


###############################################################################
# Transfers: money under concurrency (docs/contract.md) ########################
###############################################################################


def _hammer(path: str, workspace_id: str, wallet_ids: list, worker: int, count: int) -> list:
    """Random transfers among the wallets, each also retried once with its bizId."""
    import random

    svc = walletsvc.WalletService(path, busy_timeout=30)
    rng = random.Random(worker)
    done = []
    for n in range(count):
        source, target = rng.sample(wallet_ids, 2)
        biz_id, amount = f"w{worker}-{n}", f"{rng.randint(1, 900)}.{rng.randint(0, 99):02d}"
        for _ in range(2):  # the retry must not move money twice
            try:
                order = svc.create_transfer(workspace_id, source_wallet_id=source,
                                            target_wallet_id=target, amount=amount, currency="USD",
                                            biz_id=biz_id)
                done.append((biz_id, order["transferId"]))
            except walletsvc.WalletError as exc:
                assert exc.code == "T2001", exc  # rejected without a trace: a retry may succeed
    svc.close()
    return done


def test_eight_threads_hammering_transfers_conserve_money(tmp_path) -> None:
    path, workspace_id, wallets = _shared_ledger(tmp_path)
    results: list = []
    threads = [
        threading.Thread(target=lambda w=w: results.extend(_hammer(path, workspace_id, wallets, w, 40)))
        for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    facts = ledger_invariants(path)
    assert facts["total"] == 4 * 100000
    transfer_ids = dict(results)  # an acknowledged bizId always answers the same order
    assert len(set(results)) == len(transfer_ids) == facts["transfers"] > 0


def test_two_processes_sharing_one_file_conserve_money(tmp_path) -> None:
    path, workspace_id, wallets = _shared_ledger(tmp_path)
    context = multiprocessing.get_context("spawn")
    with context.Pool(2) as pool:
        runs = pool.starmap(_hammer, [(path, workspace_id, wallets, w, 60) for w in range(2)])
    facts = ledger_invariants(path)
    assert facts["total"] == 4 * 100000
    acknowledged = {pair for run in runs for pair in run}
    assert len(acknowledged) == len(dict(acknowledged)) == facts["transfers"] > 0


def test_a_forked_child_opens_its_own_connection(tmp_path) -> None:
    """A service made before os.fork works in the child on a connection of its own."""
    path, _, wallets = _shared_ledger(tmp_path)
    svc = walletsvc.WalletService(path)
    svc.deposit(wallets[0], "1.00")  # the parent's connection exists before the fork
    with svc.db.connection() as conn:
        parent_connection = id(conn)
    context = multiprocessing.get_context("fork")
    answers = context.Queue()

    def child() -> None:
        svc.deposit(wallets[0], "1.00")
        with svc.db.connection() as conn:
            answers.put(id(conn) != parent_connection)

    children = [context.Process(target=child) for _ in range(4)]
    for process in children:
        process.start()
    own = [answers.get(timeout=60) for _ in children]
    for process in children:
        process.join(timeout=60)
    assert own == [True] * 4 and all(process.exitcode == 0 for process in children)
    svc.deposit(wallets[0], "1.00")  # and the parent's still works
    assert balances(svc, wallets[0]) == ["1006.00"]
    ledger_invariants(path)


###############################################################################
# Transfers: the ledger in commit order, and its auditor (docs/contract.md) ####
###############################################################################


def test_ledger_reads_in_commit_order_under_concurrent_transfers(tmp_path, make_service) -> None:
    """4 threads move 1.00 between 3 wallets: each wallet's flows, oldest first, are an
    unbroken running balance ending at the balance (docs/contract.md)."""
    path = str(tmp_path / "order.db")
    svc = make_service(path, synchronous="NORMAL")
    ws = svc.create_workspace("order")["id"]
    wallets = [svc.create_wallet(ws, "USD")["id"] for _ in range(3)]
    for wallet_id in wallets:
        svc.deposit(wallet_id, "1000.00")
    deadline = time.monotonic() + 1.5

    def hammer(seed: int) -> None:
        import random

        rng = random.Random(seed)
        while time.monotonic() < deadline:
            source, target = rng.sample(wallets, 2)
            svc.create_transfer(ws, source, target, "1.00", "USD")

    threads = [threading.Thread(target=hammer, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("SELECT count(*) FROM transfers").fetchone()[0] > 50
        for wallet_id in wallets:
            assert running_balance_breaks(conn, wallet_id) == [], wallet_id
    finally:
        conn.close()
    for wallet_id in wallets:  # and through the API's own order: createdAt ascending
        flows = svc.list_flows(wallet_id, {"sort": "createdAt,asc", "size": 100})
        pages = flows["page"]["totalPages"]
        last = svc.list_flows(wallet_id,
                              {"sort": "createdAt,asc", "size": 100, "page": pages - 1})["content"][-1]
        assert last["balanceAfter"] == svc.get_balance(wallet_id)["balance"]
    assert svc.audit() == []


def test_ledger_time_never_goes_back_with_the_clock_nor_across_processes(tmp_path) -> None:
    path = str(tmp_path / "clocks.db")
    ahead, behind = walletsvc.Clock(frozen_at=NOW + 10), walletsvc.Clock(frozen_at=NOW)
    first = walletsvc.WalletService(path, clock=ahead)  # two services on one file: as two processes
    second = walletsvc.WalletService(path, clock=behind)
    ws = first.create_workspace("clocks")["id"]
    wallet = first.create_wallet(ws, "USD")["id"]
    early = first.deposit(wallet, "5.00")
    late = second.deposit(wallet, "1.00")  # its clock says 10 s earlier
    assert late["createdAt"] >= early["createdAt"] and late["id"] > early["id"]
    ahead.set(NOW - 3600)  # the controllable clock set back an hour
    later = first.withdraw(wallet, "2.00")
    assert later["createdAt"] == early["createdAt"] and later["id"] > late["id"]
    flows = first.list_flows(wallet, {"sort": "createdAt,asc"})["content"]
    assert [flow["balanceAfter"] for flow in flows] == ["5.00", "6.00", "4.00"]
    assert first.audit() == []
    first.reset()  # reset restarts the ledger's clock, and the service clock where it started
    assert first.create_workspace("again")["createdAt"] == "2027-01-15T08:00:10.000Z"  # NOW + 10 s


@pytest.mark.parametrize("version", [1, 3])
def test_a_database_older_than_the_first_release_is_refused(tmp_path, version: int) -> None:
    """CHANGELOG.md: upgrades start at schema version 4, the first released; an older file is refused."""
    path = str(tmp_path / "old.db")
    walletsvc.WalletService(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE schema_version SET version = ?", (version,))
    with pytest.raises(RuntimeError, match=f"schema version {version}; this walletsvc expects 7"):
        walletsvc.WalletService(path)


def test_a_version_6_database_is_upgraded_without_its_copy_guard(tmp_path) -> None:
    """Version 7 drops version 6's file_signature table (no in-place-copy guard: docs/operations.md) and the
    sandbox's unused nonce_tolerance column, even where the guard marked the file written over."""
    path = str(tmp_path / "v6.db")
    svc = walletsvc.WalletService(path)
    world_ = make_world(svc)
    svc.close()
    with sqlite3.connect(path) as conn:
        conn.executescript("CREATE TABLE file_signature (size INTEGER, mtime_ns INTEGER, checkpointer TEXT,"
                           " checkpointer_at INTEGER, changed_at INTEGER);"
                           " INSERT INTO file_signature VALUES (1, 1, NULL, NULL, 1);"
                           " ALTER TABLE sandbox ADD COLUMN nonce_tolerance INTEGER NOT NULL DEFAULT 0;"
                           " UPDATE schema_version SET version = 6;")
    upgraded = walletsvc.WalletService(path)
    try:
        assert upgraded.create_transfer(world_["ws"]["id"], world_["a"], world_["b"], "1.00",
                                        "USD")["status"] == "COMPLETED"
        with upgraded.db.connection() as conn:
            assert conn.execute("SELECT version FROM schema_version").fetchone()[0] == 7
            assert conn.execute("SELECT count(*) FROM sqlite_master WHERE name = 'file_signature'"
                                ).fetchone()[0] == 0
            assert "nonce_tolerance" not in [row[1] for row in conn.execute("PRAGMA table_info(sandbox)")]
    finally:
        upgraded.close()


def test_a_version_4_database_is_upgraded_in_place(tmp_path) -> None:
    """Schema version 5 adds the admin token, the nonce digests and the console's sessions: a version 4 file
    gets them, keeping its nonce records (a used nonce stays refused)."""
    path = str(tmp_path / "v4.db")
    svc = walletsvc.WalletService(path)
    world_ = make_world(svc)
    key = world_["key"]
    app = webtest.TestApp(walletsvc.create_app(svc))
    headers = _signed("GET", "/api/v1/wallets", key["apiKey"], key["secret"])
    data(app.get("/api/v1/wallets", headers=headers))
    svc.close()
    with sqlite3.connect(path) as conn:
        conn.executescript("DROP TABLE admin_token; DROP TABLE nonce_digests; DROP TABLE console_sessions;"
                           " DROP TABLE nonce_digest_seconds; UPDATE schema_version SET version = 4;")
    upgraded = walletsvc.WalletService(path)
    with upgraded.db.connection() as conn:
        assert conn.execute("SELECT version FROM schema_version").fetchone()[0] == 7
        for table in ("admin_token", "nonce_digests", "nonce_digest_seconds", "console_sessions"):
            assert conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0] == 0
    replayed = webtest.TestApp(walletsvc.create_app(upgraded)).get("/api/v1/wallets", headers=headers,
                                                                   expect_errors=True)
    error(replayed, "GA2013", 401)


def test_audit_is_clean_after_every_kind_of_movement(svc, world, clock, make_service) -> None:
    manual = make_service(clock=clock, settlement="manual")
    for service in (svc, manual):
        ws = service.create_workspace("audited")["id"]
        a, b = (service.create_wallet(ws, "USD")["id"] for _ in range(2))
        service.deposit(a, "50.00")
        service.create_transfer(ws, a, b, "10.00", "USD", biz_id="one")
        service.create_transfer(ws, a, b, "10.00", "USD", biz_id="one")  # a replay
        service.create_transfer(ws, a, b, "5.00", "USD", biz_id="two")
        service.withdraw(b, "1.00") if service is svc else service.fail_transfer("two")
        assert service.audit() == [], service.settings.settlement
    manual.complete_transfer("one")
    assert manual.audit() == []


@pytest.mark.parametrize("tamper, check", [
    ("UPDATE wallets SET balance = balance + 100 WHERE name = 'b'", "conservation"),
    ("UPDATE wallets SET balance = balance + 100 WHERE name = 'b'", "flows_sum"),
    ("UPDATE wallets SET balance = balance + 100 WHERE name = 'b'", "newest_flow"),
    ("UPDATE flows SET balance_after = balance_after + 1 WHERE type = 'DEPOSIT'", "running_balance"),
    ("UPDATE wallets SET pending = 100 WHERE name = 'a'", "pending"),
    ("DELETE FROM flows WHERE type = 'TRANSFER_IN'", "order_flows"),
    ("UPDATE counters SET n = n + 1 WHERE name = 'flows'", "counters"),
    ("DELETE FROM counters WHERE name = 'transfers'", "counters"),
])
def test_audit_names_each_broken_invariant_and_its_rows(svc, world, tamper: str, check: str) -> None:
    svc.create_transfer(world["ws"]["id"], world["a"], world["b"], "10.00", "USD")
    with svc.db.connection() as conn:
        conn.execute("PRAGMA ignore_check_constraints = ON")
        conn.execute(tamper)
    found = [violation for violation in svc.audit() if violation["check"] == check]
    assert found and all(violation["detail"] and violation["rows"] for violation in found)
    with pytest.raises(AssertionError, match=check):
        svc.assert_audit_clean()


def test_audit_over_the_cli_and_the_admin_surface(tmp_path, capsys, make_service) -> None:
    path = str(tmp_path / "audit.db")
    svc = make_service(path)
    ws = svc.create_workspace("audit")["id"]
    wallet = svc.create_wallet(ws, "USD")["id"]
    svc.deposit(wallet, "3.00")
    admin = webtest.TestApp(walletsvc.create_app(svc, admin_token="t"))
    assert admin.get("/_admin/audit", headers={"Authorization": "Bearer t"}).json["data"] == []
    assert run_cli(capsys, "audit", "--db", path) == (0, "[]\n", "")
    with svc.db.connection() as conn:
        conn.execute("UPDATE wallets SET balance = 7")
    code, out, _ = run_cli(capsys, "audit", "--db", path)
    assert code == 1 and {v["check"] for v in json.loads(out)} >= {"conservation", "flows_sum"}
    answer = admin.get("/_admin/audit", headers={"Authorization": "Bearer t"}).json["data"]
    assert {violation["check"] for violation in answer} == {v["check"] for v in json.loads(out)}


@pytest.mark.parametrize("whitelist, code", [(["10.0.0.1/8"], "host_bits"), (["127.0.0.2/8"], "host_bits"),
                                             (["2001:db8::1/32"], "host_bits"), ([], "empty")])
def test_an_ip_whitelist_entry_is_refused_not_widened(tmp_path, capsys, make_service, whitelist: list,
                                                      code: str) -> None:
    """The attack (docs/signing.md): "10.0.0.1/8" was stored as 10.0.0.0/8, so "127.0.0.2/8" admitted
    127.0.0.1; and [] was taken. Both are S012 by the admin API, in a scenario and by the CLI."""
    svc = make_service(str(tmp_path / "ip.db"))
    ws = svc.create_workspace("ip")["id"]
    admin = webtest.TestApp(walletsvc.create_app(svc, admin_token="t"))
    refused = admin.post_json(f"/_admin/workspaces/{ws}/keys", {"ipWhitelist": whitelist},
                              headers={"Authorization": "Bearer t"}, expect_errors=True).json
    assert refused["code"] == "S012" and "ipWhitelist" in refused["detail"]
    if code == "host_bits":
        assert "host bits" in refused["detail"] and "/" in refused["detail"]
    else:
        assert "empty" in refused["detail"] and "null" in refused["detail"]
    scenario = {"workspaces": [{"name": "w", "keys": [{"ipWhitelist": whitelist}]}]}
    with pytest.raises(walletsvc.InvalidParameter, match="keys\\[0\\].ipWhitelist"):
        walletsvc.check_scenario(scenario)
    if whitelist:
        code_, _out, err = run_cli(capsys, "key", "create", ws, "--db", str(tmp_path / "ip.db"), "--ip",
                                   whitelist[0])
        assert code_ == 1 and "host bits" in err and "\n" not in err.strip()
    assert svc.list_api_keys(ws) == []  # nothing stored
    kept = svc.create_api_key(ws, ip_whitelist=["10.0.0.0/8", "10.0.0.0/8", "127.0.0.1"])
    assert kept["ipWhitelist"] == ["10.0.0.0/8", "127.0.0.1/32"]


def test_a_scenario_key_is_stored_as_the_admin_api_stores_it(tmp_path, make_service) -> None:
    """Issue: a scenario key kept scopes ["wallet:read", "wallet:read"] where create_api_key stores one."""
    svc = make_service(str(tmp_path / "scenario.db"))
    world = svc.load_scenario({"workspaces": [{"name": "w", "keys": [
        {"scopes": ["wallet:read", "wallet:read"], "ipWhitelist": ["10.0.0.0/8", "10.0.0.0/8"]}]}]})
    (key,) = svc.list_api_keys(world["workspaces"][0]["id"])
    assert key["scopes"] == ["wallet:read"] and key["ipWhitelist"] == ["10.0.0.0/8"]


def test_a_scenario_keys_scopes_are_checked_as_the_admin_api_checks_them(make_service) -> None:
    """One check for a key's scopes, wherever the key is made: a scope that is not one of
    docs/contract.md's is named, and an empty list is refused."""
    svc = make_service()
    for scopes, says in ((["nope"], "'nope' is not a scope"), ([], "is required")):
        with pytest.raises(walletsvc.WalletError) as raised:
            svc.load_scenario({"workspaces": [{"name": "w", "keys": [{"scopes": scopes}]}]})
        assert raised.value.code == "S012" and "workspaces[0].keys[0].scopes" in str(raised.value)
        assert says in str(raised.value)
        ws = svc.create_workspace("w")
        with pytest.raises(walletsvc.WalletError) as raised:
            svc.create_api_key(ws["id"], scopes)
        assert raised.value.code == "S012" and says in str(raised.value)
    assert svc.list_workspaces()[0]["name"] == "w" and len(svc.list_workspaces()) == 2  # no scenario's


def test_a_key_takes_scopes_from_any_iterable_and_an_empty_member_id_is_no_member(make_service) -> None:
    svc = make_service()
    ws = svc.create_workspace("w")
    assert svc.create_api_key(ws["id"], {"wallet:read"})["scopes"] == ["wallet:read"]
    made = svc.create_api_key(ws["id"], (scope for scope in ("transfer:read",)))
    assert made["scopes"] == ["transfer:read"]
    with pytest.raises(walletsvc.WalletError) as raised:
        svc.create_api_key(ws["id"], member_id="")
    assert (raised.value.code, raised.value.status) == ("S404", 404)
    admin = webtest.TestApp(walletsvc.create_app(svc, admin_token="t"))
    answer = admin.post_json(f"/_admin/workspaces/{ws['id']}/keys", {"memberId": ""},
                             headers={"Authorization": "Bearer t"}, expect_errors=True)
    assert (answer.status_int, answer.json["code"]) == (404, "S404")
    assert len(svc.list_api_keys(ws["id"])) == 2


def test_a_scenarios_fixed_ids_are_checked_before_its_settings(make_service) -> None:
    scenario = {"workspaces": [{"id": "ws_1", "name": "a"}, {"id": "ws_1", "name": "b"}],
                "settings": {"settlement": "nope"}}
    with pytest.raises(walletsvc.WalletError) as raised:
        make_service().load_scenario(scenario)
    assert raised.value.code == "S012" and "workspaces[1].id" in str(raised.value)


def test_what_holds_secrets_is_private_and_never_written_through_a_symlink(tmp_path) -> None:
    """The attack (docs/operations.md): the database and the ready file were 0644; the ready file's temporary
    was opened through a planted symlink (a victim file got the secrets); a refused start left it."""
    import stat

    def mode(path: pathlib.Path) -> int:
        return stat.S_IMODE(os.stat(path).st_mode)

    old_umask = os.umask(0o022)
    try:
        victim = tmp_path / "victim.txt"
        victim.write_text("untouched")
        for n in range(40000, 40100):  # the old temporary's names (PATH.<pid>.tmp), planted
            with contextlib.suppress(FileExistsError):
                os.symlink(victim, tmp_path / f"ready.json.{n}.tmp")
        server = ServerProcess(str(tmp_path / "private.db"), tmp_path / "private.log", "--demo",
                               "--ready-file", str(tmp_path / "ready.json"))
        server.start()
        try:
            assert mode(tmp_path / "private.db") == 0o600
            assert {mode(tmp_path / f"private.db{suffix}") for suffix in ("-wal", "-shm")} == {0o600}
            deadline = time.monotonic() + 10
            while not (tmp_path / "ready.json").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert mode(tmp_path / "ready.json") == 0o600 and not (tmp_path / "ready.json").is_symlink()
            assert json.loads((tmp_path / "ready.json").read_text())["keys"][0]["secret"] == "sk_demo"
        finally:
            server.stop()
        assert victim.read_text() == "untouched"
        (tmp_path / "taken").mkdir()
        refused = subprocess.run([sys.executable, "-m", "walletsvc", "serve", "--demo", "--port", "0", "--db",
                                  str(tmp_path / "refused.db"), "--ready-file", str(tmp_path / "taken")],
                                 capture_output=True, text=True, timeout=60, check=False)
        assert refused.returncode == 2 and "--ready-file" in refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1
        left = {path.name for path in tmp_path.iterdir()}
        assert not [name for name in left if name.startswith(("taken.", "refused.db"))], left
    finally:
        os.umask(old_umask)


def test_errors_say_what_to_do(tmp_path, capsys, walletsvc_sandbox) -> None:
    """Issue 29, errors that say what to do: an unknown world's reset is GA2032 as for any unknown
    workspace in the admin API; an undeclared path (a trailing slash) is denied by default (docs/contract.md)
    saying there is no such endpoint; --threads, --workers and --port say a bad value in one line."""
    sandbox = walletsvc_sandbox
    app = webtest.TestApp(sandbox.app)
    unknown = app.post_json("/_admin/workspaces/ws_nothing/reset", {}, headers=ADMIN, expect_errors=True)
    assert (unknown.status_int, unknown.json["code"]) == (404, "GA2032")
    key, secret = sandbox.key["apiKey"], sandbox.key["secret"]
    slashed = app.get("/api/v1/wallets/", headers=_signed("GET", "/api/v1/wallets/", key, secret),
                      expect_errors=True)
    assert (slashed.status_int, slashed.json["code"]) == (403, "50090201")
    assert "No endpoint is GET /api/v1/wallets/ (without its trailing /?)" in slashed.json["detail"]
    for option, value in (("--threads", "abc"), ("--workers", "abc"), ("--port", "abc"), ("--port", "70000")):
        done = subprocess.run([sys.executable, "-m", "walletsvc", "serve", option, value],
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert option in done.stderr and value in done.stderr


def test_a_body_over_the_limit_says_the_apps_limit_not_waitresss(tmp_path) -> None:
    """Issue 29: a body of exactly 1 MiB was refused as "exceeds 1048576 bytes" (waitress's buffer); the
    limit is max_body_bytes (65536 by default), and a body at the limit is taken."""
    with demo_process(tmp_path, "limits") as (server, (key, secret, _admin, _wallets)):
        for size, status in ((1 << 20, 413), (65536, 415)):  # at the limit: read, then S415 (no JSON type)
            body = b"x" * size
            answer = requests.post(server.url + TRANSFER_PATH, data=body, timeout=30,
                                   headers={**_signed("POST", TRANSFER_PATH, key, secret, body),
                                            "Content-Type": "text/plain"})
            assert answer.status_code == status, answer.text
            if status == 413:
                assert "65536" in answer.json()["detail"] and "1048576" not in answer.json()["detail"]


DEEP = '{"workspaces": [{"name": ' + "[" * 100000 + "]" * 100000 + "}]}"
SCENARIO_MISTAKES = [  # (file, text, the line it names, the field it names)
    ("clock.toml", '[clock]\nat = "1969-12-31T00:00:00Z"\n[[workspaces]]\nname = "w"\n', 2, "'clock.at'"),
    ("twice.toml", ('[[workspaces]]\nname = "w"\n[[workspaces.wallets]]\nid = "wal_a"\nname = "a"\n'
                   'currency = "USD"\n[[workspaces.wallets]]\nid = "wal_a"\nname = "b"\ncurrency = "USD"\n'),
     8, "'workspaces[0].wallets[1].id'"),
    ("member.toml", '[[workspaces]]\nname = "w"\n[[workspaces.keys]]\nmember = "carol"\n', 4,
     "'workspaces[0].keys[0].member'"),
    ("settlement.toml", '[settings]\nsettlement = "weekly"\n[[workspaces]]\nname = "w"\n', 2,
     "'settings.settlement'"),
    ("unknown.toml", '[settings]\nnope = 1\n[[workspaces]]\nname = "w"\n', 2, "'settings.nope'"),
    ("tolerance.toml", '[settings]\ntimestamp_tolerance = 100000000000000000\n[[workspaces]]\nname = "w"\n',
     2, "'settings.timestamp_tolerance': must be from 1 to 86,400"),
    ("nan.json", '{"clock": {"at": NaN}, "workspaces": [{"name": "w"}]}', 1, "'clock.at'"),
    ("deep.json", DEEP, 1, "nested deeper than a scenario can be"),
]


@pytest.mark.parametrize("name, text, line, field", SCENARIO_MISTAKES, ids=[m[0] for m in SCENARIO_MISTAKES])
def test_every_mistake_in_a_scenario_file_names_the_file_line_and_field(tmp_path, name: str, text: str,
                                                                        line: int, field: str) -> None:
    """docs/sandbox.md and the attack: mistakes caught after parsing named neither line nor field (a key's
    member: exit 1 and a database left behind; deep nesting: "maximum recursion depth exceeded")."""
    (tmp_path / name).write_text(text)
    done = subprocess.run([sys.executable, "-m", "walletsvc", "serve", "--scenario", str(tmp_path / name),
                           "--db", str(tmp_path / "left.db"), "--port", "0"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"scenario {tmp_path / name}: line {line}: " in done.stderr and field in done.stderr
    assert "Traceback" not in done.stderr and not list(tmp_path.glob("left.db*"))


@pytest.mark.parametrize("setting, value, range_", [
    ("timestamp_tolerance", "100000000000000000", "from 1 to 86,400"), ("busy_timeout", "0", "0.001 to 600"),
    ("busy_timeout", "nan", "0.001 to 600"), ("max_body_bytes", "-1", "0 to 67,108,864"),
    ("journal_size", "10000000", "0 to 100,000"), ("nonce_records", "10", "1,000 to 100,000,000"),
    ("settlement_delay", "inf", "0 to 31,622,400"), ("id_seed", "-1", "0 to 9,223,372,036,854,775,807"),
    ("admin_token", "", "1 to 256 characters"), ("admin_token", "t" * 257, "1 to 256 characters")])
def test_every_setting_has_a_range_refused_where_given(tmp_path, make_service, setting: str, value: str,
                                                       range_: str) -> None:
    """The attack (docs/operations.md): timestamp_tolerance=10^17 was stored and made every signed request a
    500 (an OverflowError). Every setting has a range; out of it is refused at start, naming it."""
    done = subprocess.run([sys.executable, "-m", "walletsvc", "serve", "--set", f"{setting}={value}", "--db",
                           str(tmp_path / "range.db"), "--port", "0"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 2 and setting in done.stderr and range_ in done.stderr, done.stderr
    assert not list(tmp_path.glob("range.db*"))
    layer = walletsvc.Settings.layer_of(setting)
    with pytest.raises(ValueError, match=range_.replace(".", "\\.")):
        if layer == "service":
            walletsvc.WalletService(**{setting: value})
        else:
            walletsvc.create_app(make_service(), **{setting: value})


def test_a_latency_rule_slows_only_what_it_matches_under_serve(tmp_path) -> None:
    """The attack (docs/sandbox.md): with a 5 s latency rule and 20 clients, requests no rule matched
    waited up to 23 s, the sleepers holding every thread. Now a thread is started beside each sleeper."""
    with demo_process(tmp_path, "latency") as (server, (key, secret, admin, wallets)):
        slow_path = f"/api/v1/wallets/{wallets[0]}"
        rule = requests.post(server.url + "/_admin/faults", headers=admin, timeout=10, json={
            "action": "latency", "method": "GET", "path": slow_path, "latency": 3})
        assert rule.status_code == 200, rule.text
        waits: dict[str, list[float]] = {"slow": [], "other": []}

        def get(kind: str, path: str) -> None:
            started = time.monotonic()
            answer = requests.get(server.url + path, headers=_signed("GET", path, key, secret), timeout=30)
            assert answer.status_code == 200
            waits[kind].append(time.monotonic() - started)

        threads = [threading.Thread(target=get, args=("slow", slow_path)) for _ in range(10)]
        threads += [threading.Thread(target=get, args=("other", f"/api/v1/wallets/{wallets[1]}"))
                    for _ in range(10)]
        for thread in threads[:10]:
            thread.start()
        time.sleep(0.5)  # the ten sleepers hold the default four threads and more
        for thread in threads[10:]:
            thread.start()
        for thread in threads:
            thread.join(30)
    assert len(waits["slow"]) == 10 and min(waits["slow"]) >= 3
    assert len(waits["other"]) == 10 and max(waits["other"]) < 1.5, waits["other"]


def test_past_the_sleepers_limit_a_latency_rule_never_makes_other_requests_wait(tmp_path) -> None:
    """Defect: beyond 256 latency sleepers a request no rule matches waited (16 s with 320 sleepers), where
    the docs say never. Past the limit a matched request answers S503 at once (docs/sandbox.md). Bounded:
    the limit lowered to 4 (the shipped 256)."""
    server = ServerProcess(str(tmp_path / "sleepers.db"), tmp_path / "sleepers.log", "--demo")
    server.command = [sys.executable, "-c", ("import sys, walletsvc; walletsvc.MAX_SLEEPERS = 4;"
                                             " sys.exit(walletsvc.main(sys.argv[1:]))")]
    server.start()
    try:
        key, secret, admin, wallets = _demo_of(tmp_path / "sleepers.log")
        slow_path, other_path = (f"/api/v1/wallets/{wallet}" for wallet in wallets[:2])
        assert requests.post(server.url + "/_admin/faults", headers=admin, timeout=10, json={
            "action": "latency", "method": "GET", "path": slow_path, "latency": 3}).status_code == 200
        answers: dict[str, list] = {"slow": [], "other": []}

        def get(kind: str, path: str) -> None:
            started = time.monotonic()
            answer = requests.get(server.url + path, headers=_signed("GET", path, key, secret), timeout=30)
            answers[kind].append((answer.json()["code"], time.monotonic() - started))

        sleepers = [threading.Thread(target=get, args=("slow", slow_path)) for _ in range(12)]
        for thread in sleepers:
            thread.start()
        time.sleep(0.5)  # four sleep, each beside a thread of its own; eight more answered S503 at once
        others = [threading.Thread(target=get, args=("other", other_path)) for _ in range(8)]
        for thread in others:
            thread.start()
        for thread in sleepers + others:
            thread.join(30)
    finally:
        server.stop()
    held = sorted(answers["slow"], key=lambda answer: answer[1])
    assert [code for code, _ in held] == ["S503"] * 8 + ["2000"] * 4
    assert max(took for _, took in held[:8]) < 1.5 and min(took for _, took in held[8:]) >= 3
    assert [code for code, _ in answers["other"]] == ["2000"] * 8
    assert max(took for _, took in answers["other"]) < 1.5, answers["other"]


def test_audit_sums_are_exact_however_large(tmp_path, capsys, make_service) -> None:
    """The attack (docs/operations.md): ten KWD wallets of 999999999999999.999 each (within the cap) made
    `walletsvc audit` print "integer overflow" (exit 2) and GET /_admin/audit answer 500."""
    path = str(tmp_path / "rich.db")
    svc = make_service(path)
    ws = svc.create_workspace("rich")["id"]
    for _ in range(10):
        svc.deposit(svc.create_wallet(ws, "KWD")["id"], "999999999999999.999")
    assert svc.audit() == []
    admin = webtest.TestApp(walletsvc.create_app(svc, admin_token="t"))
    assert admin.get("/_admin/audit", headers={"Authorization": "Bearer t"}).json["data"] == []
    assert run_cli(capsys, "audit", "--db", path) == (0, "[]\n", "")
    with svc.db.connection() as conn:  # one minor unit too many, in a sum past 2^63
        conn.execute("UPDATE wallets SET balance = balance + 1"
                     " WHERE rowid = (SELECT min(rowid) FROM wallets)")
    (conservation,) = [v for v in svc.audit() if v["check"] == "conservation"]
    assert conservation["rows"]["balances"] == str(10 * 999999999999999999 + 1)
    assert conservation["rows"]["external"] == str(10 * 999999999999999999)


def test_the_plugin_audit_says_a_violation_is_a_walletsvc_bug() -> None:
    sandbox = walletsvc.Sandbox.create()
    sandbox.audit()
    with sandbox.service.db.connection() as conn:
        conn.execute("UPDATE wallets SET balance = balance + 1")
    with pytest.raises(AssertionError, match="a bug in walletsvc, not in your test"):
        sandbox.audit()


###############################################################################
# Lists: default order, sortable fields, filters (docs/contract.md) ############
###############################################################################


def test_default_order_is_newest_first(api: Api, many: dict) -> None:
    biz_ids = [o["bizId"] for o in data(api.get("/api/v1/transfer/query/orders", query="size=3"))["content"]]
    assert biz_ids == ["biz-25", "biz-24", "biz-23"]


def test_tie_break_on_id_keeps_pages_stable(svc, api: Api, world: dict) -> None:
    for n in range(12):  # same createdAt, same amount: only the id tells them apart
        svc.create_transfer(world["ws"]["id"], source_wallet_id=world["a"], target_wallet_id=world["b"],
                            amount="1.00", currency="USD", biz_id=f"tie-{n}")
    seen = []
    for number in range(4):
        page = data(api.get("/api/v1/transfer/query/orders", query=f"sort=amount,desc&size=3&page={number}"))
        seen += [o["transferId"] for o in page["content"]]
    assert len(seen) == len(set(seen)) == 12
    assert seen == sorted(seen, reverse=True)


@pytest.mark.parametrize("sort, expected", [
    ("balance,desc", ["a", "yen", "b"]),
    ("name,asc", ["a", "b", "yen"]),
    ("currency,desc", ["b", "a", "yen"]),
])
def test_wallet_sorts(svc, api: Api, world: dict, sort: str, expected: list) -> None:
    query = f"sort={sort}&sort=name,desc" if sort.startswith("currency") else f"sort={sort}"
    names = [w["name"] for w in data(api.get("/api/v1/wallets", query=query))["content"]]
    assert names == expected


@pytest.mark.parametrize("query, names", [
    ("currency=USD", ["a", "b"]),
    ("currency=JPY", ["yen"]),
    ("status=FROZEN", ["b"]),
    ("status=ACTIVE&currency=USD", ["a"]),
    ("unknownFilter=1", ["a", "b", "yen"]),  # unknown parameters are ignored
])
def test_wallet_filters(svc, api: Api, world: dict, query: str, names: list) -> None:
    svc.set_wallet_status(world["b"], "FROZEN")
    page = data(api.get("/api/v1/wallets", query=query + "&sort=name,asc"))
    assert [w["name"] for w in page["content"]] == names
    assert page["page"]["totalElements"] == len(names)


@pytest.mark.parametrize("path, query", [
    ("/api/v1/wallets", "currency=usd"),
    ("/api/v1/wallets", "status=OPEN"),
    ("/api/v1/transfer/query/orders", "status=DONE"),
    ("/api/v1/transfer/query/orders", "createdFrom=yesterday"),
    ("/api/v1/transfer/query/orders", "createdTo=2027-13-01"),
    # docs/reference.md: a time filter is epoch ms or RFC 3339 (a date, or a date-time with Z or an offset)
    ("/api/v1/transfer/query/orders", "createdFrom=2027-01-15T08:00:05"),  # no offset
    ("/api/v1/transfer/query/orders", "createdFrom=2027-01-15 08:00:05Z"),
    ("/api/v1/transfer/query/orders", "createdFrom=2027-01-15T08:00:05%2B0100"),
    ("/api/v1/transfer/query/orders", "createdFrom=2027-01-15T25:00:00Z"),
    ("/api/v1/transfer/query/orders", "createdFrom="),
    ("/api/v1/transfer/query/orders", "createdFrom=1234567890123456"),
    ("/api/v1/transfer/query/orders", "bizIdPrefix=has space"),
    ("/api/v1/wallets/{a}/flows", "type=REFUND"),
    ("/api/v1/wallets/{a}/flows", "direction=UP"),
    ("/api/v1/wallets/{a}/flows", "createdFrom=1.5"),
])
def test_malformed_filter_is_s012(api: Api, world: dict, path: str, query: str) -> None:
    body = error(api.get(path.format(a=world["a"]), query=query), "S012", 400)
    assert query.split("=")[0] in body["detail"]


@pytest.mark.parametrize("query, expected", [
    ("status=COMPLETED", 25),
    ("status=PENDING", 0),
    ("bizIdPrefix=biz-1", 10),
    ("bizIdPrefix=biz-2", 6),
    ("bizIdPrefix=nope", 0),
    (f"createdFrom={(NOW + 5) * 1000}", 21),  # inclusive from (epoch ms)
    ("createdTo=2027-01-15T08:00:05.000Z", 4),  # exclusive to (ISO-8601)
    ("createdFrom=2027-01-15T08:00:05Z&createdTo=2027-01-15T08:00:07Z", 2),
    ("createdFrom=2027-01-15T09:00:05%2B01:00&status=COMPLETED", 21),  # an offset
    ("createdFrom=2027-01-15t08:00:05.000z&status=COMPLETED", 21),  # RFC 3339 allows t and z
    ("createdTo=2027-01-15", 0), ("createdFrom=2027-01-15&createdTo=2027-01-16", 25),  # a date: midnight UTC
])
def test_transfer_filters(api: Api, many: dict, query: str, expected: int) -> None:
    page = data(api.get("/api/v1/transfer/query/orders", query=query + "&size=100"))
    assert page["page"]["totalElements"] == len(page["content"]) == expected


@pytest.mark.parametrize("query, expected", [
    ("", 26), ("type=DEPOSIT", 1), ("type=TRANSFER_OUT", 25), ("direction=CREDIT", 1),
    ("direction=DEBIT", 25), ("type=DEPOSIT&direction=DEBIT", 0),
    (f"createdFrom={(NOW + 20) * 1000}", 6), (f"createdTo={(NOW + 1) * 1000}", 1),
])
def test_flow_filters(api: Api, many: dict, query: str, expected: int) -> None:
    page = data(api.get(f"/api/v1/wallets/{many['a']}/flows", query=query + "&size=100"))
    assert page["page"]["totalElements"] == len(page["content"]) == expected


@pytest.mark.parametrize("sort, first_type", [("type,asc", "DEPOSIT"), ("type,desc", "TRANSFER_OUT"),
                                              ("amount,desc", "DEPOSIT"), ("createdAt,asc", "DEPOSIT")])
def test_flow_sorts(api: Api, many: dict, sort: str, first_type: str) -> None:
    page = data(api.get(f"/api/v1/wallets/{many['a']}/flows", query=f"sort={sort}&size=1"))
    assert page["content"][0]["type"] == first_type


@pytest.mark.parametrize("moment, epoch_ms", [
    ("2016-12-31T23:59:60Z", 1483228800000),  # a leap second ends a UTC day
    ("2017-01-01T08:59:60+09:00", 1483228800000),
    ("2027-01-15T08:00:00.123456789Z", 1800000000123),
])
def test_a_time_filter_takes_what_rfc_3339_allows(api: Api, world: dict, moment: str, epoch_ms: int) -> None:
    """docs/reference.md: a time filter is RFC 3339 or epoch ms; each of these is the instant given."""
    at = urllib.parse.quote(moment)
    assert data(api.get("/api/v1/transfer/query/orders", query=f"createdFrom={at}&createdTo={epoch_ms}")) \
        == data(api.get("/api/v1/transfer/query/orders",
                        query=f"createdFrom={epoch_ms}&createdTo={epoch_ms}"))
    assert data(api.get("/api/v1/transfer/query/orders",
                        query=f"createdFrom={at}&createdTo={epoch_ms + 1}")) \
        == data(api.get("/api/v1/transfer/query/orders",
                        query=f"createdFrom={epoch_ms}&createdTo={epoch_ms + 1}"))


@pytest.mark.parametrize("moment", ["0000-01-01", "0000-02-29T23:59:59.999+23:59"])
def test_a_time_filter_takes_the_year_0000(api: Api, world: dict, moment: str) -> None:
    """RFC 3339 has a year 0000 (proleptic Gregorian, a leap year): long before every order."""
    at = urllib.parse.quote(moment)
    assert data(api.get("/api/v1/transfer/query/orders",
                        query=f"createdFrom={at}"))["page"]["totalElements"] == \
        data(api.get("/api/v1/transfer/query/orders", query="createdFrom=0"))["page"]["totalElements"]
    assert data(api.get("/api/v1/transfer/query/orders",
                        query=f"createdTo={at}"))["page"]["totalElements"] == 0


@pytest.mark.parametrize("moment",
                         ["2027-01-15T08:00:60Z", "2016-12-31T23:59:60+01:00", "2027-01-15T08:00:00+24:00"])
def test_a_time_filter_refuses_what_rfc_3339_does_not(api: Api, moment: str) -> None:
    body = error(api.get("/api/v1/transfer/query/orders", query=f"createdFrom={urllib.parse.quote(moment)}"),
                 "S012", 400)
    assert "'createdFrom'" in body["detail"]


###############################################################################
# Lists: built for a big workspace (docs/contract.md) ##########################
###############################################################################


def test_every_lookup_and_list_is_served_by_an_index(svc, api: Api, many: dict) -> None:
    """Run every endpoint with tracing and EXPLAIN each SELECT: no full table scan."""
    statements: list[str] = []
    with svc.db.connection() as conn:
        conn.set_trace_callback(statements.append)
    try:
        a = many["a"]
        for path, query in [
            ("/api/v1/wallets", ""), ("/api/v1/wallets", "currency=USD&status=ACTIVE&sort=balance,desc"),
            (f"/api/v1/wallets/{a}", ""), (f"/api/v1/wallets/{a}/balance", ""),
            (f"/api/v1/wallets/{a}/flows", ""), (f"/api/v1/wallets/{a}/flows", "type=DEPOSIT"),
            (f"/api/v1/wallets/{a}/flows", "direction=DEBIT&createdFrom=0&sort=amount,asc"),
            ("/api/v1/transfer/query/orders", ""), ("/api/v1/transfer/query/orders", "status=COMPLETED"),
            ("/api/v1/transfer/query/orders", "bizIdPrefix=biz-1&createdFrom=0&createdTo=9999999999999"),
            ("/api/v1/transfer/query/orders", "sort=amount,desc"),
            (f"/api/v1/transfer/query/orders/wallet/{a}", ""),
            (f"/api/v1/transfer/query/orders/wallet/{a}", "status=COMPLETED&createdFrom=0"),
            ("/api/v1/transfer/query/orders/biz-01", ""),
            ("/api/v1/transfer/query/orders/biz-01/completed", ""),
        ]:
            data(api.get(path, query=query))
        data(api.transfer(transfer_body(many, bizId="indexed")))
    finally:
        with svc.db.connection() as conn:
            conn.set_trace_callback(None)
    selects = [s for s in statements if s.lstrip().upper().startswith("SELECT")]
    assert len(selects) > 20
    with svc.db.connection() as conn:
        for statement in selects:
            plan = [row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + statement)]
            scans = [step for step in plan if step.startswith("SCAN") and "INDEX" not in step
                     and "CONSTANT ROW" not in step and "SUBQUERY" not in step
                     and "(subquery" not in step
                     and step not in ("SCAN ledger_clock", "SCAN l", "SCAN s", "SCAN s LEFT-JOIN",
                                      "SCAN sandbox")  # one row each
                     and step != "SCAN nonce_spans"]  # at most walletsvc.MAX_SPANS rows
            assert not scans, (statement, plan)


def test_totals_come_from_counters_not_scans(svc, api: Api, many: dict) -> None:
    """totalElements of the unfiltered and status-filtered lists is one counter lookup."""
    statements: list[str] = []
    with svc.db.connection() as conn:
        conn.set_trace_callback(statements.append)
    try:
        for path, query in [("/api/v1/transfer/query/orders", ""),
                            ("/api/v1/transfer/query/orders", "status=COMPLETED"),
                            (f"/api/v1/transfer/query/orders/wallet/{many['a']}", "status=COMPLETED"),
                            (f"/api/v1/wallets/{many['a']}/flows", "type=TRANSFER_OUT")]:
            assert data(api.get(path, query=query))["page"]["totalElements"] == 25
    finally:
        with svc.db.connection() as conn:
            conn.set_trace_callback(None)
    assert not [s for s in statements
                if "count(*)" in s and "transfers" in s or "count(*)" in s and "flows" in s]


###############################################################################
# Sandbox: walletsvc serve (docs/sandbox.md) ###################################
###############################################################################


def _start_demo(db_path, *extra: str):
    """`walletsvc serve --demo` on a free port; returns (process, banner text)."""
    import subprocess
    import sys
    import time

    command = [sys.executable, "-m", "walletsvc", "serve", "--demo", "--port", "0", "--db", str(db_path),
               *extra]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    banner = ""
    deadline = time.monotonic() + 30
    while "print(walletsvc.Client()" not in banner and time.monotonic() < deadline:
        line = server.stdout.readline()
        if not line and server.poll() is not None:
            break
        banner += line
    return server, banner


def _block(banner: str, title: str) -> str:
    """The example under a heading of the demo banner, as printed: up to the next blank line."""
    return banner.split(title, 1)[1].split("\n", 1)[1].split("\n\n", 1)[0]


def _banner_shell(banner: str, title: str, tmp_path: pathlib.Path) -> subprocess.CompletedProcess:
    """A banner example run as pasted into a shell after the banner's export line, without an
    activated virtualenv (``walletsvc`` is ``sys.executable -m walletsvc``: printed_shell_env)."""
    script = f"{_block(banner, 'examples below read:')}\n{_block(banner, title)}"
    return subprocess.run(["bash", "-c", script], capture_output=True, check=False, text=True, timeout=30,
                          env=printed_shell_env(tmp_path))


def test_demo_prints_examples_that_work_as_printed(tmp_path) -> None:
    import re
    import signal

    server, banner = _start_demo(tmp_path / "demo.db")
    try:
        base_url = re.search(r"sandbox at (\S+)", banner).group(1)
        assert f"database : {tmp_path / 'demo.db'}" in banner  # absolute: a relative --db is another file
        exports = _block(banner, "examples below read:")
        assert re.fullmatch(r"export WALLETSVC_URL=\S+ WALLETSVC_KEY=ak_demo WALLETSVC_SECRET=sk_demo"
                            r" WALLETSVC_ADMIN_TOKEN=\S+", exports)
        assert re.search(r"^wallets  : alice wal_\S+, bob wal_\S+, yen wal_\S+$", banner, re.MULTILINE)
        token = re.search(r"WALLETSVC_ADMIN_TOKEN=(\S+)", banner).group(1)
        admin = {"Authorization": f"Bearer {token}"}
        moves = ({}, {"freeze": True, "at": "2030-01-01T00:00:00Z"}, {"freeze": False, "advance": -7200})
        for change in moves:
            if change:  # as printed, at a frozen clock, then a moved one (docs/signing.md)
                _clock(base_url, admin, **change)
            curl = _banner_shell(banner, "(openssl + curl), at the sandbox's clock", tmp_path)
            answer = json.loads(curl.stdout)
            assert answer["success"] is True and answer["data"]["page"]["totalElements"] == 3, change
        codes = [entry["code"] for entry in requests.get(base_url + "/_admin/journal", headers=admin,
                                                         timeout=10).json()["data"]["content"]]
        assert codes == ["2000"] * 3  # the time was read first: no refused request in the journal
        exported = dict(word.split("=", 1) for word in shlex.split(exports)[1:])
        python = subprocess.run([sys.executable, "-c", _block(banner, "From Python:")], capture_output=True,
                                check=False, text=True, timeout=30, env={**os.environ, **exported})
        assert "'totalElements': 3" in python.stdout, python.stderr
        request = _banner_shell(banner, "from another shell:", tmp_path)
        assert json.loads(request.stdout)["data"]["page"]["totalElements"] == 3, request.stderr
        import urllib.request
        request = urllib.request.Request(base_url + "/_admin/workspaces",
                                         headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=5) as reply:
            assert [w["name"] for w in json.load(reply)["data"]] == ["walletsvc demo"]
    finally:
        server.send_signal(signal.SIGTERM)
        output, _ = server.communicate(timeout=15)
    assert server.returncode == 0  # SIGTERM (like Ctrl-C) shuts down cleanly
    log_lines = [line for line in output.splitlines() if "walletsvc.access" in line]
    # docs/reference.md (walletsvc serve): the time, the logger, method, path, status, code, milliseconds
    assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} walletsvc\.access GET /api/v1/wallets 200 2000"
                     r" \d+\.\dms$", "\n".join(log_lines), re.MULTILINE), log_lines
    assert "Traceback" not in output and "Task queue depth" not in output
    again, second_banner = _start_demo(tmp_path / "demo.db")  # same database: same credentials
    again.send_signal(signal.SIGTERM)
    again.communicate(timeout=15)
    credentials = r"WALLETSVC_KEY=.*"  # (the port is a new one)
    assert re.search(credentials, banner).group(0) == re.search(credentials, second_banner).group(0)


def test_serve_takes_settings(tmp_path, capsys) -> None:
    path = str(tmp_path / "set.db")
    key = _keyed_database(path)
    server = ServerProcess(path, tmp_path / "server.log", "--set", "timestamp_tolerance=5", "--set",
                           "default_locale=zh-CN")
    server.start()
    try:
        assert _list_wallets(server, key).json()["success"] is True
        late = _list_wallets(server, key, skew=10).json()
        assert late["code"] == "GA2013" and "5" in late["detail"] and "服务器" in late["detail"]
    finally:
        server.stop()
    with pytest.raises(SystemExit):
        walletsvc.main(["serve", "--db", path, "--set", "no_such_setting=1"])
    assert "NAME one of timestamp_tolerance" in capsys.readouterr().err
    assert run_cli(capsys, "serve", "--db", path, "--set", "busy_timeout=soon")[0] == 2


@pytest.mark.parametrize("token", [None, "t0ken"])
def test_serve_without_demo_says_how_to_make_a_key(tmp_path, token) -> None:
    server = ServerProcess(str(tmp_path / "plain.db"), tmp_path / "plain.log",
                           *(["--admin-token", token] if token else []))
    server.start()
    try:
        time.sleep(0.2)
        printed = (tmp_path / "plain.log").read_text()
    finally:
        server.stop()
    assert "walletsvc key create WORKSPACE_ID" in printed and "--demo" in printed
    console = f"Sandbox console: {server.url}/_admin/console"  # only where there is one
    assert (console in printed) is (token is not None)


def test_restarting_without_demo_names_the_keys_it_holds(tmp_path) -> None:
    """Defect: restarting a demo database without --demo said "you need a key" though keys existed."""
    path = str(tmp_path / "again.db")
    for options in (["--demo"], []):
        server = ServerProcess(path, tmp_path / f"again{len(options)}.log", *options)
        server.start()
        server.stop()
    printed = (tmp_path / "again0.log").read_text()
    assert "It holds 1 API key(s) in 1 workspace(s)" in printed and "you need a key" not in printed


@pytest.mark.parametrize("options, says", [
    (["--threads", "0"], "at least 1"), (["--workers", "0"], "at least 1"),
    (["--port", "99999"], "not a TCP port"), (["--port", "-1"], "not a TCP port")])
def test_serve_refuses_what_it_cannot_serve_in_one_line(tmp_path, options: list, says: str) -> None:
    """Defects: `serve --threads 0` printed "serving" and never answered; `--port 99999` served on \
another port."""
    done = _cli("serve", "--db", str(tmp_path / "s.db"), *options)
    assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr
    assert "serving" not in done.stdout


def test_the_ready_file_says_everything_a_suite_needs(tmp_path) -> None:
    ready = tmp_path / "ready.json"
    process = subprocess.Popen([sys.executable, "-m", "walletsvc", "serve", "--demo", "--port", "0", "--db",
                                str(tmp_path / "r.db"), "--ready-file", str(ready)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        facts = json.loads(ready.read_text())
        assert facts["url"] == f"http://127.0.0.1:{facts['port']}"
        (key,) = facts["keys"]
        assert sorted(key["scopes"]) == ["transfer:create", "transfer:read", "wallet:read"]
        assert [(w["name"], w["currency"]) for w in facts["wallets"]] == [("alice", "USD"), ("bob", "USD"),
                                                                          ("yen", "JPY")]
        answer = requests.get(facts["url"] + "/api/v1/wallets", timeout=10, headers=_signed(
            "GET", "/api/v1/wallets", key["apiKey"], key["secret"])).json()
        assert {w["id"] for w in answer["data"]["content"]} == {w["id"] for w in facts["wallets"]}
        assert requests.get(facts["url"] + "/_admin/clock", timeout=10, headers={
            "Authorization": f"Bearer {facts['adminToken']}"}).status_code == 200
    finally:
        process.terminate()
        process.wait(timeout=30)


def _served_admin_token(db_path: pathlib.Path, log: pathlib.Path, *options: str) -> str:
    """The admin token ``serve`` prints (on a free port), after checking that /_admin/ takes it."""
    server = ServerProcess(str(db_path), log, *options)
    server.start()
    try:
        token = re.findall(r"WALLETSVC_ADMIN_TOKEN=(\S+)", log.read_text())[-1]
        answer = requests.get(server.url + "/_admin/workspaces", timeout=10,
                              headers={"Authorization": f"Bearer {token}"})
        assert answer.status_code == 200, answer.text
    finally:
        server.stop()
    return token


def test_the_admin_token_is_random_per_database_and_kept_in_it(tmp_path) -> None:
    """Defect: without --admin-token, serve derived the admin token from the first key's secret: every
    --demo had the same token, and a scenario's first key holder could compute it (docs/sandbox.md, The
    admin surface)."""
    first = _served_admin_token(tmp_path / "one.db", tmp_path / "one.log", "--demo")
    other = _served_admin_token(tmp_path / "two.db", tmp_path / "two.log", "--demo")
    assert first != other and len(first) >= 32  # the same demo key, yet another token
    derived = hmac.new(b"sk_demo", b"walletsvc demo admin token", hashlib.sha256).hexdigest()[:32]
    assert derived not in (first, other)
    # kept in the database: a restart, and every worker of --workers 2, take the same one
    again = _served_admin_token(tmp_path / "one.db", tmp_path / "again.log", "--demo", "--workers", "2")
    assert again == first
    with sqlite3.connect(tmp_path / "one.db") as conn:
        assert conn.execute("SELECT token FROM admin_token").fetchall() == [(first,)]
    given = _served_admin_token(tmp_path / "one.db", tmp_path / "given.log", "--demo", "--admin-token",
                                "mine")
    assert given == "mine"  # given: it wins, and is not kept
    with sqlite3.connect(tmp_path / "one.db") as conn:
        assert conn.execute("SELECT token FROM admin_token").fetchall() == [(first,)]


###############################################################################
# Sandbox: the command line (docs/sandbox.md) ##################################
###############################################################################


def test_every_cli_verb(tmp_path, capsys, make_service) -> None:
    db = ["--db", str(tmp_path / "cli.db")]

    def ok(*argv: str):
        code, out, err = run_cli(capsys, *argv, *db)
        assert code == 0, err
        return json.loads(out)

    ws = ok("workspace", "create", "Acme")
    assert [w["id"] for w in ok("workspace", "list")] == [ws["id"]]
    member = ok("member", "add", ws["id"], "alice")
    assert {m["name"] for m in ok("member", "list", ws["id"])} == {"owner", "alice"}
    key = ok("key", "create", ws["id"], "--scope", "wallet:read", "--ip", "10.0.0.0/8", "--member",
             member["id"])
    assert (key["scopes"], key["ipWhitelist"], key["memberId"]) == (
        ["wallet:read"], ["10.0.0.0/8"], member["id"])
    assert "secret" in key and "secret" not in ok("key", "list", ws["id"])[0]
    assert ok("key", "disable", key["apiKey"])["enabled"] is False
    assert ok("key", "enable", key["apiKey"])["enabled"] is True
    wallet = ok("wallet", "create", ws["id"], "USD", "--name", "main")
    other = ok("wallet", "create", ws["id"], "USD")
    assert ok("deposit", wallet["id"], "10.00")["balanceAfter"] == "10.00"
    assert ok("withdraw", wallet["id"], "2.50")["balanceAfter"] == "7.50"
    assert ok("wallet", "freeze", wallet["id"])["status"] == "FROZEN"
    assert ok("wallet", "unfreeze", wallet["id"])["status"] == "ACTIVE"
    assert ok("wallet", "get", wallet["id"])["balance"] == "7.50"
    assert ok("wallet", "list", ws["id"])["page"]["totalElements"] == 2
    manual = make_service(str(tmp_path / "cli.db"), settlement="manual")
    for biz_id in ("p-1", "p-2"):
        manual.create_transfer(ws["id"], source_wallet_id=wallet["id"], target_wallet_id=other["id"],
                               amount="1.00", currency="USD", biz_id=biz_id)
    manual.close()
    assert ok("transfer", "complete", "p-1")["status"] == "COMPLETED"
    assert ok("transfer", "fail", "p-2", "--workspace", ws["id"])["status"] == "FAILED"
    assert ok("wallet", "close", other["id"])["status"] == "CLOSED"
    assert ok("member", "remove", ws["id"], member["id"]) == {"removed": member["id"]}
    assert ok("workspace", "delete", ws["id"]) == {"deleted": ws["id"]}
    assert ok("reset", "--yes") == {"reset": str(tmp_path / "cli.db")}
    assert ok("workspace", "list") == []


def test_cli_table_output(tmp_path, capsys) -> None:
    db = ["--db", str(tmp_path / "cli.db")]
    run_cli(capsys, "workspace", "create", "Acme", *db)
    code, out, _ = run_cli(capsys, "workspace", "list", "--table", *db)
    header, row = out.splitlines()
    assert code == 0 and header.split() == ["id", "name", "ownerMemberId", "createdAt"]
    assert row.split()[1] == "Acme"


@pytest.mark.parametrize("argv, message", [
    (["workspace", "delete", "ws_missing"], "WORKSPACE_NOT_FOUND (GA2032)"),
    (["member", "add", "ws_missing", "x"], "WORKSPACE_NOT_FOUND (GA2032)"),
    (["member", "remove", "ws_missing", "mem_x"], "WORKSPACE_NOT_FOUND (GA2032)"),
    (["member", "list", "ws_missing"], "WORKSPACE_NOT_FOUND (GA2032)"),
    (["key", "create", "ws_missing"], "WORKSPACE_NOT_FOUND (GA2032)"),
    (["key", "list", "ws_missing"], "WORKSPACE_NOT_FOUND (GA2032)"),
    (["key", "disable", "ak_missing"], "NOT_FOUND (S404)"),
    (["key", "enable", "ak_missing"], "NOT_FOUND (S404)"),
    (["wallet", "create", "ws_missing", "USD"], "WORKSPACE_NOT_FOUND (GA2032)"),
    (["wallet", "list", "ws_missing"], "WORKSPACE_NOT_FOUND (GA2032)"),
    (["wallet", "get", "wal_missing"], "WALLET_NOT_FOUND (W1001)"),
    (["wallet", "freeze", "wal_missing"], "WALLET_NOT_FOUND (W1001)"),
    (["wallet", "unfreeze", "wal_missing"], "WALLET_NOT_FOUND (W1001)"),
    (["wallet", "close", "wal_missing"], "WALLET_NOT_FOUND (W1001)"),
    (["deposit", "wal_missing", "1.00"], "WALLET_NOT_FOUND (W1001)"),
    (["withdraw", "wal_missing", "1.00"], "WALLET_NOT_FOUND (W1001)"),
    (["transfer", "complete", "nope"], "TRANSFER_NOT_FOUND (T1001)"),
    (["transfer", "fail", "nope"], "TRANSFER_NOT_FOUND (T1001)"),
    (["workspace", "create", ""], "INVALID_PARAMETER (S012)"),
])
def test_cli_errors_exit_non_zero_with_name_and_detail(tmp_path, capsys, argv, message) -> None:
    walletsvc.WalletService(str(tmp_path / "cli.db")).close()  # (a command that only reads needs one)
    code, out, err = run_cli(capsys, *argv, "--db", str(tmp_path / "cli.db"))
    assert code == 1 and out == ""
    assert err.startswith(f"walletsvc: {message}: ") and "Traceback" not in err


def test_cli_reset_needs_confirmation(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        walletsvc.main(["reset", "--db", str(tmp_path / "cli.db")])
    assert exited.value.code == 2


def test_cli_unopenable_database_is_a_clear_error(tmp_path, capsys) -> None:
    code, _, err = run_cli(capsys, "workspace", "create", "x", "--db",
                           str(tmp_path / "missing" / "dir" / "x.db"))
    assert code == 2 and "unable to open database" in err


@pytest.mark.parametrize("argv", [["audit"], ["workspace", "list"], ["member", "list", "ws_x"],
                                  ["key", "list", "ws_x"], ["wallet", "list", "ws_x"],
                                  ["wallet", "get", "wal_x"]])
def test_a_command_that_only_reads_never_makes_a_database(tmp_path, argv: list) -> None:
    """Defect: `walletsvc --db typo.db audit` answered [], exit 0, and left a 160 KB database."""
    done = _cli("--db", str(tmp_path / "typo.db"), *argv)
    assert done.returncode == 2 and "no database at" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "typo.db").exists()


def test_global_options_go_before_or_after_the_subcommand(tmp_path, capsys) -> None:
    path = str(tmp_path / "cli.db")
    assert run_cli(capsys, "--db", path, "workspace", "create", "first")[0] == 0
    assert run_cli(capsys, "workspace", "create", "second", "--db", path)[0] == 0
    code, out, _ = run_cli(capsys, "--table", "workspace", "list", "--db", path)
    assert code == 0 and "first" in out and "second" in out and not out.lstrip().startswith("[")


def test_table_shows_lists_and_booleans_as_people_write_them(tmp_path, capsys) -> None:
    path = str(tmp_path / "cli.db")
    workspace = json.loads(run_cli(capsys, "workspace", "create", "w", "--db", path)[1])
    run_cli(capsys, "key", "create", workspace["id"], "--scope", "wallet:read", "--scope", "transfer:read",
            "--db", path)
    code, out, _ = run_cli(capsys, "key", "list", workspace["id"], "--db", path, "--table")
    assert (code == 0 and "wallet:read, transfer:read" in out and "true" in out and "['" not in out
            and "True" not in out)


def test_cli_request_and_sign_against_a_live_server(live, world, capsys, monkeypatch, clock) -> None:
    import subprocess
    import time as real_time

    clock.now = real_time.time()
    monkeypatch.setenv("WALLETSVC_KEY", world["key"]["apiKey"])
    monkeypatch.setenv("WALLETSVC_SECRET", world["key"]["secret"])
    code, out, _ = run_cli(capsys, "request", "GET", "/api/v1/wallets?size=1", "--url", live)
    assert code == 0 and json.loads(out)["data"]["page"] == {"size": 1, "number": 0, "totalElements": 3,
                                                               "totalPages": 3}
    body = json.dumps({"sourceWalletId": world["a"], "targetWalletId": world["b"], "amount": "1.00",
                       "currency": "USD"})
    code, out, _ = run_cli(capsys, "request", "POST", TRANSFER_PATH, "--data", body, "--url", live)
    assert code == 0 and json.loads(out)["data"]["status"] == "COMPLETED"
    code, out, _ = run_cli(capsys, "request", "GET", "/api/v1/wallets/wal_missing", "--url", live)
    assert code == 1 and json.loads(out)["code"] == "W1001"
    code, out, _ = run_cli(capsys, "sign", "GET", "/api/v1/wallets", "--format", "curl", "--url", live)
    curl = subprocess.run(["bash", "-c", out], capture_output=True, check=False, text=True, timeout=10)
    assert json.loads(curl.stdout)["success"] is True
    code, out, _ = run_cli(capsys, "sign", "GET", "/api/v1/wallets")
    assert [line.split(":")[0] for line in out.splitlines()] == ["X-Api-Key", "X-Timestamp", "X-Nonce",
                                                                 "X-Signature"]


def test_cli_request_prints_the_http_status(live, world, capsys, monkeypatch, clock) -> None:
    import time as real_time

    clock.now = real_time.time()
    monkeypatch.setenv("WALLETSVC_KEY", world["key"]["apiKey"])
    monkeypatch.setenv("WALLETSVC_SECRET", world["key"]["secret"])
    code, out, err = run_cli(capsys, "request", "GET", "/api/v1/wallets/wal_missing", "--url", live)
    assert (code, err.strip(), json.loads(out)["code"]) == (1, "HTTP 404 Not Found", "W1001")


def test_cli_request_with_an_empty_key_is_a_usage_error(capsys, monkeypatch) -> None:
    monkeypatch.setenv("WALLETSVC_KEY", "")
    with pytest.raises(SystemExit) as exited:
        walletsvc.main(["request", "GET", "/api/v1/wallets"])
    assert exited.value.code == 2


def test_request_and_client_need_nothing_against_the_demo(tmp_path, monkeypatch, make_service) -> None:
    """docs/sandbox.md, the first five minutes: after `walletsvc serve --demo` (on 8080), a signed request
    needs no flag, variable or placeholder; the demo's key is fixed (ak_demo / sk_demo)."""
    for name in ("WALLETSVC_URL", "WALLETSVC_KEY", "WALLETSVC_SECRET"):
        monkeypatch.delenv(name, raising=False)
    client = walletsvc.Client()
    assert (client.target, client.api_key, client.secret) == ("http://127.0.0.1:8080", "ak_demo", "sk_demo")
    svc = make_service(str(tmp_path / "demo.db"))
    walletsvc.start_world(svc, walletsvc.DEMO_SCENARIO)
    app = walletsvc.create_app(svc)
    assert len(walletsvc.Client(app).list_wallets()["content"]) == 3
    monkeypatch.setenv("WALLETSVC_KEY", "ak_other")
    assert walletsvc.Client(app).api_key == "ak_other"


def test_walletsvcs_clients_sign_at_a_frozen_or_moved_sandbox_clock(tmp_path, monkeypatch,
                                                                     make_service) -> None:
    """docs/sandbox.md: Client and `walletsvc request` sign at the sandbox's clock, without a failing request
    in the journal; a GA2013 for the timestamp says the server's time and, when the sandbox clock is frozen
    or moved, the machine's, which is accepted too."""
    clock = walletsvc.Clock(frozen_at=1893456000)  # 2030-01-01, as a scenario's clock
    svc = make_service(str(tmp_path / "frozen.db"), clock=clock, journal_size=1000)
    key = walletsvc.start_world(svc, walletsvc.DEMO_SCENARIO)[0]["keys"][0]
    app = walletsvc.create_app(svc)
    client = walletsvc.Client(app, key["apiKey"], key["secret"])
    assert len(client.list_wallets()["content"]) == 3
    clock.unfreeze()
    clock.advance(-7200)  # moved: two hours behind real time
    assert len(client.list_wallets()["content"]) == 3
    # It learned the time first (GET /healthz: not journaled), so no refused request is in the journal.
    assert [entry["code"] for entry in svc.journal.entries()] == ["2000", "2000"]
    stale = int(time.time()) - 3600  # an hour from both clocks
    refused = webtest.TestApp(app).get("/api/v1/wallets", headers=walletsvc.sign_request(
        "GET", "/api/v1/wallets", b"", key["apiKey"], key["secret"], timestamp=stale),
        expect_errors=True).json
    assert refused["code"] == "GA2013" and "sandbox clock is moved" in refused["detail"]
    assert "signed at the machine's time" in refused["detail"] and "accepted too" in refused["detail"]


def test_the_app_under_test_signs_with_the_machines_clock_through_freeze_advance_and_set(tmp_path) -> None:
    """Issue 45, item 1 (docs/sandbox.md): the sandbox clock moves business time, never the signature
    window. An app signing with its machine's clock, knowing nothing of the sandbox's, keeps working while a
    test freezes the clock in 2030, advances it a day and sets it back to 2020; a request captured before
    each move is still refused after it, however it was signed."""
    sandbox = walletsvc.Sandbox.create(str(tmp_path / "app.db"))
    app = webtest.TestApp(sandbox.app)
    key, secret = sandbox.key["apiKey"], sandbox.key["secret"]
    moves = [lambda: sandbox.clock.freeze(1893456000), lambda: sandbox.clock.advance(86400),
             lambda: sandbox.clock.set(1577836800), lambda: sandbox.clock.unfreeze()]
    captured = []
    for move in moves:
        headers = _signed("GET", "/api/v1/wallets", key, secret)  # the machine's clock (the test's signer)
        assert app.get("/api/v1/wallets", headers=headers).json["code"] == "2000"
        captured.append(headers)
        at_sandbox = _signed("GET", "/api/v1/wallets", key, secret, timestamp=int(sandbox.clock()))
        assert app.get("/api/v1/wallets", headers=at_sandbox).json["code"] == "2000"
        captured.append(at_sandbox)
        move()
        for n, old in enumerate(captured):  # replays, whichever clock they were signed at
            refused = app.get("/api/v1/wallets", headers=old, expect_errors=True)
            detail = error(refused, "GA2013", 401)["detail"]
            if n % 2 == 0:  # (at the machine's clock: inside the window still, so refused as a replay)
                assert "already used" in detail, detail
    sandbox.service.close()


def test_long_work_says_what_it_does_on_a_terminal_and_nothing_elsewhere(tmp_path, monkeypatch) -> None:
    """Issue 45, item 5 (docs/reference.md): `walletsvc audit` on 200,000 transfers ran 11-14 s with nothing
    printed. On a terminal, a line names the work and its seconds once it has run a while (here at once),
    and is cleared at the end; a stderr that is no terminal gets nothing. The audit tells each check."""
    path = str(tmp_path / "progress.db")
    svc = walletsvc.WalletService(path)
    make_world(svc)
    steps: list[str] = []
    assert svc.audit(progress=steps.append) == []
    svc.close()
    assert steps[0] == "the file's integrity" and len(steps) > 5
    assert all(re.fullmatch(r"\w+ \((\d+) of (\d+)\)", step) for step in steps[1:])
    assert steps[-1].endswith(f"({len(steps) - 1} of {len(steps) - 1})")

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(walletsvc, "PROGRESS_AFTER", 0)  # (1.5 s of work, not waited for here)
    for stderr, said in [(Terminal(), True), (io.StringIO(), False)]:
        monkeypatch.setattr(sys, "stderr", stderr)
        assert walletsvc.main(["audit", "--db", path]) == 0
        printed = stderr.getvalue()
        if said:
            assert printed.startswith(f"\r\x1b[Kwalletsvc: auditing {path}") and printed.endswith("\r\x1b[K")
            assert re.search(r"\(\d+ s\)", printed)
        else:
            assert printed == ""


def test_create_transfers_moves_many_in_one_write_all_or_nothing(svc, world: dict) -> None:
    """Issue 45, item 5 (docs/embedding.md): seeding 200,000 transfers one create_transfer at a time took
    416 s. create_transfers checks every item, then moves them in one write: all or nothing, the failing
    item named in the error's notes, a missing or unknown argument a TypeError naming it too."""
    ws, a, b = world["ws"]["id"], world["a"], world["b"]
    before = [svc.get_wallet(wallet)["balance"] for wallet in (a, b)]
    orders = svc.create_transfers(ws, [{"source_wallet_id": a, "target_wallet_id": b, "amount": "1.00",
                                        "currency": "USD", "biz_id": f"seed-{n}"} for n in range(50)])
    assert [order["bizId"] for order in orders] == [f"seed-{n}" for n in range(50)]
    assert {order["status"] for order in orders} == {"COMPLETED"}
    moved = [svc.get_wallet(wallet)["balance"] for wallet in (a, b)]
    assert decimal.Decimal(before[0]) - decimal.Decimal(moved[0]) == 50
    good = {"source_wallet_id": a, "target_wallet_id": b, "amount": "1.00", "currency": "USD"}
    for bad, code, note in [({**good, "amount": "1.001"}, "S012", "in transfers[1]"),
                            ({**good, "amount": "99999999.00"}, "T2001", "in transfers[1]")]:
        with pytest.raises(walletsvc.WalletError) as refused:
            svc.create_transfers(ws, [good, bad, good])
        assert refused.value.code == code and refused.value.__notes__ == [note]
    with pytest.raises(TypeError, match="colour") as refused:
        svc.create_transfers(ws, [good, {**good, "colour": "red"}])
    assert refused.value.__notes__ == ["in transfers[1]"]
    assert [svc.get_wallet(wallet)["balance"] for wallet in (a, b)] == moved  # nothing of a refused one
    svc.assert_audit_clean()


def test_a_scenarios_settings_are_the_sandboxs_in_every_process_and_every_later_start(tmp_path) -> None:
    """Issue 43, item 1 (docs/sandbox.md, Scenarios): a scenario's `settlement = "manual"` held only in the
    process that loaded it (a second serve on the file, and a restart without --scenario, settled at
    once). Now it is the sandbox's: a second server and a later start serve it, and a --set that
    disagrees is said in one line while the sandbox's stands (so does another scenario's, given to a
    later start: the file resets to the one it started from)."""
    scenario = tmp_path / "manual.json"
    scenario.write_text(json.dumps({"settings": {"settlement": "manual"}, "workspaces": [{
        "name": "shop", "keys": [{"id": "ak_shop", "secret": "sk_shop"}],
        "wallets": [{"id": "wal_a", "name": "a", "currency": "USD", "balance": "10.00"},
                    {"id": "wal_b", "name": "b", "currency": "USD"}]}]}))
    path = str(tmp_path / "manual.db")

    def status_through(server: ServerProcess, n: int) -> str:
        body = json.dumps({"sourceWalletId": "wal_a", "targetWalletId": "wal_b", "amount": "1.00",
                           "currency": "USD", "bizId": f"o-{n}"}).encode()
        return requests.post(server.url + TRANSFER_PATH, data=body, timeout=10, headers=_signed(
            "POST", TRANSFER_PATH, "ak_shop", "sk_shop", body)).json()["data"]["status"]

    first = ServerProcess(path, tmp_path / "first.log", "--scenario", str(scenario))
    second = ServerProcess(path, tmp_path / "second.log")
    first.start()
    second.start()
    try:
        assert [status_through(first, 1), status_through(second, 2)] == ["PENDING", "PENDING"]
    finally:
        second.stop()
        first.stop()
    later = ServerProcess(path, tmp_path / "later.log", "--set", "settlement=immediate")
    later.start()
    try:
        assert status_through(later, 3) == "PENDING"
    finally:
        later.stop()
    said = [line for line in (tmp_path / "later.log").read_text().splitlines() if "settlement" in line]
    assert said == [(f"walletsvc: --set settlement=immediate is not this sandbox's: its scenario says"
                     f" settlement='manual', which every process on {path} serves")]
    other = tmp_path / "immediate.json"  # another scenario on a file that started: the file's stands
    other.write_text(scenario.read_text().replace('"manual"', '"immediate"'))
    again = ServerProcess(path, tmp_path / "again.log", "--scenario", str(other))
    again.start()
    try:
        assert status_through(again, 4) == "PENDING"
    finally:
        again.stop()


def test_the_banner_names_the_first_wallets_and_how_many_more_the_ready_file_all(tmp_path) -> None:
    """Issue 45, item 5: a scenario of 20,000 wallets printed a 440 KB `wallets :` line. The banner names the
    first five and says how many more; the ready file keeps them all."""
    scenario = tmp_path / "many.json"
    scenario.write_text(json.dumps({"workspaces": [{"name": "big", "keys": [{}], "wallets": [
        {"name": f"w{n}", "currency": "USD"} for n in range(12)]}]}))
    server = ServerProcess(str(tmp_path / "many.db"), tmp_path / "many.log", "--scenario", str(scenario),
                           "--ready-file", str(tmp_path / "ready.json"))
    server.start()
    try:
        line = next(line for line in _printed_banner(tmp_path / "many.log").splitlines()
                    if line.startswith("wallets  :"))
        assert line.count("wal_") == 5
        assert line.endswith(" and 7 more (walletsvc wallet list, or --ready-file)")
        assert len(json.loads((tmp_path / "ready.json").read_text())["wallets"]) == 12
    finally:
        server.stop()


def test_request_command_signs_at_a_scenarios_frozen_clock(tmp_path) -> None:
    """The README's shop: a scenario with its clock frozen in 2030, `walletsvc request` with the banner's
    exports answers 200 (it answered GA2013 "-97957570 s from it")."""
    scenario = tmp_path / "frozen.json"
    scenario.write_text(json.dumps({"clock": {"at": "2030-01-01T00:00:00Z", "frozen": True},
                                    "workspaces": [{"name": "shop", "keys": [{"scopes": ["wallet:read"]}],
                                                    "wallets": [{"name": "till", "currency": "EUR"}]}]}))
    server = ServerProcess(str(tmp_path / "shop.db"), tmp_path / "shop.log", "--scenario", str(scenario))
    server.start()
    try:
        printed = (tmp_path / "shop.log").read_text()
        exported = dict(word.split("=", 1) for word in shlex.split(re.search(r"^export .*$", printed,
                                                                               re.MULTILINE).group(0))[1:])
        env = {**os.environ, **exported}
        done = subprocess.run([sys.executable, "-m", "walletsvc", "request", "GET", "/api/v1/wallets"],
                              capture_output=True, text=True, env=env, timeout=60, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        (till,) = json.loads(done.stdout)["data"]["content"]
        assert till["name"] == "till"
        # A scenario's rows are made at its clock (docs/sandbox.md, Scenarios), the same on every run.
        assert (till["createdAt"], till["updatedAt"]) == ("2030-01-01T00:00:00.000Z",) * 2
        admin = {"Authorization": f"Bearer {exported['WALLETSVC_ADMIN_TOKEN']}"}
        passed = requests.post(server.url + "/_admin/journal/assert", headers=admin, timeout=10, json={
            "method": "GET", "path": "/api/v1/wallets", "times": 1}).json()["data"]
        assert passed["passed"] is True, passed  # one call, one entry: no refused first try
        curl = subprocess.run(["bash", "-c", _block(printed, "(openssl + curl), at the sandbox's clock")],
                              capture_output=True, text=True, env=printed_shell_env(tmp_path, **exported),
                              timeout=60, check=False)
        assert json.loads(curl.stdout)["success"] is True, curl.stdout + curl.stderr  # the banner's curl too
    finally:
        server.stop()


def test_request_takes_paths_queries_and_urls_as_people_type_them(demo_server) -> None:
    """Defects: a path without / and a query with a space printed tracebacks; a URL without http:// failed."""
    server, env = demo_server
    env = dict(env)
    host = server.url.removeprefix("http://")
    missing = _cli("request", "GET", "api/v1/wallets", "--url", host, env=env)
    assert (missing.returncode == 2 and "must start with /" in missing.stderr
            and "Traceback" not in missing.stderr)
    spaced = _cli("request", "GET", "/api/v1/wallets?sort=name,asc&currency=USD&x=a b", "--url", host,
                  env=env)
    assert spaced.returncode == 0, spaced.stderr
    assert [w["name"] for w in json.loads(spaced.stdout)["data"]["content"]] == ["alice", "bob"]


@pytest.mark.parametrize("url", ["http://h:abc", "127.0.0.1:1/pay?x=1", "ftp://h/", "http://h/#frag"])
def test_request_refuses_a_url_it_cannot_use_in_one_line(url: str) -> None:
    done = _cli("request", "GET", "/api/v1/wallets", "--url", url, "--key", "k", "--secret", "s")
    assert done.returncode == 2 and "--url" in done.stderr and "Traceback" not in done.stderr


def test_sign_format_curl_prints_a_command_that_works_for_every_method(demo_server, tmp_path) -> None:
    """Defect: for a POST it printed headers only, and the README's pattern then sent a GET (GA2012)."""
    _server, env = demo_server  # walletsvc is `sys.executable -m walletsvc`, not whatever PATH holds
    env = printed_shell_env(tmp_path, **{name: env[name] for name in ("WALLETSVC_URL", "WALLETSVC_KEY",
                                                                       "WALLETSVC_SECRET")})
    listed = json.loads(subprocess.run(
        ["bash", "-c", 'eval "$(walletsvc sign GET /api/v1/wallets --format curl)"'],
        capture_output=True, text=True, env=env, timeout=60, check=True).stdout)
    alice, bob = sorted(listed["data"]["content"], key=lambda wallet: wallet["name"])[:2]
    body = json.dumps({"sourceWalletId": alice["id"], "targetWalletId": bob["id"], "amount": "1.00",
                       "currency": "USD", "description": "it's paid"})  # a quote and spaces survive the shell
    command = (f"eval \"$(walletsvc sign POST /api/v1/transfer/command/create --data {shlex.quote(body)} "
               "--format curl)\"")
    posted = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env, timeout=60,
                            check=True)
    assert json.loads(posted.stdout)["data"]["description"] == "it's paid"


def test_sign_curl_sends_a_body_that_starts_with_at_as_written(demo_server, tmp_path) -> None:
    """Review: with --data-binary, a body starting with @ made curl send a file instead."""
    _server, env = demo_server
    env = printed_shell_env(tmp_path, **{name: env[name] for name in ("WALLETSVC_URL", "WALLETSVC_KEY",
                                                                       "WALLETSVC_SECRET")})
    command = ('eval "$(walletsvc sign POST /api/v1/transfer/command/create --data @/etc/hostname '
               '--format curl)"')
    answer = json.loads(subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env,
                                       timeout=60, check=True).stdout)
    assert answer["code"] == "S012" and "body" in answer["detail"]  # the 14 bytes signed arrived, not a file


def test_every_environment_variable_the_cli_reads_is_documented() -> None:
    source = (pathlib.Path(__file__).parent / "walletsvc.py").read_text(encoding="utf-8")
    read = set(re.findall(r"os\.environ\.get\(\"(WALLETSVC_[A-Z_]+)\"", source))
    assert read >= {"WALLETSVC_DB", "WALLETSVC_ADMIN_TOKEN", "WALLETSVC_URL", "WALLETSVC_KEY",
                    "WALLETSVC_SECRET"}
    section = doc_section("Command line")
    assert {name for name in read if f"`{name}`" not in section} == set()


def test_version_is_printed() -> None:
    import importlib.metadata

    done = _cli("--version")
    assert (done.returncode, done.stdout.strip()) == (
        0, f"walletsvc {importlib.metadata.version('walletsvc')}")


###############################################################################
# Sandbox: a suite in any language, over HTTP (docs/sandbox.md) ################
###############################################################################


def _plain_signed(method: str, url: str, path: str, key: str, secret: str, body: bytes = b"",
                  timestamp: int | None = None) -> requests.Response:
    """A signed request written the way a suite in another language would: no walletsvc import."""
    headers = _signed(method, path, key, secret, body, timestamp)
    return requests.request(method, url + path, data=body or None, headers=headers, timeout=10)


def test_a_suite_in_any_language_drives_the_served_demo_over_http(tmp_path) -> None:
    """Clock, faults, journal and reset over plain HTTP against `walletsvc serve --demo`, one key \
throughout."""
    server = ServerProcess(str(tmp_path / "demo.db"), tmp_path / "demo.log", "--demo")
    server.start()
    try:
        key, secret, admin, _wallets = _demo_of(tmp_path / "demo.log")
        url = server.url
        frozen = requests.post(url + "/_admin/clock", json={"freeze": True, "at": "2030-01-01T00:00:00Z"},
                               headers=admin, timeout=10).json()["data"]
        assert (frozen["epochMillis"], frozen["frozen"]) == (1893456000000, True)
        # signed at the machine's clock, as an app in production signs: accepted whatever the sandbox clock
        assert _plain_signed("GET", url, "/api/v1/wallets", key, secret).json()["code"] == "2000"
        wallets = _plain_signed("GET", url, "/api/v1/wallets", key, secret, timestamp=1893456000).json()
        alice, bob = sorted(wallets["data"]["content"], key=lambda w: w["name"])[:2]
        requests.post(url + "/_admin/faults", json={"code": "S503", "method": "POST", "times": 1},
                      headers=admin, timeout=10)
        body = json.dumps({"sourceWalletId": alice["id"], "targetWalletId": bob["id"], "amount": "1.00",
                           "currency": "USD"}).encode()
        assert _plain_signed("POST", url, TRANSFER_PATH, key, secret, body, 1893456000).status_code == 503
        order = _plain_signed("POST", url, TRANSFER_PATH, key, secret, body, 1893456000).json()["data"]
        assert order["createdAt"] == "2030-01-01T00:00:00.000Z"
        requests.post(url + "/_admin/clock", json={"advance": 3600}, headers=admin, timeout=10)
        assert _plain_signed("GET", url, "/api/v1/wallets", key, secret,
                             timestamp=1893459600).status_code == 200
        journal = requests.get(url + "/_admin/journal", params={"method": "POST"}, headers=admin,
                               timeout=10).json()["data"]["content"]
        assert [entry["status"] for entry in journal] == [503, 200]
        assert requests.post(url + "/_admin/reset", headers=admin, timeout=10).json()["success"] is True
        requests.post(url + "/_admin/clock", json={"freeze": False}, headers=admin, timeout=10)
        again = _plain_signed("GET", url, "/api/v1/wallets", key, secret).json()  # the same key after reset
        assert again["data"]["page"]["totalElements"] == 3
        assert sorted(w["balance"] for w in again["data"]["content"]) == ["1000.00", "1000.00", "100000"]
        journal = requests.get(url + "/_admin/journal", headers=admin, timeout=10).json()["data"]
        assert [entry["status"] for entry in journal["content"]] == [200]  # reset emptied it
    finally:
        server.stop()


def test_the_sandbox_curl_walk_through_runs_as_printed(demo_server, tmp_path) -> None:
    import shutil

    if not all(shutil.which(tool) for tool in ("bash", "curl", "openssl", "sha256sum")):
        pytest.skip("the walk-through needs bash, curl, openssl and sha256sum")
    _server, env = demo_server  # the four variables the banner exports, in the printed blocks' environment
    env = printed_shell_env(tmp_path, **{name: value for name, value in env.items()
                                         if name.startswith("WALLETSVC_")})
    (script,) = doc_blocks("Driving the sandbox from any language", "sh")
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert '"status":"COMPLETED"' in done.stdout
    assert "transfer journaled" in done.stdout and "reset: same key, fresh demo" in done.stdout


###############################################################################
# Sandbox: one sandbox, however many processes (docs/sandbox.md) ###############
###############################################################################


def test_both_servers_print_the_same_demo(tmp_path, two_servers) -> None:
    _servers, demo = two_servers
    assert _demo_of(tmp_path / "server1.log") == demo


@pytest.mark.parametrize("layout", ["two serve", "--workers 2"])
def test_every_process_on_one_file_is_one_sandbox(tmp_path, layout: str) -> None:
    """The clock, a times=1 fault rule, the journal and reset behave as one sandbox (docs/sandbox.md)."""
    path = str(tmp_path / "one.db")
    if layout == "two serve":
        servers = [ServerProcess(path, tmp_path / f"s{n}.log", "--demo") for n in range(2)]
    else:
        servers = [ServerProcess(path, tmp_path / "s0.log", "--demo", "--workers", "2")]
    try:
        for server in servers:
            server.start()
        key, secret, admin, _wallets = _demo_of(tmp_path / "s0.log")
        urls = [server.url for server in servers] * (2 if len(servers) == 1 else 1)
        _clock(urls[0], admin, freeze=True, at="2030-01-01T00:00:00Z")
        assert {_clock(url, admin)["epochMillis"] for url in urls * 3} == {1893456000000}
        at = 1893456000
        rule = requests.post(urls[0] + "/_admin/faults", json={"code": "S503", "times": 1}, headers=admin,
                             timeout=10).json()["data"]
        codes = [requests.get(url + "/api/v1/wallets",
                              headers=_signed("GET", "/api/v1/wallets", key, secret, timestamp=at),
                              timeout=10).json()["code"]
                 for url in urls * 3]
        assert sorted(codes) == ["2000"] * 5 + ["S503"]  # the rule fired once across every process
        for url in urls:
            assert requests.get(url + "/_admin/faults", headers=admin, timeout=10).json()["data"] == [
                {**rule, "fired": 1}]
            journal = requests.get(url + "/_admin/journal", headers=admin, timeout=10).json()["data"]
            # every process's requests, in order
            assert [entry["code"] for entry in journal["content"]] == codes
        assert requests.post(urls[1] + "/_admin/reset", headers=admin, timeout=10).json()["success"] is True
        for url in urls:
            assert requests.get(url + "/_admin/faults", headers=admin, timeout=10).json()["data"] == []
            assert requests.get(url + "/_admin/journal", headers=admin, timeout=10).json()["data"][
                "page"]["totalElements"] == 0
            assert _clock(url, admin)["frozen"] is False  # as the sandbox started
    finally:
        for server in servers:
            server.stop()


def test_readme_gunicorn_recipe_with_two_workers_is_one_sandbox(tmp_path) -> None:
    import socket
    import textwrap

    (block,) = doc_blocks("One sandbox, however many processes", "python")
    (tmp_path / "sandbox_wsgi.py").write_text(textwrap.dedent(block))
    svc = walletsvc.WalletService(str(tmp_path / "sandbox.db"))
    workspace = svc.create_workspace("gunicorn")["id"]
    key = svc.create_api_key(workspace)
    svc.close()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "gunicorn", "-w", "2", "-b", f"127.0.0.1:{port}",
                                "--chdir", str(tmp_path), "sandbox_wsgi:app"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    url, admin = f"http://127.0.0.1:{port}", {"Authorization": "Bearer change-me"}
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with contextlib.suppress(requests.ConnectionError):
                requests.get(url + "/healthz", timeout=1)
                break
            time.sleep(0.1)
        _clock(url, admin, freeze=True, at=NOW)
        requests.post(url + "/_admin/faults", json={"code": "S503", "times": 1}, headers=admin, timeout=10)
        codes = [requests.get(url + "/api/v1/wallets", timeout=10, headers=_signed(
            "GET", "/api/v1/wallets", key["apiKey"], key["secret"], timestamp=NOW)).json()["code"]
                 for _ in range(8)]
        # the clock and the rule of one sandbox, whichever worker
        assert sorted(codes) == ["2000"] * 7 + ["S503"]
        assert requests.get(url + "/_admin/journal", headers=admin, timeout=10).json()["data"]["page"][
            "totalElements"] == 8
    finally:
        process.terminate()
        process.wait(timeout=10)


###############################################################################
# Sandbox: reset (docs/sandbox.md) #############################################
###############################################################################


def _workspace_of(url: str, admin: dict) -> str:
    return requests.get(url + "/_admin/workspaces", headers=admin, timeout=10).json()["data"][0]["id"]


def test_reset_returns_the_demo_exactly_as_first_printed(two_servers) -> None:
    (a, b), (key, secret, admin, wallets) = two_servers
    before = _balances_over_http(a.url, key, secret)
    body = json.dumps({"sourceWalletId": wallets[0], "targetWalletId": wallets[1], "amount": "10.00",
                       "currency": "USD"}).encode()
    requests.post(a.url + TRANSFER_PATH, data=body, headers=_signed("POST", TRANSFER_PATH, key, secret, body),
                  timeout=10)
    requests.post(a.url + f"/_admin/workspaces/{_workspace_of(a.url, admin)}/wallets",
                  json={"currency": "EUR"}, headers=admin, timeout=10)
    assert requests.post(b.url + "/_admin/reset", headers=admin, timeout=10).json()["success"] is True
    listed = requests.get(a.url + "/api/v1/wallets", headers=_signed("GET", "/api/v1/wallets", key, secret),
                          params={"sort": "createdAt,asc"}, timeout=10).json()["data"]["content"]
    assert [wallet["id"] for wallet in listed] == wallets  # the ids first printed
    assert _balances_over_http(b.url, key, secret) == before


def test_reset_on_a_busy_database_leaves_the_sandbox_as_it_was(tmp_path) -> None:
    """Defect: reset was two transactions; on a busy database it answered S503 and left no workspace, \
no key."""
    path = str(tmp_path / "busy.db")
    server = ServerProcess(path, tmp_path / "busy.log", "--demo", "--set", "busy_timeout=0.3")
    server.start()
    try:
        key, secret, admin, _ = _demo_of(tmp_path / "busy.log")
        holder = sqlite3.connect(path, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")  # another writer holds the lock past the busy timeout
        answer = requests.post(server.url + "/_admin/reset", headers=admin, timeout=10)
        assert (answer.status_code, answer.json()["code"]) == (503, "S503")
        holder.execute("ROLLBACK")
        holder.close()
        assert len(_balances_over_http(server.url, key, secret)) == 3  # the same key, the same wallets
        assert requests.post(server.url + "/_admin/reset", headers=admin, timeout=10).status_code == 200
    finally:
        server.stop()


def _post_quietly(url: str, headers: dict) -> None:
    with contextlib.suppress(requests.RequestException):  # the server is killed under it
        requests.post(url, headers=headers, timeout=5)


@pytest.mark.slow
def test_kill_9_during_reset_leaves_the_sandbox_whole(tmp_path, make_service) -> None:
    """Defect: kill -9 during reset left an empty database 9 times in 40; the restart printed new \
credentials."""
    path = str(tmp_path / "killed.db")
    server = ServerProcess(path, tmp_path / "killed.log", "--demo")
    server.start()
    first = _demo_of(tmp_path / "killed.log")
    key, secret, admin, _wallets = first
    try:
        for attempt in range(8):
            threads = [threading.Thread(target=_post_quietly, args=(server.url + "/_admin/reset", admin))
                       for _ in range(4)]
            for thread in threads:
                thread.start()
            time.sleep(0.002 * attempt)
            server.kill()
            for thread in threads:
                thread.join()
            server.start()
            assert _demo_of(tmp_path / "killed.log") == first  # the restart prints the same demo
            assert sorted(_balances_over_http(server.url, key, secret)) == ["alice", "bob", "yen"]
        assert make_service(path).audit() == []
    finally:
        server.stop()


###############################################################################
# Sandbox: scenarios and parallel worlds (docs/sandbox.md) #####################
###############################################################################


def _readme_scenario(tmp_path: pathlib.Path, replace: tuple[str, str] | None = None) -> pathlib.Path:
    (block,) = doc_blocks("Scenarios", "toml")
    if replace:
        block = block.replace(*replace, 1)
    (tmp_path / "shop.toml").write_text(block)
    return tmp_path / "shop.toml"


def test_readme_scenario_file_serves_as_printed_and_survives_reset(tmp_path) -> None:
    """Ids, key and secret hard-coded from the file work, and still work after a reset."""
    scenario = _readme_scenario(tmp_path)
    ready = tmp_path / "ready.json"
    server = ServerProcess(str(tmp_path / "shop.db"), tmp_path / "shop.log", "--scenario", str(scenario),
                           "--ready-file", str(ready))
    server.start()
    try:
        facts = json.loads(ready.read_text())
        admin = {"Authorization": f"Bearer {facts['adminToken']}"}
        assert [(k["apiKey"], k["secret"]) for k in facts["keys"]] == [
            ("ak_shop_test", "shop-test-secret-0001"), ("ak_shop_reader", "shop-reader-secret-0001")]
        assert [w["id"] for w in facts["wallets"]] == ["wal_shop_till", "wal_shop_safe", "wal_shop_old"]
        assert _clock(server.url, admin) == {"now": "2030-01-01T00:00:00.000Z", "epochMillis": 1893456000000,
                                             "frozen": True, "controllable": True}
        at = 1893456000
        body = json.dumps({"sourceWalletId": "wal_shop_till", "targetWalletId": "wal_shop_safe",
                           "amount": "5.00", "currency": "USD"}).encode()
        for round_ in range(2):
            order = requests.post(server.url + TRANSFER_PATH, data=body, timeout=10, headers=_signed(
                "POST", TRANSFER_PATH, "ak_shop_test", "shop-test-secret-0001", body, timestamp=at)).json()
            assert order["data"]["status"] == "PENDING"  # settlement = "manual", from the file
            balances_ = {w["id"]: (w["balance"], w["status"]) for w in requests.get(
                server.url + "/api/v1/wallets", timeout=10, headers=_signed(
                    "GET", "/api/v1/wallets", "ak_shop_reader", "shop-reader-secret-0001",
                    timestamp=at)).json()["data"]["content"]}
            assert balances_ == {"wal_shop_till": ("500.00", "ACTIVE"), "wal_shop_safe": ("0.00", "ACTIVE"),
                                 "wal_shop_old": ("20.00", "FROZEN")}
            _clock(server.url, admin, advance=600)
            assert requests.post(server.url + "/_admin/reset", headers=admin, timeout=10).json()["success"]
            assert _clock(server.url, admin)["epochMillis"] == 1893456000000  # the clock as it started
        members = requests.get(server.url + "/_admin/workspaces/ws_shop/members", headers=admin,
                               timeout=10).json()
        assert sorted(m["name"] for m in members["data"]) == ["clerk", "owner"]
    finally:
        server.stop()


@pytest.mark.parametrize("replace, says", [
    (('currency = "USD"', 'currency = "USX"'),
     "line {}: Invalid parameter 'workspaces[0].wallets[0].currency'"),
    (('balance = "500.00"', "balance = 500.00"),
     "line {}: Invalid parameter 'workspaces[0].wallets[0].balance'"),
    (('name = "till"', 'nmae = "till"'), "line {}: Invalid parameter 'workspaces[0].wallets[0].nmae'"),
    (('id = "ak_shop_test"', 'id = "wal_shop_test"'),
     "line {}: Invalid parameter 'workspaces[0].keys[0].id'"),
    (('frozen = true', 'frozen = tru'), "Invalid value (at line {}"),
])
def test_a_bad_scenario_is_refused_at_start_naming_the_line_and_the_field(tmp_path, make_service, replace,
                                                                           says) -> None:
    scenario = _readme_scenario(tmp_path, replace)
    line = next(number for number, text in enumerate(scenario.read_text().splitlines(), 1)
                if replace[1] in text)
    done = _cli("serve", "--db", str(tmp_path / "bad.db"), "--port", "0", "--scenario", str(scenario))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"walletsvc: scenario {scenario}: ") and says.format(line) in done.stderr
    assert (not (tmp_path / "bad.db").exists()
            or make_service(str(tmp_path / "bad.db")).list_workspaces() == [])


def test_readme_shows_the_refusal_of_a_bad_scenario_as_printed(tmp_path) -> None:
    scenario = _readme_scenario(tmp_path, ('currency = "USD"', 'currency = "USX"'))
    done = _cli("serve", "--db", str(tmp_path / "bad.db"), "--port", "0", "--scenario", scenario.name,
                cwd=tmp_path)
    section = doc_section("Scenarios")
    printed = re.search(r"`(walletsvc: scenario shop.toml: .*?)`", section, flags=re.DOTALL).group(1)
    assert done.stderr.strip() == " ".join(printed.split())


def test_a_json_scenario_and_a_python_one_load_alike(tmp_path) -> None:
    scenario = {"workspaces": [{"id": "ws_json", "name": "J",
                                "keys": [{"id": "ak_json", "secret": "json-secret"}],
                                "wallets": [{"id": "wal_json", "name": "w", "currency": "JPY",
                                             "balance": "7"}]}]}
    (tmp_path / "s.json").write_text(json.dumps(scenario, indent=2))
    for source in (tmp_path / "s.json", scenario):
        sandbox = walletsvc.Sandbox.create(scenario=source)
        assert (sandbox.workspace["id"], sandbox.key["apiKey"], sandbox.key["secret"]) == (
            "ws_json", "ak_json", "json-secret")
        assert sandbox.client.get_wallet("wal_json")["balance"] == "7"
    (tmp_path / "bad.json").write_text('{"workspaces": [\n  {"name": "x",}\n]}')
    with pytest.raises(ValueError, match=r"bad.json: line 2:"):
        walletsvc.Sandbox.create(scenario=tmp_path / "bad.json")


def test_parallel_worlds_over_http_are_isolated_and_reset_alone(walletsvc_sandbox) -> None:
    sandbox = walletsvc_sandbox
    app = webtest.TestApp(sandbox.app)
    worlds = [app.post_json("/_admin/scenarios", body, headers=ADMIN).json["data"]["workspaces"][0]
              for body in ({}, {"scenario": "demo"})]
    assert len({world["id"] for world in worlds} | {sandbox.workspace["id"]}) == 3  # fresh ids
    assert len({world["keys"][0]["secret"] for world in worlds} | {sandbox.key["secret"]}) == 3  # fresh keys
    clients = [walletsvc.Client(sandbox.app, world["keys"][0]["apiKey"], world["keys"][0]["secret"],
                                clock=sandbox.clock) for world in worlds]
    first = {w["name"]: w["id"] for w in worlds[0]["wallets"]}
    alice, bob = first["alice"], first["bob"]
    clients[0].create_transfer(alice, bob, "10.00", "USD", biz_id="first")
    other = {w["name"]: w["id"] for w in worlds[1]["wallets"]}
    clients[1].create_transfer(other["alice"], other["bob"], "3.00", "USD", biz_id="first")  # its own bizIds
    with pytest.raises(walletsvc.WalletError) as refused:
        clients[0].get_wallet(other["alice"])  # another world's wallet: never seen
    assert refused.value.code == "W1001"
    app.post_json("/_admin/faults", {"code": "S503", "workspaceId": worlds[0]["id"]}, headers=ADMIN)
    again = app.post(f"/_admin/workspaces/{worlds[0]['id']}/reset", headers=ADMIN).json["data"]
    assert again["keys"] == worlds[0]["keys"] and [w["balance"] for w in again["wallets"]] == [
        "1000.00", "1000.00", "100000"]
    assert clients[0].list_transfers()["page"]["totalElements"] == 0  # its rule went with the reset
    assert clients[1].list_transfers()["page"]["totalElements"] == 1  # the other world kept its order
    assert sandbox.client.list_wallets()["page"]["totalElements"] == 3
    error(app.post("/_admin/workspaces/ws_nowhere/reset", headers=ADMIN, expect_errors=True), "GA2032", 404)
    error(app.post_json("/_admin/scenarios", {"scenario": "other"}, headers=ADMIN, expect_errors=True),
          "S012", 400)
    bad = app.post_json("/_admin/scenarios", {"workspaces": [{"name": "x", "wallets": [{"name": "w"}]}]},
                        headers=ADMIN, expect_errors=True)
    assert "workspaces[0].wallets[0].currency" in error(bad, "S012", 400)["detail"]


def test_worlds_without_wallets_or_keys_and_with_members_named_by_id(tmp_path, walletsvc_sandbox) -> None:
    """Review: a workspace without wallets broke worlds and save_start (SQL 'IN (?, )'); a key naming its
    member by the scenario's id was refused with fresh ids; a 300-character wallet name answered 500."""
    app = webtest.TestApp(walletsvc_sandbox.app)
    bare = app.post_json("/_admin/scenarios", {"workspaces": [{"name": "nowallet"}]},
                         headers=ADMIN).json["data"]
    assert app.post(f"/_admin/workspaces/{bare['workspaces'][0]['id']}/reset", headers=ADMIN).json["success"]
    walletsvc_sandbox.service.save_start()
    by_id = {"workspaces": [{"name": "m", "members": [{"id": "mem_bob", "name": "bob"}],
                             "keys": [{"member": "mem_bob"}]}]}
    for _ in range(2):  # fresh ids each time: mem_bob is this world's own bob
        world = app.post_json("/_admin/scenarios", by_id, headers=ADMIN).json["data"]["workspaces"][0]
        bob = next(member for member in world["members"] if member["name"] == "bob")
        assert world["keys"][0]["memberId"] == bob["id"] != "mem_bob"
    long_name = {"workspaces": [{"name": "w", "wallets": [{"name": "x" * 300, "currency": "USD"}]}]}
    error(app.post_json("/_admin/scenarios", long_name, headers=ADMIN, expect_errors=True), "S012", 400)
    (tmp_path / "nokey.toml").write_text('[[workspaces]]\nname = "keyless"\n')
    server = ServerProcess(str(tmp_path / "nokey.db"), tmp_path / "nokey.log", "--scenario",
                           str(tmp_path / "nokey.toml"))
    server.start()  # (it printed a banner without a key instead of failing on one)
    server.stop()
    assert "Traceback" not in (tmp_path / "nokey.log").read_text()


def test_a_world_reset_keeps_replays_refused_and_the_journal_in_order(walletsvc_sandbox) -> None:
    """Review: a world's reset forgot its nonce records (a captured transfer moved money again) and let
    the journal's seq go back (a poller with after= missed entries)."""
    sandbox = walletsvc_sandbox
    world = sandbox.world()
    app = webtest.TestApp(sandbox.app)
    body = json.dumps({"sourceWalletId": world.wallets["alice"]["id"],
                       "targetWalletId": world.wallets["bob"]["id"],
                       "amount": "1.00", "currency": "USD"}).encode()
    captured = _signed("POST", TRANSFER_PATH, world.key["apiKey"], world.key["secret"], body,
                       timestamp=int(sandbox.clock()))
    assert app.post(TRANSFER_PATH, body, headers=captured).json["success"] is True
    newest = sandbox.journal.entries()[-1]["seq"]
    world.reset()
    replayed = error(app.post(TRANSFER_PATH, body, headers=captured, expect_errors=True), "GA2013", 401)
    assert "already used" in replayed["detail"]
    assert world.client.get_wallet(world.wallets["alice"]["id"])["balance"] == "1000.00"
    sandbox.client.list_wallets()
    assert [entry["code"] for entry in sandbox.journal.entries(after=newest)] == ["GA2013", "2000", "2000"]


def test_scenario_files_with_odd_keys_and_toml_times(tmp_path) -> None:
    """Review: a key that is not an identifier, or a TOML datetime for clock.at, printed a traceback."""
    base = '[[workspaces]]\nname = "w"\n'
    cases = {"odd.toml": (base + '"my-field" = 1\n', "workspaces[0].my-field"),
             "date.toml": ('[clock]\nat = 2030-01-01\n' + base, "clock.at"),
             "bool.toml": ('[clock]\nat = true\n' + base, "clock.at")}
    for name, (text, field) in cases.items():
        (tmp_path / name).write_text(text)
        done = _cli("serve", "--db", str(tmp_path / f"{name}.db"), "--port", "0", "--scenario",
                    str(tmp_path / name))
        assert done.returncode == 2 and field in done.stderr and "Traceback" not in done.stderr, done.stderr
    (tmp_path / "datetime.toml").write_text('[clock]\nat = 2030-01-01T00:00:00Z\n' + base)
    sandbox = walletsvc.Sandbox.create(scenario=tmp_path / "datetime.toml")
    assert sandbox.clock() == 1893456000.0 and sandbox.clock.frozen


@pytest.mark.walletsvc(scenario={"workspaces": [{
    "id": "ws_marked", "name": "Marked", "keys": [{}],
    "wallets": [{"name": "w", "currency": "EUR", "balance": "3.00"}]}]})
def test_the_marker_takes_a_scenario_and_worlds_copy_it(walletsvc_sandbox) -> None:
    sandbox = walletsvc_sandbox
    assert sandbox.workspace["id"] == "ws_marked" and sandbox.wallets["w"]["balance"] == "3.00"
    world = sandbox.world()  # the scenario the sandbox started from, with fresh ids
    assert (world.workspace["name"], world.wallets["w"]["balance"]) == ("Marked", "3.00")
    assert world.workspace["id"] != "ws_marked"
    over_http = webtest.TestApp(sandbox.app).post_json("/_admin/scenarios", {}, headers=ADMIN).json["data"]
    assert [w["name"] for w in over_http["workspaces"]] == ["Marked"]


def test_a_world_in_python_resets_alone(walletsvc_sandbox) -> None:
    sandbox = walletsvc_sandbox
    world = sandbox.world()
    assert world.workspace["id"] != sandbox.workspace["id"] and world.key["apiKey"] != sandbox.key["apiKey"]
    world.client.create_transfer(world.wallets["alice"]["id"], world.wallets["bob"]["id"], "1.00", "USD")
    sandbox.client.create_transfer(sandbox.wallets["alice"]["id"], sandbox.wallets["bob"]["id"],
                                   "2.00", "USD")
    world.reset()
    assert world.client.list_transfers()["page"]["totalElements"] == 0
    assert sandbox.client.list_transfers()["page"]["totalElements"] == 1
    sandbox.reset()  # the whole sandbox: the world made after the start is gone
    with pytest.raises(walletsvc.WalletError):
        world.client.list_wallets()


def test_javascript_and_java_blocks_run_as_printed(tmp_path) -> None:
    """Two suites in other languages, from the ready file, each in a world of its own, at the same time;
    then the signing pages' JavaScript and Java."""
    required_tools("node", "java")
    section = "Other languages"
    (start,), (js,), (java,) = (doc_blocks(section, language) for language in ("sh", "js", "java"))
    # --port 0: beside the demo that README leaves running on 8080 (issue 38); the suites read the ready file
    assert start.strip() == "walletsvc serve --scenario shop.toml --port 0 --ready-file walletsvc-ready.json"
    (tmp_path / "walletsvc.test.mjs").write_text(js)
    (tmp_path / "WalletsvcExample.java").write_text(java)
    ready = tmp_path / "walletsvc-ready.json"
    server = ServerProcess(str(tmp_path / "langs.db"), tmp_path / "langs.log", "--scenario",
                           str(_readme_scenario(tmp_path)), "--ready-file", str(ready))
    server.start()
    try:
        env = {**os.environ, "READY": str(ready)}
        runs = [subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
                for command in (["node", "--test", "walletsvc.test.mjs"], ["java", "WalletsvcExample.java"])]
        outputs = [run.communicate(timeout=180)[0] for run in runs]
        assert [run.returncode for run in runs] == [0, 0], "\n".join(outputs)
        assert "# pass 1" in outputs[0] and "# fail 0" in outputs[0]
        assert outputs[1].count("ok: ") == 6
        admin = {"Authorization": f"Bearer {json.loads(ready.read_text())['adminToken']}"}
        names = [w["name"] for w in requests.get(server.url + "/_admin/workspaces", headers=admin,
                                                 timeout=10).json()["data"]]
        assert names == ["Shop"] * 3  # the scenario's, and a world for each suite
        # docs/signing.md's JavaScript and Java, with the reader key: they sign at the frozen clock (2030)
        (tmp_path / "sign.mjs").write_text(doc_blocks("Signing in JavaScript", "js")[0])
        (tmp_path / "Sign.java").write_text(doc_blocks("Signing in Java", "java")[0])
        env = {**env, "WALLETSVC_URL": server.url, "WALLETSVC_KEY": "ak_shop_reader",
               "WALLETSVC_SECRET": "shop-reader-secret-0001"}
        for command in (["node", "sign.mjs"], ["java", "Sign.java"]):
            done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180,
                                  check=False)
            assert (done.returncode, done.stdout) == (0, "2000 3 wallets\n"), done.stdout + done.stderr
    finally:
        server.stop()


###############################################################################
# Sandbox: the pytest plugin (docs/sandbox.md) #################################
###############################################################################


def test_sandbox_fixture_is_ready_to_use(walletsvc_sandbox) -> None:
    sandbox = walletsvc_sandbox
    assert {name: (w["currency"], w["balance"]) for name, w in sandbox.wallets.items()} == {
        "alice": ("USD", "1000.00"), "bob": ("USD", "1000.00"), "yen": ("JPY", "100000")}
    assert sorted(sandbox.key["scopes"]) == sorted(CONTRACT_SCOPES)
    assert sandbox.client.list_wallets()["page"]["totalElements"] == 3
    response = webtest.TestApp(sandbox.app).get("/api/v1/wallets",
                                                headers=sandbox.headers("GET", "/api/v1/wallets"))
    assert response.json["success"] is True


def test_sandbox_reset_restores_the_seed_with_the_same_ids(walletsvc_sandbox) -> None:
    sandbox = walletsvc_sandbox
    def ids() -> list:
        return [sandbox.workspace["id"], sandbox.key["apiKey"], sandbox.key["secret"],
                *[(w["id"], w["balance"]) for w in sandbox.wallets.values()]]
    before = ids()
    sandbox.client.create_transfer(sandbox.wallets["alice"]["id"], sandbox.wallets["bob"]["id"],
                                   "5.00", "USD")
    sandbox.faults.add(code="S503")
    sandbox.clock.advance(100)
    sandbox.reset()
    assert ids() == before
    assert sandbox.journal.entries() == [] and sandbox.faults.rules() == []
    assert sandbox.client.list_transfers()["page"]["totalElements"] == 0


def test_sandbox_exposes_its_admin_token(walletsvc_sandbox) -> None:
    app = webtest.TestApp(walletsvc_sandbox.app)
    answer = app.get("/_admin/clock", headers={"Authorization": f"Bearer {walletsvc_sandbox.admin_token}"})
    assert answer.json["data"]["controllable"] is True


def test_live_fixture_serves_over_http(walletsvc_live) -> None:
    import urllib.request

    sandbox = walletsvc_live
    assert sandbox.url.startswith("http://127.0.0.1:")
    with urllib.request.urlopen(sandbox.url + "/healthz", timeout=5) as reply:
        assert json.load(reply)["data"]["status"] == "ok"
    assert sandbox.client.get_wallet(sandbox.wallets["yen"]["id"])["balance"] == "100000"
    # The fixture's client talks HTTP (docs/testing.md: for code that talks HTTP): its request reached the
    # app through the socket, with the Host header an HTTP client sends (an in-process call has none).
    entry = sandbox.journal.entries("GET", "/api/v1/wallets/*")[-1]
    assert entry["headers"]["Host"] == sandbox.url.removeprefix("http://")


def test_pytest_examples_pass_as_written_from_the_clones_parent(tmp_path) -> None:
    """README's test_pay.py and docs/testing.md's examples, run with `python -m pytest` from the folder
    that holds the clone: there the clone's folder `walletsvc/` was imported as a namespace package in
    place of the installed module ("module 'walletsvc' has no attribute 'pytest_plugin'"), as
    `pip install -e` installed a finder that Python asks only after the current folder (setup.cfg,
    package_dir). Both files in one run (a pytest start each costs seconds), then under pytest-xdist."""
    (tmp_path / "walletsvc").mkdir()  # the clone, as seen from its parent
    (tmp_path / "walletsvc" / "README.md").write_text("a clone\n")
    (tmp_path / "test_pay.py").write_text("\n\n".join(doc_blocks("A test with the pytest plugin", "python")))
    (tmp_path / "test_plugin.py").write_text("\n\n".join(doc_blocks("The pytest plugin", "python")))
    found = subprocess.run([sys.executable, "-c", "import walletsvc; print(walletsvc.__file__)"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert found.stdout.strip().endswith("walletsvc.py"), found.stdout + found.stderr  # not the folder
    for extra in ([], ["-n", "2"]):  # also under pytest-xdist: a sandbox and a port per worker
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra,
                                 "test_pay.py", "test_plugin.py"], capture_output=True, text=True,
                                timeout=120, cwd=tmp_path, check=False)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "6 passed" in result.stdout


@pytest.mark.walletsvc(settlement="manual", magic_values=True)
def test_the_marker_gives_a_test_a_sandbox_with_those_settings(walletsvc_sandbox) -> None:
    sandbox = walletsvc_sandbox
    order = sandbox.client.create_transfer(sandbox.wallets["alice"]["id"], sandbox.wallets["bob"]["id"],
                                           "10.00", "USD", biz_id="held")
    assert order["status"] == "PENDING"
    with pytest.raises(walletsvc.WalletError) as declined:
        sandbox.client.create_transfer(sandbox.wallets["alice"]["id"], sandbox.wallets["bob"]["id"],
                                       "666.66", "USD")
    assert declined.value.code == "T2001"


def test_an_unmarked_test_gets_the_defaults(walletsvc_sandbox) -> None:
    sandbox = walletsvc_sandbox
    order = sandbox.client.create_transfer(sandbox.wallets["alice"]["id"], sandbox.wallets["bob"]["id"],
                                           "666.66", "USD")
    assert order["status"] == "COMPLETED"


@pytest.mark.walletsvc(settlement="manual")
def test_the_marker_applies_to_the_live_sandbox_too(walletsvc_live) -> None:
    sandbox = walletsvc_live
    assert sandbox.url.startswith("http://127.0.0.1:")
    order = sandbox.client.create_transfer(sandbox.wallets["alice"]["id"], sandbox.wallets["bob"]["id"],
                                           "1.00", "USD")
    assert order["status"] == "PENDING"


def test_every_fixture_is_documented() -> None:
    listed = subprocess.run([sys.executable, "-m", "pytest", "--fixtures", "-p", "no:cacheprovider",
                             str(pathlib.Path(__file__))], capture_output=True, text=True, timeout=120,
                            check=False)
    ours = re.findall(r"^(walletsvc_\w+)(?: \[session scope\])?.*\n((?:    .*\n)*)", listed.stdout,
                      flags=re.MULTILINE)
    assert {name for name, _ in ours} >= {"walletsvc_sandbox", "walletsvc_live", "walletsvc_session_sandbox",
                                          "walletsvc_session_live"}
    for name, doc in ours:
        assert doc.strip() and "no docstring available" not in doc, name


def test_a_live_server_stops_with_keep_alive_clients_connected() -> None:
    """Defect: the live fixture's teardown always waited out a 5 s join while a client kept a connection."""
    sandbox = walletsvc.Sandbox.create()
    server = walletsvc.LiveServer(sandbox.app)
    session = requests.Session()
    assert session.get(server.url + "/healthz", timeout=5).status_code == 200
    server.stop()
    with pytest.raises(requests.ConnectionError):  # its connection was closed: nothing waited for it to leave
        session.get(server.url + "/healthz", timeout=5)


###############################################################################
# Sandbox: the clock (docs/sandbox.md) #########################################
###############################################################################


def test_clock_freeze_set_advance_unfreeze() -> None:
    import time as real_time

    clock = walletsvc.Clock()
    assert abs(clock() - real_time.time()) < 1 and not clock.frozen
    clock.freeze(at=1000)
    assert clock() == 1000 and clock.frozen
    clock.advance(5.5)
    clock.set(2000)
    assert clock() == 2000
    clock.unfreeze()
    assert 2000 <= clock() < 2001
    clock.advance(-1000)
    assert 1000 <= clock() < 1001
    clock.reset()
    assert abs(clock() - real_time.time()) < 1


def test_everything_reads_the_service_clock(walletsvc_sandbox) -> None:
    sandbox = walletsvc_sandbox
    sandbox.clock.freeze(at=NOW)
    app = webtest.TestApp(sandbox.app)
    headers = sandbox.headers("GET", "/api/v1/wallets")
    order = sandbox.client.create_transfer(sandbox.wallets["alice"]["id"], sandbox.wallets["bob"]["id"],
                                           "1.00", "USD")
    assert order["createdAt"] == T0  # createdAt
    sandbox.clock.advance(61)
    assert app.get("/api/v1/wallets", headers=headers, expect_errors=True).json["code"] == "GA2013"  # window
    sandbox.clock.set(NOW)
    assert app.get("/api/v1/wallets", headers=headers).json["success"] is True
    assert app.get("/api/v1/wallets", headers=headers, expect_errors=True).json["code"] == "GA2013"  # replay
    sandbox.clock.advance(120)  # nonce records expire after twice the window
    sandbox.clock.set(NOW)
    assert app.get("/api/v1/wallets", headers=headers, expect_errors=True).json["code"] == "GA2013"
    assert webtest.TestApp(sandbox.app).get("/healthz").json["timestamp"] == NOW * 1000  # envelope


def test_admin_clock_controls_the_sandbox(walletsvc_sandbox) -> None:
    sandbox = walletsvc_sandbox
    admin = webtest.TestApp(sandbox.app)
    auth = {"Authorization": "Bearer walletsvc-test-admin"}
    state = admin.post_json("/_admin/clock", {"freeze": True, "at": "2027-01-15T08:00:00Z"},
                            headers=auth).json["data"]
    assert state == {"now": T0, "epochMillis": NOW * 1000, "frozen": True, "controllable": True}
    state = admin.post_json("/_admin/clock", {"advance": 1.5}, headers=auth).json["data"]
    assert state["now"] == "2027-01-15T08:00:01.500Z"
    assert admin.get("/_admin/clock", headers=auth).json["data"]["frozen"] is True
    bad = admin.post_json("/_admin/clock", {"advance": "soon"}, headers=auth, expect_errors=True)
    assert bad.json["code"] == "S012"


@pytest.mark.parametrize("at, reason", [
    (10**400, "clock"), (-(10**400), "clock"), (1893456000000, "looks like epoch milliseconds"),
    ("1893456000", "string of digits"), ("1893456000000", "string of digits"), ("soon", "RFC 3339"),
    ("2030-01-01T00:00:00", "RFC 3339"), (None, "must be JSON number or string")])
def test_clock_times_are_one_unit_everywhere(walletsvc_sandbox, at: Any, reason: str) -> None:
    """docs/sandbox.md: a JSON number is epoch seconds, a string ISO-8601 (RFC 3339, the profile the document
    states); milliseconds are refused, saying so; null is not a time."""
    app = webtest.TestApp(walletsvc_sandbox.app)
    detail = error(app.post_json("/_admin/clock", {"at": at}, headers=ADMIN, expect_errors=True), "S012", 400)
    assert reason in detail["detail"]
    assert app.get("/_admin/clock", headers=ADMIN).json["data"]["frozen"] is False  # nothing changed


def test_clock_takes_epoch_seconds_as_a_number_and_iso_as_a_string(walletsvc_sandbox) -> None:
    app = webtest.TestApp(walletsvc_sandbox.app)
    for at in (1893456000, 1893456000.0, "2030-01-01T00:00:00Z", "2030-01-01T08:00:00+08:00"):
        state = app.post_json("/_admin/clock", {"freeze": True, "at": at}, headers=ADMIN).json["data"]
        assert (state["epochMillis"], state["frozen"]) == (1893456000000, True)


def test_a_clock_belongs_to_one_service() -> None:
    clock = walletsvc.Clock()
    walletsvc.WalletService(":memory:", clock=clock)
    with pytest.raises(ValueError, match="a Clock of its own"):
        walletsvc.WalletService(":memory:", clock=clock)


###############################################################################
# Sandbox: ids (docs/sandbox.md) ###############################################
###############################################################################


def test_seeded_ids_are_the_same_on_every_run(make_service) -> None:
    def run() -> list:
        sandbox = walletsvc.Sandbox.create()
        order = sandbox.client.create_transfer(sandbox.wallets["alice"]["id"], sandbox.wallets["bob"]["id"],
                                               "1.00", "USD")
        return [sandbox.workspace["id"], sandbox.key["apiKey"], sandbox.key["secret"],
                *[w["id"] for w in sandbox.wallets.values()], order["transferId"]]
    assert run() == run()
    unseeded = [make_service().create_workspace("x")["id"] for _ in range(2)]
    assert unseeded[0] != unseeded[1]


def test_ids_can_be_seeded_over_http(make_service) -> None:
    made = []
    for _ in range(2):
        svc = make_service()
        admin = webtest.TestApp(walletsvc.create_app(svc, admin_token="t"))
        auth = {"Authorization": "Bearer t"}
        admin.post_json("/_admin/ids", {"seed": 42}, headers=auth)
        workspace = admin.post_json("/_admin/workspaces", {"name": "seeded"}, headers=auth).json["data"]
        key = admin.post_json(f"/_admin/workspaces/{workspace['id']}/keys", {}, headers=auth).json["data"]
        made.append((workspace["id"], key["apiKey"], key["secret"]))
        refused = admin.post_json("/_admin/ids", {"seed": "x"}, headers=auth, expect_errors=True)
        assert refused.json["code"] == "S012"
    assert made[0] == made[1]  # the same sequence in two services
    fresh = make_service().create_workspace("random")["id"]
    assert fresh != made[0][0]


@pytest.mark.parametrize("seed", [-1, 2**63])
def test_a_seed_out_of_the_settings_range_is_refused_naming_it(walletsvc_sandbox, seed: int) -> None:
    """Defect: POST /_admin/ids {"seed": -1} answered 200 where id_seed=-1 is refused, and 2^63 said "is too
    large" without the range. One range, 0 to 2^63 - 1, everywhere (docs/reference.md)."""
    app = webtest.TestApp(walletsvc_sandbox.app)
    refused = app.post_json("/_admin/ids", {"seed": seed}, headers=ADMIN, expect_errors=True)
    assert "9,223,372,036,854,775,807" in error(refused, "S012", 400)["detail"]
    with pytest.raises(walletsvc.WalletError, match="0 to 9,223,372,036,854,775,807"):
        walletsvc_sandbox.service.seed_ids(seed)
    seeds = app.get("/openapi.json").json["components"]["schemas"]["SeedBody"]["properties"]["seed"]
    assert (seeds["minimum"], seeds["maximum"]) == (0, 2**63 - 1)


def test_seeding_again_on_a_used_database_never_collides(walletsvc_sandbox) -> None:
    """Defect: a second POST /_admin/ids {"seed": 42} made every create S500 (UNIQUE constraint)."""
    sandbox = walletsvc_sandbox
    app = webtest.TestApp(sandbox.app)
    workspace = sandbox.workspace["id"]
    made = []
    for seed in (42, 42, 7, None, 42):
        assert app.post_json("/_admin/ids", {"seed": seed}, headers=ADMIN).json["success"] is True
        for _ in range(2):
            made.append(app.post_json(f"/_admin/workspaces/{workspace}/wallets", {"currency": "USD"},
                                      headers=ADMIN).json["data"]["id"])
    assert made == sorted(made) and len(set(made)) == len(made)  # unique, increasing in commit order
    assert sandbox.service.audit() == []


def test_seed_null_means_random_again(walletsvc_sandbox) -> None:
    app = webtest.TestApp(walletsvc_sandbox.app)
    wallets = f"/_admin/workspaces/{walletsvc_sandbox.workspace['id']}/wallets"

    def tail_after(seed: int | None) -> str:
        """The random part (the last 80 bits) of the first id made after setting ``seed``."""
        assert app.post_json("/_admin/ids", {"seed": seed}, headers=ADMIN).json["success"] is True
        return app.post_json(wallets, {"currency": "USD"}, headers=ADMIN).json["data"]["id"][-20:]
    seeded = tail_after(7)
    assert tail_after(7) == seeded  # the seed's sequence starts again
    random_tails = {tail_after(None), tail_after(None)}
    assert len(random_tails) == 2 and seeded not in random_tails
    error(app.post_json("/_admin/ids", {}, headers=ADMIN, expect_errors=True), "S012", 400)
    error(app.post_json("/_admin/ids", {"seed": "1"}, headers=ADMIN, expect_errors=True), "S012", 400)


def test_seeded_ids_repeat_from_the_same_starting_state(walletsvc_sandbox) -> None:
    sandbox = walletsvc_sandbox
    def run() -> list[str]:
        sandbox.service.seed_ids(5)
        wallet = sandbox.service.create_wallet(sandbox.workspace["id"], "EUR")["id"]
        order = sandbox.client.create_transfer(sandbox.wallets["alice"]["id"], sandbox.wallets["bob"]["id"],
                                               "1.00", "USD")["transferId"]
        return [wallet, order]
    first = run()
    sandbox.reset()
    assert run() == first


def test_a_new_seed_under_a_frozen_clock_keeps_the_ledger_in_commit_order(walletsvc_sandbox) -> None:
    """Defect: another seed issued ids that sorted before existing ones; audit found broken running \
balances."""
    sandbox = walletsvc_sandbox
    sandbox.clock.freeze(at=NOW)
    alice, bob = sandbox.wallets["alice"]["id"], sandbox.wallets["bob"]["id"]
    for seed in (9, 1, 3):
        sandbox.service.seed_ids(seed)
        for _ in range(3):
            sandbox.client.create_transfer(alice, bob, "1.00", "USD")
    flows = sandbox.client.list_flows(alice, sort="createdAt,asc", size=100)["content"]
    assert [flow["balanceAfter"] for flow in flows] == ["1000.00"] + [f"{999 - n}.00" for n in range(9)]
    assert sandbox.service.audit() == []


def test_two_servers_seeded_alike_issue_unique_ids(tmp_path) -> None:
    """Defect: two `serve --set id_seed=0` on one file made every other create S500."""
    path = str(tmp_path / "seeded.db")
    servers = [ServerProcess(path, tmp_path / f"s{n}.log", "--demo", "--set", "id_seed=0") for n in range(2)]
    try:
        for server in servers:
            server.start()
        _key, _secret, admin, _ = _demo_of(tmp_path / "s0.log")
        workspace = requests.get(servers[0].url + "/_admin/workspaces", headers=admin,
                                 timeout=10).json()["data"][0]
        made = []
        for n in range(8):
            answer = requests.post(servers[n % 2].url + f"/_admin/workspaces/{workspace['id']}/wallets",
                                   json={"currency": "USD"}, headers=admin, timeout=10)
            assert answer.status_code == 200, answer.text
            made.append(answer.json()["data"]["id"])
        assert made == sorted(made) and len(set(made)) == 8
    finally:
        for server in servers:
            server.stop()


def test_a_seeded_demo_restarts_without_collisions(tmp_path, make_service) -> None:
    """Defect: `serve --demo --set id_seed=0`, stop, start again: the second transfer was S500."""
    server = ServerProcess(str(tmp_path / "d.db"), tmp_path / "d.log", "--demo", "--set", "id_seed=0")
    try:
        for _ in range(2):
            server.start()
            key, secret, _admin, wallets = _demo_of(tmp_path / "d.log")
            body = json.dumps({"sourceWalletId": wallets[0], "targetWalletId": wallets[1], "amount": "1.00",
                               "currency": "USD"}).encode()
            for _ in range(3):
                answer = requests.post(server.url + TRANSFER_PATH, data=body, timeout=10,
                                       headers=_signed("POST", TRANSFER_PATH, key, secret, body))
                assert answer.status_code == 200, answer.text
            server.stop()
    finally:
        server.stop()
    assert make_service(str(tmp_path / "d.db")).audit() == []


###############################################################################
# Sandbox: fault rules (docs/sandbox.md) #######################################
###############################################################################


@pytest.mark.parametrize("rule, request_path, fires", [
    ({"code": "S503"}, "/api/v1/wallets", True),
    ({"code": "S503", "method": "POST"}, "/api/v1/wallets", False),
    ({"code": "S503", "path": "/api/v1/wallets/*"}, "/api/v1/wallets", False),
    ({"code": "S503", "path": "/api/v1/wallets*"}, "/api/v1/wallets", True),
    ({"code": "S503", "workspace_id": "ws_other"}, "/api/v1/wallets", False),
    ({"code": "W1002"}, "/api/v1/wallets", True),
    ({"code": "X999", "status": 418}, "/api/v1/wallets", True),
])
def test_fault_rules_force_errors_on_matching_requests(walletsvc_sandbox, rule, request_path, fires) -> None:
    sandbox = walletsvc_sandbox
    sandbox.faults.add(**rule)
    app = webtest.TestApp(sandbox.app)
    response = app.get(request_path, headers=sandbox.headers("GET", request_path), expect_errors=True)
    if fires:
        expected_status = rule.get("status") or CATALOG[rule["code"]][1]
        assert (response.status_int, response.json["code"]) == (expected_status, rule["code"])
        assert "fault rule" in response.json["detail"]
    else:
        assert response.json["success"] is True


def _attempt(call):
    try:
        return call()
    except walletsvc.WalletError as exc:
        return exc


def test_fault_rules_fire_n_times_or_always(walletsvc_sandbox) -> None:
    sandbox = walletsvc_sandbox
    sandbox.faults.add(code="S503", times=2)
    codes = [c.code if isinstance(c, walletsvc.WalletError) else "2000" for c in
             (_attempt(sandbox.client.list_wallets) for _ in range(3))]
    assert codes == ["S503", "S503", "2000"]
    # spent, listed
    assert [(rule["id"], rule["fired"]) for rule in sandbox.faults.rules()] == [("fault_1", 2)]
    sandbox.faults.add(code="S503")
    assert all(_attempt(sandbox.client.list_wallets).code == "S503" for _ in range(5))
    assert [rule["fired"] for rule in sandbox.faults.rules()] == [2, 5]
    sandbox.faults.clear()
    assert sandbox.client.list_wallets()["page"]["totalElements"] == 3


def test_a_forced_status_is_the_same_on_the_wire_and_in_the_raised_error(walletsvc_sandbox) -> None:
    sandbox = walletsvc_sandbox
    sandbox.faults.add(code="T2001", status=400)
    refused = _attempt(sandbox.client.list_wallets)
    assert (refused.code, refused.status, isinstance(refused, walletsvc.WalletError)) == ("T2001", 400, True)


def test_reset_restarts_fault_ids(walletsvc_sandbox) -> None:
    sandbox = walletsvc_sandbox
    sandbox.faults.add(code="S503")
    sandbox.reset()
    assert sandbox.faults.add(code="S503")["id"] == "fault_1"


def test_latency_fault_delays_the_answer(walletsvc_sandbox) -> None:
    import time as real_time

    sandbox = walletsvc_sandbox
    sandbox.faults.add(action="latency", latency=0.3, times=1)
    started = real_time.perf_counter()
    assert sandbox.client.list_wallets()["page"]["totalElements"] == 3
    assert real_time.perf_counter() - started >= 0.3


def test_commit_then_fail_applies_the_transfer_and_answers_500(walletsvc_sandbox) -> None:
    sandbox = walletsvc_sandbox
    alice, bob = sandbox.wallets["alice"]["id"], sandbox.wallets["bob"]["id"]
    sandbox.faults.add(action="commit_then_fail", method="POST", times=1)
    with pytest.raises(walletsvc.WalletError) as raised:
        sandbox.client.create_transfer(alice, bob, "10.00", "USD", biz_id="retry-me")
    assert (raised.value.code, raised.value.status) == ("S500", 500)
    assert sandbox.service.get_balance(alice)["balance"] == "990.00"  # it did commit
    again = sandbox.client.create_transfer(alice, bob, "10.00", "USD", biz_id="retry-me")
    assert sandbox.client.last_headers["Idempotent-Replayed"] == "true" and again["status"] == "COMPLETED"
    assert sandbox.service.get_balance(alice)["balance"] == "990.00"


def test_commit_then_drop_drops_the_connection_on_a_live_server(walletsvc_live, caplog) -> None:
    """And logs it in one line, no traceback (issue 43, item 9: 80 tracebacks in the bank runs, each
    request logged 200 though no answer was delivered)."""
    import requests

    caplog.set_level(logging.INFO)
    sandbox = walletsvc_live
    alice, bob = sandbox.wallets["alice"]["id"], sandbox.wallets["bob"]["id"]
    sandbox.faults.add(action="commit_then_drop", method="POST", times=1)
    auth = walletsvc.HmacAuth(sandbox.key["apiKey"], sandbox.key["secret"])
    body = {"sourceWalletId": alice, "targetWalletId": bob, "amount": "3.00", "currency": "USD",
            "bizId": "d-1"}
    with pytest.raises(requests.exceptions.RequestException):
        requests.post(sandbox.url + TRANSFER_PATH, json=body, auth=auth, timeout=5).json()
    assert sandbox.service.get_balance(alice)["balance"] == "997.00"
    retry = requests.post(sandbox.url + TRANSFER_PATH, json=body, auth=auth, timeout=5)
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert sandbox.service.get_balance(alice)["balance"] == "997.00"
    assert not [record for record in caplog.records if record.exc_info]


@pytest.mark.parametrize("rule", [{"action": "explode"}, {"code": "X1"}, {"status": 200, "code": "X1"},
                                  {"latency": -1}, {"times": 0}, {"method": 5}])
def test_bad_fault_rules_are_refused(walletsvc_sandbox, rule) -> None:
    with pytest.raises(walletsvc.WalletError) as raised:
        walletsvc_sandbox.faults.add(**rule)
    assert raised.value.code == "S012"


def test_a_fault_rule_fires_at_most_two_billion_times(walletsvc_sandbox) -> None:
    app = webtest.TestApp(walletsvc_sandbox.app)
    for times in (2**31 + 1, 10**30):
        refused = app.post_json("/_admin/faults", {"code": "S503", "times": times}, headers=ADMIN,
                                expect_errors=True)
        assert "at most 2147483648" in error(refused, "S012", 400)["detail"]
    assert app.post_json("/_admin/faults", {"code": "S503", "times": 2**31}, headers=ADMIN).json["success"]


def test_fault_rules_are_capped(walletsvc_sandbox) -> None:
    app = webtest.TestApp(walletsvc_sandbox.app)
    for n in range(100):
        app.post_json("/_admin/faults", {"code": "S503", "path": f"/nowhere/{n}"}, headers=ADMIN)
    refused = app.post_json("/_admin/faults", {"code": "S503"}, headers=ADMIN, expect_errors=True)
    assert "limit of 100" in error(refused, "S012", 400)["detail"]
    app.delete("/_admin/faults/fault_1", headers=ADMIN)
    assert app.post_json("/_admin/faults", {"code": "S503"}, headers=ADMIN).json["data"]["id"] == "fault_101"


def test_fault_rules_match_on_body_fields_and_headers(walletsvc_sandbox) -> None:
    sandbox = walletsvc_sandbox
    sandbox.faults.add(code="S503", method="POST", body={"amount": "7.00"})
    sandbox.faults.add(code="W1002", method="POST", headers={"X-Tenant": "blocked"})
    _transfer_of(sandbox, "1.00", "passes")
    _transfer_of(sandbox, "7.00", "fails")
    _transfer_of(sandbox, "1.00", "tenant", **{"X-Tenant": "blocked"})
    assert [entry["code"] for entry in sandbox.journal.entries("POST")] == ["2000", "S503", "W1002"]
    assert [rule["fired"] for rule in sandbox.faults.rules()] == [1, 1]


def test_admin_faults_and_journal(walletsvc_sandbox) -> None:
    sandbox = walletsvc_sandbox
    admin = webtest.TestApp(sandbox.app)
    auth = {"Authorization": "Bearer walletsvc-test-admin"}
    rule = admin.post_json("/_admin/faults", {"code": "T2001", "method": "POST", "times": 1},
                           headers=auth).json["data"]
    assert rule["status"] == 422 and admin.get("/_admin/faults", headers=auth).json["data"] == [rule]
    with pytest.raises(walletsvc.WalletError):
        sandbox.client.create_transfer(sandbox.wallets["alice"]["id"], sandbox.wallets["bob"]["id"],
                                       "1.00", "USD")
    assert admin.get("/_admin/faults", headers=auth).json["data"] == [{**rule, "fired": 1}]  # spent, listed
    journal = admin.get("/_admin/journal", params={"method": "POST"}, headers=auth).json["data"]["content"]
    assert [(e["path"], e["status"], e["code"]) for e in journal] == [(TRANSFER_PATH, 422, "T2001")]
    admin.delete("/_admin/journal", headers=auth)
    admin.post_json("/_admin/faults", {"code": "S503"}, headers=auth)
    admin.delete("/_admin/faults", headers=auth)
    assert admin.get("/_admin/journal", headers=auth).json["data"]["content"] == []
    assert admin.get("/_admin/faults", headers=auth).json["data"] == []
    bad = admin.post_json("/_admin/faults", {"action": "nope"}, headers=auth, expect_errors=True)
    assert bad.json["code"] == "S012"


def test_admin_removes_one_fault_rule_and_reads_the_newest_journal_entries(walletsvc_sandbox) -> None:
    sandbox = walletsvc_sandbox
    admin = webtest.TestApp(sandbox.app)
    auth = {"Authorization": "Bearer walletsvc-test-admin"}
    first, second = (admin.post_json("/_admin/faults", {"code": "S503", "path": path},
                                     headers=auth).json["data"]
                     for path in ("/nowhere", "/elsewhere"))
    assert admin.delete(f"/_admin/faults/{first['id']}", headers=auth).json["data"] is None
    assert [rule["id"] for rule in admin.get("/_admin/faults", headers=auth).json["data"]] == [second["id"]]
    error(admin.delete(f"/_admin/faults/{first['id']}", headers=auth, expect_errors=True), "S404", 404)
    for size in (1, 2, 3):
        sandbox.client.list_wallets(size=size)
    newest = admin.get("/_admin/journal", params={"last": "2"}, headers=auth).json["data"]["content"]
    assert [entry["query"] for entry in newest] == ["size=2", "size=3"]  # still oldest first
    assert len(admin.get("/_admin/journal", params={"last": "99"}, headers=auth).json["data"]["content"]) == 3
    assert admin.get("/_admin/journal", params={"last": "9" * 40}, headers=auth).json["data"]["page"][
        "totalElements"] == 3  # no upper bound, as the API's page numbers
    assert admin.get("/_admin/journal", params={"last": "0"}, headers=auth).json["data"]["content"] == []
    for bad in ("-1", "x", "1.5"):
        error(admin.get("/_admin/journal", params={"last": bad}, headers=auth, expect_errors=True),
              "S012", 400)


###############################################################################
# Sandbox: the journal (docs/sandbox.md) #######################################
###############################################################################


def test_journal_records_each_api_request(walletsvc_sandbox) -> None:
    sandbox = walletsvc_sandbox
    sandbox.clock.freeze(at=NOW)
    app = webtest.TestApp(sandbox.app)
    path = f"/api/v1/wallets/{sandbox.wallets['alice']['id']}"
    headers = sandbox.headers("GET", path)
    app.get(path + "?x=1", headers=headers)
    app.get(path, headers={**headers, "X-Signature": "AAAA", "X-Nonce": "other"}, expect_errors=True)
    app.get(path, headers={"X-Api-Key": "ak_nope"}, expect_errors=True)
    ok, forged, unknown = sandbox.journal.entries()
    answer = json.loads(ok["responseBody"])
    assert ok == {"seq": ok["seq"], "at": T0, "method": "GET", "path": path, "query": "x=1",
                  "apiKey": sandbox.key["apiKey"], "status": 200, "code": "2000", "signature": "valid",
                  "replayed": False,
                  "canonicalMessage": f"GET\n{path}\n{NOW}\n{headers['X-Nonce']}\n{EMPTY_SHA256}",
                  "headers": {"Host": "localhost:80", **headers}, "body": "", "diagnosis": None,
                  "responseBody": ok["responseBody"], "elapsedMs": ok["elapsedMs"]}
    assert answer["data"]["id"] == sandbox.wallets["alice"]["id"] and 0 < ok["elapsedMs"] < 1000
    assert (forged["status"], forged["code"], forged["signature"]) == (401, "GA2012", "invalid")
    assert (unknown["code"], unknown["signature"], unknown["canonicalMessage"]) == (
        "GA2011", "unchecked", None)
    assert sandbox.assert_called("GET", "/api/v1/wallets/*", times=3) == [ok, forged, unknown]
    sandbox.journal.assert_not_called("POST", TRANSFER_PATH)
    with pytest.raises(AssertionError, match=r"path='/api/v1/transfer/command/create' 1 time\(s\), got 0"):
        sandbox.assert_called("POST", TRANSFER_PATH, times=1)
    with pytest.raises(AssertionError, match="GET /api/v1/wallets/"):
        sandbox.journal.assert_called("DELETE", "/api/*")


def test_journal_is_bounded() -> None:
    sandbox = walletsvc.Sandbox.create(journal_size=3)
    for _ in range(5):
        sandbox.client.list_wallets()
    assert len(sandbox.journal.entries()) == 3
    off = walletsvc.Sandbox.create(journal_size=0)
    off.client.list_wallets()
    assert off.journal.entries() == []


def test_journal_keeps_the_request_body_and_the_diagnosed_mistake(walletsvc_sandbox) -> None:
    sandbox = walletsvc_sandbox
    body = json.dumps({"sourceWalletId": sandbox.wallets["alice"]["id"],
                       "targetWalletId": sandbox.wallets["bob"]["id"], "amount": "1.00", "currency": "USD"})
    headers = sandbox.headers("POST", TRANSFER_PATH, b"")  # the empty-body hash signed on a POST
    webtest.TestApp(sandbox.app).post(TRANSFER_PATH, body,
                                      headers={**headers, "Content-Type": "application/json"},
                                      expect_errors=True)
    (entry,) = sandbox.journal.entries("POST")
    assert (entry["code"], entry["body"], entry["headers"]["Content-Type"]) == (
        "GA2012", body, "application/json")
    assert entry["diagnosis"] == "the empty-body hash was signed on a request with a body"
    assert json.loads(entry["responseBody"])["code"] == "GA2012"


def test_journal_assertions_match_query_headers_body_and_code(walletsvc_sandbox) -> None:
    sandbox = walletsvc_sandbox
    _transfer_of(sandbox, "1.00", "small", **{"X-Trace": "abc"})
    _transfer_of(sandbox, "5000.00", "large")
    journal = sandbox.journal
    (small,) = journal.assert_called("POST", TRANSFER_PATH, times=1, body={"amount": "1.00"},
                                     headers={"x-trace": "abc"}, query={"trace": "on"})
    assert small["code"] == "2000"
    journal.assert_called(code="T2001", at_least=1, body={"bizId": "large"})
    journal.assert_called("POST", at_least=2)
    journal.assert_not_called(body={"amount": "2.00"})
    with pytest.raises(AssertionError) as failed:
        journal.assert_called("POST", TRANSFER_PATH, body={"amount": "1.50"})
    assert "closest entries" in str(failed.value)
    # issue 45, item 3: the field that differs and both values, first (the body was cut before them)
    assert 'body.amount is "1.00", expected "1.50"' in str(failed.value)
    assert "method is" not in str(failed.value).split("closest entries", 1)[1].splitlines()[1]
    with pytest.raises(AssertionError, match='body.description is missing, expected "rent"'):
        journal.assert_called("POST", TRANSFER_PATH, body={"bizId": "small", "description": "rent"})
    with pytest.raises(AssertionError, match="at least 3 time"):
        journal.assert_called("POST", at_least=3)


def test_journal_and_fault_matchers_over_http(walletsvc_sandbox) -> None:
    sandbox = walletsvc_sandbox
    admin = webtest.TestApp(sandbox.app)
    auth = {"Authorization": f"Bearer {sandbox.admin_token}"}
    admin.post_json("/_admin/faults", {"code": "T2001", "method": "POST", "body": {"bizId": "doomed"}},
                    headers=auth)
    _transfer_of(sandbox, "1.00", "doomed")
    _transfer_of(sandbox, "1.00", "fine")
    found = admin.get("/_admin/journal", params={"method": "POST", "body": '{"bizId": "doomed"}'},
                      headers=auth).json["data"]["content"]
    assert [entry["code"] for entry in found] == ["T2001"]
    assert len(admin.get("/_admin/journal", params={"query.trace": "on", "code": "2000"},
                         headers=auth).json["data"]["content"]) == 1
    verdict = admin.post_json("/_admin/journal/assert",
                              {"method": "POST", "body": {"bizId": "fine"}, "times": 1},
                              headers=auth).json["data"]
    assert verdict == {"passed": True, "count": 1, "message": None}
    missed = admin.post_json("/_admin/journal/assert", {"body": {"bizId": "nope"}}, headers=auth).json["data"]
    assert missed["passed"] is False and "closest entries" in missed["message"]


def test_the_journal_is_paged_like_the_api_lists(walletsvc_sandbox) -> None:
    sandbox = walletsvc_sandbox
    app = webtest.TestApp(sandbox.app)
    for size in range(1, 26):
        sandbox.client.list_wallets(size=size)
    first = app.get("/_admin/journal", headers=ADMIN).json["data"]
    assert first["page"] == {"size": 20, "number": 0, "totalElements": 25, "totalPages": 2}
    assert [entry["query"] for entry in first["content"]] == [f"size={n}" for n in range(1, 21)]
    capped = app.get("/_admin/journal", params={"size": "1000"}, headers=ADMIN).json["data"]
    assert capped["page"]["size"] == 100 and len(capped["content"]) == 25
    newer = app.get("/_admin/journal", params={"after": first["content"][-1]["seq"]},
                    headers=ADMIN).json["data"]
    assert [entry["query"] for entry in newer["content"]] == [f"size={n}" for n in range(21, 26)]
    for name, bad in (("page", "-1"), ("size", "0"), ("after", "x")):
        error(app.get("/_admin/journal", params={name: bad}, headers=ADMIN, expect_errors=True), "S012", 400)


def test_a_journal_entry_is_bounded_whatever_the_request_carries(walletsvc_sandbox) -> None:
    """Defect: 1,000 requests with 44 headers of 1.2 KB each raised the server's memory by 62 MB."""
    sandbox = walletsvc_sandbox
    app = webtest.TestApp(sandbox.app)
    headers = {f"X-Filler-{n}": "h" * 1200 for n in range(44)}
    app.post("/api/v1/wallets?" + "q" * 9000, "b" * 60000, headers={**headers, "X-Api-Key": "k" * 9000},
             expect_errors=True)
    (entry,) = app.get("/_admin/journal", headers=ADMIN).json["data"]["content"]
    size = sum(len(name) + len(value) for name, value in entry["headers"].items())
    assert size <= 2048 + 64  # the headers together, with the note of how many were cut
    assert "more header(s)" in entry["headers"]["X-Walletsvc-Cut"]
    assert len(json.dumps(entry)) <= 10 * 2048 * 2  # every field capped (JSON escapes at most double)


def test_the_journal_caps_count_bytes_not_characters(walletsvc_sandbox) -> None:
    """Defect: the journal's 2 KiB caps counted characters: 2,048 two-byte characters (or quotes, which JSON
    escapes) kept 4 KB. Each cap is 2048 bytes as kept, in UTF-8 (docs/sandbox.md)."""
    app = webtest.TestApp(walletsvc_sandbox.app)
    app.get("/api/v1/wallets?" + "é" * 3000, headers={"X-Quotes": '"' * 3000}, expect_errors=True)
    (entry,) = app.get("/_admin/journal", headers=ADMIN).json["data"]["content"]
    assert 2048 <= len(entry["query"].encode()) <= 2048 + 32
    assert entry["query"].endswith("é...[3952 more]")  # bytes cut, no character cut in two
    kept = json.dumps(list(entry["headers"].items()), ensure_ascii=False, separators=(",", ":")).encode()
    assert 2000 <= len(kept) <= 2048 + 64 and '"' * 500 in entry["headers"]["X-Quotes"]  # as kept, escaped


def test_the_journal_is_bounded_whatever_the_requests_carry() -> None:
    import tracemalloc

    sandbox = walletsvc.Sandbox.create()
    app = webtest.TestApp(sandbox.app)
    long_path = "/api/v1/wallets/" + "x" * 250_000
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(200):
            headers = {**sandbox.headers("GET", long_path),
                       "X-Signature": base64.b64encode(b"\0" * 32).decode()}
            error(app.get(long_path, headers=headers, expect_errors=True), "GA2012", 401)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    entries = sandbox.journal.entries()
    assert len(entries) == 200 and entries[0]["path"].endswith("more]")
    assert len(entries[0]["path"]) < 2100 and len(entries[0]["canonicalMessage"]) < 2100
    assert grown < 5 * 2**20, grown  # 200 x 2 x 250 KB would be 100 MB
    assert sum(len(json.dumps(entry)) for entry in entries) < 200 * 20 * 1024  # what the database keeps


def test_a_deeply_nested_body_never_breaks_the_journal_or_a_fault_rule(walletsvc_sandbox) -> None:
    sandbox = walletsvc_sandbox
    app = webtest.TestApp(sandbox.app)
    sandbox.faults.add(code="S503", method="POST", body={"bizId": "x"})
    deep = b"[" * 5000 + b"]" * 5000
    headers = {"Content-Type": "application/json", **sandbox.headers("POST", TRANSFER_PATH, deep)}
    error(app.post(TRANSFER_PATH, deep, headers=headers, expect_errors=True), "S012", 400)
    found = app.get("/_admin/journal", params={"body": '{"bizId": "x"}'}, headers=ADMIN).json["data"]
    assert found["content"] == []
    verdict = app.post_json("/_admin/journal/assert", {"body": {"a": {"b": 1}}, "never": True}, headers=ADMIN)
    assert verdict.json["data"]["passed"] is True


###############################################################################
# Sandbox: magic values (docs/sandbox.md) ######################################
###############################################################################


def test_the_sandboxs_assert_called_takes_what_docs_sandbox_md_promises(walletsvc_sandbox) -> None:
    """Issue 45, item 2: docs/sandbox.md promises `sandbox.assert_called(method, path, times=None,
    at_least=None, never=False, **matchers)`; the fixture's took only `times` (TypeError on at_least)."""
    sandbox = walletsvc_sandbox
    sandbox.client.list_wallets()
    sandbox.client.list_wallets()
    assert len(sandbox.assert_called("GET", "/api/v1/wallets", at_least=2, code="2000")) == 2
    sandbox.assert_called("POST", "/api/v1/transfer/command/create", never=True)
    with pytest.raises(AssertionError, match="at least 3 time"):
        sandbox.assert_called("GET", "/api/v1/wallets", at_least=3)
    documented = ["method", "path", "times", "at_least", "never", "criteria"]
    assert list(inspect.signature(sandbox.assert_called).parameters) == documented
    assert list(inspect.signature(sandbox.service.journal.assert_called).parameters) == documented


def test_magic_values_are_off_by_default(walletsvc_sandbox) -> None:
    sandbox = walletsvc_sandbox
    order = sandbox.client.create_transfer(sandbox.wallets["alice"]["id"], sandbox.wallets["bob"]["id"],
                                           "666.66", "USD")
    assert order["status"] == "COMPLETED"
    with pytest.raises(walletsvc.WalletError) as raised:
        sandbox.client.get_wallet("wal_magic_busy")
    assert raised.value.code == "W1001"


def test_magic_values_when_enabled() -> None:
    """docs/sandbox.md: built-in fault rules, decided before the ledger, whose detail says why; they are
    not among the rules the admin surface lists."""
    sandbox = walletsvc.Sandbox.create(magic_values=True)
    alice, bob = sandbox.wallets["alice"]["id"], sandbox.wallets["bob"]["id"]
    with pytest.raises(walletsvc.WalletError) as raised:
        sandbox.client.create_transfer(alice, bob, "666.66", "USD")
    assert raised.value.code == "T2001" and "magic amount 666.66" in raised.value.detail()
    assert sandbox.client.create_transfer(alice, bob, "666.67", "USD")["status"] == "COMPLETED"
    for call in (lambda: sandbox.client.get_wallet("wal_magic_busy"),
                 lambda: sandbox.client.list_flows("wal_magic_busy"),
                 lambda: sandbox.client.create_transfer("wal_magic_busy", bob, "1.00", "USD"),
                 lambda: sandbox.client.create_transfer(alice, "wal_magic_busy", "1.00", "USD")):
        with pytest.raises(walletsvc.WalletError) as raised:
            call()
        assert (raised.value.code, raised.value.status) == ("S503", 503)
        assert "magic wallet wal_magic_busy" in raised.value.detail()
    assert sandbox.faults.rules() == [] and sandbox.service.audit() == []


###############################################################################
# Sandbox console (docs/sandbox.md) ############################################
###############################################################################


def console_cookie(value: str) -> dict:
    """A Cookie header with the console session of webtest's Host (localhost:80)."""
    return {"Cookie": f"walletsvc_console_80={value}"}


def console_session(app: webtest.TestApp, prefix: str = "") -> str:
    """Log in with the form, as a browser does; webtest keeps the cookie. The page's CSRF token."""
    form = app.get(prefix + "/_admin/console")
    assert form.status_int == 200 and form.content_type == "text/html"
    assert re.search(r'<input name="token" type="password"', form.text)
    login = app.post(prefix + "/_admin/console", {"token": "s3cret"}, status=303)
    assert urllib.parse.urljoin(prefix + "/_admin/console",
                                login.headers["Location"]) == prefix + "/_admin/console"
    page = app.get(prefix + "/_admin/console")
    return re.search(r'<meta name="csrf" content="([\w-]+)">', page.text).group(1)


def test_console_login_sets_a_strict_http_only_session_cookie(svc) -> None:
    app = admin_app(svc)
    wrong = app.post("/_admin/console", {"token": "s3cret-not"}, status=401)
    assert "That is not the admin token." in wrong.text and "Set-Cookie" not in wrong.headers
    assert 'name="token"' in wrong.text  # the form again
    login = app.post("/_admin/console", {"token": "s3cret"}, status=303)
    # webtest's Host: localhost:80
    cookie = re.fullmatch(r"walletsvc_console_80=[\w-]{20,}\.(\d+)\.[\w-]{40,}; Path=/_admin/; "
                          r"Max-Age=43200; HttpOnly; SameSite=Strict", login.headers["Set-Cookie"])
    assert abs(int(cookie.group(1)) - (time.time() + 12 * 3600)) < 60  # README: a session lasts 12 hours
    page = app.get("/_admin/console")
    for name in ("Wallets", "Transfers", "Journal", "Clock", "Faults"):
        assert f'">{name}</a>' in page.text
    assert "s3cret" not in page.text + login.headers["Set-Cookie"]  # the token is never echoed
    policy = page.headers["Content-Security-Policy"]
    assert ("default-src 'none'" in policy and "connect-src 'self'" in policy
            and "frame-ancestors 'none'" in policy)
    assert "unsafe-inline" not in policy and page.headers["X-Frame-Options"] == "DENY"
    # nothing fetched from elsewhere
    assert "http" not in re.sub(r"https?://(www\.)?w3\.org\S*", "", page.text)


def test_the_console_cookie_alone_authorizes_nothing(svc) -> None:
    app = admin_app(svc)
    csrf = console_session(app)
    svc.create_workspace("kept")
    same = {"X-Console-Csrf": csrf}
    assert [ws["name"] for ws in data(app.get("/_admin/workspaces", headers=same))] == ["kept"]
    assert data(app.get("/_admin/workspaces", headers={**same, "Origin": "http://localhost:80",
                                                          "Sec-Fetch-Site": "same-origin"}))
    for refused in ({}, {"X-Console-Csrf": csrf[:-1] + ("A" if csrf[-1] != "A" else "B")},
                    {**same, "Origin": "http://evil.example"}, {**same, "Origin": "null"},
                    {**same, "Sec-Fetch-Site": "cross-site"}, {**same, "Sec-Fetch-Site": "same-site"}):
        error(app.post("/_admin/reset", headers=refused, expect_errors=True), "S403", 403)
    assert [ws["name"] for ws in svc.list_workspaces()] == ["kept"]  # nothing was reset
    error(app.get("/_admin/workspaces", headers={**same, "Origin": "http://a]"}, expect_errors=True),
          "S403", 403)
    session = app.cookies["walletsvc_console_80"].strip('"')
    bare = webtest.TestApp(app.app)  # the same app, no cookie jar: only the Cookie header given
    assert data(bare.get("/_admin/workspaces", headers={**same, **console_cookie(session)}))  # the control
    other = admin_app(svc, "another-token")  # a session of another admin token is no session here
    error(other.get("/_admin/workspaces", headers={**same, **console_cookie(session)}, expect_errors=True),
          "S401", 401)
    assert 'name="token"' in other.get("/_admin/console", headers=console_cookie(session)).text
    port = {"HTTP_HOST": "localhost:9090"}  # another sandbox's port: browsers send it the cookie too
    error(bare.get("/_admin/workspaces", headers={**same, **console_cookie(session)}, extra_environ=port,
                   expect_errors=True), "S401", 401)
    nonce, expires, mac = session.split(".")
    for forged in (f"{nonce}.{expires}.forged", f"{nonce}.{int(expires) + 1}.{mac}",
                   f"x{nonce}.{expires}.{mac}", "x", "a.b.c.d", ""):
        error(bare.get("/_admin/workspaces", headers={**same, **console_cookie(forged)}, expect_errors=True),
              "S401", 401)


def test_console_logout_ends_the_session(svc) -> None:
    app = admin_app(svc)
    csrf = console_session(app)
    error(app.post("/_admin/console/logout", expect_errors=True), "S403", 403)  # cross-site logout: refused
    session = app.cookies["walletsvc_console_80"].strip('"')
    bare = webtest.TestApp(app.app)  # the same app, no cookie jar: only the Cookie header given
    assert data(bare.get("/_admin/workspaces",
                         headers={"X-Console-Csrf": csrf, **console_cookie(session)})) == []
    out = app.post("/_admin/console/logout", headers={"X-Console-Csrf": csrf})
    assert "Max-Age=0" in out.headers["Set-Cookie"]
    assert 'name="token"' in app.get("/_admin/console").text
    error(app.get("/_admin/workspaces", headers={"X-Console-Csrf": csrf}, expect_errors=True), "S401", 401)
    # a copy of the cookie: logged out all the same
    copy = {"X-Console-Csrf": csrf, **console_cookie(session)}
    error(bare.get("/_admin/workspaces", headers=copy, expect_errors=True), "S401", 401)


def test_console_logout_holds_in_every_process_on_the_file(tmp_path, make_service) -> None:
    """Defect: logout ended the session in one worker only; under --workers 2 a copied cookie still worked
    in about half the requests. Sessions are sandbox state, in the database (docs/sandbox.md)."""
    path = str(tmp_path / "console.db")
    one, two = (admin_app(make_service(path)) for _ in range(2))  # as two processes serving the file
    csrf = console_session(one)
    session = {"X-Console-Csrf": csrf, **console_cookie(one.cookies["walletsvc_console_80"].strip('"'))}
    assert data(two.get("/_admin/workspaces", headers=session)) == []  # logged in: in every process
    one.post("/_admin/console/logout", headers={"X-Console-Csrf": csrf})
    error(two.get("/_admin/workspaces", headers=session, expect_errors=True), "S401", 401)
    assert 'name="token"' in two.get("/_admin/console", headers=session).text
    error(one.get("/_admin/workspaces", headers=session, expect_errors=True), "S401", 401)


def test_console_sessions_expire(svc, monkeypatch) -> None:
    monkeypatch.setattr(walletsvc.Console, "SESSION_SECONDS", -1)
    app = admin_app(svc)
    login = app.post("/_admin/console", {"token": "s3cret"}, status=303)
    value = re.match(r"walletsvc_console_80=([^;]+)", login.headers["Set-Cookie"]).group(1)
    kept = console_cookie(value)  # kept past its Max-Age, as a copy would be
    # the login form: the session is over
    assert 'name="token"' in app.get("/_admin/console", headers=kept).text
    error(app.get("/_admin/workspaces", headers=kept, expect_errors=True), "S401", 401)


def test_console_cookie_path_never_widens_and_polling_stays_out_of_the_access_log(svc, caplog) -> None:
    import logging

    app = admin_app(svc)
    odd = app.post("/%5Fadmin/console", {"token": "s3cret"},
                   extra_environ={"REQUEST_URI": "/%5Fadmin/console"}, status=303)
    assert "; Path=/_admin/;" in odd.headers["Set-Cookie"]
    app.reset()
    csrf = console_session(app)
    logger = logging.getLogger("walletsvc.test.access")
    app.app.http.access_log = logger
    with caplog.at_level(logging.INFO, logger=logger.name):
        app.get("/_admin/journal", headers={"X-Console-Csrf": csrf})  # the page's polling
        app.post("/_admin/reset", headers={"X-Console-Csrf": csrf})  # an action
        app.get("/_admin/journal", headers={"Authorization": "Bearer s3cret"})  # another client
    assert [record.getMessage().split(" ")[:3] for record in caplog.records] == [
        ["POST", "/_admin/reset", "200"], ["GET", "/_admin/journal", "200"]]


def test_console_under_a_mount_prefix_scopes_its_cookie_to_it(svc) -> None:
    parent = bottle.Bottle()
    parent.mount("/payments/", walletsvc.create_app(svc, admin_token="s3cret"))
    app = webtest.TestApp(parent)
    csrf = console_session(app, "/payments")
    assert [(cookie.name, cookie.path) for cookie in app.cookiejar] == [
        ("walletsvc_console_80", "/payments/_admin/")]
    assert data(app.get("/payments/_admin/clock", headers={"X-Console-Csrf": csrf}))["controllable"] is False


###############################################################################
# The sandbox console in a real browser (docs/sandbox.md) ######################
###############################################################################


SCREENSHOTS = ("console-wallets.png", "console-journal.png", "console-phone.png")  # docs/, in sandbox.md


@pytest.fixture
def browser(tmp_path):
    """Headless Chromium from Debian's chromium and chromium-driver packages, driven by selenium,
    with a fresh profile and none of its own network traffic. Without them the test is skipped,
    unless WALLETSVC_BROWSER=required (as in .ci/run, which installs them)."""
    import shutil

    binary, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if not (binary and driver_path):
        message = "the console's browser test needs Debian's chromium and chromium-driver"
        if os.environ.get("WALLETSVC_BROWSER") == "required":
            pytest.fail(message)
        pytest.skip(message)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1280,800", f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def console_log_in(browser, url: str, token: str) -> None:
    from selenium.webdriver.common.by import By

    browser.get(url + "/_admin/console")
    browser.find_element(By.NAME, "token").send_keys(token)
    browser.find_element(By.CSS_SELECTOR, "form button").click()
    until(browser, lambda: browser.find_elements(By.LINK_TEXT, "Wallets"))


def until(browser, condition: Callable, seconds: float = 5) -> Any:
    """The condition's first true value, polled; AssertionError with the page after ``seconds``."""
    from selenium.common.exceptions import StaleElementReferenceException

    deadline = time.monotonic() + seconds
    while True:
        with contextlib.suppress(StaleElementReferenceException):  # the page re-rendered under us
            value = condition()
            if value:
                return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds} s; the page says:\n"
                                 f"{browser.find_element('tag name', 'body').text}")
        time.sleep(0.1)


def table_rows(browser, selector: str) -> list[list[str]]:
    return [[cell.text for cell in row.find_elements("tag name", "td")]
            for row in browser.find_elements("css selector", selector + " tbody tr")]


class ServedPage:
    """One HTML page served on 127.0.0.1 at a port of its own (another origin), in a thread."""

    def __init__(self, html: str) -> None:
        import http.server

        page = html.encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(page)))
                self.end_headers()
                self.wfile.write(page)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"

    def __enter__(self) -> ServedPage:  # noqa: PYI034 - Self needs no import for one class
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_console_in_a_real_browser(browser, demo_server, tmp_path) -> None:
    from selenium.webdriver.common.by import By

    server, env = demo_server
    assert f"console  : {server.url}/_admin/console" in server.log_path.read_text()
    auth = walletsvc.HmacAuth(env["WALLETSVC_KEY"], env["WALLETSVC_SECRET"])
    admin = {"Authorization": f"Bearer {env['WALLETSVC_ADMIN_TOKEN']}"}
    shots = pathlib.Path(os.environ.get("WALLETSVC_SCREENSHOTS") or tmp_path)

    def wallets() -> dict:
        return {row[1]: row[4:7] for row in table_rows(browser, "#wallets .data")}

    def view(name: str) -> None:
        browser.find_element(By.LINK_TEXT, name).click()

    # Log in: a wrong token gives the form again with a message; the token, a strict HttpOnly cookie.
    browser.get(server.url + "/_admin/console")
    browser.find_element(By.NAME, "token").send_keys("not-the-token")
    browser.find_element(By.CSS_SELECTOR, "form button").click()
    until(browser, lambda: "That is not the admin token." in browser.page_source)
    console_log_in(browser, server.url, env["WALLETSVC_ADMIN_TOKEN"])
    cookie = browser.get_cookie(f"walletsvc_console_{server.port}")
    assert cookie["httpOnly"] is True and cookie["sameSite"] == "Strict"
    assert [link.text for link in browser.find_elements(By.CSS_SELECTOR, "nav a")] == [
        "Wallets", "Transfers", "Journal", "Clock", "Faults"]
    until(browser, lambda: wallets() == {"alice": ["1000.00", "1000.00", "0.00"],
                                         "bob": ["1000.00", "1000.00", "0.00"],
                                         "yen": ["100000", "100000", "0"]})

    # A signed transfer from outside: in the journal within 3 s, and the balances move.
    ids = {wallet["name"]: wallet["id"] for wallet in
           requests.get(server.url + "/api/v1/wallets", auth=auth, timeout=10).json()["data"]["content"]}
    body = {"sourceWalletId": ids["alice"], "targetWalletId": ids["bob"], "amount": "10.00",
            "currency": "USD", "bizId": "console-1"}
    requests.post(server.url + TRANSFER_PATH, json=body, auth=auth, timeout=10).raise_for_status()
    view("Journal")
    until(browser, lambda: ["POST", TRANSFER_PATH, "200", "2000", "valid"] in
          [row[1:6] for row in table_rows(browser, "#journal .data")], seconds=3)
    view("Wallets")
    until(browser, lambda: wallets()["alice"][0] == "990.00" and wallets()["bob"][0] == "1010.00")
    browser.find_element(By.CSS_SELECTOR, f'tr[data-wallet="{ids["alice"]}"]').click()
    flows = until(browser, lambda: table_rows(browser, "#flows"))
    assert flows[0][1:6] == ["TRANSFER_OUT", "DEBIT", "10.00", "990.00", "bob"]  # (issue 45, item 6)
    counterparty = browser.find_element(By.CSS_SELECTOR, "#flows tbody tr td:nth-child(6) span")
    assert counterparty.get_attribute("title") == ids["bob"]  # the id, on hover
    view("Transfers")
    order = until(browser, lambda: browser.find_elements(By.CSS_SELECTOR,
                                                         '#transfers tr[data-biz="console-1"]'))
    assert order[0].text.split()[2:4] == ["alice", "bob"]  # names, not 36-character ids
    view("Wallets")
    until(browser, lambda: table_rows(browser, "#flows"))
    browser.save_screenshot(str(shots / SCREENSHOTS[0]))

    # A bad signature (the query string signed): the journal row opens on the server's diagnosis.
    timestamp, nonce = str(int(time.time())), str(uuid.uuid4())
    signature = spec_signature(env["WALLETSVC_SECRET"], "GET", "/api/v1/wallets?size=5", timestamp, nonce,
                               b"")
    refused = requests.get(server.url + "/api/v1/wallets?size=5", timeout=10, headers={
        "X-Api-Key": env["WALLETSVC_KEY"], "X-Timestamp": timestamp, "X-Nonce": nonce,
        "X-Signature": signature})
    assert refused.json()["code"] == "GA2012"
    view("Journal")
    row = until(browser, lambda: [row for row in browser.find_elements(By.CSS_SELECTOR,
                                                                       "#journal .data tbody tr")
                                  if "GA2012" in row.text])
    row[0].click()
    diagnosis = until(browser, lambda: browser.find_elements(By.CSS_SELECTOR, "#entry .diagnosis"))
    assert "the query string was signed" in diagnosis[0].text
    canonical = browser.find_element(By.CSS_SELECTOR, "#entry pre.canonical").text
    assert canonical.startswith(f"GET\n/api/v1/wallets\n{timestamp}\n{nonce}\n")
    assert env["WALLETSVC_SECRET"] not in browser.page_source
    browser.save_screenshot(str(shots / SCREENSHOTS[1]))

    # Faults: add one with the form (it fires on the next transfer), then remove it.
    view("Faults")
    form = browser.find_element(By.ID, "fault-form")
    form.find_element(By.NAME, "code").send_keys("T2001")
    form.find_element(By.NAME, "times").send_keys("1")
    form.find_element(By.NAME, "body").send_keys('{"amount": "1.00"}')
    form.find_element(By.CSS_SELECTOR, "button").click()
    until(browser, lambda: table_rows(browser, "#faults .data"))
    view("Wallets")  # a rule is active: every view's header says so, and leads to the Faults view
    faults_on = until(browser, lambda: [link for link in browser.find_elements(By.ID, "faults-on")
                                        if link.is_displayed()])
    assert faults_on[0].text == "1 fault rule active"
    browser.set_window_size(390, 500)  # a phone: the header stays at the top however far the page scrolls
    browser.execute_script("window.scrollTo(0, document.body.scrollHeight)")
    header = browser.find_element(By.TAG_NAME, "header")
    assert browser.execute_script("return window.scrollY") > 0
    assert browser.execute_script("return arguments[0].getBoundingClientRect().top", header) == 0
    assert faults_on[0].is_displayed()
    browser.save_screenshot(str(shots / SCREENSHOTS[2]))
    browser.set_window_size(1280, 900)
    faults_on[0].click()
    until(browser, lambda: browser.find_element(By.ID, "faults").is_displayed())
    forced = requests.post(server.url + TRANSFER_PATH, auth=auth, timeout=10, json={**body, "amount": "1.00",
                                                                                   "bizId": "console-2"})
    assert (forced.status_code, forced.json()["code"]) == (422, "T2001")
    until(browser, lambda: table_rows(browser, "#faults .data")[0][8] == "1")  # fired once
    browser.find_element(By.CSS_SELECTOR, "#faults .data button").click()
    until(browser, lambda: "No fault rules." in browser.find_element(By.ID, "faults").text)
    until(browser, lambda: not browser.find_element(By.ID, "faults-on").is_displayed())
    assert requests.get(server.url + "/_admin/faults", headers=admin, timeout=10).json()["data"] == []

    # Nothing went over the network but to the sandbox (Chromium's log of every request it made;
    # chrome:// and data: URLs are the browser's own, read from memory).
    fetched = [json.loads(entry["message"])["message"]["params"]["request"]["url"]
               for entry in browser.get_log("performance")
               if json.loads(entry["message"])["message"]["method"] == "Network.requestWillBeSent"]
    network = [url for url in fetched
               if not url.startswith(("chrome:", "chrome-untrusted:", "data:", "about:"))]
    assert len(network) > 20 and all(url.startswith(server.url + "/") for url in network), network

    # Another origin on the same site (127.0.0.1, another port) posts with the cookie: refused.
    evil = ServedPage(f"""<form id="f" method="post" action="{server.url}/_admin/faults" enctype="text/plain">
        <input name='{{"code": "S503", "x": "' value='"}}'></form>
        <script>fetch("{server.url}/_admin/reset", """
                      f"""{{method: "POST", mode: "no-cors", credentials: "include"}})
          .finally(() => document.getElementById("f").submit());</script>""")
    with evil:
        browser.get(evil.url)
        until(browser, lambda: '"S403"' in browser.page_source)  # the form's answer, shown by the browser
    assert requests.get(server.url + "/_admin/faults", headers=admin, timeout=10).json()["data"] == []
    assert walletsvc.Client(server.url, env["WALLETSVC_KEY"],
                            env["WALLETSVC_SECRET"]).get_balance(ids["alice"])["balance"] == "990.00"

    browser.get(server.url + "/_admin/console")  # still logged in
    until(browser, lambda: wallets())

    # The clock: freeze, then advance an hour with the form.
    view("Clock")
    browser.find_element(By.ID, "clock-freeze").click()
    clock = until(browser, lambda: requests.get(server.url + "/_admin/clock", headers=admin,
                                                timeout=10).json()["data"]
                  if "(frozen)" in browser.find_element(By.ID, "now").text else None)
    assert clock["frozen"] is True
    browser.find_element(By.CSS_SELECTOR, "#clock-advance button").click()  # the form's default: 3600 s
    advanced = until(browser, lambda: requests.get(server.url + "/_admin/clock", headers=admin,
                                                   timeout=10).json()["data"]
                     if browser.find_element(By.ID, "clock-now").text != clock["now"] else None)
    assert advanced["epochMillis"] - clock["epochMillis"] == 3_600_000
    browser.find_element(By.CSS_SELECTOR, '#clock-set input[name="at"]').send_keys("2030-01-01T00:00:00Z")
    browser.find_element(By.CSS_SELECTOR, "#clock-set button").click()
    until(browser, lambda: browser.find_element(By.ID, "clock-now").text == "2030-01-01T00:00:00.000Z")
    browser.find_element(By.ID, "clock-unfreeze").click()
    until(browser, lambda: "(running)" in browser.find_element(By.CSS_SELECTOR, "#clock .data").text)
    view("Wallets")

    # Reset asks first; dismissed, nothing happens; accepted, the demo is back (and the clock).
    browser.find_element(By.ID, "reset").click()
    browser.switch_to.alert.dismiss()
    until(browser, lambda: wallets().get("alice", [""])[0] == "990.00")
    browser.find_element(By.ID, "reset").click()
    browser.switch_to.alert.accept()
    until(browser, lambda: wallets().get("alice", [""])[0] == "1000.00")
    back = requests.get(server.url + "/_admin/clock", headers=admin, timeout=10).json()["data"]
    assert back["frozen"] is False and abs(back["epochMillis"] / 1000 - time.time()) < 60


def test_console_completes_a_pending_transfer_in_a_real_browser(browser, tmp_path) -> None:
    from selenium.webdriver.common.by import By

    server = ServerProcess(str(tmp_path / "manual.db"), tmp_path / "manual.log", "--demo", "--set",
                           "settlement=manual")
    server.start()
    try:
        key, secret, admin, _wallets = _demo_of(server.log_path)
        token = admin["Authorization"].removeprefix("Bearer ")
        client = walletsvc.Client(server.url, key, secret)
        ids = {wallet["name"]: wallet["id"] for wallet in client.list_wallets()["content"]}
        assert client.create_transfer(ids["alice"], ids["bob"], "10.00", "USD",
                                      biz_id="hold-1")["status"] == "PENDING"
        console_log_in(browser, server.url, token)
        until(browser, lambda: {row[1]: row[4:7] for row in table_rows(browser, "#wallets .data")}.get(
            "alice") == ["1000.00", "990.00", "10.00"])  # held, not moved
        browser.find_element(By.LINK_TEXT, "Transfers").click()
        row = until(browser,
                    lambda: browser.find_elements(By.CSS_SELECTOR, '#transfers tr[data-biz="hold-1"]'))
        assert "PENDING" in row[0].text
        row[0].find_element(By.XPATH, ".//button[text()='Complete']").click()
        until(browser, lambda: "COMPLETED" in browser.find_element(By.CSS_SELECTOR,
                                                                   '#transfers tr[data-biz="hold-1"]').text)
        assert client.transfer_completed("hold-1")["completed"] is True
        assert client.get_balance(ids["alice"])["balance"] == "990.00"
        client.create_transfer(ids["alice"], ids["bob"], "5.00", "USD", biz_id="hold-2")
        row = until(browser,
                    lambda: browser.find_elements(By.CSS_SELECTOR, '#transfers tr[data-biz="hold-2"]'))
        row[0].find_element(By.XPATH, ".//button[text()='Fail']").click()
        until(browser, lambda: "FAILED" in browser.find_element(By.CSS_SELECTOR,
                                                                '#transfers tr[data-biz="hold-2"]').text)
        assert browser.find_element(By.ID, "message").text == "hold-2: failed."
        assert client.get_balance(ids["alice"])["available"] == "990.00"  # the hold released
        client.create_transfer(ids["alice"], ids["bob"], "5.00", "USD", biz_id="..")  # valid, but a path step
        row = until(browser, lambda: browser.find_elements(By.CSS_SELECTOR, '#transfers tr[data-biz=".."]'))
        assert not row[0].find_element(By.XPATH, ".//button[text()='Complete']").is_enabled()
    finally:
        server.stop()


def test_the_sandbox_page_shows_the_console_screenshots() -> None:
    """The screenshots the browser test takes (WALLETSVC_SCREENSHOTS=docs) are in docs/sandbox.md."""
    page = (README.parent / "docs" / "sandbox.md").read_text(encoding="utf-8")
    for name in SCREENSHOTS:
        assert f"]({name})" in page
        assert (README.parent / "docs" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


###############################################################################
# Durability where money moves (docs/operations.md) ############################
###############################################################################


@pytest.fixture
def traced(tmp_path, clock, make_service, monkeypatch):
    """A file-backed service at default durability, its app, and the SQL its write connections run."""
    svc = make_service(str(tmp_path / "durable.db"), clock=clock)
    world_ = make_world(svc)
    api = Api(webtest.TestApp(walletsvc.create_app(svc)), world_["key"], clock)
    return svc, api, world_, _trace_writes(svc)


def test_a_new_file_has_2_kb_pages_and_an_existing_one_keeps_its_own(tmp_path, clock) -> None:
    """docs/operations.md: a new database file is made with pages of 2 KB (a transfer's commit writes 71 KB
    to the -wal, not 122); a file made with SQLite's default 4 KB pages is served as it is."""
    fresh = walletsvc.WalletService(str(tmp_path / "new.db"), clock=clock)
    make_world(fresh)
    fresh.close()
    old = tmp_path / "old.db"
    sqlite3.connect(old).execute("PRAGMA page_size = 4096").connection.execute("VACUUM").connection.close()
    served = walletsvc.WalletService(str(old), clock=clock)
    world_ = make_world(served)
    served.create_transfer(world_["ws"]["id"], world_["a"], world_["b"], "1.00", "USD")
    served.close()
    sizes = {name: sqlite3.connect(tmp_path / name).execute("PRAGMA page_size").fetchone()[0]
             for name in ("new.db", "old.db")}
    assert sizes == {"new.db": 2048, "old.db": 4096}


def test_a_read_records_its_nonce_without_waiting_for_a_disk_sync(traced) -> None:
    """docs/operations.md: a read's one write is its nonce record, committed without a disk sync."""
    _svc, api, world_, statements = traced
    data(api.get(f"/api/v1/wallets/{world_['a']}"))
    assert statements == ["BEGIN IMMEDIATE", "SAVEPOINT unit", "INSERT INTO nonce_records", "RELEASE unit",
                          "COMMIT"]  # at NORMAL: no PRAGMA switched around it


def test_a_transfer_records_its_nonce_in_its_own_transaction_one_commit(traced) -> None:
    """docs/contract.md: a transfer's nonce and ledger rows are one unit, committed once, durably; the read
    after it commits without a sync again."""
    _svc, api, world_, statements = traced
    data(api.transfer(transfer_body(world_)))
    assert statements[:4] == ["PRAGMA synchronous = FULL", "BEGIN IMMEDIATE", "SAVEPOINT unit",
                              "INSERT INTO nonce_records"]
    assert "INSERT INTO transfers" in statements and statements.count("COMMIT") == 1
    assert statements[-1] == "COMMIT" and statements.count("PRAGMA synchronous = FULL") == 1
    del statements[:]
    data(api.get(f"/api/v1/wallets/{world_['a']}"))
    assert statements[:2] == ["PRAGMA synchronous = NORMAL", "BEGIN IMMEDIATE"]


def test_a_durable_write_commits_at_full_on_whichever_connection_it_runs(tmp_path, make_service) -> None:
    """docs/operations.md: a batch holding a durable write commits at synchronous FULL (a disk sync), one of
    reads' records alone at NORMAL, whatever ran before on the connection: a thread's first write, a write
    after close(), one inside a read of the thread's own, a durable write taken behind a read's record."""
    full, normal = 2, 1  # (PRAGMA synchronous, read inside the unit: the level its commit runs at)
    db = make_service(str(tmp_path / "levels.db")).db

    def level(conn: sqlite3.Connection) -> int:
        return conn.execute("PRAGMA synchronous").fetchone()[0]

    results: dict[str, int] = {}

    def queued(name: str, durable: bool) -> None:
        results[name] = db.write([level], durable=durable)[0]

    for name, durable in (("money", True), ("record", False), ("money again", True)):
        thread = threading.Thread(target=queued, args=(name, durable))  # each a new thread's first write
        thread.start()
        thread.join(10)
    assert results == {"money": full, "record": normal, "money again": full}
    assert [db.write([level], durable=durable)[0] for durable in (True, True, False, False, True)] == [
        full, full, normal, normal, full]
    db.close()
    assert db.write([level])[0] == full
    with db.snapshot():
        levels = [db.write([level], durable=durable)[0] for durable in (True, False, True)]
    assert levels == [full, normal, full]
    holding, release = threading.Event(), threading.Event()
    results.clear()
    threads = [threading.Thread(target=lambda: db.write([lambda conn: (holding.set(), release.wait(10))],
                                                        durable=False))]
    threads[0].start()
    holding.wait(10)
    for name, durable in (("record", False), ("money", True)):  # queued in this order: the record leads
        threads.append(threading.Thread(target=queued, args=(name, durable)))
        threads[-1].start()
        time.sleep(0.3)
    release.set()
    for thread in threads:
        thread.join(10)
    assert results == {"record": full, "money": full}  # one batch, one commit, with a disk sync
    relaxed = make_service(str(tmp_path / "relaxed.db"), synchronous="NORMAL").db
    assert [relaxed.write([level], durable=durable)[0] for durable in (True, False)] == [normal, normal]


def test_with_a_journal_a_request_writes_once_nonce_entry_and_ledger_together(tmp_path, clock, make_service,
                                                                               monkeypatch) -> None:
    """docs/operations.md: a request writes at most once, at its end: a read its nonce and journal entry
    (without a disk sync), a transfer those and its ledger rows (with one)."""
    svc = make_service(str(tmp_path / "journaled.db"), clock=clock, journal_size=10)
    world_ = make_world(svc)
    api = Api(webtest.TestApp(walletsvc.create_app(svc)), world_["key"], clock)
    statements = _trace_writes(svc)
    data(api.get(f"/api/v1/wallets/{world_['a']}"))
    assert statements == ["BEGIN IMMEDIATE", "SAVEPOINT unit", "INSERT INTO nonce_records",
                          "INSERT INTO journal", "RELEASE unit", "COMMIT"]
    data(api.transfer(transfer_body(world_)))
    money = statements[6:]
    assert money[:4] == ["PRAGMA synchronous = FULL", "BEGIN IMMEDIATE", "SAVEPOINT unit",
                         "INSERT INTO nonce_records"]
    assert money.index("INSERT INTO transfers") < money.index("INSERT INTO journal") < money.index("COMMIT")
    assert money.count("COMMIT") == 1 and money[-1] == "COMMIT"
    svc.close()


def test_a_refused_transfer_uses_its_nonce_and_applies_nothing(traced) -> None:
    svc, api, world_, _statements = traced
    body = json.dumps(transfer_body(world_, amount="500.00")).encode()
    headers = {"Content-Type": "application/json", **api.headers("POST", TRANSFER_PATH, body)}
    error(api.request("POST", TRANSFER_PATH, body, headers=headers), "T2001", 422)
    svc.deposit(world_["a"], "1000.00")  # now it would pass, but the same request is a replay
    error(api.request("POST", TRANSFER_PATH, body, headers=headers), "GA2013", 401)
    assert balances(svc, world_["a"], world_["b"]) == ["1100.00", "0.00"]
    assert svc.list_transfers(world_["ws"]["id"])["page"]["totalElements"] == 0


def test_a_replayed_transfer_moves_money_once(traced) -> None:
    svc, api, world_, _statements = traced
    body = json.dumps(transfer_body(world_)).encode()
    headers = {"Content-Type": "application/json", **api.headers("POST", TRANSFER_PATH, body)}
    data(api.request("POST", TRANSFER_PATH, body, headers=headers))
    error(api.request("POST", TRANSFER_PATH, body, headers=headers), "GA2013", 401)
    assert balances(svc, world_["a"], world_["b"]) == ["74.50", "25.50"]


###############################################################################
# walletsvc serve on a hostile network (docs/operations.md) ####################
###############################################################################


def _served(tmp_path) -> tuple:
    path = str(tmp_path / "hostile.db")
    key = _keyed_database(path)
    server = ServerProcess(path, tmp_path / "server.log")
    server.start()
    return server, key



def _drip(slow: list, every: float, stop: threading.Event) -> None:
    """A slow sender's way, on every socket of ``slow``: one more header line every ``every`` seconds, never
    the end of the headers, until ``stop``."""
    def drip() -> None:
        while not stop.wait(every):
            for number, sock in enumerate(slow):
                with contextlib.suppress(OSError):
                    sock.sendall(f"X-Slow-{number}: {time.time()}\r\n".encode())

    threading.Thread(target=drip, daemon=True).start()


def test_idle_and_slowloris_connections_do_not_keep_a_fresh_client_out(tmp_path) -> None:
    import socket

    server, key = _served(tmp_path)
    sockets: list = []
    stop = threading.Event()
    try:
        for _ in range(300):  # idle: connected, nothing sent
            sockets.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
        slow = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(100)]
        sockets += slow
        for sock in slow:
            sock.sendall(b"GET /api/v1/wallets HTTP/1.1\r\nHost: x\r\n")

        _drip(slow, 1, stop)
        time.sleep(1.5)
        started = time.monotonic()
        answer = _list_wallets(server, key)
        assert answer.status_code == 200 and answer.json()["success"] is True
        assert time.monotonic() - started < 2
    finally:
        stop.set()
        for sock in sockets:
            sock.close()
        server.stop()


def test_slow_senders_filling_the_connection_limit_never_keep_a_fresh_client_out(tmp_path) -> None:
    """Defect: 1,000 slow senders (a header line every 10 s, so channel_timeout never closed them) filled
    waitress's connection limit: fresh requests, /healthz and /_admin/ timed out. A request whose headers
    are not complete within a bound is closed, and the limit leaves room for a fresh client
    (docs/operations.md).
    Bounded: the limit lowered to 40 connections and the bound to 2 s (the shipped 1000 and 10 s)."""
    import socket

    ready = tmp_path / "ready.json"
    lowered = ("import sys, walletsvc; walletsvc.HEADERS_WITHIN = 2.0;"
               " walletsvc.WAITRESS_LIMITS.update(connection_limit=40, cleanup_interval=1);"
               " sys.exit(walletsvc.main(sys.argv[1:]))")
    process = subprocess.Popen([sys.executable, "-c", lowered, "serve", "--demo", "--port", "0", "--db",
                                str(tmp_path / "slow.db"), "--ready-file", str(ready)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    slow: list = []
    stop = threading.Event()
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        facts = json.loads(ready.read_text())
        (key,) = facts["keys"]
        for _ in range(60):  # more than the limit: the ones past it wait in the listen backlog
            sock = socket.create_connection(("127.0.0.1", facts["port"]), timeout=5)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            slow.append(sock)

        _drip(slow, 0.3, stop)
        time.sleep(1)
        admin = {"Authorization": f"Bearer {facts['adminToken']}"}
        signed = _signed("GET", "/api/v1/wallets", key["apiKey"], key["secret"])
        for path, headers in (("/healthz", {}), ("/_admin/clock", admin), ("/api/v1/wallets", signed)):
            started = time.monotonic()
            answer = requests.get(facts["url"] + path, headers=headers, timeout=5)
            assert answer.json()["success"] is True and time.monotonic() - started < 3, path
        time.sleep(3)  # past the bound (and a cleanup): the slow senders accepted at first are closed
        closed = 0
        for sock in slow[:20]:
            sock.settimeout(0.5)
            with contextlib.suppress(OSError):
                closed += sock.recv(1) == b""
        assert closed == 20
    finally:
        stop.set()
        for sock in slow:
            sock.close()
        process.terminate()
        process.wait(timeout=30)


def test_an_oversized_body_is_refused_without_being_read(tmp_path) -> None:
    import socket

    server, key = _served(tmp_path)
    try:
        headers = walletsvc.sign_request("POST", TRANSFER_PATH, b"x" * 100_000, key["apiKey"], key["secret"])
        between = requests.post(server.url + TRANSFER_PATH, data=b"x" * 100_000, timeout=10,
                                headers={**headers, "Content-Type": "application/json"})
        assert (between.status_code, between.json()["code"]) == (413, "S413")  # over 64 KiB: the envelope
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(f"POST {TRANSFER_PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: 200000000\r\n\r\n".encode() + b"{" * 65536)
            started = time.monotonic()
            reply = sock.recv(4096)  # answered after 64 KiB of a 200 MB body: nothing spooled
            assert reply.startswith(b"HTTP/1.1 413") and time.monotonic() - started < 2
            while b"\r\n\r\n" in reply and not reply.endswith(b"}"):  # the body may come in a later packet
                more = sock.recv(4096)
                if not more:
                    break
                reply += more
            # waitress's answer: the envelope
            assert b"application/json" in reply and b'"code":"S413"' in reply
    finally:
        server.stop()


@pytest.mark.parametrize("header", [b"Content-Length;", b"Content-Length: abc", b"X-\x01: y",
                                    b"Transfer-Encoding: gzip"])  # (waitress's 501: a 4xx now)
def test_what_the_http_server_cannot_parse_is_answered_with_the_envelope(tmp_path, header: bytes) -> None:
    """docs/contract.md: every answer is the envelope, even waitress's own to a request it cannot parse
    (which never reaches the app)."""
    import socket

    server, _ = _served(tmp_path)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(b"GET /api/v1/wallets HTTP/1.1\r\nHost: x\r\n" + header + b"\r\n\r\n")
            reply = b""
            while chunk := sock.recv(4096):
                reply += chunk
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith((b"HTTP/1.1 400", b"HTTP/1.0 400"))
        assert b"Content-Type: application/json; charset=utf-8" in head and b"Cache-Control: no-store" in head
        answer = json.loads(body)
        assert (answer["code"], answer["message"], answer["success"]) == ("S012", "INVALID_PARAMETER", False)
        assert "not valid HTTP" in answer["detail"] and ".." not in answer["detail"]  # (one dot)
    finally:
        server.stop()


def test_the_waitress_internals_serving_leans_on_are_there() -> None:
    """walletsvc serve leans on waitress internals where waitress has no public API for the need
    (docs/operations.md): a waitress that moves one must fail here, naming it, before anything
    subtler fails elsewhere."""
    import inspect

    import waitress
    from waitress import wasyncore
    from waitress.channel import HTTPChannel
    from waitress.task import ErrorTask, ThreadedTaskDispatcher

    assert "_dispatcher" in inspect.signature(waitress.create_server).parameters
    assert HTTPChannel.error_task_class is ErrorTask and callable(ErrorTask.execute)
    assert callable(wasyncore.close_all)
    assert callable(ThreadedTaskDispatcher.add_task) and callable(ThreadedTaskDispatcher.set_thread_count)
    dispatcher = ThreadedTaskDispatcher()
    server = waitress.create_server(lambda environ, start_response: [], host="127.0.0.1", port=0,
                                    _dispatcher=dispatcher)
    try:
        assert server.task_dispatcher is dispatcher and server.channel_class is HTTPChannel
        assert isinstance(server._map, dict) and callable(server.trigger.pull_trigger)
        # guarding_slow_senders
        assert callable(server.readable) and callable(server.maintenance) and server.accepting is True
        assert isinstance(server.active_channels, dict) and server.adj.connection_limit > 0
        assert {"will_close", "last_activity", "request"} <= set(dir(HTTPChannel))
        assert "self.requests" in inspect.getsource(HTTPChannel.__init__)
        assert "headers_finished" in dir(HTTPChannel.parser_class) and callable(HTTPChannel.received)
    finally:
        server.close()
        server.trigger.close()


###############################################################################
# Storage that fails: locked, read-only, full, gone (docs/operations.md) #######
###############################################################################


def _storage_world(tmp_path, clock, **settings) -> tuple[walletsvc.WalletService, Api, str, str]:
    """A file database: a workspace, a full key, a wallet with 1000.00 USD and an empty one."""
    svc = walletsvc.WalletService(str(tmp_path / "storage.db"), clock=clock, **settings)
    ws = svc.create_workspace("Acme")
    key = svc.create_api_key(ws["id"])
    source, target = (svc.create_wallet(ws["id"], "USD")["id"] for _ in range(2))
    svc.deposit(source, "1000.00")
    return svc, Api(webtest.TestApp(walletsvc.create_app(svc)), key, clock), source, target


def test_locked_database_answers_s503_then_recovers(tmp_path, clock) -> None:
    svc, api, source, target = _storage_world(tmp_path, clock, busy_timeout=0.2)
    path = svc.db.path
    body = {"sourceWalletId": source, "targetWalletId": target, "amount": "1.00", "currency": "USD"}
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    try:
        started = time.monotonic()
        error(api.transfer(body), "S503", 503)
        error(api.get(f"/api/v1/wallets/{source}"), "S503", 503)  # its nonce cannot be recorded
        assert time.monotonic() - started < 2 * 0.2 + 2  # the busy timeout, not a hang
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert balances(svc, source, target) == ["1000.00", "0.00"]
    data(api.transfer(body))
    assert balances(svc, source, target) == ["999.00", "1.00"]


def _on_the_writer(svc: walletsvc.WalletService, pragma: str) -> None:
    """A pragma on the one connection the service writes through here: this thread's (a batch's leader's)."""
    svc.db.write([lambda conn: conn.execute(pragma)], durable=False)


def test_read_only_storage_answers_s503_and_applies_nothing(tmp_path, clock) -> None:
    svc, api, source, target = _storage_world(tmp_path, clock)
    body = {"sourceWalletId": source, "targetWalletId": target, "amount": "1.00", "currency": "USD",
            "bizId": "ro-1"}
    _on_the_writer(svc, "PRAGMA query_only = ON")  # every write fails as on a read-only file
    error(api.transfer(body), "S503", 503)
    error(api.get(f"/api/v1/wallets/{source}"), "S503", 503)  # a read must still record its nonce
    svc.db.close()  # its connections open anew, writable
    assert balances(svc, source, target) == ["1000.00", "0.00"]
    assert svc.list_transfers(api.key["workspaceId"], {})["content"] == []
    data(api.transfer(body))
    assert balances(svc, source, target) == ["999.00", "1.00"]


def test_full_disk_answers_s503_and_never_half_applies(tmp_path, clock) -> None:
    svc, api, source, target = _storage_world(tmp_path, clock)
    with svc.db.connection() as conn:
        conn.execute("VACUUM")
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
    _on_the_writer(svc, f"PRAGMA max_page_count = {pages}")  # the disk is full at the current size
    done = 0
    for n in range(500):
        body = {"sourceWalletId": source, "targetWalletId": target, "amount": "1.00", "currency": "USD",
                "bizId": f"full-{n}", "description": "x" * 100}
        response = api.transfer(body)
        if response.status_int != 200:
            assert "the disk is full" in error(response, "S503", 503)["detail"]  # (issue 43, item 7)
            health = api.app.get("/healthz", expect_errors=True)
            assert "the disk is full: the sandbox cannot write" in error(health, "S503", 503)["detail"]
            break
        done += 1
    else:
        pytest.fail("the database never filled up")
    assert balances(svc, source, target) == [usd(100000 - 100 * done),
                                             usd(100 * done)]
    ledger_invariants(svc.db.path)
    _on_the_writer(svc, "PRAGMA max_page_count = 1073741823")
    data(api.get(f"/api/v1/wallets/{source}"))  # room again: a read's nonce record commits,
    data(api.app.get("/healthz"))               # and /healthz says the sandbox writes again
    data(api.transfer(body))  # the same bizId, retried once there is room: applied once
    assert balances(svc, source, target)[1] == usd(100 * (done + 1))
    ledger_invariants(svc.db.path)


def test_server_started_on_a_locked_database_answers_s503_until_it_is_free(tmp_path) -> None:
    path = str(tmp_path / "locked.db")
    key = _keyed_database(path)
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    server = ServerProcess(path, tmp_path / "server.log", "--set", "busy_timeout=0.2")
    try:
        server.start()  # a lock held by another writer is not unwritable storage
        started = time.monotonic()
        busy = _list_wallets(server, key)
        assert (busy.status_code, busy.json()["code"]) == (503, "S503")
        assert time.monotonic() - started < 5
        blocker.execute("ROLLBACK")
        assert _list_wallets(server, key).json()["success"] is True
    finally:
        blocker.close()
        server.stop()


def _as_unprivileged(command: list) -> list:
    """``command`` run so that file permissions bind it (root ignores them)."""
    import shutil

    if os.geteuid() != 0:
        return command
    if not shutil.which("setpriv"):
        pytest.skip("running as root without setpriv: a read-only file cannot be simulated")
    return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *command]


@pytest.mark.parametrize("read_only", ["file", "directory", "directory, new file"])
def test_serve_refuses_unwritable_storage_at_start(tmp_path, read_only: str) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    path = folder / "wallets.db"
    walletsvc.WalletService(str(path)).close()
    before = path.read_bytes()
    if read_only == "file":
        path.chmod(0o444)
    else:
        for leftover in folder.glob("wallets.db-*"):
            leftover.unlink()
        folder.chmod(0o555)
    target = folder / "new.db" if read_only == "directory, new file" else path
    try:
        finished = subprocess.run(_as_unprivileged(
            [sys.executable, "-m", "walletsvc", "serve", "--db", str(target), "--port", "0"]),
            check=False, capture_output=True, text=True, timeout=60)
    finally:
        folder.chmod(0o755)
        path.chmod(0o644)
    assert finished.returncode == 2, finished.stderr
    assert f"walletsvc: cannot serve {target}:" in finished.stderr
    assert "must be writable" in finished.stderr and "Traceback" not in finished.stderr
    assert path.read_bytes() == before
    assert not list(folder.glob("*.db-*"))  # nothing left behind (read-only -wal/-shm blocked the next start)
    server = ServerProcess(str(target), tmp_path / "after.log")  # writable again: it starts
    try:
        server.start()
    finally:
        server.stop()


def test_a_busy_port_is_named_with_a_way_out(tmp_path) -> None:
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        finished = subprocess.run([sys.executable, "-m", "walletsvc", "serve", "--db", str(tmp_path / "p.db"),
                                   "--port", str(port), "--demo"], check=False, capture_output=True,
                                  text=True,
                                  timeout=60)
    assert finished.returncode == 2
    assert f"port {port} on 127.0.0.1 is already in use" in finished.stderr and "--port 0" in finished.stderr
    assert "Traceback" not in finished.stderr
    # A refused start removes what it began (docs/contract.md): the demo's seeded database was left behind,
    # and the next start with another scenario served the old world.
    assert sorted(path.name for path in tmp_path.iterdir()) == []


def _open_at(path: str, moment: float) -> None:
    time.sleep(max(0.0, moment - time.time()))
    walletsvc.WalletService(path).close()


def test_two_services_opening_a_new_file_at_the_same_moment_both_start(tmp_path) -> None:
    """Defect: 1 start in ~20 lost the race for a new file and exited 2, "database is locked"."""
    context = multiprocessing.get_context("fork")
    for attempt in range(20):
        path = str(tmp_path / f"race{attempt}.db")
        moment = time.time() + 0.15
        processes = [context.Process(target=_open_at, args=(path, moment)) for _ in range(3)]
        for process in processes:
            process.start()
        for process in processes:
            process.join(30)
        assert [process.exitcode for process in processes] == [0, 0, 0], attempt


def _delete(path: pathlib.Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(f"{path}{suffix}")


def _replace(path: pathlib.Path) -> None:
    walletsvc.WalletService(f"{path}.other").close()
    os.replace(f"{path}.other", path)


def _delete_wal(path: pathlib.Path) -> None:
    os.remove(f"{path}-wal")


def _replace_wal(path: pathlib.Path) -> None:
    pathlib.Path(f"{path}-wal.other").write_bytes(b"")
    os.replace(f"{path}-wal.other", f"{path}-wal")


def _delete_shm(path: pathlib.Path) -> None:
    os.remove(f"{path}-shm")


SWAPS = [_delete, _replace, _delete_wal, _replace_wal, _delete_shm]
SWAP_NAMES = ["deleted", "replaced", "wal-deleted", "wal-replaced", "shm-deleted"]


def test_no_process_joins_a_file_whose_shm_a_running_server_lost(tmp_path) -> None:
    """Issue 36, item 2: with -shm deleted under a running server, a second process on the file (a restart,
    a respawned worker, a second serve) made a new -shm, the two stopped coordinating, and 415-941
    acknowledged transfers were lost in a malformed file. Now the second one is refused, naming the first."""
    path = tmp_path / "sandbox.db"
    with demo_process(tmp_path, "sandbox") as (server, _):
        _delete_shm(path)
        with pytest.raises(sqlite3.OperationalError, match=rf"process {server.process.pid} still serves it"
                                                           r" through a -shm that was deleted"):
            walletsvc.WalletService(str(path))
        second = _cli("serve", "--db", str(path), "--port", "0")
        assert second.returncode != 0 and "-shm that was deleted" in second.stderr
        assert "Traceback" not in second.stderr
    walletsvc.WalletService(str(path)).close()  # once that process is gone, the file serves again


def test_a_new_file_at_the_path_of_a_deleted_one_opens_though_its_old_shm_is_still_mapped(tmp_path) -> None:
    """The refusal above is for a process that still serves the file: a deleted -shm that belonged to an
    earlier file at the path (deleted with it, still mapped by a connection of another thread) is none."""
    path = tmp_path / "reused.db"
    first = walletsvc.WalletService(str(path))
    reader = threading.Thread(target=first.list_workspaces)  # (a connection of its own, kept by its thread)
    reader.start()
    reader.join()
    first.close()
    _delete(path)
    second = walletsvc.WalletService(str(path))
    try:
        assert second.create_workspace("again")["name"] == "again"
    finally:
        second.close()


def test_a_malformed_database_is_s503_saying_what_to_do_and_healthz_503(tmp_path, clock) -> None:
    """Issue 36, item 4: a malformed or truncated file answered S500 ("a bug") to every request, with
    tracebacks, while /healthz said ok."""
    path = tmp_path / "broken.db"
    svc = walletsvc.WalletService(str(path), clock=clock)
    world_ = make_world(svc)
    for n in range(40):
        svc.create_wallet(world_["ws"]["id"], "USD", name=f"filler-{n}")
    svc.close()  # (the last connection moves everything into the file)
    svc = walletsvc.WalletService(str(path), clock=clock)
    try:
        app = webtest.TestApp(walletsvc.create_app(svc))
        api = Api(app, world_["key"], clock)
        size = path.stat().st_size
        with open(path, "r+b") as handle:  # under the running service: every page but the first, overwritten
            handle.seek(4096)
            handle.write(os.urandom(size - 4096))
        for answer in (api.get(f"/api/v1/wallets/{world_['a']}"), api.transfer(transfer_body(world_)),
                       app.get("/healthz", expect_errors=True)):
            body = error(answer, "S503", 503)
            assert "malformed" in body["detail"] and "Restore it from a copy" in body["detail"]
    finally:
        svc.close()
    started = _cli("serve", "--db", str(path), "--port", "0")  # and a start on it says so, in one line
    assert started.returncode != 0 and "malformed" in started.stderr and "Traceback" not in started.stderr
    assert started.stderr.startswith(f"walletsvc: cannot serve {path}: ")  # (the "path: reason" form)


def test_walletsvc_audit_reads_the_files_integrity_first(tmp_path) -> None:
    """Issue 43, item 2: a page in the middle overwritten with random bytes, and `walletsvc audit` printed []
    and exited 0. Now the audit says the file is malformed (SQLite's integrity_check), exit status 1, in
    the CLI, the Python API and GET /_admin/audit alike."""
    path = tmp_path / "books.db"
    svc = walletsvc.WalletService(str(path))
    world_ = make_world(svc)
    for _ in range(400):
        svc.create_transfer(world_["ws"]["id"], world_["a"], world_["b"], "0.01", "USD")
    svc.close()
    with open(path, "r+b") as handle:
        handle.seek(path.stat().st_size // 4096 // 2 * 4096)
        handle.write(random.Random(7).randbytes(4096))
    audit = _cli("audit", "--db", str(path))
    assert audit.returncode == 1 and "Traceback" not in audit.stderr, audit.stderr
    found = json.loads(audit.stdout)
    assert [violation["check"] for violation in found] == ["integrity"]
    assert "malformed" in found[0]["detail"]
    table = _cli("audit", "--db", str(path), "--table")
    assert table.returncode == 1 and "integrity" in table.stdout


@pytest.mark.parametrize("beside", ["nothing", "its -wal"])
def test_a_start_on_an_empty_file_is_refused_saying_what_to_do(tmp_path, beside) -> None:
    """Issue 43, item 3: a database truncated to 0 bytes served an empty sandbox (the old key answered
    GA2011). An empty file given as the database is refused with what to do, and left as it was; a new
    path is made as before."""
    path = tmp_path / "cut.db"
    path.write_bytes(b"")
    os.utime(path, (time.time() - 60, time.time() - 60))  # truncated a minute ago (a new one may be a peer's)
    if beside == "its -wal":
        pathlib.Path(f"{path}-wal").write_bytes(b"\0" * 32)
    started = _cli("serve", "--db", str(path), "--port", "0")
    assert started.returncode == 2 and "Traceback" not in started.stderr
    assert started.stderr.startswith(f"walletsvc: cannot serve {path}: the file is empty"), started.stderr
    assert "restore a backup" in started.stderr and "new path" in started.stderr
    assert path.stat().st_size == 0
    with pytest.raises(sqlite3.OperationalError, match="the file is empty"):
        walletsvc.WalletService(str(path))
    fresh = walletsvc.WalletService(str(tmp_path / "new.db"))
    assert fresh.list_workspaces() == []
    fresh.close()


def test_an_empty_admin_token_is_refused_at_start(tmp_path) -> None:
    """Issue 43, item 8: `--admin-token ''` started with a random token, silently, while `--set admin_token=`
    was refused with the range (docs/reference.md: a value outside a setting's range is refused at start)."""
    for option in (["--admin-token", ""], ["--set", "admin_token="]):
        started = _cli("serve", "--demo", "--db", str(tmp_path / "token.db"), "--port", "0", *option)
        assert started.returncode == 2 and "Traceback" not in started.stderr
        assert "admin_token" in started.stderr and "1 to 256 characters" in started.stderr
        assert not (tmp_path / "token.db").exists()


@pytest.mark.parametrize("workers, sigint", [("1", "default"), ("2", "default"), ("1", "ignored")])
def test_sigterm_answers_every_request_under_way_then_stops_within_a_bound(tmp_path, workers, sigint) -> None:
    """Issue 43, item 4 (docs/reference.md): SIGTERM on `--workers 2` cut 30 of 32 requests under way with
    no answer, and one process took 5.4 s to exit. Now every worker stops accepting, answers what it has
    (here eight requests a latency rule holds for a second), and the server exits within the 5 s drain
    bound (and a second). It does so too where SIGINT is ignored (a shell's background job, nohup):
    one process used to drain, then serve on for good."""
    server = ServerProcess(str(tmp_path / "drain.db"), tmp_path / "drain.log", "--demo", "--workers", workers)
    if sigint == "ignored":
        server.command = ["sh", "-c", 'trap "" INT; exec "$@"', "sh", *server.command]  # (exec keeps it so)
    server.start()
    try:
        key, secret, admin, wallets = _demo_of(tmp_path / "drain.log")
        assert requests.post(server.url + "/_admin/faults", json={"action": "latency", "latency": 1.0,
                                                                 "method": "GET"},
                             headers=admin, timeout=10).status_code == 200
        answers: list[int] = []

        def call() -> None:
            path = f"/api/v1/wallets/{wallets[0]}"
            answers.append(requests.get(server.url + path, headers=_signed("GET", path, key, secret),
                                        timeout=10).status_code)

        calls = [threading.Thread(target=call) for _ in range(8)]
        for thread in calls:
            thread.start()
        time.sleep(0.4)  # all under way, held by the rule
        started = time.monotonic()
        server.process.terminate()
        server.process.wait(timeout=30)
        stopped = time.monotonic() - started
        for thread in calls:
            thread.join(10)
    finally:
        server.stop()
    assert answers == [200] * 8
    assert stopped < 5 + 1, stopped


def _shm_lost_under_load(path: pathlib.Path, load: _TransferLoad) -> dict:
    """The -shm of the file at ``path`` deleted under ``load``, then made anew by another tool opening the
    file; the load's answers once it stopped."""
    time.sleep(0.5)
    os.remove(f"{path}-shm")
    with contextlib.closing(sqlite3.connect(path)) as tool:  # (it makes a -shm anew)
        tool.execute("SELECT count(*) FROM wallets").fetchone()
    time.sleep(0.3)
    return load.stop()


def test_a_lost_shm_made_anew_by_another_tool_still_refuses_a_second_server_and_loses_nothing(
        tmp_path) -> None:
    """The attack on the file guard's removal: the -shm deleted under a server under load, then made anew by
    another tool opening the file; a second server started on it (its newcomer check looked only for a
    missing -shm) and the first, stopped, moved the -wal into the file from its lost index: the whole file
    destroyed, 3 runs in 3. Now the second is refused, naming the first (/proc/locks), and the first never
    checkpoints as it closes: what another program committed through the new -shm is kept."""
    path = tmp_path / "live.db"
    with demo_process(tmp_path, "live") as (server, (key, secret, _admin, wallets)):
        answers = _shm_lost_under_load(path, _TransferLoad(server.url, key, secret, wallets))
        second = _cli("serve", "--db", str(path), "--port", "0")
        assert second.returncode != 0 and "Traceback" not in second.stderr
        assert f"process {server.process.pid} still serves it" in second.stderr, second.stderr
        with contextlib.closing(sqlite3.connect(path)) as other, other:  # another program writes meanwhile
            other.execute("UPDATE workspaces SET name = 'written beside'")
    acked = {biz_id for biz_id, answer in answers.items() if answer == (200, "2000")}
    assert len(acked) > 20
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert acked <= {biz_id for (biz_id,) in conn.execute("SELECT biz_id FROM transfers")}
        assert conn.execute("SELECT name FROM workspaces").fetchone()[0] == "written beside"
    audit = _cli("audit", "--db", str(path))
    assert (audit.returncode, audit.stdout) == (0, "[]\n"), audit.stdout + audit.stderr


def test_a_worker_started_again_beside_one_that_lost_its_shm_is_refused_and_not_restarted(tmp_path) -> None:
    """docs/operations.md (When things go wrong): no process joins a file one of its servers lost the -shm
    of. `--workers 2` started a worker again after one died, and the new one served beside the one left
    (it joined as a second `serve` is refused from joining). Now it is refused, says why, and is not
    started again."""
    path = tmp_path / "workers.db"
    with demo_process(tmp_path, "workers", "--workers", "2") as (server, (key, secret, _admin, wallets)):
        _shm_lost_under_load(path, _TransferLoad(server.url, key, secret, wallets))
        log = tmp_path / "workers.log"
        first = [int(pid) for pid in re.findall(r"worker (\d+) serving", log.read_text())]
        assert len(first) == 2
        status = os.stat(path)  # (the worker left must hold the file: the one the load reached, if one only)
        file = f"{os.major(status.st_dev):02x}:{os.minor(status.st_dev):02x}:{status.st_ino}"
        locks = pathlib.Path("/proc/locks").read_text().splitlines()
        holding = {int(row[4]) for row in map(str.split, locks) if len(row) > 5 and row[5] == file}
        first.sort(key=lambda pid: pid in holding)  # a worker holding the file stays (last)
        assert first[1] in holding, (first, holding)
        os.kill(first[0], signal.SIGKILL)
        time.sleep(1.5)
        printed = log.read_text()
        assert sorted(re.findall(r"worker (\d+) serving", printed)) == sorted(str(pid) for pid in first)
        refused = re.findall(r"worker \d+ not started: .*", printed)
        assert len(refused) == 1 and f"process {first[1]} still serves it" in refused[0], printed[-3000:]


def test_a_file_another_program_wrote_while_no_server_ran_is_served(tmp_path, clock) -> None:
    """An ordinary tool beside the file (docs/operations.md): sqlite3 wrote the file while no server ran (its
    last connection moving the frames into the file as it closed), and another of its connections has
    written since and is still open when the service starts."""
    path = tmp_path / "edited.db"
    svc = walletsvc.WalletService(str(path), clock=clock)
    world_ = make_world(svc)
    svc.close()
    edit = sqlite3.connect(path)
    with edit:
        edit.execute("UPDATE workspaces SET name = 'Edited'")
    edit.close()  # (the last connection: its checkpoint changes the file)
    still_open = sqlite3.connect(path)
    with still_open:
        still_open.execute("UPDATE workspaces SET name = 'Edited again'")
    try:
        again = walletsvc.WalletService(str(path), clock=clock)
        try:
            assert again.create_transfer(world_["ws"]["id"], world_["a"], world_["b"], "1.00",
                                         "USD")["status"] == "COMPLETED"
            assert again.get_workspace(world_["ws"]["id"])["name"] == "Edited again"
        finally:
            again.close()
    finally:
        still_open.close()


def test_the_wal_starts_over_however_long_a_service_writes(tmp_path, clock) -> None:
    """docs/operations.md: once a checkpoint took every frame, the next write starts the -wal over, so it
    stays as large as a tenth of a second of writes (a checkpoint inside a transaction never lets it:
    350 MB after 3,000 transfers, and growing)."""
    path = tmp_path / "bounded.db"
    svc = walletsvc.WalletService(str(path), clock=clock)
    world_ = make_world(svc)
    sizes = []
    try:
        for _ in range(6):  # rounds of the same writes, each after a checkpoint fell due
            time.sleep(0.3)
            for _ in range(20):
                svc.create_transfer(world_["ws"]["id"], world_["a"], world_["b"], "0.01", "USD")
            sizes.append(os.path.getsize(f"{path}-wal"))
    finally:
        svc.close()
    assert sizes[-1] <= sizes[1] * 1.5, sizes  # (growing, it is three times as large)


def _transfer_until(path: str, workspace_id: str, wallets: list, stop_at: float) -> None:
    svc = walletsvc.WalletService(path, busy_timeout=30)
    while time.time() < stop_at:
        svc.create_transfer(workspace_id, wallets[0], wallets[1], "0.01", "USD")
    svc.close()


def test_the_wal_starts_over_while_two_processes_write_without_a_pause(tmp_path) -> None:
    """The same with two processes writing all the time (`--workers 2` under load): a checkpoint that took
    every frame was always followed by the other process's frames before the next write began, so the
    -wal never started over (2 GB of -wal after 15 s of transfers). The checkpoint now waits for the
    readers (RESTART), briefly: the next write starts the -wal over."""
    path, workspace_id, wallets = _shared_ledger(tmp_path)
    stop_at = time.time() + 3.0
    context = multiprocessing.get_context("fork")
    writers = [context.Process(target=_transfer_until, args=(path, workspace_id, wallets, stop_at))
               for _ in range(2)]
    for writer in writers:
        writer.start()
    salts = []  # the -wal header's salts (SQLite's file format): drawn anew each time it starts over
    while time.time() < stop_at - 0.5:  # (as the writers end, the last one to close removes the -wal)
        time.sleep(0.25)
        with open(f"{path}-wal", "rb") as wal:
            salts.append(wal.read(24)[16:24])
    for writer in writers:
        writer.join(30)
    assert [writer.exitcode for writer in writers] == [0, 0]
    assert len(set(salts)) >= 4, salts  # (before: one, all along)
    assert ledger_invariants(path)["total"] == 4 * 100000


def test_sixteen_threads_of_one_service_checkpointing_every_2_ms_conserve_money(tmp_path,
                                                                               monkeypatch) -> None:
    """Sixteen threads of one service, a checkpoint after a batch at most every 2 ms: every transfer is
    answered and the ledger adds up."""
    monkeypatch.setattr(walletsvc, "CHECKPOINT_SECONDS", 0.002)
    path, workspace_id, wallets = _shared_ledger(tmp_path)
    svc = walletsvc.WalletService(path, busy_timeout=30)
    stop_at, failures = time.monotonic() + 3, []

    def transfers(n: int) -> None:
        while time.monotonic() < stop_at and not failures:
            try:
                svc.create_transfer(workspace_id, wallets[n % 4], wallets[(n + 1) % 4], "0.01", "USD")
            except Exception as exc:  # noqa: BLE001 (any failure is the finding: asserted below)
                failures.append(exc)

    threads = [threading.Thread(target=transfers, args=(n,)) for n in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    svc.close()
    assert failures == []
    assert ledger_invariants(path)["total"] == 4 * 100000


class _TransferLoad:
    """Six clients sending signed transfers of 0.01 between the demo's alice and bob, each with a bizId of
    its own, until stopped: what each was answered, by bizId."""

    def __init__(self, url: str, key: str, secret: str, wallets: list) -> None:
        self.answers: dict[str, tuple[int, str]] = {}
        self._stop = threading.Event()

        def client(n: int) -> None:
            session = requests.Session()
            for attempt in itertools.count():
                if self._stop.is_set():
                    return
                biz_id = f"c{n}-{attempt}"
                body = json.dumps({"sourceWalletId": wallets[n % 2], "targetWalletId": wallets[1 - n % 2],
                                   "amount": "0.01", "currency": "USD", "bizId": biz_id}).encode()
                reply = session.post(url + TRANSFER_PATH, data=body, timeout=10,
                                     headers=_signed("POST", TRANSFER_PATH, key, secret, body))
                self.answers[biz_id] = (reply.status_code, reply.json()["code"])

        self._clients = [threading.Thread(target=client, args=(n,)) for n in range(6)]
        for thread in self._clients:
            thread.start()

    def stop(self) -> dict[str, tuple[int, str]]:
        self._stop.set()
        for thread in self._clients:
            thread.join(30)
        return self.answers


def _checkpoint_beside(path: pathlib.Path, mode: str) -> None:
    """The sqlite3 shell's `PRAGMA wal_checkpoint(MODE)` on a served file, as another tool runs it."""
    conn = sqlite3.connect(path, timeout=5)
    try:
        conn.execute(f"PRAGMA wal_checkpoint({mode})").fetchall()
    finally:
        conn.close()


@pytest.mark.parametrize("workers", ["1", "2"])
def test_touch_and_another_tools_checkpoint_beside_a_loaded_server_disturb_nothing(tmp_path, workers) -> None:
    """docs/operations.md: ordinary tools beside a running server never disturb it. The in-place-copy guard
    took `touch live.db` and the sqlite3 shell's checkpoint for a copy written over the file (S503 for good,
    and its recovery lost acknowledged transfers). Now every transfer is answered 200 and every one
    answered is in the file, which passes walletsvc audit."""
    path = tmp_path / "live.db"
    with demo_process(tmp_path, "live", "--workers", workers) as (server, (key, secret, _admin, wallets)):
        load = _TransferLoad(server.url, key, secret, wallets)
        for action in (lambda: path.touch(), lambda: _checkpoint_beside(path, "PASSIVE"),
                       lambda: os.utime(path, (0, 0)), lambda: _checkpoint_beside(path, "TRUNCATE"),
                       lambda: _checkpoint_beside(path, "RESTART"), lambda: path.touch()):
            time.sleep(0.3)
            action()
        time.sleep(0.3)
        answers = load.stop()
        assert requests.get(server.url + "/healthz", timeout=10).status_code == 200
    assert len(answers) > 50 and set(answers.values()) == {(200, "2000")}, set(answers.values())
    conn = sqlite3.connect(path)
    try:
        kept = {biz_id for (biz_id,) in conn.execute("SELECT biz_id FROM transfers")}
    finally:
        conn.close()
    assert set(answers) <= kept
    audit = _cli("audit", "--db", str(path))
    assert (audit.returncode, audit.stdout) == (0, "[]\n"), audit.stderr


def test_a_backup_taken_while_two_workers_write_is_restored_into_every_process_at_once(tmp_path) -> None:
    """docs/operations.md, Backup and restore: `walletsvc backup` copies a served file consistently while
    `--workers 2` writes; `walletsvc restore` puts the copy in through the write door: both processes answer
    the copy's balances from the next request, transfers go on from there, a request replayed from before
    the restore is still refused, and the ledger passes walletsvc audit."""
    path, copy_ = tmp_path / "live.db", tmp_path / "copy.db"
    with demo_process(tmp_path, "live", "--workers", "2") as (server, (key, secret, _admin, wallets)):
        captured = _signed("GET", "/api/v1/wallets", key, secret)
        assert requests.get(server.url + "/api/v1/wallets", headers=captured, timeout=10).status_code == 200
        load = _TransferLoad(server.url, key, secret, wallets)
        time.sleep(0.5)
        backed_up = _cli("backup", str(copy_), "--db", str(path))
        time.sleep(0.5)
        answers = load.stop()
        assert backed_up.returncode == 0, backed_up.stderr
        assert oct(copy_.stat().st_mode & 0o777) == "0o600"  # (it holds the keys' secrets)
        with contextlib.closing(sqlite3.connect(copy_)) as conn:
            assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            in_copy = conn.execute("SELECT count(*) FROM transfers").fetchone()[0]
            copied = {name: balance for name, balance in conn.execute("SELECT name, balance FROM wallets")}
        assert 0 < in_copy < len(answers) and set(answers.values()) == {(200, "2000")}
        assert copied["alice"] + copied["bob"] == 200000  # (one consistent state: the total conserved)
        restored = _cli("restore", str(copy_), "--db", str(path))
        assert restored.returncode == 0 and "every server on it serves it" in restored.stdout, restored.stderr
        for _ in range(12):  # a fresh connection each: both processes answer
            with requests.Session() as session:
                balances = {wallet["name"]: wallet["balance"] for wallet in session.get(
                    server.url + "/api/v1/wallets", headers=_signed("GET", "/api/v1/wallets", key, secret),
                    timeout=10).json()["data"]["content"]}
            assert balances["alice"] == f"{copied['alice'] / 100:.2f}"
            assert balances["bob"] == f"{copied['bob'] / 100:.2f}"
        replayed = requests.get(server.url + "/api/v1/wallets", headers=captured, timeout=10)
        assert (replayed.status_code, replayed.json()["code"]) == (401, "GA2013")
        assert "already used" in replayed.json()["detail"]  # (the restore kept the nonce records)
        body = json.dumps({"sourceWalletId": wallets[0], "targetWalletId": wallets[1], "amount": "1.00",
                           "currency": "USD"}).encode()
        after = requests.post(server.url + TRANSFER_PATH, data=body, timeout=10,
                              headers=_signed("POST", TRANSFER_PATH, key, secret, body))
        assert after.status_code == 200, after.text
    audit = _cli("audit", "--db", str(path))
    assert (audit.returncode, audit.stdout) == (0, "[]\n"), audit.stderr
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute("SELECT count(*) FROM transfers").fetchone()[0] == in_copy + 1


def test_a_restore_from_a_file_being_written_reads_one_state_of_it(tmp_path) -> None:
    """The attack on restore: a file still served under load read table by table gave a ledger that failed
    its audit (10 of 10) or a bare FOREIGN KEY failure (12 of 12). Now the backup is copied first with
    SQLite's backup API (one state of it): every restore is whole, and the restored ledger passes
    walletsvc audit."""
    live = tmp_path / "live.db"
    walletsvc.WalletService(str(live)).close()
    with demo_process(tmp_path, "source") as (server, (key, secret, _admin, wallets)):
        load = _TransferLoad(server.url, key, secret, wallets)
        try:
            for _ in range(5):
                time.sleep(0.2)
                restored = _cli("restore", str(tmp_path / "source.db"), "--db", str(live))
                assert restored.returncode == 0, restored.stderr
                audit = _cli("audit", "--db", str(live))
                assert (audit.returncode, audit.stdout) == (0, "[]\n"), audit.stdout + audit.stderr
        finally:
            answers = load.stop()
    assert len(answers) > 20


@pytest.mark.parametrize("backup", ["missing", "not a database", "malformed", "another schema version",
                                    "a newer schema version", "the database itself", "the database's -wal",
                                    "a ledger that fails its audit", "a ledger clock no walletsvc wrote",
                                    "a fault rule no walletsvc wrote", "no sandbox row"])
def test_a_backup_or_restore_that_cannot_be_done_is_refused_in_one_line_changing_nothing(tmp_path,
                                                                                        backup) -> None:
    """docs/operations.md, Backup and restore: refused with what to do: the live database is as it was."""
    live, copy_ = tmp_path / "live.db", tmp_path / "copy.db"
    svc = walletsvc.WalletService(str(live))
    world_ = make_world(svc)
    svc.close()
    assert _cli("backup", str(copy_), "--db", str(live)).returncode == 0
    if backup == "not a database":
        copy_.write_bytes(b"not a database" * 100)
    elif backup == "malformed":
        with open(copy_, "r+b") as handle:  # (a page in the middle: the b-trees' pages no longer agree)
            handle.seek(copy_.stat().st_size // 2)
            handle.write(os.urandom(4096))
    elif backup == "missing":
        copy_.unlink()
    else:
        edit = {"another schema version": "UPDATE schema_version SET version = 6",
                "a newer schema version": "UPDATE schema_version SET version = 99",
                "a ledger that fails its audit": "UPDATE wallets SET balance = balance + 100000000",
                "a ledger clock no walletsvc wrote": "UPDATE ledger_clock SET last_id = 'zzzz'",
                "a fault rule no walletsvc wrote": "INSERT INTO fault_rules (id, rule) VALUES (1, 'no rule')",
                "no sandbox row": "DELETE FROM sandbox"}.get(backup)
        if edit:
            with contextlib.closing(sqlite3.connect(copy_)) as conn, conn:
                conn.execute(edit)
    verb, target = {"the database itself": ("backup", live), "the database's -wal": (
        "backup", pathlib.Path(f"{live}-wal"))}.get(backup, ("restore", copy_))
    refused = _cli(verb, str(target), "--db", str(live))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert {"missing": "no backup at", "not a database": "is no walletsvc database",
            "malformed": "is malformed", "another schema version": "walletsvc audit --db",
            "a newer schema version": "with the walletsvc that made it",
            "the database itself": "is the database itself", "the database's -wal": "a file of its own",
            "a ledger that fails its audit": "fails the audit (conservation",
            "a ledger clock no walletsvc wrote": "ledger_clock row is not a time and an id",
            "a fault rule no walletsvc wrote": "fault rule 1 is no rule",
            "no sandbox row": "not one ledger_clock row and one sandbox row"}[backup] in refused.stderr
    after = walletsvc.WalletService(str(live))
    try:
        assert after.get_wallet(world_["a"])["balance"] == "100.00" and after.audit() == []
    finally:
        after.close()


@pytest.mark.parametrize("swap", SWAPS, ids=SWAP_NAMES)
def test_a_deleted_or_replaced_database_file_is_noticed_before_the_next_write(tmp_path, swap) -> None:
    """Defect: the file deleted under a running server, 20 transfers acknowledged into nothing; replaced,
    the server went on answering 200 while the file became malformed."""
    path = tmp_path / "sandbox.db"
    with demo_process(tmp_path, "sandbox") as (server, (key, secret, admin, wallets)):
        swap(path)
        body = json.dumps({"sourceWalletId": wallets[0], "targetWalletId": wallets[1], "amount": "1.00",
                           "currency": "USD"}).encode()
        answer = requests.post(server.url + TRANSFER_PATH, data=body, timeout=10,
                               headers=_signed("POST", TRANSFER_PATH, key, secret, body))
        assert (answer.status_code, answer.json()["code"]) == (503, "S503")
        assert "deleted or replaced" in answer.json()["detail"]
        created = requests.post(server.url + "/_admin/workspaces", json={"name": "lost"}, headers=admin,
                                timeout=10)
        assert (created.status_code, created.json()["code"]) == (503, "S503")
        health = requests.get(server.url + "/healthz", timeout=10)
        assert (health.status_code, health.json()["code"]) == (503, "S503")
        assert requests.get(server.url + "/api/v1/wallets",
                            headers=_signed("GET", "/api/v1/wallets", key, secret),
                            timeout=10).status_code == 503  # a read records its nonce: a write too
    if path.exists():  # the file at the path is whole, and nothing was written into it
        conn = sqlite3.connect(path)
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master")}
        if "workspaces" in tables:  # (a new file's tables live in its -wal until the first checkpoint)
            assert conn.execute("SELECT count(*) FROM workspaces WHERE name = 'lost'").fetchone()[0] == 0
            assert conn.execute("SELECT count(*) FROM transfers").fetchone()[0] == 0
        conn.close()


@pytest.mark.parametrize("swap", SWAPS, ids=SWAP_NAMES)
def test_under_load_with_two_workers_nothing_is_acknowledged_into_a_swapped_file(tmp_path, swap) -> None:
    """The attack's reproduction (docs/operations.md): under `--workers 2` and six transfer clients, the file
    or its -wal deleted or replaced: 2-5 transfers were answered 200 into the unlinked file, and a
    deleted -wal gave S500 "malformed". Now every transfer sent after the change answers S503 (never
    200, never 500), and after a kill -9 the file at its path passes integrity_check."""
    path = tmp_path / "load.db"
    with demo_process(tmp_path, "load", "--workers", "2") as (server, (key, secret, _admin, wallets)):
        swapped = threading.Event()
        answers: list[tuple[bool, int, str]] = []  # (sent after the swap, status, code)

        def client(n: int) -> None:
            session = requests.Session()
            for attempt in range(400):
                body = json.dumps({"sourceWalletId": wallets[n % 2], "targetWalletId": wallets[1 - n % 2],
                                   "amount": "0.01", "currency": "USD", "bizId": f"c{n}-{attempt}"}).encode()
                after = swapped.is_set()
                reply = session.post(server.url + TRANSFER_PATH, data=body, timeout=10,
                                     headers=_signed("POST", TRANSFER_PATH, key, secret, body))
                answers.append((after, reply.status_code, reply.json()["code"]))
                if after and len([a for a in answers if a[0]]) > 60:
                    return

        clients = [threading.Thread(target=client, args=(n,)) for n in range(6)]
        for thread in clients:
            thread.start()
        time.sleep(0.5)
        swap(path)
        swapped.set()
        for thread in clients:
            thread.join(60)
        server.kill()
        time.sleep(1)  # its workers stop with it
    before = [status for after, status, _ in answers if not after]
    after = [(status, code) for sent_after, status, code in answers if sent_after]
    assert before.count(200) > 10 and len(after) > 30
    assert set(after) == {(503, "S503")}, sorted(set(after))
    if path.exists():
        conn = sqlite3.connect(path)
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        conn.close()


def test_a_database_is_never_made_through_a_dangling_symlink(tmp_path) -> None:
    """Review: O_EXCL failed on a planted dangling symlink and SQLite then made the target, 0644."""
    (tmp_path / "link.db").symlink_to(tmp_path / "target.db")
    with pytest.raises(RuntimeError, match="symbolic link"):
        walletsvc.WalletService(str(tmp_path / "link.db"))
    assert not (tmp_path / "target.db").exists()


def test_after_a_swap_no_new_connection_opens_the_file_put_there(tmp_path, make_service) -> None:
    """Review: a connection opened after the file was replaced read the new file with this one's -wal.
    Now no connection is opened on it: every use after the swap is S503."""
    path = tmp_path / "swap.db"
    svc = make_service(str(path))
    world_ = make_world(svc)
    app = walletsvc.create_app(svc)
    _replace(path)
    answers = []

    def read() -> None:  # a new thread: a new connection
        client = walletsvc.Client(app, world_["key"]["apiKey"], world_["key"]["secret"])
        answers.append(client.send("GET", "/api/v1/wallets")[2]["code"])

    thread = threading.Thread(target=read)
    thread.start()
    thread.join(10)
    assert answers == ["S503"]
    assert webtest.TestApp(app).get("/healthz", expect_errors=True).json["code"] == "S503"


def _transactions(svc: walletsvc.WalletService) -> list[tuple[str, str]]:
    """From now on, each BEGIN, COMMIT and ROLLBACK any connection of this thread writes through runs
    (the one that syncs, and this thread's own), with the walletsvc function that ran it."""
    seen: list[tuple[str, str]] = []
    module = walletsvc.__file__

    def trace(sql: str) -> None:
        words = sql.upper().split()
        word = words[0]
        if word in ("BEGIN", "COMMIT") or words == ["ROLLBACK"]:  # (not a savepoint's ROLLBACK TO)
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename != module:
                frame = frame.f_back
            seen.append((word, frame.f_code.co_qualname if frame else "?"))

    for durable in (True, False):
        svc.db.write([lambda conn: conn.set_trace_callback(trace)], durable=durable)
    seen.clear()
    return seen


@pytest.mark.parametrize("journal_size", [0, 100])
def test_every_request_and_python_write_begins_and_commits_once_through_one_function(
        tmp_path, make_service, clock: FrozenClock, journal_size: int, monkeypatch) -> None:
    """docs/contributing.md: storage has one write entry point; a request writes once, at its end (its
    nonce record, a transfer's rows and its journal entry together), and so does each Python API write;
    the checkpoint after every batch here runs in no transaction of its own."""
    monkeypatch.setattr(walletsvc, "CHECKPOINT_SECONDS", 0.0)
    svc = make_service(str(tmp_path / "once.db"), clock=clock, journal_size=journal_size)
    world_ = make_world(svc)
    api = Api(webtest.TestApp(walletsvc.create_app(svc)), world_["key"], clock)
    seen = _transactions(svc)
    actions = {
        "signed GET": lambda: data(api.get(f"/api/v1/wallets/{world_['a']}")),
        "signed create-transfer": lambda: data(api.transfer(transfer_body(world_, bizId="once-1"))),
        "a refused transfer": lambda: error(api.transfer(transfer_body(world_, amount="999.00")), "T2001",
                                            422),
        "an idempotent replay": lambda: data(api.transfer(transfer_body(world_, bizId="once-1"))),
        "create_wallet": lambda: svc.create_wallet(world_["ws"]["id"], "USD"),
        "deposit": lambda: svc.deposit(world_["b"], "1.00"),
        "create_transfer": lambda: svc.create_transfer(world_["ws"]["id"], world_["a"], world_["b"], "1.00",
                                                       "USD"),
    }
    doors = set()
    for name, action in actions.items():
        seen.clear()
        action()
        assert [word for word, _ in seen] == ["BEGIN", "COMMIT"], name
        doors.update(function for _, function in seen)
    assert len(doors) == 1  # one function begins and commits every write: no second door


def test_a_write_unit_cannot_write_through_the_door_it_runs_in(tmp_path, make_service) -> None:
    """A unit that called Database.write would wait for the batch it is part of: it is refused at once,
    and nothing of its caller's units is kept."""
    svc = make_service(str(tmp_path / "nested.db"))
    db = svc.db
    db.write([lambda conn: conn.execute("CREATE TABLE probe (n INTEGER)")])

    def nested(conn: sqlite3.Connection) -> None:
        conn.execute("INSERT INTO probe VALUES (1)")
        db.write([lambda inner: inner.execute("INSERT INTO probe VALUES (2)")])

    started = time.monotonic()
    with pytest.raises(RuntimeError, match="write unit"):
        db.write([nested])
    assert time.monotonic() - started < 1
    assert db.one("SELECT count(*) FROM probe")[0] == 0


def _sharing_turns(make_service, path: pathlib.Path, shared: bool = True) -> walletsvc.Database:
    """A file's Database with a table ``probe (n)``, sharing turns with the processes it forks if
    ``shared``."""
    db = make_service(str(path)).db
    db.write([lambda conn: conn.execute("CREATE TABLE probe (n INTEGER)")])
    if shared:
        db.share_turns()
    return db


def _worker_holding_a_write(db: walletsvc.Database, seconds: float) -> int:
    """A forked process whose write (``probe`` row 1) holds its transaction for ``seconds``: its pid, once
    it holds it."""
    inside, told = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            db.write([lambda conn: (conn.execute("INSERT INTO probe VALUES (1)"), os.write(told, b"1"),
                                    time.sleep(seconds))])
            code = 0
        finally:
            os._exit(code)
    os.close(told)
    try:
        assert os.read(inside, 1) == b"1"  # (b"": the worker's write failed)
    finally:
        os.close(inside)
    return pid


def _exit_status(pid: int) -> int:
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.mark.parametrize("shared", [True, False])
def test_processes_sharing_turns_wait_for_each_others_write_asleep(tmp_path, make_service, monkeypatch,
                                                                   shared) -> None:
    """docs/sandbox.md: processes forked after ``share_turns()`` (those of `serve --workers`) wait for
    another's write asleep, woken as it commits; processes that share no turns retry SQLite's lock every
    50-250 us meanwhile."""
    monkeypatch.setattr(walletsvc, "TURN_RECHECK", 60.0)  # only the wake-up ends the wait within the patience
    db = _sharing_turns(make_service, tmp_path / "turns.db", shared)
    worker = _worker_holding_a_write(db, 0.3)
    begins: list[str] = []
    with db.connection() as conn:  # (the leader's own connection runs its batch)
        conn.set_trace_callback(lambda sql: begins.append(sql) if sql.startswith("BEGIN") else None)
    started = time.monotonic()
    with db.patience(3.0):  # (the turn looked at again only as the patience ends: the write, 3 s late)
        db.write([lambda conn: conn.execute("INSERT INTO probe VALUES (2)")])
    assert time.monotonic() - started < 2.0
    assert _exit_status(worker) == 0
    assert db.one("SELECT group_concat(n) FROM probe")[0] == "1,2"  # after the worker's commit
    if shared:  # one BEGIN, or a few more while the worker's checkpoint holds SQLite's lock (no turn)
        assert len(begins) < 30
    else:  # about 1,000 in the 0.3 s
        assert len(begins) > 100


def test_a_worker_waiting_for_its_turn_gives_up_at_its_patience(tmp_path, make_service) -> None:
    """docs/sandbox.md: an admin write waits at most half a second for the lock, then answers S503, and a
    worker's turn is no exception: past its patience the write raises BatchLost, nothing of it kept."""
    db = _sharing_turns(make_service, tmp_path / "patience.db")
    worker = _worker_holding_a_write(db, 0.8)
    started = time.monotonic()
    with db.patience(0.2), pytest.raises(walletsvc.BatchLost, match="locked"):
        db.write([lambda conn: conn.execute("INSERT INTO probe VALUES (2)")])
    assert 0.2 <= time.monotonic() - started < 0.7
    assert _exit_status(worker) == 0
    assert db.one("SELECT group_concat(n) FROM probe")[0] == "1"


def test_a_worker_killed_holding_its_turn_keeps_no_other_waiting(tmp_path, make_service) -> None:
    """The kernel drops a killed worker's lock without a wake-up: the others look again every few ms and
    write on at once, and nothing of the killed worker's write is kept."""
    db = _sharing_turns(make_service, tmp_path / "killed.db")
    worker = _worker_holding_a_write(db, 30)
    killer = threading.Timer(0.2, os.kill, (worker, signal.SIGKILL))
    killer.start()
    started = time.monotonic()
    with db.patience(2.0):
        db.write([lambda conn: conn.execute("INSERT INTO probe VALUES (2)")])
    assert time.monotonic() - started < 1.5
    assert _exit_status(worker) == -signal.SIGKILL
    assert db.one("SELECT group_concat(n) FROM probe")[0] == "2"


def test_an_interrupt_just_after_taking_the_turn_gives_it_back(tmp_path, make_service, monkeypatch) -> None:
    """Ctrl-C landing in the main thread as it took its turn: the write is interrupted, and the turn given
    back, so that the other workers write on."""
    db = _sharing_turns(make_service, tmp_path / "interrupted.db")
    lockf = fcntl.lockf

    def interrupted(file: Any, operation: int, *args: Any) -> Any:
        lockf(file, operation, *args)
        if operation & fcntl.LOCK_EX:
            monkeypatch.setattr(fcntl, "lockf", lockf)  # (once)
            raise KeyboardInterrupt
    monkeypatch.setattr(fcntl, "lockf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        db.write([lambda conn: conn.execute("INSERT INTO probe VALUES (1)")])
    pid = os.fork()
    if pid == 0:  # another worker
        code = 1
        try:
            with db.patience(1.0):
                db.write([lambda conn: conn.execute("INSERT INTO probe VALUES (2)")])
            code = 0
        finally:
            os._exit(code)
    assert _exit_status(pid) == 0
    assert db.one("SELECT group_concat(n) FROM probe")[0] == "2"


def test_a_threads_first_connection_waits_while_another_program_holds_the_file(tmp_path,
                                                                               make_service) -> None:
    """An attack's finding: a worker's first connection, opened while another process briefly held the whole
    file (the last one closing it, a recovery), answered S503 at once. Its set-up now waits the busy
    timeout, as the file's opening does; only its statements after it never wait in SQLite's handler."""
    path = tmp_path / "held.db"
    svc = make_service(str(path))
    workspace = svc.create_workspace("w")
    svc.db.close()
    other = sqlite3.connect(path, check_same_thread=False)
    other.execute("PRAGMA locking_mode = EXCLUSIVE")
    other.execute("SELECT count(*) FROM sqlite_master").fetchone()  # the whole file is its own now
    threading.Timer(0.3, other.close).start()
    listed: list = []
    thread = threading.Thread(target=lambda: listed.extend(svc.list_workspaces()))  # (a new connection)
    started = time.monotonic()
    thread.start()
    thread.join(10)
    assert [each["id"] for each in listed] == [workspace["id"]]
    assert 0.25 < time.monotonic() - started < 5


def test_the_workers_of_serve_share_one_turn(tmp_path) -> None:
    """docs/sandbox.md: the workers of `serve --workers` take turns through a lock the parent made before
    forking: each worker holds the same unnamed file, and a wake-up (an eventfd) of its own kind."""
    with demo_process(tmp_path, "turns", "--workers", "2"):
        log, deadline = tmp_path / "turns.log", time.monotonic() + 10
        while len(workers := re.findall(r"worker (\d+) serving", log.read_text())) < 2:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        unnamed, wakes = [], []
        for pid in workers:
            links = {fd: os.readlink(fd) for fd in pathlib.Path(f"/proc/{pid}/fd").iterdir()}
            unnamed.append({(status.st_dev, status.st_ino) for fd, link in links.items()
                            if link.endswith(" (deleted)") and (status := os.stat(fd))})
            wakes.append(sum(link == "anon_inode:[eventfd]" for link in links.values()))
    assert unnamed[0] & unnamed[1], unnamed
    assert wakes == [1, 1]


def test_a_unit_that_fails_inside_a_batch_rolls_back_alone(tmp_path, make_service, monkeypatch) -> None:
    """docs/contract.md: writes waiting together run in one transaction, each in its own savepoint, and
    commit once; the one that raises gets its own exception and leaves nothing; the others commit."""
    svc = make_service(str(tmp_path / "batch.db"))
    db = svc.db
    db.write([lambda conn: conn.execute("CREATE TABLE probe (n INTEGER PRIMARY KEY)")])
    statements: list[str] = []  # of every thread's connection (a batch writes through its leader's)
    counted = {"COMMIT", "ROLLBACK TO unit"}.intersection
    holding, release = threading.Event(), threading.Event()

    def traced_write(units: list) -> list:
        with db.connection() as conn:
            conn.set_trace_callback(lambda sql: statements.extend(counted({sql})))
        return db.write(units)

    def hold() -> None:  # a writer of this process holds the turn while eight units queue behind it
        traced_write([lambda conn: (holding.set(), release.wait(10))])

    results: dict[int, Any] = {}

    def unit(n: int) -> None:
        def write(conn: sqlite3.Connection) -> int:
            conn.execute("INSERT INTO probe VALUES (?)", (n,))
            if n == 3:
                raise ValueError("unit 3 fails")
            return n * 10
        try:
            results[n] = traced_write([write])[0]
        except ValueError as exc:
            results[n] = exc

    holder = threading.Thread(target=hold)
    holder.start()
    holding.wait(10)
    threads = [threading.Thread(target=unit, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    release.set()
    for thread in [holder, *threads]:
        thread.join(10)
    assert isinstance(results.pop(3), ValueError)
    assert results == {n: n * 10 for n in range(8) if n != 3}
    kept = set(db.one("SELECT group_concat(n) FROM probe")[0].split(","))
    assert kept == {str(n) for n in range(8) if n != 3}
    assert statements.count("COMMIT") == 2  # the holder's, then one for all eight units
    assert statements.count("ROLLBACK TO unit") == 1


@pytest.mark.parametrize("what", ["database", "wal"])
def test_a_file_gone_during_a_batch_answers_s503_for_every_unit_and_acknowledges_none(tmp_path, make_service,
                                                                                       what) -> None:
    """docs/operations.md: the file's identity is checked inside the batch's lock, before its COMMIT."""
    path = tmp_path / "gone.db"
    svc = make_service(str(path))
    world_ = make_world(svc)
    app = walletsvc.create_app(svc)
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with contextlib.suppress(sqlite3.Error):
            svc.db.write([lambda conn: (holding.set(), release.wait(10))])

    holder = threading.Thread(target=hold)
    holder.start()
    holding.wait(10)
    answers: list[dict] = []

    def transfer(n: int) -> None:
        client = walletsvc.Client(app, world_["key"]["apiKey"], world_["key"]["secret"])
        body = {"sourceWalletId": world_["a"], "targetWalletId": world_["b"], "amount": "1.00",
                "currency": "USD", "bizId": f"gone-{n}"}
        answers.append(client.send("POST", TRANSFER_PATH, body=json.dumps(body).encode())[2])

    threads = [threading.Thread(target=transfer, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    time.sleep(0.3)  # all six wait behind the holder
    os.remove(f"{path}-wal" if what == "wal" else path)
    release.set()
    for thread in [holder, *threads]:
        thread.join(10)
    assert [answer["code"] for answer in answers] == ["S503"] * 6
    assert all("deleted or replaced" in answer["detail"] for answer in answers)
    health = webtest.TestApp(app).get("/healthz", expect_errors=True)
    assert (health.status_int, health.json["code"]) == (503, "S503")


def test_a_replay_sent_at_once_from_eight_threads_and_two_processes_wins_once(tmp_path, two_servers) -> None:
    """docs/signing.md: a nonce is recorded atomically; of 16 copies of one signed transfer sent at once to
    two processes, exactly one is applied and the others answer GA2013."""
    servers, (key, secret, _admin, wallets) = two_servers
    body = json.dumps({"sourceWalletId": wallets[0], "targetWalletId": wallets[1], "amount": "1.00",
                       "currency": "USD", "bizId": "once"}).encode()
    headers = _signed("POST", TRANSFER_PATH, key, secret, body)
    start = threading.Barrier(16)
    answers: list[tuple[int, str]] = []

    def send(server: ServerProcess) -> None:
        session = requests.Session()
        start.wait(10)
        reply = session.post(server.url + TRANSFER_PATH, data=body, headers=headers, timeout=10)
        answers.append((reply.status_code, reply.json()["code"]))

    threads = [threading.Thread(target=send, args=(servers[n % 2],)) for n in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(answers) == [(200, "2000")] + [(401, "GA2013")] * 15
    balances = _balances_over_http(servers[0].url, key, secret)
    assert (balances["alice"], balances["bob"]) == ("999.00", "1001.00")  # moved once


###############################################################################
# walletsvc serve --workers N (docs/operations.md) #############################
###############################################################################


def test_workers_share_the_load_of_one_socket(tmp_path) -> None:
    with demo_process(tmp_path, "w", "--workers", "2") as (server, (key, secret, admin, _)):
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda _: requests.get(server.url + "/api/v1/wallets", timeout=10, headers=_signed(
                "GET", "/api/v1/wallets", key, secret)), range(64)))
        printed = (tmp_path / "w.log").read_text()
        assert len(set(re.findall(r"worker (\d+) serving", printed))) == 2
        assert requests.get(server.url + "/_admin/journal", params={"size": 1}, headers=admin,
                            timeout=10).json()["data"]["page"]["totalElements"] == 64
    assert server.process.returncode == 0


def test_workers_hold_their_own_locks_and_leave_with_their_parent(tmp_path) -> None:
    """Review: workers forked with the parent's connection open took no SQLite locks of their own, and
    outlived a killed parent; another process then deleted the WAL under them and acknowledged
    transfers were lost."""
    path = tmp_path / "locks.db"
    with demo_process(tmp_path, "locks", "--workers", "2") as (server, (key, secret, _admin, wallets)):
        body = json.dumps({"sourceWalletId": wallets[0], "targetWalletId": wallets[1], "amount": "1.00",
                           "currency": "USD"}).encode()

        def pay(_: int) -> int:
            return requests.post(server.url + TRANSFER_PATH, data=body, timeout=10,
                                 headers=_signed("POST", TRANSFER_PATH, key, secret, body)).status_code
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert set(pool.map(pay, range(40))) == {200}
        assert _cli("workspace", "list", "--db", str(path)).returncode == 0  # another process comes and goes
        assert os.path.exists(f"{path}-wal")  # the workers' locks kept it from taking the WAL away
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert set(pool.map(pay, range(40))) == {200}
        server.kill()  # the parent, with SIGKILL: its workers must not serve on alone
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                requests.get(server.url + "/healthz", timeout=1)
            except requests.RequestException:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the workers outlived their parent")
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT count(*) FROM transfers").fetchone()[0] == 80  # every acknowledged one
    conn.close()


def test_healthz_and_admin_answer_within_a_second_while_a_writer_holds_the_lock(tmp_path) -> None:
    """Review: two admin writes waiting out the 5 s busy timeout took both control threads, and /healthz
    waited behind them."""
    with (demo_process(tmp_path, "held") as (server, (_key, _secret, admin, _)),
          contextlib.closing(sqlite3.connect(tmp_path / "held.db", isolation_level=None)) as holder):
        holder.execute("BEGIN IMMEDIATE")
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            started = time.monotonic()
            writes = [pool.submit(requests.post, server.url + "/_admin/clock", json={"advance": 1},
                                  headers=admin, timeout=10) for _ in range(2)]
            time.sleep(0.1)
            health = requests.get(server.url + "/healthz", timeout=10)
            assert health.status_code == 200 and time.monotonic() - started < 1.0
            for write in writes:
                answer = write.result()
                assert (answer.status_code, answer.json()["code"]) == (503, "S503")
            assert time.monotonic() - started < 2.0  # S503 after about half a second, not five


def test_the_control_surface_answers_while_latency_holds_every_worker(tmp_path) -> None:
    """Defect: a 10 s latency rule with 8 clients kept /healthz waiting 19 s, DELETE /_admin/faults 10 s."""
    with demo_process(tmp_path, "slow", "--threads", "2") as (server, (key, secret, admin, _)):
        requests.post(server.url + "/_admin/faults", json={"action": "latency", "latency": 3}, headers=admin,
                      timeout=10)
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            held = [pool.submit(requests.get, server.url + "/api/v1/wallets", timeout=30,
                                headers=_signed("GET", "/api/v1/wallets", key, secret)) for _ in range(6)]
            time.sleep(0.5)  # every worker thread is asleep in the rule
            for method, path in (("GET", "/healthz"), ("GET", "/_admin/faults"), ("DELETE", "/_admin/faults"),
                                 ("GET", "/_admin/console")):
                started = time.monotonic()
                answer = requests.request(method, server.url + path, headers=admin, timeout=10)
                assert answer.status_code == 200 and time.monotonic() - started < 1.0, (
                    path, answer.status_code)
            assert all(future.result().status_code == 200 for future in held)


###############################################################################
# Replay protection, whatever the clock does (docs/operations.md) ##############
###############################################################################


def test_a_nonce_recorded_by_one_process_is_rejected_by_another(tmp_path, clock) -> None:
    path, workspace_id, _ = _shared_ledger(tmp_path)
    first_svc = walletsvc.WalletService(path, clock=clock)
    key = first_svc.create_api_key(workspace_id, ["wallet:read"])
    first = Api(webtest.TestApp(walletsvc.create_app(first_svc)), key, clock)
    second_svc = walletsvc.WalletService(path, clock=clock)
    second = Api(webtest.TestApp(walletsvc.create_app(second_svc)), key, clock)
    headers = first.headers("GET", "/api/v1/wallets")
    data(first.request("GET", "/api/v1/wallets", headers=headers))
    error(second.request("GET", "/api/v1/wallets", headers=headers), "GA2013", 401)


def test_a_captured_transfer_is_refused_after_the_clock_moves_forward_and_back(walletsvc_sandbox) -> None:
    """Defect: advance 1 h, any signed GET purged the record, back 1 h: the capture moved money again."""
    sandbox = walletsvc_sandbox
    app = webtest.TestApp(sandbox.app)
    key, secret = sandbox.key["apiKey"], sandbox.key["secret"]
    alice, bob = sandbox.wallets["alice"]["id"], sandbox.wallets["bob"]["id"]
    app.post_json("/_admin/clock", {"freeze": True, "at": NOW}, headers=ADMIN)
    body = json.dumps({"sourceWalletId": alice, "targetWalletId": bob, "amount": "10.00",
                       "currency": "USD"}).encode()
    captured = _signed("POST", TRANSFER_PATH, key, secret, body, timestamp=NOW)
    assert app.post(TRANSFER_PATH, body, headers=captured).json["success"] is True
    app.post_json("/_admin/clock", {"advance": 3600}, headers=ADMIN)
    assert app.get("/api/v1/wallets", headers=_signed("GET", "/api/v1/wallets", key, secret,
                                                      timestamp=NOW + 3600)).json["success"] is True
    app.post_json("/_admin/clock", {"advance": -3600}, headers=ADMIN)
    replay = app.post(TRANSFER_PATH, body, headers=captured, expect_errors=True)
    error(replay, "GA2013", 401)
    assert sandbox.service.get_wallet(alice)["balance"] == "990.00"
    fresh = app.get("/api/v1/wallets",
                    headers=_signed("GET", "/api/v1/wallets", key, secret, timestamp=NOW + 5))
    assert fresh.json["success"] is True  # a timestamp the purge did not cover passes


def test_a_keys_forgotten_seconds_are_kept_as_runs_never_wider_than_what_was_forgotten(tmp_path, clock,
                                                                                       make_service) -> None:
    """Review: the forgotten seconds grew by a row per key per second. They are runs now: a key under
    steady load leaves one, and a run never covers a second that held no forgotten record."""
    svc = make_service(str(tmp_path / "runs.db"), clock=clock)
    world_ = make_world(svc)
    app = webtest.TestApp(walletsvc.create_app(svc, nonce_records=1000))
    key = world_["key"]
    first = int(clock())
    for n in range(14_000):  # past the records (1000) and their digests (10,000)
        if n % 100 == 0 and n:
            clock.advance(1 if n != 1000 else 2)  # one second skipped: no request was signed in it
        app.get("/api/v1/wallets", headers=walletsvc.sign_request(
            "GET", "/api/v1/wallets", b"", key["apiKey"], key["secret"], timestamp=int(clock())))
    with svc.db.connection() as conn:
        runs = [tuple(run) for run in conn.execute(
            "SELECT lo, hi FROM nonces_forgotten WHERE api_key = ? ORDER BY lo", (key["apiKey"],))]
    assert runs[0] == (first, first + 9) and runs[1][0] == first + 11  # the gap of first + 10 is kept
    for second, refused in ((first + 5, True), (first + 10, False), (first + 11, True)):
        clock.now = second
        answer = app.get("/api/v1/wallets", expect_errors=True, headers=walletsvc.sign_request(
            "GET", "/api/v1/wallets", b"", key["apiKey"], key["secret"], timestamp=second))
        assert (answer.json["code"] == "GA2013") is refused, second


def test_no_fresh_request_is_refused_after_the_clock_moves_and_returns(walletsvc_sandbox) -> None:
    """The attack's reproduction (docs/operations.md): sign at real time T; freeze at T+59 and sign; advance
    an hour and sign; return to real time. Every fresh request was then refused GA2013 for 60 s."""
    sandbox = walletsvc_sandbox
    app = webtest.TestApp(sandbox.app)
    key, secret = sandbox.key["apiKey"], sandbox.key["secret"]
    captured = []

    def fresh(at: int) -> None:
        headers = _signed("GET", "/api/v1/wallets", key, secret, timestamp=at)
        assert app.get("/api/v1/wallets", headers=headers).json["success"] is True
        captured.append(headers)

    real = int(time.time())
    fresh(real)
    app.post_json("/_admin/clock", {"freeze": True, "at": real + 59}, headers=ADMIN)
    fresh(real + 59)
    app.post_json("/_admin/clock", {"advance": 3600}, headers=ADMIN)
    fresh(real + 59 + 3600)
    app.post_json("/_admin/clock", {"freeze": False, "at": time.time()}, headers=ADMIN)  # back to real time
    app.post_json("/_admin/clock", {"advance": -_clock_offset(app)}, headers=ADMIN)
    for _ in range(20):
        fresh(int(json.loads(app.get("/_admin/clock", headers=ADMIN).body)["data"]["epochMillis"] // 1000))
    for headers in captured[:-20]:  # and no captured request passes again, whatever the clock shows
        at = int(headers["X-Timestamp"])
        app.post_json("/_admin/clock", {"freeze": True, "at": at}, headers=ADMIN)
        assert app.get("/api/v1/wallets", headers=headers, expect_errors=True).json["code"] == "GA2013"


def _clock_offset(app: webtest.TestApp, admin: dict = ADMIN) -> float:
    """How far the sandbox clock is from real time, in seconds."""
    shown = json.loads(app.get("/_admin/clock", headers=admin).body)["data"]["epochMillis"]
    return shown / 1000 - time.time()


def test_random_clock_moves_across_two_services_refuse_no_fresh_request_and_every_replay(tmp_path) -> None:
    """docs/operations.md, 200 random freeze / advance / set / return moves through two services on one file
    (every process's state is the file's): each fresh request signed at the sandbox's time passes, and
    every request captured before is refused after every move."""
    import random

    path = str(tmp_path / "moves.db")
    services = [walletsvc.WalletService(path, clock=walletsvc.Clock()) for _ in range(2)]
    key = walletsvc.start_world(services[0], walletsvc.DEMO_SCENARIO)[0]["keys"][0]
    apps = [webtest.TestApp(walletsvc.create_app(svc, admin_token="t")) for svc in services]
    admin = {"Authorization": "Bearer t"}
    rng, captured, real = random.Random(28), [], int(time.time())
    for move in range(200):
        app = apps[move % 2]
        kind = rng.choice(["freeze", "advance", "set", "return"])
        body = {"freeze": {"freeze": True, "at": real + rng.randint(-86400, 86400)},
                "advance": {"advance": rng.choice([-3600, -61, -1, 1, 59, 3600])},
                "set": {"at": real + rng.randint(-120, 120)},
                "return": {"freeze": False}}[kind]
        app.post_json("/_admin/clock", body, headers=admin)
        if kind == "return":
            app.post_json("/_admin/clock", {"advance": -_clock_offset(app, admin)}, headers=admin)
        now = json.loads(app.get("/_admin/clock", headers=admin).body)["data"]["epochMillis"] // 1000
        headers = _signed("GET", "/api/v1/wallets", key["apiKey"], key["secret"], timestamp=now)
        answer = apps[(move + 1) % 2].get("/api/v1/wallets", headers=headers, expect_errors=True).json
        assert answer["success"] is True, (move, kind, answer)
        for old in captured[-30:] + [headers]:  # (the newest 30 each move: every one is replayed often)
            replayed = apps[move % 2].get("/api/v1/wallets", headers=old, expect_errors=True)
            assert replayed.json["code"] == "GA2013", (move, kind)
        captured.append(headers)
    for svc in services:
        svc.close()


def test_a_transfer_captured_on_one_server_never_replays_on_the_other(two_servers) -> None:
    (a, b), (key, secret, admin, wallets) = two_servers
    _clock(a.url, admin, freeze=True, at=NOW)
    body = json.dumps({"sourceWalletId": wallets[0], "targetWalletId": wallets[1], "amount": "10.00",
                       "currency": "USD"}).encode()
    captured = _signed("POST", TRANSFER_PATH, key, secret, body, timestamp=NOW)
    assert requests.post(b.url + TRANSFER_PATH, data=body, headers=captured, timeout=10).status_code == 200
    _clock(a.url, admin, advance=3600)
    assert requests.get(a.url + "/api/v1/wallets", timeout=10, headers=_signed(
        "GET", "/api/v1/wallets", key, secret, timestamp=NOW + 3600)).status_code == 200
    _clock(b.url, admin, advance=-3600)
    for server in (b, a):
        replay = requests.post(server.url + TRANSFER_PATH, data=body, headers=captured, timeout=10)
        assert (replay.status_code, replay.json()["code"]) == (401, "GA2013")
    assert _balances_over_http(a.url, key, secret, NOW + 5)["alice"] == "990.00"  # NOW itself: forgotten


def test_processes_with_different_windows_never_accept_a_replay(tmp_path) -> None:
    """Review: a record expired by a 60 s process's window was taken over by a 300 s process that
    still accepted the timestamp: one captured transfer moved money twice."""
    path = str(tmp_path / "windows.db")
    narrow_clock, wide_clock = walletsvc.Clock(frozen_at=NOW), walletsvc.Clock()
    narrow = walletsvc.WalletService(path, clock=narrow_clock)
    world_ = make_world(narrow)
    wide = walletsvc.WalletService(path, clock=wide_clock)
    narrow_app = webtest.TestApp(walletsvc.create_app(narrow, timestamp_tolerance=60))
    wide_app = webtest.TestApp(walletsvc.create_app(wide, timestamp_tolerance=300))
    body = json.dumps(transfer_body(world_)).encode()
    captured = _signed("POST", TRANSFER_PATH, world_["key"]["apiKey"], world_["key"]["secret"], body,
                       timestamp=NOW)
    assert wide_app.get("/healthz").json["success"]  # (both apps are up before the transfer)
    assert narrow_app.post(TRANSFER_PATH, body, headers=captured).json["success"] is True
    narrow_clock.advance(100)  # the one sandbox clock: past the narrow window, inside the wide one
    for app in (narrow_app, wide_app):
        app.get("/api/v1/wallets", headers=_signed("GET", "/api/v1/wallets", world_["key"]["apiKey"],
                                                   world_["key"]["secret"], timestamp=NOW + 100))
    error(wide_app.post(TRANSFER_PATH, body, headers=captured, expect_errors=True), "GA2013", 401)
    assert balances(narrow, world_["a"]) == ["74.50"]  # 100.00 less one 25.50


###############################################################################
# Nothing lost under load, crashes and bad input (docs/operations.md) ##########
###############################################################################
#
# Bounded here; a soak runs the same tests longer (README, "Soak"):
#   WALLETSVC_SOAK_SECONDS=600 WALLETSVC_FUZZ_EXAMPLES=20000 python -m pytest -m slow -s

SOAK_SECONDS = float(os.environ.get("WALLETSVC_SOAK_SECONDS", "0"))
FUZZ_EXAMPLES = int(os.environ.get("WALLETSVC_FUZZ_EXAMPLES", "300"))


class BankClient:
    """Random transfers with unique bizIds; a timeout, a dropped connection or a
    5xx is retried with the same bizId (on either server) until it has an answer."""

    def __init__(self, servers: list, key: dict, wallets: list, worker: int, deadline: float) -> None:
        import random

        self.servers, self.wallets, self.worker, self.deadline = servers, wallets, worker, deadline
        self.auth = walletsvc.HmacAuth(key["apiKey"], key["secret"])
        self.rng = random.Random(worker)
        self.session = requests.Session()
        self.attempted: dict = {}  # bizId -> (source, target, minor units)
        self.acknowledged: dict = {}  # bizId -> transferId
        self.rejected: dict = {}  # bizId -> code
        self.unresolved: list = []
        self.retries = self.replays = self.twin_sends = self.busy = 0
        self.failures: list = []

    def post(self, body: bytes, server: ServerProcess | None = None,
             session: requests.Session | None = None) -> requests.Response | None:
        server = server or self.rng.choice(self.servers)
        try:
            response = (session or self.session).post(
                server.url + TRANSFER_PATH, data=body, auth=self.auth, timeout=10,
                headers={"Content-Type": "application/json"})
        except requests.RequestException:
            return None
        if response.status_code == 503 and response.json()["code"] == "S503":
            self.busy += 1  # the database was locked past the busy timeout
        return None if response.status_code >= 500 else response

    def twins(self, biz_id: str, body: bytes) -> bool:
        """The same transfer sent to both processes at once: one applies it, the other
        answers the same order. True when both answered; else the retry loop must
        settle it (one twin may be refused for the balance of that moment while the
        other, unanswered, was applied)."""
        answers: list = []
        threads = [
            threading.Thread(target=lambda s=server: answers.append(self.post(body, s, requests.Session())))
            for server in self.servers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.twin_sends += 1
        for response in answers:
            if response is not None:
                self.record(biz_id, response)
        applied = [response for response in answers if response is not None and response.status_code == 200]
        if len(applied) == 2 and sorted(
                r.headers.get("Idempotent-Replayed", "") for r in applied) != ["", "true"]:
            self.failures.append(("twins were not one original and one replay", biz_id))
        return None not in answers

    def transfer(self, biz_id: str, body: bytes) -> None:
        give_up = self.deadline + 120
        while (response := self.post(body)) is None:
            self.retries += 1
            if time.monotonic() > give_up:
                self.unresolved.append(biz_id)
                return
            time.sleep(0.01)
        self.record(biz_id, response)

    def record(self, biz_id: str, response: requests.Response) -> None:
        answer = response.json()
        if response.status_code == 200 and answer["success"]:
            order = answer["data"]
            if order["bizId"] != biz_id or order["status"] != "COMPLETED":
                self.failures.append(("wrong order", biz_id, order))
            if self.acknowledged.setdefault(biz_id, order["transferId"]) != order["transferId"]:
                self.failures.append(("two orders for one bizId", biz_id, order))
            self.rejected.pop(biz_id, None)  # a twin refused earlier, when the balance was lower
        elif answer.get("code") == "T2001":  # insufficient balance: refused without a trace
            if biz_id not in self.acknowledged:
                self.rejected[biz_id] = answer["code"]
        else:
            self.failures.append(("unexpected answer", biz_id, response.status_code, answer))

    def run(self) -> None:
        try:
            n = 0
            while time.monotonic() < self.deadline:
                source, target = self.rng.sample(self.wallets, 2)
                minor = self.rng.randint(1, 30000)
                biz_id = f"bank-{self.worker}-{n}"
                n += 1
                self.attempted[biz_id] = (source, target, minor)
                body = json.dumps({"sourceWalletId": source, "targetWalletId": target, "bizId": biz_id,
                                   "amount": usd(minor), "currency": "USD"}).encode()
                answered = self.rng.random() < 0.05 and self.twins(biz_id, body)
                if not answered and biz_id not in self.acknowledged:
                    self.transfer(biz_id, body)
                if biz_id in self.acknowledged and self.rng.random() < 0.1:  # a client that resends anyway
                    first = self.acknowledged[biz_id]
                    self.transfer(biz_id, body)
                    self.replays += 1
                    if self.acknowledged[biz_id] != first:
                        self.failures.append(("replay changed the order", biz_id))
        except Exception as exc:  # noqa: BLE001 - reported by the test, never lost in a thread
            self.failures.append(("client crashed", repr(exc)))


def _nonce_crosses_processes(servers: list, key: dict) -> bool | None:
    """One signed request to each server with the same headers: the second must be GA2013.
    None when a server was down at the time."""
    headers = walletsvc.sign_request("GET", "/api/v1/wallets", b"", key["apiKey"], key["secret"])
    try:
        first = requests.get(servers[0].url + "/api/v1/wallets", headers=headers, timeout=10)
        second = requests.get(servers[1].url + "/api/v1/wallets", headers=headers, timeout=10)
    except requests.RequestException:
        return None
    if first.status_code >= 500 or second.status_code >= 500:
        return None
    return first.status_code == 200 and (second.status_code, second.json()["code"]) == (401, "GA2013")


def _kill_and_restart(servers: list, deadline: float, seed: int, kills: list) -> None:
    import random

    rng = random.Random(seed)
    while time.monotonic() < deadline:
        time.sleep(rng.uniform(0.2, 1.5))
        victims = servers if rng.random() < 0.15 else [rng.choice(servers)]  # now and then both at once
        for server in victims:
            server.kill()
            kills.append(server.port)
        for server in victims:
            try:
                server.start()
            except AssertionError as exc:  # reported by the test, not lost in a thread
                kills.append(exc)
                return


def _lock_now_and_then(path: str, deadline: float, locks: list) -> None:
    """Hold the write lock past the servers' busy timeout, now and then."""
    conn = sqlite3.connect(path, isolation_level=None, timeout=30)
    while time.monotonic() < deadline:
        time.sleep(2)
        conn.execute("BEGIN IMMEDIATE")
        time.sleep(0.8)
        conn.execute("ROLLBACK")
        locks.append(1)
    conn.close()


@pytest.mark.slow
@pytest.mark.parametrize("crashes", [False, True], ids=["steady", "kill-9"])
def test_bank_workload_across_two_server_processes(tmp_path, crashes: bool) -> None:
    """Jepsen's bank: 8 clients, 10 wallets, two processes on one file, retries
    with the same bizId; with crashes, servers are SIGKILLed and restarted."""
    seconds = SOAK_SECONDS or (12 if crashes else 6)
    path = str(tmp_path / "bank.db")
    svc = walletsvc.WalletService(path)
    workspace = svc.create_workspace("Bank")
    key = svc.create_api_key(workspace["id"])
    wallets = [svc.create_wallet(workspace["id"], "USD")["id"] for _ in range(10)]
    for wallet_id in wallets:
        svc.deposit(wallet_id, "1000.00")
    svc.close()
    servers = [ServerProcess(path, tmp_path / f"server{n}.log", "--set", "busy_timeout=0.3", "--threads", "8")
               for n in range(2)]  # 2 processes x 8 threads, their writes grouped by each one's writer
    for server in servers:
        server.start()
    deadline = time.monotonic() + seconds
    clients = [BankClient(servers, key, wallets, worker, deadline) for worker in range(8)]
    threads = [threading.Thread(target=client.run) for client in clients]
    kills: list = []
    locks: list = []
    if crashes:  # and locks: the other ways a request fails after it was sent
        threads.append(threading.Thread(target=_kill_and_restart, args=(servers, deadline, 7, kills)))
        threads.append(threading.Thread(target=_lock_now_and_then, args=(path, deadline, locks)))
    nonce_checks = []
    try:
        for thread in threads:
            thread.start()
        while time.monotonic() < deadline:
            if (verdict := _nonce_crosses_processes(servers, key)) is not None:
                nonce_checks.append(verdict)
            time.sleep(0.5)
        for thread in threads:
            thread.join()
    finally:
        for server in servers:
            server.stop()

    failures = [failure for client in clients for failure in client.failures]
    attempted = {biz: facts for client in clients for biz, facts in client.attempted.items()}
    acknowledged = {biz: order for client in clients for biz, order in client.acknowledged.items()}
    rejected = {biz for client in clients for biz in client.rejected}
    unresolved = [biz for client in clients for biz in client.unresolved]
    facts = ledger_invariants(path)  # conservation, no negative balance, Σ flows = balance, integrity_check
    conn = sqlite3.connect(path)
    stored = {biz: (row_id, source, target, amount) for biz, row_id, source, target, amount in conn.execute(
        "SELECT biz_id, id, source_wallet_id, target_wallet_id, amount FROM transfers")}
    duplicated = conn.execute("SELECT count(*) FROM (SELECT biz_id FROM transfers GROUP BY biz_id"
                              " HAVING count(*) > 1)").fetchone()[0]
    conn.close()
    lost = [biz for biz in acknowledged if biz not in stored]
    report = {"seconds": seconds, "attempted": len(attempted), "acknowledged": len(acknowledged),
              "rejected_insufficient": len(rejected), "lost": len(lost), "duplicated": duplicated,
              "unresolved": len(unresolved), "retries": sum(c.retries for c in clients),
              "replays": sum(c.replays for c in clients), "twin_sends": sum(c.twin_sends for c in clients),
              "kills": len(kills), "locks": len(locks), "s503_answers": sum(c.busy for c in clients),
              "nonce_checks": len(nonce_checks)}
    print("bank workload:", json.dumps(report))
    assert not failures, failures[:5]
    assert facts["total"] == 10 * 100000
    assert not lost and not duplicated and not unresolved
    assert set(stored) == set(acknowledged)  # every stored order was acknowledged: no phantoms
    for biz, (transfer_id, source, target, amount) in stored.items():
        assert transfer_id == acknowledged[biz]
        assert (source, target, amount) == attempted[biz]
    assert not rejected & set(stored)
    assert len(acknowledged) > 50
    assert nonce_checks and all(nonce_checks)
    audit = subprocess.run([sys.executable, "-m", "walletsvc", "audit", "--db", path], capture_output=True,
                           text=True, timeout=60, check=False)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    if crashes:
        assert not [kill for kill in kills if isinstance(kill, Exception)], kills
        assert len(kills) >= 3 and locks
        assert sum(client.busy for client in clients) > 0  # S503 while locked, retried, nothing lost


FUZZ_SETTINGS = hypothesis.settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
                                    derandomize=not SOAK_SECONDS,  # the same cases on every CI run
                                    suppress_health_check=list(hypothesis.HealthCheck))
FUZZ_TEMPLATES = ("/api/v1/wallets", "/api/v1/wallets/{}", "/api/v1/wallets/{}/balance",
                  "/api/v1/wallets/{}/flows", TRANSFER_PATH, "/api/v1/transfer/query/orders",
                  "/api/v1/transfer/query/orders/{}", "/api/v1/transfer/query/orders/{}/completed",
                  "/api/v1/transfer/query/orders/wallet/{}", "/api/v1/{}", "/{}", "/healthz",
                  "/openapi.json", "/_admin/workspaces", "/_admin/{}", "/_admin/workspaces/{}/wallets",
                  "/_admin/wallets/{}/deposit", "/_admin/faults", "/_admin/clock",
                  "/_admin/transfers/{}/complete", "/_admin/transfers/{}/fail", "/_admin/workspaces/{}/keys",
                  "/_admin/workspaces/{}/members", "/_admin/wallets/{}/status", "/_admin/wallets/{}/withdraw",
                  "/_admin/keys/{}/disable", "/_admin/audit", "/_admin/journal")
FUZZ_HEADERS = ("X-Api-Key", "X-Timestamp", "X-Nonce", "X-Signature", "Content-Type", "Accept-Language",
                "X-Forwarded-For", "Idempotency-Key", "Authorization", "Accept", "Content-Encoding")
FUZZ_FIELDS = ("sourceWalletId", "targetWalletId", "amount", "currency", "bizId", "description", "status",
               "name", "seconds", "action", "method", "path", "times", "now", "scopes", "memberId",
               "ipWhitelist", "workspaceId", "at", "advance", "freeze", "latency", "code")
FUZZ_QUERY_NAMES = ("page", "size", "sort", "status", "currency", "type", "direction", "createdFrom",
                    "createdTo", "bizIdPrefix", "minBalance", "name")
latin1 = st.text(st.characters(min_codepoint=0, max_codepoint=255), max_size=40)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats(allow_nan=False)
    | st.text(max_size=30) | st.sampled_from(["10.00", "0.01", "-1", "1e3", "USD", "JPY", "usd", "a\x00"])
    | st.sampled_from([1e308, -1e308, 253402300800, "2027-01-01T00:00:00Z", ["wallet:read"]]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8)


@st.composite
def fuzz_requests(draw, sandbox: walletsvc.Sandbox) -> dict:
    """One request: a known or made-up path with real or junk segments, query,
    headers and body; signed properly (to get past authentication) or not."""
    known = [sandbox.wallets["alice"]["id"], sandbox.wallets["yen"]["id"], "wal_magic_busy", "biz-1",
             sandbox.workspace["id"], sandbox.key["apiKey"]]
    segment = draw(st.sampled_from(known) | st.sampled_from(known) | st.text(max_size=30) | st.just(".."))
    path = draw(st.sampled_from(FUZZ_TEMPLATES[:9]) | st.sampled_from(FUZZ_TEMPLATES)).replace(
        "{}", urllib.parse.quote(segment, safe=draw(st.sampled_from(["", "/", "/%:@!$&'()*+,;="]))))
    if draw(st.booleans()):
        path = draw(st.sampled_from([path, path + "/", path.upper(), "//" + path, path + "%", path + "%zz"]))
    pairs = draw(st.lists(st.tuples(st.sampled_from(FUZZ_QUERY_NAMES) | latin1, latin1), max_size=4))
    query = draw(st.sampled_from([urllib.parse.urlencode(pairs), "&".join(f"{k}={v}" for k, v in pairs)]))
    method = draw(st.sampled_from(["GET", "POST"])
                  | st.sampled_from(["PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
                  | st.from_regex(r"\A[A-Za-z]{1,8}\Z"))
    if draw(st.booleans()):  # a real endpoint with its own method, so that bodies and queries get parsed
        method = "POST" if path == TRANSFER_PATH else "GET"
    document = draw(st.dictionaries(st.sampled_from(FUZZ_FIELDS), json_values, max_size=6)
                    | st.fixed_dictionaries({"sourceWalletId": st.sampled_from(known),
                                             "targetWalletId": st.sampled_from(known),
                                             "amount": (st.sampled_from(["1.00", "0.001", "1000000.00"])
                                                        | latin1),
                                             "currency": st.sampled_from(["USD", "JPY", "XXX"])}))
    body = draw(st.just(json.dumps(document).encode()) | st.binary(max_size=200) | st.just(b""))
    headers = draw(st.dictionaries(st.sampled_from(FUZZ_HEADERS), latin1, max_size=4))
    signing = draw(st.sampled_from(["signed", "signed", "unsigned", "tampered"]))
    if signing != "unsigned":  # random headers, but not in place of the four signed ones
        headers.update(sandbox.headers(method, path, body))
        if draw(st.booleans()):
            headers["Content-Type"] = "application/json"
    if signing == "tampered":  # one header or the body changed after signing
        name = draw(st.sampled_from(["X-Api-Key", "X-Timestamp", "X-Nonce", "X-Signature", "body"]))
        if name == "body":
            body += draw(st.binary(min_size=1, max_size=5))
        else:
            headers[name] = draw(latin1)
    if draw(st.booleans()):
        headers["Authorization"] = "Bearer walletsvc-test-admin"
    return {"method": method, "path": path, "query": query, "headers": headers, "body": body}


def call_wsgi(app, method: str, path: str, query: str, headers: dict, body: bytes) -> tuple[int, dict, bytes]:
    """The WSGI call a server would make for this request, raw path included."""
    import io

    environ = {"REQUEST_METHOD": method, "SCRIPT_NAME": "",
               "REQUEST_URI": path + (f"?{query}" if query else ""),
               "PATH_INFO": urllib.parse.unquote(path, "latin-1"), "QUERY_STRING": query,
               "SERVER_NAME": "fuzz", "SERVER_PORT": "80", "SERVER_PROTOCOL": "HTTP/1.1",
               "REMOTE_ADDR": "127.0.0.1", "CONTENT_LENGTH": str(len(body)),
               "wsgi.input": io.BytesIO(body), "wsgi.errors": io.StringIO(), "wsgi.version": (1, 0),
               "wsgi.url_scheme": "http", "wsgi.multithread": False, "wsgi.multiprocess": False,
               "wsgi.run_once": False}
    for name, value in headers.items():
        if name == "Content-Type":
            environ["CONTENT_TYPE"] = value
        else:
            environ["HTTP_" + name.upper().replace("-", "_")] = value
    started: list = []
    chunks = app(environ,
                 lambda status, response_headers, exc_info=None: started.extend((status, response_headers)))
    payload = b"".join(chunks)
    getattr(chunks, "close", lambda: None)()
    return int(started[0].split()[0]), dict(started[1]), payload


def assert_enveloped(method: str, status: int, headers: dict, payload: bytes) -> None:
    """Never a 500, never a traceback: the envelope, with a catalog code on failure."""
    assert status != 500 and b"Traceback" not in payload, payload[:500]
    assert headers["Content-Type"] == "application/json; charset=utf-8"
    if method == "HEAD":
        assert payload == b""
        return
    envelope = json.loads(payload)
    if status == 200 and envelope.get("openapi") == "3.1.0":  # /openapi.json is the bare document
        return
    assert {"success", "code", "message", "data"} <= set(envelope), envelope
    if envelope["success"]:
        assert 200 <= status < 300
    else:
        assert {**CATALOG, **ADMIN_CATALOG}.get(envelope["code"], (None, None))[1] == status, (
            status, envelope)
        assert envelope["message"] and envelope["data"] is None


@pytest.mark.slow
def test_fuzzed_requests_always_get_the_envelope() -> None:
    """Hypothesis-made methods, paths, queries, headers and bodies, signed and not."""
    sandbox = walletsvc.Sandbox.create()
    seen: dict = {}

    @hypothesis.given(st.data())
    @FUZZ_SETTINGS
    def run(draws) -> None:
        sandbox.reset()
        request = draws.draw(fuzz_requests(sandbox))
        status, headers, payload = call_wsgi(sandbox.app, **request)
        assert_enveloped(request["method"], status, headers, payload)
        code = json.loads(payload).get("code", "openapi") if payload else str(status)
        seen[code] = seen.get(code, 0) + 1
        sandbox.service.assert_audit_clean()  # whatever came in, the books still balance

    run()
    print("fuzz codes:", json.dumps(dict(sorted(seen.items()))))
    assert sum(seen.values()) >= min(FUZZ_EXAMPLES, 100)
    # from the first step of the pipeline to the ledger
    assert {"GA2001", "GA2012", "GA2013", "S404", "S012", "2000"} <= set(seen), seen


@pytest.mark.slow
def test_fuzzed_requests_over_a_socket_always_get_the_envelope() -> None:
    """The same fuzz through waitress: its environ (REQUEST_URI, chunked bodies,
    Expect: 100-continue) rather than one built by the test."""
    import http.client

    sandbox = walletsvc.Sandbox.create()
    server = walletsvc.LiveServer(sandbox.app)
    port = int(server.url.rsplit(":", 1)[1])
    header_safe = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40)
    seen: dict = {}

    @hypothesis.given(st.data())
    @hypothesis.settings(FUZZ_SETTINGS, max_examples=max(FUZZ_EXAMPLES // 3, 50))
    def run(draws) -> None:
        sandbox.reset()
        request = draws.draw(fuzz_requests(sandbox))
        # a well-formed HTTP request line and headers: what waitress refuses before the app is not ours
        path = urllib.parse.quote(request["path"], safe="/%:@!$&'()*+,;=")
        query = urllib.parse.quote(request["query"], safe="=&%")
        headers = {name: value for name, value in request["headers"].items()
                   if value == value.strip() and all(32 <= ord(c) < 127 for c in value)}
        headers.update(draws.draw(st.dictionaries(
            st.sampled_from(["Expect", "Connection", "Accept-Encoding"]), header_safe, max_size=1)))
        method = request["method"].upper()  # waitress refuses lower-case methods itself
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            chunked = request["body"] and draws.draw(st.booleans())
            body = iter([request["body"]]) if chunked else request["body"]
            connection.request(method, path + (f"?{query}" if query else ""), body=body,
                               headers=headers, encode_chunked=bool(chunked))
            response = connection.getresponse()
            payload = response.read()
        finally:
            connection.close()
        assert_enveloped(method, response.status, dict(response.getheaders()), payload)
        code = json.loads(payload).get("code", "openapi") if payload else str(response.status)
        seen[code] = seen.get(code, 0) + 1

    try:
        run()
    finally:
        server.stop()
    print("socket fuzz codes:", json.dumps(dict(sorted(seen.items()))))
    assert {"GA2001", "S404", "2000"} <= set(seen), seen


###############################################################################
# The module as a newcomer reads it (docs/contributing.md) #####################
###############################################################################


def test_the_module_docstring_lists_every_section_in_order() -> None:
    source = pathlib.Path(walletsvc.__file__).read_text(encoding="utf-8")
    rule = "#" * 79
    banners = re.findall(rf"^{rule}\n# (.+?) #+\n{rule}$", source, re.MULTILINE)
    listed = re.findall(r"^ +(\d+)\. (.+?) - ", walletsvc.__doc__, re.MULTILINE)
    assert [int(number) for number, _ in listed] == list(range(1, len(banners) + 1))
    assert [name for _, name in listed] == banners
    for sought in ("The request path", "Pagination", "Request journal", "The console's session"):
        assert sought in banners  # the pipeline, a page query, what the journal keeps, the console's login


def test_help_starts_with_the_contents() -> None:
    import pydoc

    text = pydoc.plain(pydoc.render_doc(walletsvc))
    description = text.split("DESCRIPTION", 1)[1].lstrip()
    assert description.startswith("Contents, in the order of the module's sections")
    assert "1. Constants and helpers" in description.split("walletsvc implements", 1)[0]


def test_each_section_uses_only_those_above_it() -> None:
    """What runs in a section (function bodies included) names nothing a later section defines; the
    console's page alone is kept last, as bottle keeps its template, and read at run time."""
    import ast

    source = pathlib.Path(walletsvc.__file__).read_text(encoding="utf-8")
    rule = "#" * 79
    starts = [source[: match.start()].count("\n") + 1
              for match in re.finditer(rf"^{rule}\n# .+? #+\n{rule}$", source, re.MULTILINE)]

    def section(line: int) -> int:
        return sum(1 for start in starts if start < line)

    tree = ast.parse(source)
    defined: dict[str, int] = {}
    for node in tree.body:
        targets = [node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else [
            name.id for target in getattr(node, "targets", [getattr(node, "target", None)]) if target
            for name in ast.walk(target) if isinstance(name, ast.Name)]
        for target in targets:
            defined.setdefault(target, section(node.lineno))
    last = len(starts)
    later = set()
    for node in tree.body:
        here = section(node.lineno)
        for name in ast.walk(node):
            if isinstance(name, ast.Name) and defined.get(name.id, 0) > here and defined[name.id] != last:
                later.add((here, name.id))
    assert later == set()


###############################################################################
# The benchmark script (README, "Benchmarks") ##################################
###############################################################################


@pytest.mark.slow
def test_bench_quick_runs_every_section_and_prints_every_target_figure() -> None:
    """`bench_walletsvc.py --quick` (every section, small counts; wrk and strace not needed) ends
    well, and its table has a row for each figure the write path's issues set a target for."""
    done = subprocess.run([sys.executable, "bench_walletsvc.py", "--quick"], capture_output=True, text=True,
                          cwd=pathlib.Path(__file__).parent, timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in done.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| figure |")}
    figures = ["HTTP signed GET at defaults, 8 connections", "HTTP signed GET at defaults p99",
               "HTTP POST create transfer vs HEAD", "HTTP POST create transfer at defaults p99",
               "HTTP GET /api/v1/wallets/{id} p99, --workers 2 vs 1",
               "HTTP POST create transfer p99, --workers 2 vs 1",
               "commits with fsync per acknowledged transfer, 8 connections",
               "in-process GET /api/v1/wallets/{id}",
               "test double per-test overhead (walletsvc_sandbox: reset + audit)",
               "scenario load, wallets with fixed ids vs without (5,000 wallets)",
               "latency rule isolation: non-matching requests, p99 wait",
               "latency rule isolation: non-matching requests, max wait",
               "nonce records after 5,000 requests over 300 s"]
    assert [figure for figure in figures if figure not in rows] == []
    assert all(len(rows[figure]) == 5 for figure in figures)  # name, value, baseline, ratio, target


def test_serve_log_lines_show_each_record_time_as_logging_itself_would() -> None:
    # serve's formatter formats each second's date once; every line must still read as the standard
    # library's own formatter writes it (milliseconds too), across seconds and back again.
    ours, standard = walletsvc.LogFormatter(), logging.Formatter("%(asctime)s %(name)s %(message)s")
    start = 1795899820.0
    for created in (start, start + 0.25, start + 1.999, start + 2.0, start, start + 86400.5):
        record = logging.LogRecord("walletsvc.access", logging.INFO, __file__, 1, "GET %s", ("/x",), None)
        record.created, record.msecs = created, (created - int(created)) * 1000
        assert ours.format(record) == standard.format(record)
