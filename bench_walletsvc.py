"""Benchmarks of walletsvc, each figure a ratio against a baseline measured in the same run.

    python bench_walletsvc.py            # every figure (about ten minutes on 2 cores)
    python bench_walletsvc.py --quick    # every section, smaller counts: a smoke run (well under a minute)
    python bench_walletsvc.py --only previous --previous REV   # against walletsvc.py at a git REV

Baselines built here: **bare** (a bottle route answering a same-sized envelope: no auth, no SQL)
and **floor** (the least work a correct signed request must do, written straight-line with
sqlite3 and hmac: key row, nonce check and insert, HMAC, the wallet row or the transfer
transaction, the JSON envelope). Medians of several rounds; prints a table.

Only walletsvc's public surfaces are used (WalletService, create_app, sign_request, Sandbox,
Clock, `walletsvc serve` in a child process, the /_admin/ HTTP surface), so that the bench keeps
working while its internals change; the bulk dataset of the scale section alone writes SQL to
the tables of schema.sql, and the anatomy's side "as served" sets its access log up as `walletsvc
serve` does (its LogFormatter and lean_log_records). wrk and strace are used when installed;
without them the figures come from a Python load generator, and what cannot be measured prints
"n/a".
"""

from __future__ import annotations

import argparse
import base64
import bisect
import contextlib
import ctypes
import functools
import hashlib
import hmac
import http.client
import importlib.util
import io
import itertools
import json
import logging
import multiprocessing
import os
import pathlib
import random
import re
import shutil
import signal
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
TRANSFER = "/api/v1/transfer/command/create"
MODULE_FOLDER = str(pathlib.Path(walletsvc.__file__).resolve().parent)  # the walletsvc.py a server runs
WRK = shutil.which("wrk")  # Debian's wrk when installed, else the Python load generator
STRACE = shutil.which("strace")  # for the disk syncs per transfer; without it they are n/a


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
# `walletsvc serve` in a child process ##########################################
###############################################################################


def write_scenario(tmp: str, name: str, wallets: int = 10) -> str:
    """A scenario file: one workspace, a full-scope key, ``wallets`` USD wallets funded for any bench."""
    path = os.path.join(tmp, f"{name}.scenario.json")
    funded = [{"name": f"w{n}", "currency": "USD", "balance": "1000000000.00"} for n in range(wallets)]
    with open(path, "w") as handle:
        json.dump({"workspaces": [{"name": "bench", "keys": [{"scopes": list(walletsvc.SCOPES)}],
                                   "wallets": funded}]}, handle)
    return path


@contextlib.contextmanager
def served(tmp: str, name: str, *options: str, folder: str = MODULE_FOLDER, scenario: bool = True,
           lifetime: float = 900):
    """`walletsvc serve` at its defaults (plus ``options``) on 127.0.0.1 in a child process, from
    the walletsvc.py in ``folder``, serving ``tmp/name.db`` (with ``scenario``: started from a bench
    scenario); yields (process, ready file as a dict: url, port, keys, wallets). Stopped by its pid
    on leaving, or after ``lifetime`` seconds."""
    db, ready_path = os.path.join(tmp, f"{name}.db"), os.path.join(tmp, f"{name}.ready.json")
    command = [sys.executable, "-m", "walletsvc", "serve", "--db", db, "--port", "0", "--host", "127.0.0.1",
               "--ready-file", ready_path, *options]
    if scenario and "--scenario" not in options:
        command += ["--scenario", write_scenario(tmp, name)]
    log = os.path.join(tmp, f"{name}.log")
    with open(log, "w") as output:  # the child writes to its own copy of the descriptor
        # cwd and PYTHONPATH both: `-m` puts the cwd first, and the venv may hold another walletsvc
        process = subprocess.Popen(command, cwd=folder, env={**os.environ, "PYTHONPATH": folder},
                                   stdout=output, stderr=subprocess.STDOUT,
                                   preexec_fn=_stop_with_parent)  # noqa: PLW1509 - it calls prctl only
    watchdog = threading.Timer(lifetime, process.kill)  # bounded even if the bench itself is stuck
    watchdog.daemon = True
    watchdog.start()
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(ready_path):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"walletsvc serve {name} did not start: "
                                   f"{pathlib.Path(log).read_text()[-500:]}")
            time.sleep(0.02)
        with open(ready_path) as handle:
            yield process, json.load(handle)
    finally:
        watchdog.cancel()
        stop(process)


_PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # looked up before any fork: the child only calls it


def _stop_with_parent() -> None:
    """In the child, before exec: SIGTERM when the bench dies, so that no server outlives it."""
    _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


def plan_for(ready: dict, method: str) -> dict:
    """What a load generator needs to sign requests against a served scenario."""
    key = ready["keys"][0]
    return {"method": method, "wallets": [wallet["id"] for wallet in ready["wallets"]],
            "key": key["apiKey"], "secret": key["secret"]}


