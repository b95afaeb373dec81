"""Benchmarks of walletsvc, each figure a ratio against a baseline measured in the same run.

    python bench_walletsvc.py            # every figure (about eight minutes on 2 cores)
    python bench_walletsvc.py --quick    # smaller counts, for a smoke run
    python bench_walletsvc.py --only previous --previous REV   # in process, against walletsvc.py at a git REV

Baselines built here: **bare** (a bottle route answering a same-sized envelope: no auth, no SQL)
and **floor** (the least work a correct signed request must do, written straight-line with
sqlite3 and hmac on the same database: key row, nonce check and insert, HMAC, the wallet row or
the transfer transaction, the JSON envelope). Medians of several rounds; prints a table.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import hmac
import http.client
import importlib.util
import io
import json
import logging
import multiprocessing
import os
import pathlib
import random
import re
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import bottle

import walletsvc

# walletsvc's defaults, as users get them (synchronous=FULL); the floor follows the same policy
SETTINGS: dict = {}
SERVER_THREADS = int(os.environ.get("BENCH_THREADS", "4"))  # waitress threads, bare and walletsvc alike
TRANSFER = "/api/v1/transfer/command/create"


###############################################################################
# Helpers ######################################################################
###############################################################################


def median_of_rounds(run, calls: int, rounds: int) -> float:
    """Microseconds per call: the median over rounds of (round time / calls)."""
    results = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            run()
        results.append((time.perf_counter() - started) / calls * 1e6)
    return statistics.median(results)


def environ_for(method: str, path: str, body: bytes, headers: dict, query: str = "") -> dict:
    environ = {"REQUEST_METHOD": method, "PATH_INFO": path, "SCRIPT_NAME": "", "QUERY_STRING": query,
               "SERVER_NAME": "bench", "SERVER_PORT": "80", "SERVER_PROTOCOL": "HTTP/1.1",
               "REMOTE_ADDR": "127.0.0.1", "CONTENT_LENGTH": str(len(body)), "wsgi.input": io.BytesIO(body),
               "wsgi.errors": sys.stderr, "wsgi.url_scheme": "http", "wsgi.multithread": True,
               "wsgi.multiprocess": False, "wsgi.run_once": False, "wsgi.version": (1, 0)}
    if body:
        environ["CONTENT_TYPE"] = "application/json"
    for name, value in headers.items():
        environ["HTTP_" + name.upper().replace("-", "_")] = value
    return environ


def call_wsgi(app, method: str, path: str, body: bytes, headers: dict, query: str = "") -> bytes:
    status = []
    chunks = app(environ_for(method, path, body, headers, query), lambda s, h, e=None: status.append(s))
    payload = b"".join(chunks)
    if not status[0].startswith("200"):
        raise RuntimeError(f"{method} {path}: {status[0]} {payload[:200]!r}")
    return payload


def seeded(path: str, wallets: int = 10, **settings) -> tuple:
    svc = walletsvc.WalletService(path, **{**SETTINGS, **settings})
    ws = svc.create_workspace("bench")
    key = svc.create_api_key(ws["id"])
    ids = [svc.create_wallet(ws["id"], "USD")["id"] for _ in range(wallets)]
    for wallet_id in ids:
        svc.deposit(wallet_id, "1000000000.00")
    return svc, ws, key, ids


def bare_app(get_body: bytes, post_body: bytes) -> bottle.Bottle:
    app = bottle.Bottle()

    def answer(payload: bytes) -> bottle.HTTPResponse:
        return bottle.HTTPResponse(payload, 200, {"Content-Type": "application/json; charset=utf-8"})

    app.route("/api/v1/wallets/<wallet_id>", "GET", lambda wallet_id: answer(get_body))
    app.route(TRANSFER, "POST", lambda: answer(post_body))
    return app


###############################################################################
# Floor: the least work of a correct signed request ############################
###############################################################################


# The floor's schema: the tables, and only the indexes the default list orders
# (createdAt descending) and bizId idempotency need.
MINIMAL_SCHEMA = """
CREATE TABLE api_keys (id TEXT PRIMARY KEY, secret TEXT NOT NULL, workspace_id TEXT NOT NULL,
                       enabled INTEGER NOT NULL);
CREATE TABLE nonces (api_key TEXT NOT NULL, nonce TEXT NOT NULL, expires_at INTEGER NOT NULL,
                     PRIMARY KEY (api_key, nonce)) WITHOUT ROWID;
CREATE TABLE wallets (id TEXT PRIMARY KEY, workspace_id TEXT NOT NULL, name TEXT NOT NULL, \
currency TEXT NOT NULL,
                      status TEXT NOT NULL, balance INTEGER NOT NULL CHECK (balance >= 0),
                      pending INTEGER NOT NULL, created_at INTEGER NOT NULL, updated_at INTEGER NOT NULL);
CREATE INDEX wallets_by_created ON wallets (workspace_id, created_at, id);
CREATE TABLE transfers (id TEXT PRIMARY KEY, workspace_id TEXT NOT NULL, biz_id TEXT NOT NULL,
                        source_wallet_id TEXT NOT NULL, target_wallet_id TEXT NOT NULL, \
amount INTEGER NOT NULL,
                        currency TEXT NOT NULL, status TEXT NOT NULL, created_at INTEGER NOT NULL,
                        updated_at INTEGER NOT NULL, completed_at INTEGER, UNIQUE (workspace_id, biz_id));
CREATE INDEX transfers_by_created ON transfers (workspace_id, created_at, id);
CREATE TABLE flows (id TEXT PRIMARY KEY, wallet_id TEXT NOT NULL, type TEXT NOT NULL, direction TEXT NOT NULL,
                    amount INTEGER NOT NULL, balance_after INTEGER NOT NULL, transfer_id TEXT, biz_id TEXT,
                    counterparty_wallet_id TEXT, created_at INTEGER NOT NULL);