def threads_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def default_threads(tmp: str, serving: subprocess.Popen) -> int:
    """The request threads `walletsvc serve` runs by default, counted rather than assumed: the OS
    threads of the default server less those of one started with --threads 1, plus that one."""
    with served(tmp, "one-thread", "--threads", "1") as (single, _):
        return threads_of(serving.pid) - threads_of(single.pid) + 1


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
    """Straight-line sqlite3 + hmac on a minimal schema (MINIMAL_SCHEMA, holding the service's key
    and wallets as its public API gives them), served as a WSGI app like the other two. It follows
    the same durability policy: a read's nonce is committed without a disk sync, a transfer and its
    nonce are one transaction committed at synchronous=FULL."""

    def __init__(self, path: str, key: dict, wallets: list[dict]) -> None:
        self.conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.conn.execute("PRAGMA journal_mode = WAL")
        self.conn.execute("PRAGMA busy_timeout = 5000")
        self.conn.execute("PRAGMA synchronous = FULL")
        self.conn.executescript(MINIMAL_SCHEMA)
        now_ms = int(time.time() * 1000)
        self.conn.execute("INSERT INTO api_keys VALUES (?, ?, ?, 1)",
                          (key["apiKey"], key["secret"], wallets[0]["workspaceId"]))
        self.conn.executemany("INSERT INTO wallets VALUES (?, ?, ?, ?, ?, ?, 0, ?, ?)", [
            (w["id"], w["workspaceId"], w["name"] or "", w["currency"], w["status"],
             int(w["balance"].replace(".", "")), now_ms, now_ms) for w in wallets])

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
    floor = Floor(os.path.join(tmp, "floor.db"), key, [svc.get_wallet(wallet) for wallet in wallets])
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
# The request path's shape: a call trace of one warmed-up request ###############
###############################################################################


def module_sections() -> list[tuple[int, str]]:
    """walletsvc.py's sections (a banner "# Name ####" between two rules of #), by first line."""
    lines = pathlib.Path(walletsvc.__file__).read_text(encoding="utf-8").splitlines()
    return [(number + 1, re.sub(r"\s*#+$", "", line[2:]).strip()) for number, line in enumerate(lines)
            if re.fullmatch(r"# [A-Za-z].* #{4,}", line) and number and lines[number - 1].startswith("####")]


def call_trace(run) -> list[str]:
    """The section of each walletsvc function ``run`` calls, in call order (generator expressions,
    comprehensions and lambdas are part of the function they are written in)."""
    sections = module_sections()
    starts = [line for line, _ in sections]
    module = walletsvc.__file__
    seen: list[str] = []

    def profile(frame, event, arg) -> None:
        code = frame.f_code
        if event == "call" and code.co_filename == module and not code.co_name.startswith("<"):
            seen.append(sections[bisect.bisect_right(starts, code.co_firstlineno) - 1][1])

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return seen


SHAPE_TARGETS = {"signed GET": (7, 16), "signed create-transfer": (9, 25)}  # sections, changes of section


def request_shape(tmp: str) -> list:
    """How many sections one signed request runs through, and how often it changes section: an
    embedded service at its defaults, and with the sandbox's journal (report)."""
    rows = []
    for journal in (0, 1000):
        svc, _, key, wallets = seeded(os.path.join(tmp, f"shape-{journal}.db"), journal_size=journal)
        app = walletsvc.create_app(svc)
        path = f"/api/v1/wallets/{wallets[0]}"
        body = json.dumps({"sourceWalletId": wallets[0], "targetWalletId": wallets[1], "amount": "0.01",
                           "currency": "USD"}).encode()
        for name, (method, target, payload) in {"signed GET": ("GET", path, b""),
                                                "signed create-transfer": ("POST", TRANSFER, body)}.items():
            for _ in range(20):  # warmed up: caches filled, connections open
                call_wsgi(app, method, target, payload,
                          walletsvc.sign_request(method, target, payload, key["apiKey"], key["secret"]))
            headers = walletsvc.sign_request(method, target, payload, key["apiKey"], key["secret"])
            trace = call_trace(functools.partial(call_wsgi, app, method, target, payload, headers))
            changes = sum(1 for before, after in itertools.pairwise(trace) if before != after)
            most_sections, most_changes = SHAPE_TARGETS[name]
            label = f"{name}{' (journal on)' if journal else ''}"
            rows.append((f"{label}: sections / changes of section", f"{len(set(trace))} / {changes}",
                         f"{len(trace)} calls", None,
                         "report" if journal else f"<= {most_sections} / <= {most_changes}"))
            if not journal:
                rows.append((f"{name}: its path", " > ".join(_runs(trace)), "", None, "report"))
        svc.close()
    return rows


def _runs(trace: list[str]) -> list[str]:
    """The sections in order, each run of calls in one section once."""
    return [section for index, section in enumerate(trace) if not index or trace[index - 1] != section]


###############################################################################
# Anatomy: where a request's microseconds go ###################################
###############################################################################

# The C calls a part is named after, whoever makes them: SQLite's statements, the HMAC and digests, JSON.
_C_PARTS = {"sqlite3": "SQLite statements", "_hashlib": "HMAC and SHA-256", "_operator": "HMAC and SHA-256",
            "_json": "JSON"}
# Libraries whose Python is a part of its own, whoever calls them: the access log is the logging package's.
_LIBRARY_PARTS = {os.path.dirname(logging.__file__): "The access log (logging)"}


class _Parts:
    """A sys.setprofile callback charging the time between two events to the part running: a C call
    of _C_PARTS to its part, else the section of ``owner`` (a file) whose Python runs, a library's
    time going to the section that called it."""

    def __init__(self, owner: str, sections: list[tuple[int, str]]) -> None:
        self.owner, self.sections, self.starts = owner, sections, [line for line, _ in sections]
        self.of_code: dict = {}
        self.totals: dict[str, int] = {}
        self.events: dict[str, int] = {}
        self.part, self.last = "(outside)", time.perf_counter_ns()

    def section(self, frame) -> str:
        while frame is not None and frame.f_code.co_filename != self.owner:
            library = _LIBRARY_PARTS.get(os.path.dirname(frame.f_code.co_filename))
            if library is not None:
                return library
            frame = frame.f_back
        if frame is None:
            return "(outside)"
        if frame.f_code not in self.of_code:  # (called by a library of its own part: in that part)
            caller = frame.f_back and _LIBRARY_PARTS.get(os.path.dirname(frame.f_back.f_code.co_filename))
            at = bisect.bisect_right(self.starts, frame.f_code.co_firstlineno) - 1
            self.of_code[frame.f_code] = caller or self.sections[max(at, 0)][1]
        return self.of_code[frame.f_code]

    def __call__(self, frame, event, arg) -> None:
        now = time.perf_counter_ns()
        self.totals[self.part] = self.totals.get(self.part, 0) + now - self.last
        self.events[self.part] = self.events.get(self.part, 0) + 1
        if event == "c_call":
            module = getattr(arg, "__module__", None) or type(getattr(arg, "__self__", None)).__module__
            self.part = _C_PARTS.get(module) or self.section(frame)
        else:
            self.part = self.section(frame.f_back if event == "return" else frame)
        self.last = time.perf_counter_ns()

    def traced(self, run, calls: int) -> dict[str, float]:
        sys.setprofile(self)
        try:
            for _ in range(calls):
                run()
        finally:
            sys.setprofile(None)
        return self.totals


def anatomy_of(run, calls: int, owner: str, sections: list[tuple[int, str]]) -> dict[str, float]:
    """Microseconds per call of ``run``, by part (_Parts), measured under sys.setprofile with each
    event's own cost (calibrated on empty calls) taken off, then scaled to ``run``'s untraced time."""
    def empty() -> None:
        pass

    calibration = _Parts(owner, sections)
    per_event = sum(calibration.traced(empty, calls * 20).values()) / max(sum(calibration.events.values()), 1)
    parts = _Parts(owner, sections)
    spent = {part: max(total - parts.events.get(part, 0) * per_event, 0)
             for part, total in parts.traced(run, calls).items()}
    untraced, whole = median_of_rounds(run, calls, 3), sum(spent.values()) or 1
    return {part: untraced * value / whole for part, value in sorted(spent.items(), key=lambda kv: -kv[1])}


def anatomy(tmp: str, calls: int) -> list:
    """Where a signed GET and a create-transfer spend their time in process, part by part, beside the
    floor's own parts (docs/operations.md keeps the table): an embedded service at its defaults, and as
    `walletsvc serve` runs it (the journal on, the clock in the database, an access log line written)."""
    embedded = seeded(os.path.join(tmp, "anatomy.db"))
    as_served = seeded(os.path.join(tmp, "anatomy-served.db"), journal_size=walletsvc.SANDBOX_JOURNAL_SIZE,
                       clock=walletsvc.Clock())
    key, wallets = embedded[2], embedded[3]
    floor = Floor(os.path.join(tmp, "anatomy-floor.db"), key,
                  [embedded[0].get_wallet(wallet) for wallet in wallets])
    served_app = walletsvc.create_app(as_served[0])
    module, sections = walletsvc.__file__, module_sections()
    sides = [("walletsvc", walletsvc.create_app(embedded[0]), embedded, module, sections),
             ("as served", served_app, as_served, module, sections),
             ("floor", floor, embedded, __file__, [(1, "Python")])]
    rows = []
    with access_log_to(os.path.join(tmp, "anatomy-access.log")) as served_app.http.access_log:
        for name in ("signed GET", "create-transfer"):
            for label, served, (_, _, key, wallets), owner, sections in sides:
                method, target, payload = anatomy_request(name, wallets)

                def one(served=served, method=method, target=target, payload=payload, key=key) -> None:
                    call_wsgi(served, method, target, payload,
                              walletsvc.sign_request(method, target, payload, key["apiKey"], key["secret"]))
                for _ in range(50):
                    one()
                parts = anatomy_of(one, calls, owner, sections)
                whole = sum(parts.values())
                rows += [(f"anatomy, {name}, {label}: {part}", f"{micros:.1f} us", f"of {whole:.0f} us",
                          micros / whole, "report") for part, micros in parts.items() if micros >= 0.5]
    for svc, *_ in (embedded, as_served):
        svc.close()
    return rows


def anatomy_request(name: str, wallets: list[str]) -> tuple[str, str, bytes]:
    if name == "signed GET":
        return "GET", f"/api/v1/wallets/{wallets[0]}", b""
    return "POST", TRANSFER, json.dumps({"sourceWalletId": wallets[0], "targetWalletId": wallets[1],
                                         "amount": "0.01", "currency": "USD"}).encode()


@contextlib.contextmanager
def access_log_to(path: str):
    """The access log as `walletsvc serve` writes it (its logger, formatter and records), into the file at
    ``path``; logging as it was after."""
    logger = logging.getLogger("walletsvc.access")
    handler = logging.FileHandler(path)
    handler.setFormatter(walletsvc.LogFormatter())
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    kept = (logging.logThreads, logging.logProcesses, logging.logMultiprocessing, logging._srcfile)
    walletsvc.lean_log_records()
    try:
        yield logger
    finally:
        logging.logThreads, logging.logProcesses, logging.logMultiprocessing, logging._srcfile = kept
        logger.removeHandler(handler)
        handler.close()
        logger.propagate = True
        logger.setLevel(logging.NOTSET)