CREATE INDEX flows_by_created ON flows (wallet_id, created_at, id);
"""


class Floor:
    """Straight-line sqlite3 + hmac on a minimal schema (MINIMAL_SCHEMA, copied from the
    service's key and wallets), served as a WSGI app like the other two. It follows the
    same durability policy: a read's nonce is committed without a disk sync, a transfer
    and its nonce are one transaction committed at synchronous=FULL."""

    def __init__(self, service_path: str, path: str) -> None:
        self.conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.conn.execute("PRAGMA journal_mode = WAL")
        self.conn.execute("PRAGMA busy_timeout = 5000")
        self.conn.execute("PRAGMA synchronous = FULL")
        self.conn.executescript(MINIMAL_SCHEMA)
        self.conn.execute("ATTACH ? AS service", (service_path,))
        self.conn.execute("INSERT INTO api_keys SELECT id, secret, workspace_id, enabled"
                          " FROM service.api_keys")
        self.conn.execute("INSERT INTO wallets SELECT id, workspace_id, name, currency, status, balance,"
                          " pending, created_at, updated_at FROM service.wallets")
        self.conn.execute("DETACH service")

    def __call__(self, environ: dict, start_response) -> list:
        if environ["REQUEST_METHOD"] == "GET":
            payload = self.get_wallet(environ["PATH_INFO"], environ)
        else:
            payload = self.transfer(environ["wsgi.input"].read(int(environ["CONTENT_LENGTH"])), environ)
        start_response("200 OK",
                       [("Content-Type", "application/json"), ("Content-Length", str(len(payload)))])
        return [payload]

    def authenticate(self, method: str, path: str, body: bytes, environ: dict) -> tuple:
        api_key = environ["HTTP_X_API_KEY"]
        key = self.conn.execute("SELECT secret, workspace_id, enabled FROM api_keys WHERE id = ?",
                                (api_key,)).fetchone()
        now = time.time()
        timestamp, nonce = environ["HTTP_X_TIMESTAMP"], environ["HTTP_X_NONCE"]
        if not key[2] or abs(now - int(timestamp)) > 60:
            raise RuntimeError("rejected")
        now_ms = int(now * 1000)
        if self.conn.execute("SELECT 1 FROM nonces WHERE api_key = ? AND nonce = ? AND expires_at > ?",
                             (api_key, nonce, now_ms)).fetchone():
            raise RuntimeError("replay")
        message = b"\n".join((method.encode(), path.encode(), timestamp.encode(), nonce.encode(),
                              hashlib.sha256(body).hexdigest().encode()))
        expected = hmac.new(key[0].encode(), message, hashlib.sha256).digest()
        if not hmac.compare_digest(expected, base64.b64decode(environ["HTTP_X_SIGNATURE"])):
            raise RuntimeError("signature")
        self.nonce = (api_key, nonce, (int(timestamp) + 61) * 1000)
        return key[1], now_ms

    def get_wallet(self, path: str, environ: dict) -> bytes:
        workspace_id, now_ms = self.authenticate("GET", path, b"", environ)
        self.conn.execute("PRAGMA synchronous = NORMAL")  # a read's nonce: no disk sync
        self.conn.execute("INSERT INTO nonces (api_key, nonce, expires_at) VALUES (?, ?, ?)", self.nonce)
        self.conn.execute("PRAGMA synchronous = FULL")
        row = self.conn.execute("SELECT id, workspace_id, name, currency, status, balance, created_at,"
                                " updated_at FROM wallets WHERE id = ? AND workspace_id = ?",
                                (path.rsplit("/", 1)[1], workspace_id)).fetchone()
        data = {"id": row[0], "workspaceId": row[1], "name": row[2], "currency": row[3], "status": row[4],
                "balance": f"{row[5] // 100}.{row[5] % 100:02d}", "createdAt": str(row[6]),
                "updatedAt": str(row[7])}
        return json.dumps({"version": "v1", "timestamp": now_ms, "success": True, "code": "2000",
                           "message": "SUCCESS", "data": data}).encode()

    def transfer(self, body: bytes, environ: dict) -> bytes:
        workspace_id, now_ms = self.authenticate("POST", TRANSFER, body, environ)
        request = json.loads(body)
        amount = int(request["amount"].replace(".", ""))
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute("INSERT INTO nonces (api_key, nonce, expires_at) VALUES (?, ?, ?)", self.nonce)
            source, target = (conn.execute("SELECT balance - pending, status, currency FROM wallets"
                                           " WHERE id = ? AND workspace_id = ?",
                                           (request[k], workspace_id)).fetchone()
                              for k in ("sourceWalletId", "targetWalletId"))
            if (source[0] < amount or {source[1], target[1]} != {"ACTIVE"}
                    or {source[2], target[2]} != {"USD"}):
                raise RuntimeError("rejected")
            transfer_id = "tr_" + uuid.uuid4().hex
            balance_out = conn.execute("UPDATE wallets SET balance = balance - ?, updated_at = ? WHERE id = ?"
                                       " RETURNING balance",
                                       (amount, now_ms, request["sourceWalletId"])).fetchall()
            balance_in = conn.execute("UPDATE wallets SET balance = balance + ?, updated_at = ? WHERE id = ?"
                                      " RETURNING balance",
                                      (amount, now_ms, request["targetWalletId"])).fetchall()
            conn.execute("INSERT INTO transfers (id, workspace_id, biz_id, source_wallet_id,"
                         " target_wallet_id, amount, currency, status, created_at, updated_at, completed_at)"
                         " VALUES (?, ?, ?, ?, ?, ?, 'USD', 'COMPLETED', ?, ?, ?)",
                         (transfer_id, workspace_id, transfer_id, request["sourceWalletId"],
                          request["targetWalletId"], amount, now_ms, now_ms, now_ms))
            for wallet, kind, direction, balance, other in (
                    (request["sourceWalletId"], "TRANSFER_OUT", "DEBIT", balance_out,
                     request["targetWalletId"]),
                    (request["targetWalletId"], "TRANSFER_IN", "CREDIT", balance_in,
                     request["sourceWalletId"])):
                conn.execute("INSERT INTO flows (id, wallet_id, type, direction, amount, balance_after,"
                             " transfer_id, biz_id, counterparty_wallet_id, created_at)"
                             " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                             ("fl_" + uuid.uuid4().hex, wallet, kind, direction, amount, balance[0][0],
                              transfer_id, transfer_id, other, now_ms))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        return json.dumps({"version": "v1", "timestamp": now_ms, "success": True, "code": "2000",
                           "message": "SUCCESS", "data": {"transferId": transfer_id, "status": "COMPLETED",
                                                          "amount": request["amount"],
                                                          "currency": "USD"}}).encode()


###############################################################################
# Figure 1: in-process signed requests #########################################
###############################################################################


def in_process(tmp: str, calls: int, rounds: int) -> list:
    svc, _, key, wallets = seeded(os.path.join(tmp, "inproc.db"))
    app = walletsvc.create_app(svc)
    floor = Floor(os.path.join(tmp, "inproc.db"), os.path.join(tmp, "floor.db"))
    path = f"/api/v1/wallets/{wallets[0]}"
    sign = walletsvc.sign_request
    get_body = call_wsgi(app, "GET", path, b"", sign("GET", path, b"", key["apiKey"], key["secret"]))
    transfer_body = json.dumps({"sourceWalletId": wallets[0], "targetWalletId": wallets[1],
                                "amount": "0.01", "currency": "USD"}).encode()
    post_body = call_wsgi(app, "POST", TRANSFER, transfer_body,
                          sign("POST", TRANSFER, transfer_body, key["apiKey"], key["secret"]))
    bare = bare_app(get_body, post_body)

    def service_get():
        call_wsgi(app, "GET", path, b"", sign("GET", path, b"", key["apiKey"], key["secret"]))

    def floor_get():
        call_wsgi(floor, "GET", path, b"", sign("GET", path, b"", key["apiKey"], key["secret"]))

    def bare_get():
        call_wsgi(bare, "GET", path, b"", sign("GET", path, b"", key["apiKey"], key["secret"]))

    def service_post():
        call_wsgi(app, "POST", TRANSFER, transfer_body, sign("POST", TRANSFER, transfer_body, key["apiKey"],
                                                             key["secret"]))

    def floor_post():
        call_wsgi(floor, "POST", TRANSFER, transfer_body, sign("POST", TRANSFER, transfer_body, key["apiKey"],
                                                               key["secret"]))

    def bare_post():
        call_wsgi(bare, "POST", TRANSFER, transfer_body, sign("POST", TRANSFER, transfer_body, key["apiKey"],
                                                              key["secret"]))

    rows = []
    for name, service, floor_run, bare_run in (("GET /api/v1/wallets/{id}", service_get, floor_get, bare_get),
                                               ("POST create transfer", service_post, floor_post, bare_post)):
        measured = {label: [] for label in ("service", "floor", "bare")}
        for _ in range(rounds):  # interleaved, so that noise hits all three alike
            for label, run in (("service", service), ("floor", floor_run), ("bare", bare_run)):
                measured[label].append(median_of_rounds(run, calls, 1))
        s, f, b = (statistics.median(measured[label]) for label in ("service", "floor", "bare"))
        target = "<= 1.3x floor" if name.startswith("GET") else "<= 1.5x floor"
        rows.append((f"in-process {name}", f"{s:.0f} us", f"floor {f:.0f} us", s / f, target))
        rows.append((f"in-process {name} vs bare", f"{s:.0f} us", f"bare {b:.0f} us", s / b, "report"))
    svc.close()
    return rows


###############################################################################
# Figure 2: over HTTP through waitress ##########################################
###############################################################################


def serve_for_bench(kind: str, db: str, ready) -> None:
    """Child process: serve the bare app or walletsvc on waitress; report the port."""
    import waitress

    logging.getLogger("waitress.queue").setLevel(logging.ERROR)
    if os.environ.get("BENCH_SWITCH"):
        sys.setswitchinterval(float(os.environ["BENCH_SWITCH"]))
    if kind == "walletsvc":  # as `walletsvc serve` runs it, at its defaults
        walletsvc.serve(walletsvc.WalletService(db, **SETTINGS), port=0, threads=SERVER_THREADS,
                        on_ready=lambda url: ready.put(int(url.rsplit(":", 1)[1])))
        return
    with open(db + ".bodies", "rb") as handle:
        get_body, post_body = json.loads(handle.read())
    server = waitress.create_server(bare_app(get_body.encode(), post_body.encode()), host="127.0.0.1", port=0,
                                    threads=SERVER_THREADS)  # waitress's defaults otherwise
    ready.put(server.effective_port)
    server.run()


def signed_request(plan: dict, rng: random.Random) -> tuple[str, bytes, dict]:
    """A GET of a random wallet or a 0.01 transfer between two, signed: path, body, headers
    (for localstripe: a GET of a customer or the creation of one)."""
    if plan.get("peer") == "localstripe":
        headers = {"Authorization": "Bearer sk_test_bench"}
        if plan["method"] == "GET":
            return f"/v1/customers/{plan['customer']}", b"", headers
        return "/v1/customers", f"email=c{rng.random()}@example.com".encode(), {
            **headers, "Content-Type": "application/x-www-form-urlencoded"}
    if plan["method"] == "GET":
        path, body = f"/api/v1/wallets/{rng.choice(plan['wallets'])}", b""
    else:
        source, target = rng.sample(plan["wallets"], 2)
        path, body = TRANSFER, json.dumps({"sourceWalletId": source, "targetWalletId": target,
                                           "amount": "0.01", "currency": "USD"}).encode()
    headers = walletsvc.sign_request(plan["method"], path, body, plan["key"], plan["secret"])
    if body:
        headers["Content-Type"] = "application/json"
    return path, body, headers


def load_worker(port: int, plan: dict, seconds: float, threads: int, results) -> None:
    """Child process: ``threads`` keep-alive connections sending signed requests."""
    counts = []

    def loop(seed: int) -> None:
        rng = random.Random(seed)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        done, deadline = 0, time.monotonic() + seconds
        while time.monotonic() < deadline:
            path, body, headers = signed_request(plan, rng)
            conn.request(plan["method"], path, body=body or None, headers=headers)
            reply = conn.getresponse()
            reply.read()
            done += reply.status == 200
        counts.append(done)
        conn.close()

    workers = [threading.Thread(target=loop, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    results.put(sum(counts))


WRK = shutil.which("wrk")  # Debian's wrk when installed, else the Python load generator

_WRK_SCRIPT = """
local requests = {%s}
local threads, counter = %d, 0
function setup(thread) thread:set("id", counter); counter = counter + 1 end
function init(args) n = id end
function request() n = n + threads; return requests[(n %% #requests) + 1] end
"""


def requests_per_second(port: int, plan: dict, seconds: float) -> tuple[float, float | None]:
    """Signed requests answered 200 per second, and the p99 latency in ms (wrk only):
    wrk when present, else Python."""
    if WRK:
        return wrk_requests_per_second(port, plan, seconds)
    return python_requests_per_second(port, plan, seconds), None


def wrk_requests_per_second(port: int, plan: dict, seconds: float) -> tuple[float, float]:
    """wrk (2 threads, 8 connections) replaying requests signed beforehand, each
    nonce once (wrk cannot compute HMACs); answers other than 2xx are not counted."""
    rng = random.Random(7)
    raw = []
    for _ in range(int(6000 * seconds)):  # more than either server answers in the time
        path, body, headers = signed_request(plan, rng)
        headers.update({"Host": f"127.0.0.1:{port}", "Content-Length": str(len(body))})
        head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        raw.append(f"{plan['method']} {path} HTTP/1.1\r\n{head}\r\n{body.decode()}")
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(_WRK_SCRIPT % (",".join(json.dumps(r) for r in raw), 2))
    try:
        out = subprocess.run([WRK, "-t2", "-c8", "--latency", f"-d{max(1, round(seconds))}s", "-s",
                              script.name, f"http://127.0.0.1:{port}/"],
                             capture_output=True, text=True, timeout=seconds + 60, check=True).stdout
    finally:
        os.unlink(script.name)
    total = int(re.search(r"(\d+) requests in ([\d.]+)(m?s)", out).group(1))
    elapsed = re.search(r"requests in ([\d.]+)(m?s)", out)
    duration = float(elapsed.group(1)) / (1000 if elapsed.group(2) == "ms" else 1)
    failed = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    p99 = re.search(r"99%\s+([\d.]+)(us|ms|s)\b", out)
    p99_ms = float(p99.group(1)) * {"us": 0.001, "ms": 1, "s": 1000}[p99.group(2)]
    return (total - (int(failed.group(1)) if failed else 0)) / duration, p99_ms


def python_requests_per_second(port: int, plan: dict, seconds: float) -> float:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    workers = [context.Process(target=load_worker, args=(port, plan, seconds, 4, results)) for _ in range(2)]
    for worker in workers:
        worker.start()
    total = sum(results.get(timeout=seconds + 60) for _ in workers)
    for worker in workers:
        worker.join()
    return total / seconds


def over_http(tmp: str, seconds: float, rounds: int) -> list:
    db = os.path.join(tmp, "http.db")
    svc, _, key, wallets = seeded(db)
    app = walletsvc.create_app(svc)
    path = f"/api/v1/wallets/{wallets[0]}"
    get_body = call_wsgi(app, "GET", path, b"", walletsvc.sign_request("GET", path, b"", key["apiKey"],
                                                                       key["secret"]))
    body = json.dumps({"sourceWalletId": wallets[0], "targetWalletId": wallets[1], "amount": "0.01",
                       "currency": "USD"}).encode()
    post_body = call_wsgi(app, "POST", TRANSFER, body, walletsvc.sign_request("POST", TRANSFER, body,
                                                                              key["apiKey"], key["secret"]))
    svc.close()
    with open(db + ".bodies", "w") as handle:
        json.dump([get_body.decode(), post_body.decode()], handle)
    context = multiprocessing.get_context("spawn")
    ports, servers = {}, {}
    for kind in ("bare", "walletsvc"):
        ready = context.Queue()
        servers[kind] = context.Process(target=serve_for_bench, args=(kind, db, ready), daemon=True)
        servers[kind].start()
        ports[kind] = ready.get(timeout=30)
    peer = start_localstripe()
    rows = []
    try:
        for method, target in (("GET", 0.7), ("POST", 0.3)):
            plan = {"method": method, "wallets": wallets, "key": key["apiKey"], "secret": key["secret"]}
            measured: dict = {"bare": [], "walletsvc": [], "localstripe": []}
            for _ in range(rounds):
                for kind in ("bare", "walletsvc"):
                    measured[kind].append(requests_per_second(ports[kind], plan, seconds))
                if peer:
                    measured["localstripe"].append(requests_per_second(peer["port"], {**plan, **peer},
                                                                       seconds))
            (bare, bare_p99), (ours, p99) = (_median_pair(measured[kind]) for kind in ("bare", "walletsvc"))
            name = "GET /api/v1/wallets/{id}" if method == "GET" else "POST create transfer"
            rows.append((f"HTTP {name}", f"{ours:.0f} req/s", f"bare {bare:.0f} req/s", ours / bare,
                         f">= {target:.2f}x bare"))
            if p99 is not None:
                rows.append((f"HTTP {name} p99", f"{p99:.1f} ms", f"bare {bare_p99:.1f} ms", None,
                             "<= 25 ms"))
            if peer:
                theirs, their_p99 = _median_pair(measured["localstripe"])
                what = "GET a customer" if method == "GET" else "POST create a customer"
                rows.append((f"HTTP {name} vs localstripe ({what})", f"{ours:.0f} req/s",
                             f"localstripe {theirs:.0f} req/s (p99 {their_p99 or 0:.0f} ms)", ours / theirs,
                             "> 1x"))
    finally:
        for server in servers.values():
            server.terminate()
            server.join(timeout=10)
        if peer:
            peer["process"].terminate()
            peer["process"].wait(timeout=10)
    return rows


def _median_pair(pairs: list) -> tuple:
    rates = [rate for rate, _ in pairs]
    latencies = [p99 for _, p99 in pairs if p99 is not None]
    return statistics.median(rates), statistics.median(latencies) if latencies else None


LOCALSTRIPE = os.environ.get("LOCALSTRIPE") or shutil.which("localstripe")  # the peer, when installed


def start_localstripe() -> dict | None:
    """localstripe (a stateful Stripe fake in Python) from an empty store, with one customer."""
    if not LOCALSTRIPE:
        return None
    with contextlib.suppress(FileNotFoundError):
        os.remove("/tmp/localstripe.pickle")  # its whole store, rewritten on every write
    port = _free_port()
    process = subprocess.Popen([LOCALSTRIPE, "--port", str(port), "--from-scratch"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    auth = {"Authorization": "Bearer sk_test_bench", "Content-Type": "application/x-www-form-urlencoded"}
    for _ in range(200):
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("POST", "/v1/customers", body=b"email=first@example.com", headers=auth)
            customer = json.loads(conn.getresponse().read())["id"]
            return {"peer": "localstripe", "port": port, "customer": customer, "process": process}
        except OSError:
            time.sleep(0.1)
    process.terminate()
    return None


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


###############################################################################
# Figure 3 and 6: a million transfers ##########################################
###############################################################################


def build_dataset(path: str, transfers: int, wallets: int = 100) -> tuple:
    """Bulk insert with SQL: transfers and their two flows each, a deposit that funds each wallet,
    running balances, balances and counters computed after: a ledger the auditor finds clean."""
    svc, ws, key, ids = seeded(path, wallets=wallets)
    svc.close()
    started = time.perf_counter()
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA synchronous = OFF")
    conn.execute("BEGIN IMMEDIATE")
    for trigger in ("transfers_counted", "transfers_recounted", "flows_counted"):
        conn.execute(f"DROP TRIGGER {trigger}")
    indexes = [name for (name,) in conn.execute(  # rebuilt in one sorted pass after the insert
        "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name IN ('transfers', 'flows')"
        " AND sql IS NOT NULL")]
    for index in indexes:
        conn.execute(f"DROP INDEX {index}")
    conn.execute("CREATE TEMP TABLE w (k INTEGER PRIMARY KEY, id TEXT)")
    conn.executemany("INSERT INTO w VALUES (?, ?)", list(enumerate(ids)))
    base = int(time.time() * 1000) - transfers
    conn.execute(f"""
        WITH RECURSIVE seq(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM seq WHERE i < {transfers - 1})
        INSERT INTO transfers (id, workspace_id, biz_id, source_wallet_id, target_wallet_id, amount,
                               currency, status, created_at, updated_at, completed_at)
        SELECT printf('tr_%026d', i), ?, printf('b%09d', i), s.id, t.id, 1 + i % 997, 'USD',
               CASE WHEN i % 10 = 0 THEN 'FAILED' ELSE 'COMPLETED' END, {base} + i, {base} + i,
               CASE WHEN i % 10 = 0 THEN NULL ELSE {base} + i END
          FROM seq JOIN w s ON s.k = i % {wallets} JOIN w t ON t.k = (i + 1) % {wallets}""", (ws["id"],))
    conn.execute(f"""
        INSERT INTO flows (id, wallet_id, type, direction, amount, balance_after, transfer_id, biz_id,
                           counterparty_wallet_id, created_at)
        SELECT 'fl_o' || substr(id, 4), source_wallet_id, 'TRANSFER_OUT', 'DEBIT', amount, 1, id, biz_id,
               target_wallet_id, created_at FROM transfers WHERE status = 'COMPLETED'
        UNION ALL
        SELECT 'fl_i' || substr(id, 4), target_wallet_id, 'TRANSFER_IN', 'CREDIT', amount, 1, id, biz_id,
               source_wallet_id, created_at FROM transfers WHERE status = 'COMPLETED'
        UNION ALL
        SELECT 'fl_d' || substr(id, 5), id, 'DEPOSIT', 'CREDIT', 1000000000000, 1, NULL, NULL, NULL,
               {base} - 1 FROM wallets""")
    conn.execute("CREATE TEMP TABLE running (id TEXT PRIMARY KEY, wallet_id TEXT, balance INTEGER)"
                 " WITHOUT ROWID")
    conn.execute("INSERT INTO running SELECT id, wallet_id, sum(CASE direction WHEN 'CREDIT' THEN amount"
                 " ELSE -amount END) OVER (PARTITION BY wallet_id ORDER BY created_at, id) FROM flows")
    conn.execute("UPDATE flows SET balance_after = running.balance FROM running WHERE running.id = flows.id")
    conn.execute("UPDATE wallets SET balance = last.balance FROM (SELECT wallet_id, sum(CASE direction"
                 " WHEN 'CREDIT' THEN amount ELSE -amount END) AS balance FROM flows GROUP BY wallet_id)"
                 " AS last WHERE last.wallet_id = wallets.id")
    conn.execute("DELETE FROM counters")
    for owner in ("workspace_id", "source_wallet_id", "target_wallet_id"):
        conn.execute(f"INSERT INTO counters SELECT {owner}, 'transfers', count(*) FROM transfers GROUP BY 1"
                     " ON CONFLICT DO UPDATE SET n = n + excluded.n")
        conn.execute(f"INSERT INTO counters SELECT {owner}, 'transfers:' || status, count(*) FROM transfers"
                     " GROUP BY 1, 2 ON CONFLICT DO UPDATE SET n = n + excluded.n")
    conn.execute("INSERT INTO counters SELECT wallet_id, 'flows', count(*) FROM flows GROUP BY 1")
    conn.execute("INSERT INTO counters SELECT wallet_id, 'flows:' || type, count(*) FROM flows GROUP BY 1, 2")
    conn.execute("COMMIT")
    conn.close()
    with sqlite3.connect(path) as again:  # the schema script is idempotent: triggers and indexes come back
        again.executescript(pathlib.Path(walletsvc.__file__).with_name("schema.sql").read_text())
    with sqlite3.connect(path) as check:
        assert check.execute("SELECT count(*) FROM sqlite_master WHERE type = 'trigger'").fetchone()[0] == 3
        restored = {name for (name,) in check.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
        assert set(indexes) <= restored
    return ws, key, ids, time.perf_counter() - started


def list_timings(path: str, key: dict, wallet_id: str, calls: int, rounds: int) -> dict:
    svc = walletsvc.WalletService(path, **SETTINGS)
    app = walletsvc.create_app(svc)

    def timing(request_path: str, query: str) -> float:
        def run():
            call_wsgi(app, "GET", request_path, b"",
                      walletsvc.sign_request("GET", request_path, b"", key["apiKey"], key["secret"]), query)
        run()
        return median_of_rounds(run, calls, rounds)

    result = {"page 0": timing("/api/v1/transfer/query/orders", "size=20"),
              "status": timing("/api/v1/transfer/query/orders", "status=FAILED&size=20"),
              "flows": timing(f"/api/v1/wallets/{wallet_id}/flows", "size=20"),
              "page 1000": timing("/api/v1/transfer/query/orders", "page=1000&size=20")}
    svc.close()
    return result


def audit_row(path: str, label: str) -> tuple:
    """The auditor over the whole dataset, in one read transaction: it must be clean."""
    svc = walletsvc.WalletService(path, **SETTINGS)
    started = time.perf_counter()
    violations = svc.audit()
    seconds = time.perf_counter() - started
    svc.close()
    assert violations == [], violations[:3]
    return (f"svc.audit() of {label} transfers (clean)", f"{seconds:.1f} s", "", None, "report")


def peak_rss_kib(path: str, key: dict, wallet_id: str) -> int:
    """Serve the dataset with `walletsvc serve`, exercise the lists, read VmHWM."""
    server = subprocess.Popen([sys.executable, "-m", "walletsvc", "serve", "--db", path, "--port", "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        port = None
        while port is None:
            line = server.stdout.readline()
            if "serving on" in line:
                port = int(line.rsplit(":", 1)[1])
        client = walletsvc.Client(f"http://127.0.0.1:{port}", key["apiKey"], key["secret"])
        for _ in range(20):
            client.list_transfers(size=100)
            client.list_transfers(status="FAILED", size=100)
            client.list_transfers(page=1000, size=100)
            client.list_flows(wallet_id, size=100)
            client.list_wallet_transfers(wallet_id, size=100)
        with open(f"/proc/{server.pid}/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM"))
    finally:
        server.terminate()
        server.wait(timeout=10)


def scale(tmp: str, transfers: int, calls: int, rounds: int) -> list:
    small = os.path.join(tmp, "small.db")
    big = os.path.join(tmp, "big.db")
    _, small_key, small_ids, _ = build_dataset(small, 1000)
    _, big_key, big_ids, seconds = build_dataset(big, transfers)
    small_t = list_timings(small, small_key, small_ids[3], calls, rounds)
    big_t = list_timings(big, big_key, big_ids[3], calls, rounds)
    label = f"{transfers:,}"
    rows = [(f"build {label} transfers + flows (bulk SQL)", f"{seconds:.1f} s", "", None, "seconds")]
    for name, shown, target in (("page 0", "page 0 of the transfer list", "<= 2x"),
                                ("flows", "page 0 of a wallet's flows", "<= 2x"),
                                ("status", "status-filtered transfer list", "<= 5x"),
                                ("page 1000", "page 1000 of the transfer list", "report")):
        rows.append((f"{label} transfers: {shown}", f"{big_t[name]:.0f} us", f"1,000: {small_t[name]:.0f} us",
                     big_t[name] / small_t[name], target))
    rows.append(audit_row(big, label))
    rss = peak_rss_kib(big, big_key, big_ids[3])
    rows.append((f"peak RSS of a server holding {label} transfers", f"{rss / 1024:.0f} MiB", "", None,
                 "report"))
    return rows


###############################################################################
# Figures 4 and 5: nonce table, fresh service, reset ###########################
###############################################################################


def nonce_table(requests: int) -> list:
    clock = walletsvc.Clock(frozen_at=time.time())
    svc = walletsvc.WalletService(":memory:", clock=clock)
    ws = svc.create_workspace("nonces")
    key = svc.create_api_key(ws["id"])
    wallet = svc.create_wallet(ws["id"], "USD")
    app = walletsvc.create_app(svc)
    path = f"/api/v1/wallets/{wallet['id']}"
    step = 300 / requests  # spread over 300 s of service clock: five 60 s windows
    largest = 0
    for n in range(requests):
        headers = walletsvc.sign_request("GET", path, b"", key["apiKey"], key["secret"],
                                         timestamp=int(clock()))
        call_wsgi(app, "GET", path, b"", headers)
        clock.advance(step)
        if n % 1000 == 0:
            with svc.db.connection() as conn:
                largest = max(largest, conn.execute("SELECT count(*) FROM nonces").fetchone()[0])
    with svc.db.connection() as conn:
        final = conn.execute("SELECT count(*) FROM nonces").fetchone()[0]
    per_window = requests / 5
    return [(f"nonce rows after {requests:,} requests over 300 s", f"{final:,} (peak {largest:,})",
             f"{per_window:,.0f} requests per 60 s window", largest / per_window, "bounded (~2.5 windows)")]


def startup(rounds: int) -> list:
    def fresh():
        svc = walletsvc.WalletService(":memory:")
        walletsvc.create_app(svc)
        ws = svc.create_workspace("w")
        svc.create_api_key(ws["id"])
        svc.create_wallet(ws["id"], "USD")
        svc.create_wallet(ws["id"], "USD")

    sandbox = walletsvc.Sandbox.create()
    fresh_ms = median_of_rounds(fresh, 50, rounds) / 1000
    reset_ms = median_of_rounds(sandbox.reset, 50, rounds) / 1000

    def per_test() -> None:  # what walletsvc_sandbox adds to a test: the reset before, the audit after
        sandbox.reset()
        sandbox.audit()

    def empty_test() -> None:
        pass

    overhead_ms = (median_of_rounds(per_test, 200, rounds) - median_of_rounds(empty_test, 200, rounds)) / 1000
    rows = [("fresh in-memory service + app + seed", f"{fresh_ms:.2f} ms", "", None, "<= 3 ms"),
            ("Sandbox.reset (restore the saved start)", f"{reset_ms:.2f} ms", "", None, "<= 3 ms"),
            ("walletsvc_sandbox per test (reset + audit) over an empty test", f"{overhead_ms:.2f} ms", "",
             None, "<= 0.5 ms")]
    return rows + live_teardown_and_world_reset(rounds)


def live_teardown_and_world_reset(rounds: int) -> list:
    """The live fixture's teardown with a keep-alive client connected, and a world's reset over HTTP."""
    stops = []
    for _ in range(rounds):
        server = walletsvc.LiveServer(walletsvc.Sandbox.create().app)
        connection = http.client.HTTPConnection("127.0.0.1", int(server.url.rsplit(":", 1)[1]), timeout=5)
        connection.request("GET", "/healthz")
        connection.getresponse().read()  # the connection stays open, as a client's session keeps it
        started = time.perf_counter()
        server.stop()
        stops.append((time.perf_counter() - started) * 1000)
        connection.close()
    sandbox = walletsvc.Sandbox.create()
    server = walletsvc.LiveServer(sandbox.app)
    port = int(server.url.rsplit(":", 1)[1])
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    admin = {"Authorization": f"Bearer {sandbox.admin_token}", "Content-Type": "application/json"}
    connection.request("POST", "/_admin/scenarios", body=b"{}", headers=admin)
    world = json.loads(connection.getresponse().read())["data"]["workspaces"][0]["id"]

    def reset_world() -> None:
        connection.request("POST", f"/_admin/workspaces/{world}/reset", headers=admin)
        assert connection.getresponse().read()

    reset_ms = median_of_rounds(reset_world, 50, rounds) / 1000
    connection.close()
    server.stop()
    return [("live fixture teardown (LiveServer.stop, a keep-alive client)",
             f"{statistics.median(stops):.1f} ms", "", None, "<= 100 ms"),
            ("reset of a world over HTTP (POST /_admin/workspaces/{id}/reset)", f"{reset_ms:.2f} ms", "",
             None, "<= 5 ms")]


###############################################################################
# Against a previous version, in the same run ####################################
###############################################################################


def previous_module(rev: str, tmp: str):
    """walletsvc.py and schema.sql as they were at git revision ``rev``, imported under another name."""
    folder = os.path.join(tmp, "previous")
    os.makedirs(folder, exist_ok=True)
    here = pathlib.Path(__file__).parent
    for name in ("walletsvc.py", "schema.sql"):
        text = subprocess.run(["git", "show", f"{rev}:{name}"], cwd=here, capture_output=True, text=True,
                              check=True).stdout
        pathlib.Path(folder, name).write_text(text)
    spec = importlib.util.spec_from_file_location("walletsvc_previous", os.path.join(folder, "walletsvc.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look themselves up there)
    spec.loader.exec_module(module)
    return module


sign = walletsvc.sign_request


def against_previous(tmp: str, rev: str, calls: int, rounds: int) -> list:
    """The in-process signed GET and create transfer of this walletsvc and of the one at ``rev``,
    on file databases, at the defaults and with the sandbox's journal (journal_size=1000), rounds
    interleaved so that noise hits both alike."""
    previous = previous_module(rev, tmp)
    runs: dict = {}
    for settings, label in (({}, "defaults"), ({"journal_size": 1000}, "journal on")):
        for version, module in (("now", walletsvc), ("previous", previous)):
            svc = module.WalletService(os.path.join(tmp, f"{version}-{len(runs)}.db"),
                                       **{**SETTINGS, **settings})
            ws = svc.create_workspace("bench")
            key = svc.create_api_key(ws["id"])
            wallets = [svc.create_wallet(ws["id"], "USD")["id"] for _ in range(2)]
            svc.deposit(wallets[0], "1000000000.00")
            app = module.create_app(svc)
            path = f"/api/v1/wallets/{wallets[0]}"
            body = json.dumps({"sourceWalletId": wallets[0], "targetWalletId": wallets[1], "amount": "0.01",
                               "currency": "USD"}).encode()
            runs[(label, "GET /api/v1/wallets/{id}", version)] = lambda app=app, path=path, key=key: (
                call_wsgi(app, "GET", path, b"", sign("GET", path, b"", key["apiKey"], key["secret"])))
            runs[(label, "POST create transfer", version)] = lambda app=app, body=body, key=key: call_wsgi(
                app, "POST", TRANSFER, body, sign("POST", TRANSFER, body, key["apiKey"], key["secret"]))
    rows = []
    for label, name in dict.fromkeys((label, name) for label, name, _ in runs):
        measured: dict = {"now": [], "previous": []}
        for _ in range(rounds):
            for version in ("now", "previous"):
                measured[version].append(median_of_rounds(runs[(label, name, version)], calls, 1))
        now, before = (statistics.median(measured[version]) for version in ("now", "previous"))
        rows.append((f"in-process {name} ({label}) vs {rev}", f"{now:.0f} us", f"{rev} {before:.0f} us",
                     now / before, "<= 1.10x" if label == "defaults" else "report"))
    return rows


###############################################################################
# Workers: --workers 1 against --workers 2 over HTTP ##############################
###############################################################################


def serve_workers(db: str, workers: int, ready) -> None:
    """Child process: `walletsvc serve --workers N` at its defaults; reports the port."""
    logging.getLogger("waitress.queue").setLevel(logging.ERROR)
    walletsvc.serve(walletsvc.WalletService(db, **SETTINGS), port=0, threads=SERVER_THREADS, workers=workers,
                    on_ready=lambda url: ready.put(int(url.rsplit(":", 1)[1])))


def cpu_seconds(root: int) -> float:
    """User + system CPU seconds of process ``root`` and every descendant (from /proc)."""
    ticks, parents = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = pathlib.Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry)], ticks[int(entry)] = int(fields[1]), int(fields[11]) + int(fields[12])
    family, grew = {root}, True
    while grew:
        grew = False
        for pid, parent in parents.items():
            if parent in family and pid not in family:
                family.add(pid)
                grew = True
    return sum(ticks.get(pid, 0) for pid in family) / os.sysconf("SC_CLK_TCK")


def workers_over_http(tmp: str, seconds: float, rounds: int) -> list:
    """Throughput, p99 and CPU seconds per request of --workers 1 and --workers 2 (one database):
    the CPU per request says whether N workers would scale with N cores on a bigger machine than
    this 2-core one, where the load generator takes a core."""
    db = os.path.join(tmp, "workers.db")
    svc, _, key, wallets = seeded(db)
    svc.close()
    context = multiprocessing.get_context("spawn")
    servers, ports = {}, {}
    for workers in (1, 2):
        ready = context.Queue()
        servers[workers] = context.Process(target=serve_workers, args=(db, workers, ready), daemon=True)
        servers[workers].start()
        ports[workers] = ready.get(timeout=30)
    rows = []
    try:
        time.sleep(0.5)  # the forked workers are up
        for method in ("GET", "POST"):
            plan = {"method": method, "wallets": wallets, "key": key["apiKey"], "secret": key["secret"]}
            measured: dict = {1: [], 2: []}
            for _ in range(rounds):
                for workers in (1, 2):
                    before = cpu_seconds(servers[workers].pid)
                    rate, p99 = requests_per_second(ports[workers], plan, seconds)
                    cpu = (cpu_seconds(servers[workers].pid) - before) / max(rate * seconds, 1)
                    measured[workers].append((rate, p99, cpu))
            (one, two) = ([statistics.median(values) if None not in values else None
                           for values in zip(*measured[workers])] for workers in (1, 2))
            name = "GET /api/v1/wallets/{id}" if method == "GET" else "POST create transfer"
            rows.append((f"HTTP {name}, --workers 2 vs 1", f"{two[0]:.0f} req/s",
                         f"1 worker {one[0]:.0f} req/s", two[0] / one[0], "report"))
            if one[1] is not None:
                rows.append((f"HTTP {name} p99, --workers 2 vs 1", f"{two[1]:.1f} ms",
                             f"1 worker {one[1]:.1f} ms", two[1] / one[1], "report"))
            rows.append((f"HTTP {name} CPU per request, --workers 2 vs 1", f"{two[2] * 1e6:.0f} us",
                         f"1 worker {one[2] * 1e6:.0f} us", two[2] / one[2], "~1x: scales with cores"))
    finally:
        for server in servers.values():
            server.terminate()
            server.join(timeout=10)
    return rows


###############################################################################
# Main #########################################################################
###############################################################################


SECTIONS = ("startup", "in_process", "previous", "http", "workers", "nonce", "scale")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller counts for a smoke run")
    parser.add_argument("--only", action="append", choices=SECTIONS, help="run only this section; repeatable")
    parser.add_argument("--previous", metavar="REV", default="HEAD",
                        help="the git revision the 'previous' section measures against (default HEAD)")
    args = parser.parse_args()
    quick = args.quick
    rounds = 3 if quick else 7
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        sections = {"startup": lambda: startup(rounds),
                    "in_process": lambda: in_process(tmp, 200 if quick else 1000, rounds),
                    "previous": lambda: against_previous(tmp, args.previous, 200 if quick else 1000, rounds),
                    "workers": lambda: workers_over_http(tmp, 1.0 if quick else 3.0, 3 if quick else 5),
                    "http": lambda: over_http(tmp, 1.0 if quick else 3.0, 3 if quick else 5),
                    "nonce": lambda: nonce_table(20_000 if quick else 200_000),
                    "scale": lambda: scale(tmp, 100_000 if quick else 1_000_000, 50 if quick else 200,
                                           rounds)}
        for name in args.only or SECTIONS:
            for row in sections[name]():
                rows.append(row)
                print_row(row)
    print()
    print("| figure | walletsvc | baseline | ratio | target |")
    print("|---|---|---|---|---|")
    for name, value, baseline, ratio, target in rows:
        print(f"| {name} | {value} | {baseline} | {'' if ratio is None else f'{ratio:.2f}x'} | {target} |")
    return 0


def print_row(row: tuple) -> None:
    name, value, baseline, ratio, target = row
    shown = "" if ratio is None else f"{ratio:.2f}x"
    print(f"{name:<55} {value:>18} {baseline:>24} {shown:>8}  {target}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