###############################################################################
# Load generators: wrk, else Python ##############################################
###############################################################################


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


def drive(port: int, plans: list[dict], *, seconds: float | None = None, requests: int | None = None,
          seed: int = 0, timeout: float = 30) -> list[list[tuple[int, float]]]:
    """One keep-alive connection per plan, each a thread of this process sending its plan's signed
    requests until ``seconds`` have passed or it has sent ``requests``: per connection, the
    (status, seconds waited) of every request."""
    deadline = time.monotonic() + (3600 if seconds is None else seconds)
    answers: list[list[tuple[int, float]]] = [[] for _ in plans]

    def loop(n: int) -> None:
        rng = random.Random(seed * 1000 + n)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        try:
            while time.monotonic() < deadline and (requests is None or len(answers[n]) < requests):
                path, body, headers = signed_request(plans[n], rng)
                started = time.perf_counter()
                conn.request(plans[n]["method"], path, body=body or None, headers=headers)
                reply = conn.getresponse()
                reply.read()
                answers[n].append((reply.status, time.perf_counter() - started))
        finally:
            conn.close()

    threads = [threading.Thread(target=loop, args=(n,)) for n in range(len(plans))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers


def load_worker(port: int, plan: dict, seconds: float, connections: int, seed: int, results) -> None:
    """Child process: ``drive`` with ``connections`` connections; puts (answered 200, latencies)."""
    answers = [answer for connection in drive(port, [plan] * connections, seconds=seconds, seed=seed)
               for answer in connection]
    results.put((sum(status == 200 for status, _ in answers), [waited for _, waited in answers]))


def p99_ms(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000 if ordered else float("nan")


_WRK_SCRIPT = """
local requests = {%s}
local threads, counter = %d, 0
function setup(thread) thread:set("id", counter); counter = counter + 1 end
function init(args) n = id end
function request() n = n + threads; return requests[(n %% #requests) + 1] end
"""


def requests_per_second(port: int, plan: dict, seconds: float) -> tuple[float, float]:
    """Signed requests answered 200 per second over 8 keep-alive connections, and the p99 latency
    in ms: wrk when present, else Python."""
    if WRK:
        return wrk_requests_per_second(port, plan, seconds)
    return python_requests_per_second(port, plan, seconds)


def wrk_requests_per_second(port: int, plan: dict, seconds: float) -> tuple[float, float]:
    """wrk (2 threads, 8 connections) replaying requests signed beforehand, each
    nonce once (wrk cannot compute HMACs); answers other than 2xx are not counted."""
    rng = random.Random(7)
    raw = []
    for _ in range(int(12000 * seconds)):  # more than any server here answers in the time (the floor: ~6,000)
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
    p99 = float(p99.group(1)) * {"us": 0.001, "ms": 1, "s": 1000}[p99.group(2)]
    return (total - (int(failed.group(1)) if failed else 0)) / duration, p99


def python_requests_per_second(port: int, plan: dict, seconds: float) -> tuple[float, float]:
    """Two processes of four connections each (one process would be bound by its GIL)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    workers = [context.Process(target=load_worker, args=(port, plan, seconds, 4, seed, results))
               for seed in range(2)]
    for worker in workers:
        worker.start()
    answered, latencies = 0, []
    for _ in workers:
        ok, waited = results.get(timeout=seconds + 60)
        answered, latencies = answered + ok, latencies + waited
    for worker in workers:
        worker.join()
    return answered / seconds, p99_ms(latencies)


def load_tool() -> str:
    return "wrk" if WRK else "python"


###############################################################################
# Figure 2: over HTTP through waitress ##########################################
###############################################################################


def serve_bare(get_body: bytes, post_body: bytes, threads: int, ready) -> None:
    """Child process: the bare app on waitress (its defaults but for ``threads``); reports the port."""
    import waitress

    logging.getLogger("waitress.queue").setLevel(logging.ERROR)
    server = waitress.create_server(bare_app(get_body, post_body), host="127.0.0.1", port=0, threads=threads)
    ready.put(server.effective_port)
    server.run()


class HttpFloor(Floor):
    """The floor as an app served by waitress's threads: the same straight-line work, on one
    connection per thread (a transfer waits for the write lock in SQLite's busy handler)."""

    def __init__(self, path: str, key: dict, wallets: list[dict]) -> None:
        self.path, self.local = path, threading.local()
        super().__init__(path, key, wallets)

    @property
    def conn(self) -> sqlite3.Connection:
        conn = getattr(self.local, "conn", None)
        if conn is None:
            conn = self.local.conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            for pragma in ("journal_mode = WAL", "busy_timeout = 5000", "synchronous = FULL"):
                conn.execute(f"PRAGMA {pragma}")
        return conn

    @conn.setter
    def conn(self, value: sqlite3.Connection) -> None:
        self.local.conn = value

    @property
    def nonce(self) -> tuple:
        return self.local.nonce  # (each request's own, in its thread)

    @nonce.setter
    def nonce(self, value: tuple) -> None:
        self.local.nonce = value


def serve_floor(path: str, plan: dict, threads: int, ready) -> None:
    """Child process: the floor on waitress (its defaults but for ``threads``), holding the plan's key
    and wallets; reports the port."""
    import waitress

    logging.getLogger("waitress.queue").setLevel(logging.ERROR)
    key = {"apiKey": plan["key"], "secret": plan["secret"]}
    wallets = [{"id": wallet_id, "workspaceId": "ws_floor", "name": "", "currency": "USD", "status": "ACTIVE",
                "balance": "1000000000.00"} for wallet_id in plan["wallets"]]
    server = waitress.create_server(HttpFloor(path, key, wallets), host="127.0.0.1", port=0, threads=threads)
    ready.put(server.effective_port)
    server.run()


@contextlib.contextmanager
def child_server(serving, *args):
    """``serving(*args, ready)`` in a spawned child process (the bare app, the floor): its port."""
    context = multiprocessing.get_context("spawn")
    ready = context.Queue()
    server = context.Process(target=serving, args=(*args, ready), daemon=True)
    server.start()
    try:
        yield ready.get(timeout=30)
    finally:
        server.terminate()
        server.join(timeout=10)


def answer_body(port: int, plan: dict) -> bytes:
    """One signed request's answer (it must be a 200): what the bare app answers, same-sized."""
    path, body, headers = signed_request(plan, random.Random(0))
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request(plan["method"], path, body=body or None, headers=headers)
    reply = conn.getresponse()
    payload = reply.read()
    conn.close()
    if reply.status != 200:
        raise RuntimeError(f"{plan['method']} {path}: {reply.status} {payload[:200]!r}")
    return payload


HTTP_FIGURES = {"GET": ("HTTP signed GET at defaults, 8 connections", 0.85, 10),
                "POST": ("HTTP POST create transfer at defaults, 8 connections", 0.8, 25)}


def over_http(tmp: str, seconds: float, rounds: int) -> list:
    """`walletsvc serve` as users start it against the floor (the same required work in straight-line
    code) and the bare app, each on waitress at as many threads."""
    with served(tmp, "http") as (process, ready):
        threads = default_threads(tmp, process)
        plans = {method: plan_for(ready, method) for method in HTTP_FIGURES}
        bodies = [answer_body(ready["port"], plans[method]) for method in HTTP_FIGURES]
        floor_db = os.path.join(tmp, "http-floor.db")
        with child_server(serve_bare, *bodies, threads) as bare_port, \
                child_server(serve_floor, floor_db, plans["GET"], threads) as floor_port:
            peer = start_localstripe()
            try:
                return [row for method, plan in plans.items()
                        for row in http_rows(method, plan, {"bare": bare_port, "floor": floor_port,
                                                            "walletsvc": ready["port"]},
                                             peer, threads, seconds, rounds)]
            finally:
                if peer:
                    stop(peer["process"])


def http_rows(method: str, plan: dict, ports: dict, peer: dict | None, threads: int, seconds: float,
              rounds: int) -> list:
    name, target, p99_target = HTTP_FIGURES[method]
    measured: dict = {"bare": [], "floor": [], "walletsvc": [], "localstripe": []}
    for _ in range(rounds):  # interleaved, so that noise hits each alike
        for kind, port in ports.items():
            measured[kind].append(requests_per_second(port, plan, seconds))
        if peer:
            their_plan = {**plan, **{name: value for name, value in peer.items() if name != "process"}}
            measured["localstripe"].append(requests_per_second(peer["port"], their_plan, seconds))
    (bare, _), (floor, floor_p99), (ours, p99) = (_median_pair(measured[kind])
                                                         for kind in ("bare", "floor", "walletsvc"))
    short = name.split(",")[0]
    rows = [(name, f"{ours:.0f} req/s", f"floor {floor:.0f} req/s ({threads} threads, {load_tool()})",
             ours / floor, f">= {target:.2f}x floor"),
            (f"{short} vs bare", f"{ours:.0f} req/s", f"bare {bare:.0f} req/s", ours / bare, "report"),
            (f"{short}: the floor vs bare", f"{floor:.0f} req/s", f"bare {bare:.0f} req/s", floor / bare,
             "report"),
            (f"{short} p99", f"{p99:.1f} ms", f"floor {floor_p99:.1f} ms", p99 / floor_p99,
             f"<= {p99_target} ms")]
    if peer:
        theirs, their_p99 = _median_pair(measured["localstripe"])
        what = "GET a customer" if method == "GET" else "POST create a customer"
        rows.append((f"{short} vs localstripe ({what})", f"{ours:.0f} req/s",
                     f"localstripe {theirs:.0f} req/s (p99 {their_p99:.0f} ms)", ours / theirs, "> 1x"))
    return rows


def _median_pair(pairs: list) -> tuple:
    return statistics.median(rate for rate, _ in pairs), statistics.median(p99 for _, p99 in pairs)


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
    # the triggers (counters, computed after) and indexes (rebuilt in one sorted pass) of the two
    # tables filled here, whatever schema.sql names them; schema.sql brings them back
    dropped = conn.execute("SELECT type, name FROM sqlite_master WHERE type IN ('trigger', 'index')"
                           " AND tbl_name IN ('transfers', 'flows') AND sql IS NOT NULL").fetchall()
    for kind, name in dropped:
        conn.execute(f"DROP {kind.upper()} {name}")
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
        restored = set(check.execute("SELECT type, name FROM sqlite_master"))
        assert set(dropped) <= restored, set(dropped) - restored
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


def peak_rss_kib(tmp: str, name: str, key: dict, wallet_id: str) -> int:
    """Serve the dataset with `walletsvc serve`, exercise the lists, read VmHWM."""
    with served(tmp, name, scenario=False) as (server, ready):
        client = walletsvc.Client(ready["url"], key["apiKey"], key["secret"])
        for _ in range(20):
            client.list_transfers(size=100)
            client.list_transfers(status="FAILED", size=100)
            client.list_transfers(page=1000, size=100)
            client.list_flows(wallet_id, size=100)
            client.list_wallet_transfers(wallet_id, size=100)
        with open(f"/proc/{server.pid}/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM"))


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
    rss = peak_rss_kib(tmp, "big", big_key, big_ids[3])
    rows.append((f"peak RSS of a server holding {label} transfers", f"{rss / 1024:.0f} MiB", "", None,
                 "report"))
    return rows


###############################################################################
# Figures 4 and 5: nonce table, fresh service, reset ###########################
###############################################################################


def nonce_table(tmp: str, requests: int, bound: int) -> list:
    """Signed GETs spread over 300 s of a frozen, advanced service clock, against a service that keeps
    ``bound`` nonce records; the records are counted by a connection of our own (the file's table,
    not walletsvc's objects): kept exactly up to the bound, by count, whatever the clock did."""
    db = os.path.join(tmp, "nonces.db")
    clock = walletsvc.Clock(frozen_at=time.time())
    svc = walletsvc.WalletService(db, clock=clock)
    ws = svc.create_workspace("nonces")
    key = svc.create_api_key(ws["id"])
    wallet = svc.create_wallet(ws["id"], "USD")
    app = walletsvc.create_app(svc, nonce_records=bound)
    path = f"/api/v1/wallets/{wallet['id']}"
    step = 300 / requests  # spread over 300 s of service clock: five 60 s windows
    counter = sqlite3.connect(db)
    largest = 0
    for n in range(requests + 1):
        if n % max(1, requests // 50) == 0 or n == requests:
            largest = max(largest, counter.execute("SELECT count(*) FROM nonce_records").fetchone()[0])
        if n == requests:
            break
        headers = walletsvc.sign_request("GET", path, b"", key["apiKey"], key["secret"],
                                         timestamp=int(clock()))
        call_wsgi(app, "GET", path, b"", headers)
        clock.advance(step)
    final = counter.execute("SELECT count(*) FROM nonce_records").fetchone()[0]
    counter.close()
    svc.close()
    return [(f"nonce records after {requests:,} requests over 300 s", f"{final:,} (peak {largest:,})",
             f"nonce_records {bound:,}", largest / bound, "<= nonce_records + 256")]


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
            ("test double per-test overhead (walletsvc_sandbox: reset + audit)", f"{overhead_ms:.2f} ms",
             f"fresh service {fresh_ms:.2f} ms", overhead_ms / fresh_ms, "<= 0.5 ms")]
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


def previous_folder(rev: str, tmp: str) -> str:
    """A folder holding walletsvc.py and schema.sql as they were at git revision ``rev``."""
    folder = os.path.join(tmp, "previous")
    os.makedirs(folder, exist_ok=True)
    here = pathlib.Path(__file__).parent
    for name in ("walletsvc.py", "schema.sql"):
        text = subprocess.run(["git", "show", f"{rev}:{name}"], cwd=here, capture_output=True, text=True,
                              check=True).stdout
        pathlib.Path(folder, name).write_text(text)
    return folder


def previous_module(folder: str):
    """The walletsvc.py in ``folder``, imported under another name."""
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
    previous = previous_module(previous_folder(rev, tmp))
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


def previous_over_http(tmp: str, rev: str, seconds: float, rounds: int) -> list:
    """A signed GET and a create transfer over HTTP: `walletsvc serve` of this walletsvc.py and of the one
    at ``rev`` (run from its own folder), both at their defaults, the same load, rounds interleaved."""
    folder = previous_folder(rev, tmp)
    rows = []
    with served(tmp, "now") as (_, now), served(tmp, "previous", folder=folder) as (_, before):
        for method, name in (("GET", "signed GET"), ("POST", "POST create transfer")):
            measured: dict = {"now": [], "previous": []}
            for _ in range(rounds):
                for version, ready in (("now", now), ("previous", before)):
                    measured[version].append(requests_per_second(ready["port"], plan_for(ready, method),
                                                                 seconds))
            (ours, p99), (theirs, their_p99) = (_median_pair(measured[version])
                                                for version in ("now", "previous"))
            rows += [(f"HTTP {name} vs {rev}", f"{ours:.0f} req/s",
                      f"{rev} {theirs:.0f} req/s ({load_tool()})", ours / theirs, "report"),
                     (f"HTTP {name} p99 vs {rev}", f"{p99:.1f} ms", f"{rev} {their_p99:.1f} ms",
                      p99 / their_p99, "report")]
    return rows


###############################################################################
# Workers: --workers 1 against --workers 2 over HTTP ##############################
###############################################################################


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
    """Throughput, p99 and CPU seconds per request of `walletsvc serve --workers 1` and `--workers 2`:
    the CPU per request says whether N workers would scale with N cores on a bigger machine than
    this 2-core one, where the load generator takes a core."""
    with served(tmp, "workers1", "--workers", "1") as (one_process, one_ready), \
            served(tmp, "workers2", "--workers", "2") as (two_process, two_ready):
        servers = {1: (one_process, one_ready), 2: (two_process, two_ready)}
        time.sleep(0.5)  # the forked workers are up
        return [row for method in ("GET", "POST") for row in workers_rows(method, servers, seconds, rounds)]


def workers_rows(method: str, servers: dict, seconds: float, rounds: int) -> list:
    measured: dict = {1: [], 2: []}
    for _ in range(rounds):
        for workers, (process, ready) in servers.items():
            before = cpu_seconds(process.pid)
            rate, p99 = requests_per_second(ready["port"], plan_for(ready, method), seconds)
            cpu = (cpu_seconds(process.pid) - before) / max(rate * seconds, 1)
            measured[workers].append((rate, p99, cpu))
    one, two = ([statistics.median(values) for values in zip(*measured[workers])] for workers in (1, 2))
    name = "GET /api/v1/wallets/{id}" if method == "GET" else "POST create transfer"
    return [(f"HTTP {name}, --workers 2 vs 1", f"{two[0]:.0f} req/s", f"1 worker {one[0]:.0f} req/s",
             two[0] / one[0], "report"),
            (f"HTTP {name} p99, --workers 2 vs 1", f"{two[1]:.1f} ms", f"1 worker {one[1]:.1f} ms",
             two[1] / one[1], "<= 25 ms"),
            (f"HTTP {name} CPU per request, --workers 2 vs 1", f"{two[2] * 1e6:.0f} us",
             f"1 worker {one[2] * 1e6:.0f} us", two[2] / one[2], "~1x: scales with cores")]


###############################################################################
# Disk syncs per acknowledged transfer (strace) ##################################
###############################################################################


FSYNC_FIGURE = "commits with fsync per acknowledged transfer, 8 connections"


def fsyncs_per_transfer(tmp: str, transfers: int) -> list:
    """`walletsvc serve` at its defaults, strace attached to every thread once it serves: the
    fsync and fdatasync calls while 8 connections send ``transfers`` transfers, per one answered 200."""
    if not STRACE:
        return [(FSYNC_FIGURE, "n/a", "strace not installed", None, "<= 0.35")]
    with served(tmp, "fsync") as (process, ready):
        plan = plan_for(ready, "POST")
        drive(ready["port"], [plan] * 8, requests=2)  # the connections' first requests: not what is counted
        summary = os.path.join(tmp, "fsync.strace")
        tracer = subprocess.Popen([STRACE, "-f", "-c", "-e", "trace=fsync,fdatasync", "-o", summary,
                                   "-p", str(process.pid)], stderr=subprocess.PIPE, text=True)
        try:
            if "attached" not in tracer.stderr.readline():  # attached to every thread from here on
                return [(FSYNC_FIGURE, "n/a", "strace could not attach", None, "<= 0.35")]
            answers = drive(ready["port"], [plan] * 8, requests=-(-transfers // 8), seed=1)
        finally:
            tracer.send_signal(signal.SIGINT)  # detaches and writes its summary
            tracer.communicate(timeout=30)
    syncs = sum(int(line.split()[3]) for line in pathlib.Path(summary).read_text().splitlines()
                if line.split()[-1:] in (["fsync"], ["fdatasync"]))
    acknowledged = sum(status == 200 for connection in answers for status, _ in connection)
    return [(FSYNC_FIGURE, f"{syncs / acknowledged:.2f}", f"{syncs:,} syncs / {acknowledged:,} acknowledged",
             syncs / acknowledged, "<= 0.35")]


###############################################################################
# A latency fault rule slows only what it matches ################################
###############################################################################


ISOLATION_FIGURE = "latency rule isolation: non-matching requests"


def latency_rule_isolation(tmp: str, latency: float, seconds: float) -> list:
    """`walletsvc serve` at its defaults; 10 connections GET one wallet and 10 GET the others, first
    with no rule, then with a rule (POST /_admin/faults) delaying the first wallet's GET by
    ``latency`` s: the waits of the requests the rule does not match, before and after."""
    token = "bench-admin-token"
    with served(tmp, "isolation", "--admin-token", token) as (_, ready):
        everyone = plan_for(ready, "GET")
        slow, other = ({**everyone, "wallets": wallets} for wallets in (everyone["wallets"][:1],
                                                                        everyone["wallets"][1:]))
        plans = [slow] * 10 + [other] * 10
        before = drive(ready["port"], plans, seconds=min(seconds, 1.0))[10:]
        admin_request(ready["port"], token, "POST", "/_admin/faults", {
            "action": "latency", "method": "GET", "path": f"/api/v1/wallets/{slow['wallets'][0]}",
            "latency": latency})
        after = drive(ready["port"], plans, seconds=seconds, seed=1, timeout=latency + 30)[10:]
    waits, calm = ([waited for connection in run for _, waited in connection] for run in (after, before))
    ruled = f"a {latency:g} s rule on another path"
    return [(f"{ISOLATION_FIGURE}, p99 wait", f"{p99_ms(waits):.1f} ms", f"no rule {p99_ms(calm):.1f} ms",
             p99_ms(waits) / p99_ms(calm), f"<= 100 ms ({ruled})"),
            (f"{ISOLATION_FIGURE}, max wait", f"{max(waits) * 1000:.1f} ms",
             f"no rule {max(calm) * 1000:.1f} ms", max(waits) / max(calm), f"not slowed ({ruled})")]


def admin_request(port: int, token: str, method: str, path: str, body: dict) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request(method, path, body=json.dumps(body),
                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    reply = conn.getresponse()
    payload = reply.read()
    conn.close()
    if reply.status != 200:
        raise RuntimeError(f"{method} {path}: {reply.status} {payload[:200]!r}")
    return json.loads(payload)


###############################################################################
# Scenario load: wallets with fixed ids, and without #############################
###############################################################################


SCENARIO_FIGURE = "scenario load, wallets with fixed ids vs without"

# Child process: load a scenario file into a fresh file database; print the seconds load_scenario took.
_LOAD_SCENARIO = """
import json, sys, time, walletsvc
scenario = json.load(open(sys.argv[1]))
svc = walletsvc.WalletService(sys.argv[2])
started = time.perf_counter()
svc.load_scenario(scenario)
print(time.perf_counter() - started)
"""


def scenario_load(tmp: str, wallets: int, limit: float) -> list:
    """load_scenario of one workspace of ``wallets`` wallets, without then with fixed ids
    (``"id": "wal_..."``), each in a child process stopped after ``limit`` seconds."""
    seconds = {}
    for fixed in (False, True):
        made = [{"name": f"w{n}", "currency": "USD", **({"id": f"wal_bench{n:08d}"} if fixed else {})}
                for n in range(wallets)]
        path = os.path.join(tmp, f"load-{fixed}.json")
        with open(path, "w") as handle:
            json.dump({"workspaces": [{"name": "bench", "wallets": made}]}, handle)
        try:
            seconds[fixed] = float(subprocess.run(
                [sys.executable, "-c", _LOAD_SCENARIO, path, os.path.join(tmp, f"load-{fixed}.db")],
                cwd=MODULE_FOLDER, env={**os.environ, "PYTHONPATH": MODULE_FOLDER}, capture_output=True,
                text=True, timeout=limit, check=True).stdout.split()[-1])
        except subprocess.TimeoutExpired:  # run() kills the child
            seconds[fixed] = None
    without, with_ids = seconds[False], seconds[True]
    label = f"{SCENARIO_FIGURE} ({wallets:,} wallets)"
    if without is None:
        return [(label, f"> {limit:g} s", f"without ids > {limit:g} s", None, "<= 1.2x")]
    if with_ids is None:
        return [(label, f"> {limit:g} s", f"without ids {without:.2f} s", f"> {limit / without:.1f}x",
                 "<= 1.2x")]
    return [(label, f"{with_ids:.2f} s", f"without ids {without:.2f} s", with_ids / without, "<= 1.2x")]


###############################################################################
# Main #########################################################################
###############################################################################


SECTIONS = ("shape", "anatomy", "startup", "in_process", "previous", "http", "workers", "fsync", "isolation",
            "nonce", "scenario", "scale")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="every section with small counts: a smoke run")
    parser.add_argument("--only", action="append", choices=SECTIONS, help="run only this section; repeatable")
    parser.add_argument("--previous", metavar="REV", default="HEAD",
                        help="the git revision the 'previous' section measures against (default HEAD)")
    args = parser.parse_args()
    quick = args.quick
    rounds = 3 if quick else 7
    seconds, http_rounds = (1.0, 1) if quick else (3.0, 5)  # of load per measurement, and rounds of those
    rows = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        sections = {"shape": lambda: request_shape(tmp),
                    "anatomy": lambda: anatomy(tmp, 100 if quick else 1000),
                    "startup": lambda: startup(rounds),
                    "in_process": lambda: in_process(tmp, 200 if quick else 1000, rounds),
                    "previous": lambda: previous_rows(tmp, args.previous, 200 if quick else 1000, rounds,
                                                      seconds, http_rounds),
                    "http": lambda: over_http(tmp, seconds, http_rounds),
                    "workers": lambda: workers_over_http(tmp, seconds, http_rounds),
                    "fsync": lambda: fsyncs_per_transfer(tmp, 240 if quick else 2000),
                    "isolation": lambda: latency_rule_isolation(tmp, 1.0 if quick else 5.0,
                                                                2.0 if quick else 6.0),
                    "nonce": lambda: nonce_table(tmp, 5_000 if quick else 200_000,
                                                 1_000 if quick else 100_000),
                    "scenario": lambda: scenario_load(tmp, 5_000 if quick else 100_000, 10 if quick else 60),
                    "scale": lambda: scale(tmp, 10_000 if quick else 1_000_000, 50 if quick else 200,
                                           rounds)}
        for name in args.only or SECTIONS:
            for row in sections[name]():
                rows.append(row)
                print_row(row)
    print(f"\n{len(rows)} figures in {time.monotonic() - started:.0f} s (load: {load_tool()},"
          f" strace: {'yes' if STRACE else 'no'})\n")
    print("| figure | walletsvc | baseline | ratio | target |")
    print("|---|---|---|---|---|")
    for name, value, baseline, ratio, target in rows:
        print(f"| {name} | {value} | {baseline} | {shown(ratio)} | {target} |")
    return 0


def previous_rows(tmp: str, rev: str, calls: int, rounds: int, seconds: float, http_rounds: int) -> list:
    """In process and over HTTP against the walletsvc.py at ``rev``; n/a when git cannot show it."""
    try:
        previous_folder(rev, tmp)
    except (OSError, subprocess.CalledProcessError) as exc:
        reason = f"git show {rev}: {getattr(exc, 'stderr', None) or exc}".strip()[:60]
        return [(f"HTTP POST create transfer vs {rev}", "n/a", reason, None, f">= 2x {rev}")]
    return against_previous(tmp, rev, calls, rounds) + previous_over_http(tmp, rev, seconds, http_rounds)


def shown(ratio: float | str | None) -> str:
    """A ratio as the table shows it; a string is a bound ("> 12.0x") already written."""
    return "" if ratio is None else ratio if isinstance(ratio, str) else f"{ratio:.2f}x"


def print_row(row: tuple) -> None:
    name, value, baseline, ratio, target = row
    print(f"{name:<55} {value:>18} {baseline:>24} {shown(ratio):>8}  {target}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
