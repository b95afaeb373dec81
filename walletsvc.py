"""walletsvc: a wallet-and-transfer service in one module.

Contents, in the order of the module's sections: each uses only those above it, but for
the console's page, kept last as bottle keeps its template, which handlers read at run time.

  Core
     1. Constants and helpers - enums, IP entries, JSON
     2. Errors - the catalog: one class per code, bilingual messages
     3. Settings - every setting, its converter, default and layer
     4. Money and time - currencies, amounts as integer minor units; times as the API shows them
     5. Storage - SQLite: schema, connections, the one door for writes, the file's check
     6. Signing and replay protection - the canonical message, HMAC, signing mistakes; nonce records
     7. Pagination - page and size, filters, how a page query is built
     8. The ledger's invariants - the audits, as SQL
     9. Wallets and transfers - the values a request gives: checked; lists' sorts and filters
  The sandbox's state (in the database, shared by every process)
    10. Request journal - what the journal keeps, and its assertions
    11. Fault rules - forced errors, latency, commit then fail or drop
    12. Scenarios and the starting state - worlds, their checks, backups
  The service
    13. The service - WalletService: resources, ids, its clock, the ledger and its write units
  HTTP
    14. HTTP schemas - the JSON shapes, and the request body check
    15. Declared endpoints and the envelope - ``@endpoint``, what a handler answers
    16. The request path - the WSGI app, HttpApi: decide (the whole pipeline), commit, render, log
    17. OpenAPI document - /openapi.json, from the declarations
    18. API handlers - the endpoints of the contract
    19. The console's session - how the console logs in
    20. Admin surface - /_admin/: workspaces, keys, wallets, clock, faults, journal, console
    21. App factory - create_app
  Tools
    22. Client - a signing client, typed errors
    23. Serving - ``serve``: waitress, workers, hostile networks
    24. pytest plugin - the ``walletsvc_sandbox`` fixtures, Sandbox, LiveServer
    25. Command line - ``walletsvc serve``, ``request``, ``sign``, admin commands
  Assets
    26. The console's page - its HTML, style and script

walletsvc implements the Wallet and Transfer Service HTTP interface (HMAC-signed requests, workspaces,
API keys with scopes, wallets, balances, flows, transfer orders, pagination) on bottle and SQLite. Run it
as a local sandbox, embed it in a WSGI app, or use it as a fake wallet backend in tests::

    import walletsvc

    svc = walletsvc.WalletService(":memory:")      # or a file path
    ws = svc.create_workspace("Acme")
    key = svc.create_api_key(ws["id"], scopes=["wallet:read"])
    wallet = svc.create_wallet(ws["id"], "USD", name="main")
    svc.deposit(wallet["id"], "100.00")
    app = walletsvc.create_app(svc)                # a WSGI callable

    headers = walletsvc.sign_request("GET", "/api/v1/wallets", b"", key["apiKey"], key["secret"])

From a shell: ``walletsvc serve --demo`` serves a seeded sandbox on
127.0.0.1:8080 and prints the credentials to use.
"""

from __future__ import annotations

import _thread
import argparse
import base64
import binascii
import bisect
import collections
import contextlib
import copy
import dataclasses
import datetime
import decimal
import enum
import errno
import fcntl
import fnmatch
import functools
import hashlib
import hmac
import html
import http.client
import importlib.metadata
import inspect
import io
import ipaddress
import itertools
import json
import logging
import os
import re
import secrets
import select
import shlex
import signal
import sqlite3
import sys
import tempfile
import threading
import time
import tomllib
import urllib.error
import urllib.parse
import urllib.request
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from http import HTTPStatus
from typing import IO, Any, NamedTuple, NoReturn, Self, TypeVar

import bottle

__all__ = [
    "API_VERSION", "CURRENCY_EXPONENTS", "ERRORS", "SCOPES", "WAITRESS_LIMITS", "AdminApi", "Client",
    "Clock", "Direction", "Endpoint", "FlowType", "HmacAuth", "Principal", "Received", "Reply", "Role",
    "Sandbox", "Settings", "Settlement", "TransferStatus", "WalletApi", "WalletApp", "WalletError",
    "WalletService", "WalletStatus", "body_hash", "canonical_message", "create_app", "endpoint", "main",
    "server_time", "sign_request",
]
__version__ = "0.1.0"

log = logging.getLogger("walletsvc")


###############################################################################
# Constants and helpers ########################################################
###############################################################################

API_VERSION = "v1"
SUCCESS_CODE = "2000"
SCOPES = ("wallet:read", "transfer:read", "transfer:create")
LOCALES = ("en-US", "zh-CN")


class WalletStatus(enum.StrEnum):
    """A wallet's state: only an ACTIVE wallet moves money; CLOSED is final."""

    ACTIVE = "ACTIVE"
    FROZEN = "FROZEN"
    CLOSED = "CLOSED"


class TransferStatus(enum.StrEnum):
    """A transfer order's state: PENDING until settled, then COMPLETED or FAILED."""

    PENDING = "PENDING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"


class Direction(enum.StrEnum):
    """Which way a flow moves its wallet's balance."""

    DEBIT = "DEBIT"
    CREDIT = "CREDIT"


class FlowType(enum.StrEnum):
    """A ledger entry's kind; each has one direction (``FlowType.direction``)."""

    direction: Direction

    def __new__(cls, value: str, direction: Direction) -> Self:
        member = str.__new__(cls, value)
        member._value_, member.direction = value, direction
        return member

    DEPOSIT = "DEPOSIT", Direction.CREDIT
    WITHDRAWAL = "WITHDRAWAL", Direction.DEBIT
    TRANSFER_OUT = "TRANSFER_OUT", Direction.DEBIT
    TRANSFER_IN = "TRANSFER_IN", Direction.CREDIT


class Role(enum.StrEnum):
    """A member's role: each workspace has one OWNER, made with it (named OWNER_NAME)."""

    OWNER = "OWNER"
    MEMBER = "MEMBER"


class Settlement(enum.StrEnum):
    """When a transfer's money moves (the ``settlement`` setting)."""

    IMMEDIATE = "immediate"  # in the request: the order is COMPLETED
    MANUAL = "manual"  # PENDING until complete_transfer or fail_transfer
    DELAYED = "delayed"  # PENDING until settlement_delay has passed on the service clock


WALLET_STATUSES, TRANSFER_STATUSES = tuple(WalletStatus), tuple(TransferStatus)
FLOW_TYPES, FLOW_DIRECTIONS = tuple(FlowType), tuple(Direction)
OWNER_NAME = "owner"  # the name of the member every workspace is made with


_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")  # a bizId, or an id a scenario fixes (after its prefix)
ID_MAX = 64  # characters of a wallet id a request may name


def _network_pattern() -> str:
    """An IP whitelist or trusted proxy entry as a regex: IPv4 (no leading 0), IPv6 (RFC 3986), or CIDR."""
    octet = "(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
    ipv4 = rf"{octet}(\.{octet}){{3}}"
    h16 = "[0-9a-fA-F]{1,4}"
    ls32 = f"({h16}:{h16}|{ipv4})"
    forms = [f"({h16}:){{6}}{ls32}", f"::({h16}:){{5}}{ls32}",
             *(f"(({h16}:){{0,{before}}}{h16})?::({h16}:){{{4 - before}}}{ls32}" for before in range(5)),
             f"(({h16}:){{0,5}}{h16})?::{h16}", f"(({h16}:){{0,6}}{h16})?::"]
    return f"({ipv4}(/(3[0-2]|[12]?[0-9]))?|({'|'.join(forms)})(/(12[0-8]|1[01][0-9]|[1-9]?[0-9]))?)"


NETWORK_PATTERN = _network_pattern()
_NETWORK = re.compile(NETWORK_PATTERN)


def parse_network(text: Any) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    """An address or CIDR block (NETWORK_PATTERN) as a network; ValueError if it is not one."""
    if not isinstance(text, str) or not _NETWORK.fullmatch(text):
        raise ValueError(f"{str(text)[:60]!r} is not an IP address or CIDR block")
    network = ipaddress.ip_network(text, strict=False)
    if "/" in text and network.network_address != ipaddress.ip_address(text.split("/")[0]):
        raise HostBitsSet(f"{text!r} has host bits set: write {network} (it is never widened)", network)
    return network


class HostBitsSet(ValueError):
    """A CIDR block whose address has bits past its prefix (``10.0.0.1/8``): refused, not widened."""

    def __init__(self, message: str, network: ipaddress.IPv4Network | ipaddress.IPv6Network) -> None:
        super().__init__(message)
        self.network = network


DESCRIPTION_MAX = 255  # characters of a transfer's description
NAME_MAX = 200  # characters of a workspace's, member's or wallet's name
_NONCE = re.compile(r"[!-~]{1,128}")  # printable ASCII, no whitespace


_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
# A JSON value's type, as a schema names it (bool is not a number in JSON).
_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda value: isinstance(value, str),
    "integer": lambda value: isinstance(value, int) and not isinstance(value, bool),
    "number": lambda value: isinstance(value, (int, float)) and not isinstance(value, bool),
    "boolean": lambda value: isinstance(value, bool), "array": lambda value: isinstance(value, list),
    "object": lambda value: isinstance(value, dict), "null": lambda value: value is None}


###############################################################################
# Errors #######################################################################
###############################################################################

class WalletError(Exception):
    """Root of every error walletsvc raises on purpose: the catalog's ``code``, ``name`` and ``status``, and
    ``detail(locale)``, the envelope's sentence in each locale (docs/reference.md, Error catalog)."""

    code, name, status = "S500", "INTERNAL_ERROR", 500
    messages = ("An unexpected error occurred.", "服务器发生意外错误。")

    def __init_subclass__(cls, code: str = "", name: str = "", status: int = 0) -> None:
        """A subclass's catalog entry, given on its class line (none: the root's S500, as InternalError)."""
        super().__init_subclass__()
        if code:
            cls.code, cls.name, cls.status = code, name, status

    def __init__(self, extra: str | None = None, *, text: str | None = None, zh_extra: str | None = None,
                 **params: Any) -> None:
        self.params, self.extra = params, extra
        self.zh_extra = zh_extra if zh_extra is not None else extra
        self.text = text  # a detail already rendered (by a server, for the client)
        super().__init__(self.detail("en-US"))

    def detail(self, locale: str = "en-US") -> str:
        if self.text is not None:
            return self.text
        text = (self.messages[1] if locale == "zh-CN" else self.messages[0]).format(**self.params)
        extra = self.zh_extra if locale == "zh-CN" else self.extra
        return f"{text} {extra}" if extra else text


class ApiKeyMissing(WalletError, code="GA2001", name="API_KEY_MISSING", status=401):
    messages = ("The X-Api-Key header is missing.", "缺少 X-Api-Key 请求头。")


class ApiKeyNotFound(WalletError, code="GA2011", name="API_KEY_NOT_FOUND", status=401):
    messages = ("The API key does not exist.", "API 密钥不存在。")


class ApiKeyDisabled(WalletError, code="GA2021", name="API_KEY_DISABLED", status=403):
    messages = ("The API key has been disabled.", "API 密钥已被停用。")


class WorkspaceNotFound(WalletError, code="GA2032", name="WORKSPACE_NOT_FOUND", status=404):
    messages = ("The workspace does not exist.", "工作空间不存在。")


class NotWorkspaceMember(WalletError, code="GA2034", name="NOT_WORKSPACE_MEMBER", status=403):
    messages = ("The key's member no longer belongs to the workspace.", "该密钥所属成员已不在工作空间中。")


class RequestExpired(WalletError, code="GA2013", name="REQUEST_EXPIRED", status=401):
    messages = ("{reason}", "{reason_zh}")


class SignatureInvalid(WalletError, code="GA2012", name="SIGNATURE_INVALID", status=401):
    messages = ("The request signature is invalid.", "请求签名无效。")


class IpNotWhitelisted(WalletError, code="GA2022", name="IP_NOT_WHITELISTED", status=403):
    messages = ("The client IP address is not in the key's whitelist.", "客户端 IP 地址不在密钥的白名单中。")


class ScopeRequired(WalletError, code="GA2024", name="SCOPE_REQUIRED", status=403):
    messages = ("The API key lacks the scope {scope}.", "API 密钥缺少权限范围 {scope}。")


class ApiAccessDenied(WalletError, code="50090201", name="API_ACCESS_DENIED", status=403):
    messages = ("Not open to API keys (deny by default).", "不对 API 密钥开放（默认拒绝）。")


class InvalidParameter(WalletError, code="S012", name="INVALID_PARAMETER", status=400):
    messages = ("Invalid parameter '{field}': {reason}.", "参数 '{field}' 无效：{reason_zh}。")


class Unauthorized(WalletError, code="S401", name="UNAUTHORIZED", status=401):
    messages = ("The admin surface needs Authorization: Bearer <admin token>.",
                "管理接口需要 Authorization: Bearer <管理令牌>。")


class CrossSiteRefused(WalletError, code="S403", name="FORBIDDEN", status=403):
    messages = ("A console session authorizes only the console page's own requests (X-Console-Csrf).",
                "控制台会话只授权控制台页面本身的请求（X-Console-Csrf）。")


class NotFound(WalletError, code="S404", name="NOT_FOUND", status=404):
    messages = ("No such {thing}.", "{thing_zh}不存在。")


class MethodNotAllowed(WalletError, code="S405", name="METHOD_NOT_ALLOWED", status=405):
    messages = ("This method is not allowed on this path.", "该路径不支持此请求方法。")


class PayloadTooLarge(WalletError, code="S413", name="PAYLOAD_TOO_LARGE", status=413):
    messages = ("The request body exceeds {limit} bytes.", "请求体超过 {limit} 字节。")


class UnsupportedMediaType(WalletError, code="S415", name="UNSUPPORTED_MEDIA_TYPE", status=415):
    messages = ("The request body must be application/json.", "请求体必须是 application/json。")


class InternalError(WalletError):
    pass


class ServiceBusy(WalletError, code="S503", name="SERVICE_BUSY", status=503):
    messages = ("The database is busy or unavailable; retry later.", "数据库繁忙或不可用，请稍后重试。")


class WalletNotFound(WalletError, code="W1001", name="WALLET_NOT_FOUND", status=404):
    messages = ("Wallet {wallet_id} does not exist.", "钱包 {wallet_id} 不存在。")


class WalletNotActive(WalletError, code="W1002", name="WALLET_NOT_ACTIVE", status=422):
    messages = ("Wallet {wallet_id} is {state}.", "钱包 {wallet_id} 的状态为 {state}。")


class TransferNotFound(WalletError, code="T1001", name="TRANSFER_NOT_FOUND", status=404):
    messages = ("Transfer order {biz_id} does not exist.", "转账订单 {biz_id} 不存在。")


class InsufficientBalance(WalletError, code="T2001", name="INSUFFICIENT_BALANCE", status=422):
    messages = ("The available balance of wallet {wallet_id} is below the amount.",
                "钱包 {wallet_id} 的可用余额不足。")


class CurrencyMismatch(WalletError, code="T2002", name="CURRENCY_MISMATCH", status=422):
    messages = ("Wallet {wallet_id} holds {wallet_currency}, not {currency}.",
                "钱包 {wallet_id} 的币种是 {wallet_currency}，不是 {currency}。")


class SameWallet(WalletError, code="T2003", name="SAME_WALLET", status=422):
    messages = ("The source and target wallets are the same.", "转出和转入钱包相同。")


class IdempotencyConflict(WalletError, code="T2004", name="IDEMPOTENCY_CONFLICT", status=409):
    messages = ("bizId {biz_id} was already used with different parameters.",
                "bizId {biz_id} 已用于参数不同的请求。")


def _catalog(root: type[WalletError]) -> list[type[WalletError]]:
    """Every subclass of ``root``, nested ones too (each after its parent), in the order they are declared."""
    return [error for cls in root.__subclasses__() for error in (cls, *_catalog(cls))]


ERRORS = tuple(_catalog(WalletError))  # the catalog: every class above

ERRORS_BY_CODE: Mapping[str, type[WalletError]] = {error.code: error for error in ERRORS}

_REASONS = {  # why a parameter was refused, in each locale (InvalidParameter's reason)
    "required": ("is required", "为必填项"),
    "status_of_code": (("is required: {code} is not a code of the error catalog, so give the HTTP status"
                        " to answer it with (e.g. 503)"),
                       "为必填项：{code} 不是错误目录中的代码，请给出应答所用的 HTTP 状态码（例如 503）"),
    "string": ("must be a string", "必须是字符串"),
    "integer": ("must be an integer", "必须是整数"),
    "number": ("must be a number", "必须是数字"),
    "boolean": ("must be true or false", "必须是 true 或 false"),
    "array": ("must be an array", "必须是数组"),
    "type": ("must be JSON {kinds}", "必须是 JSON {kinds}"),
    "minimum": ("must be at least {minimum}", "不能小于 {minimum}"),
    "maximum": ("must be at most {maximum}", "不能大于 {maximum}"),
    "one_of": ("must be one of {choices}", "必须是以下之一：{choices}"),
    "unknown_field": ("is not a known field", "不是可识别的字段"),
    "sort_field": ("cannot sort by '{value}'; sortable fields: {choices}",
                   "不能按 '{value}' 排序；可排序字段：{choices}"),
    "sort_direction": ("the direction must be asc or desc", "排序方向必须是 asc 或 desc"),
    "sort_keys": ("takes at most {maximum} sort keys", "最多接受 {maximum} 个排序键"),
    "currency": ("'{value}' is not an ISO 4217 currency code", "'{value}' 不是 ISO 4217 币种代码"),
    "amount": ("must be a positive decimal string such as \"10.00\" (no sign, exponent or leading zero)",
               "必须是正的十进制字符串，例如 \"10.00\"（不带符号、指数或前导零）"),
    "decimals": ("{currency} allows at most {exponent} decimal places",
                 "{currency} 最多允许 {exponent} 位小数"),
    "range": ("must be an integer from {minimum} to {maximum}", "必须是 {minimum} 到 {maximum} 之间的整数"),
    "one_name": ("takes one name in its brackets ({kind}[NAME]=VALUE), not a nested one",
                 "方括号中只能有一个名称（{kind}[NAME]=VALUE），不能嵌套"),
    "mapping": ("must be a mapping of parameter names to values, such as {{\"size\": 5}}",
                "必须是参数名到值的映射，例如 {{\"size\": 5}}"),
    "too_large": ("is too large", "过大"),
    "time": ("must be RFC 3339 (2027-01-15T08:00:00Z, or a date) or epoch milliseconds",
             "必须是 RFC 3339 时间（2027-01-15T08:00:00Z，或日期）或毫秒时间戳"),
    "time_iso": ("must be RFC 3339 (2027-01-15T08:00:00Z, or a date), or a JSON number of epoch seconds",
                 "必须是 RFC 3339 时间（2027-01-15T08:00:00Z，或日期），或表示秒级时间戳的 JSON 数字"),
    "time_digits": ("is a string of digits: send epoch seconds as a JSON number, or RFC 3339 as a string",
                    "是一串数字：秒级时间戳请以 JSON 数字发送，或以字符串发送 RFC 3339 时间"),
    "time_ms": ("looks like epoch milliseconds; send epoch seconds (or RFC 3339)",
                "看起来是毫秒时间戳；请发送秒级时间戳（或 RFC 3339 时间）"),
    "clock_range": ("must keep the clock between 1970-01-01 and 9999-12-31",
                    "必须使时钟保持在 1970-01-01 至 9999-12-31 之间"),
    "biz_id": ("must be 1-64 characters of A-Z a-z 0-9 . _ : -", "必须是 1-64 个 A-Z a-z 0-9 . _ : - 字符"),
    "max_length": ("must be at most {maximum} characters", "最多 {maximum} 个字符"),
    "length": ("must be 1-{maximum} characters", "必须是 1-{maximum} 个字符"),
    "json": ("is not a JSON object", "不是 JSON 对象"),
    "http": ("is not valid HTTP: {problem}", "不是有效的 HTTP：{problem}"),
    "surrogate": ("holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is no character",
                  "含有单独的 UTF-16 代理项（\\ud800-\\udfff），它不是字符"),
    "nul": ("must not contain the NUL character", "不能包含 NUL 字符"),
    "duplicate": ("appears more than once", "重复出现"),
    "unsigned_key": (("is not signed, so it is accepted only when equal to the body's bizId; send the key as"
                     " bizId in the signed body"),
                     "不在签名范围内，仅在与请求体的 bizId 相同时接受；请将该键作为 bizId 放入签名的请求体"),
    "ip": ("'{value}' is not an IP address or CIDR block", "'{value}' 不是 IP 地址或 CIDR 网段"),
    "host_bits": ("'{value}' has host bits set: write {network} (a block is never widened)",
                  "'{value}' 含有主机位：请写作 {network}（网段不会被自动放宽）"),
    "setting": ("{problem}", "{problem}"),
    "empty_whitelist": ("must not be empty: leave it out (or null) for no whitelist",
                        "不能为空：不设白名单时请省略（或设为 null）"),
    "scope": ("'{value}' is not a scope; scopes: {choices}", "'{value}' 不是权限范围；可选：{choices}"),
    "state": ("is {state}", "状态为 {state}"),
    "closed": ("cannot change: the wallet is CLOSED, which is final",
               "无法更改：钱包已关闭（CLOSED 为最终状态）"),
    "taken": ("'{value}' is already taken", "'{value}' 已被占用"),
    "scenario_id": ("must be an id starting {prefix} (1-64 of A-Z a-z 0-9 _ . : -)",
                    "必须是以 {prefix} 开头的 id（1-64 个 A-Z a-z 0-9 _ . : - 字符）"),
    "secret": ("must be 1-128 printable ASCII characters without spaces",
               "必须是 1-128 个不含空格的可打印 ASCII 字符"),
    "scenario_amount": ("must be a string such as \"1000.00\" (a TOML or JSON number could be rounded)",
                        "必须是字符串，例如 \"1000.00\"（TOML 或 JSON 数字可能被舍入）"),
    "too_many": ("has reached its limit of {maximum}; remove some first", "已达上限 {maximum}，请先删除一些"),
}


def invalid(field: str, reason: str, **params: Any) -> InvalidParameter:
    """An S012 error naming ``field``, with ``reason`` from _REASONS."""
    en, zh = _REASONS[reason]
    return InvalidParameter(field=field, reason=en.format(**params), reason_zh=zh.format(**params))


def expired(en: str, zh: str) -> RequestExpired:
    return RequestExpired(reason=en, reason_zh=zh)


_THINGS_ZH = {"member": "成员", "API key": "API 密钥", "path": "路径", "fault rule": "故障规则",
              "world": "世界（场景实例）"}


def not_found(thing: str) -> NotFound:
    return NotFound(thing=thing, thing_zh=_THINGS_ZH[thing])


###############################################################################
# Settings #####################################################################
###############################################################################

def _between(kind: type, minimum: float, maximum: float, *, optional: bool = False) -> Callable[[Any], Any]:
    """A setting's converter: a ``kind`` from ``minimum`` to ``maximum`` (None when ``optional``)."""
    def convert(value: Any) -> Any:
        if optional and value in (None, ""):
            return None
        if isinstance(value, bool) or (kind is int and isinstance(value, float) and not value.is_integer()):
            raise ValueError(f"must be a {kind.__name__} from {minimum:,} to {maximum:,}")
        try:
            number = kind(value)
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"must be a {kind.__name__} from {minimum:,} to {maximum:,}") from None
        if not minimum <= number <= maximum:  # (NaN is no number in any range)
            raise ValueError(f"must be from {minimum:,} to {maximum:,}")
        return number
    return convert


def _boolean(value: Any) -> bool:
    if isinstance(value, str):
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"not a boolean: {value!r}")
    return bool(value)


def _optional_str(value: Any) -> str | None:
    """None, or 1 to 256 characters: an empty string is refused, never taken for "unset"."""
    if value is None:
        return None
    if not 1 <= len(str(value)) <= 256:
        raise ValueError("must be 1 to 256 characters (leave it unset for none)")
    return str(value)


def _networks(value: Any) -> tuple:
    if isinstance(value, str):
        value = [part for part in value.split(",") if part.strip()]
    return tuple(parse_network(str(part).strip()) for part in value)


def _one_of(*choices: str) -> Callable[[Any], str]:
    def convert(value: Any) -> str:
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return value
    return convert


SANDBOX_JOURNAL_SIZE = 1000  # requests the journal of `walletsvc serve` and the pytest sandbox keeps
ID_SEEDS = (0, 2**63 - 1)  # the seeds of deterministic ids: the id_seed setting's and POST /_admin/ids's

LAYERS = {"service": "WalletService(path, **settings)", "http": "create_app(svc, **settings)"}


def _setting(layer: str, default: Any, convert: Callable[[Any], Any]) -> Any:
    """A setting's field: its default, its layer and its converter (its meaning: docs/reference.md)."""
    return dataclasses.field(default=default, metadata={"layer": layer, "convert": convert})


@dataclasses.dataclass(frozen=True)
class Settings:
    """Every setting, with its converter, default and layer (LAYERS); strings are converted, and an unknown
    or misplaced setting is a ValueError saying where it goes (docs/reference.md, Settings)."""

    timestamp_tolerance: int = _setting("http", 60, _between(int, 1, 86400))  # X-Timestamp's window, s
    nonce_records: int = _setting("http", 100_000, _between(int, 1000, 100_000_000))  # (Replay protection)
    max_body_bytes: int = _setting("http", 65536, _between(int, 0, 64 << 20))  # larger answers S413
    debug_signatures: bool = _setting("http", False, _boolean)  # GA2012 names the signing mistake
    trusted_proxies: tuple = _setting("http", (), _networks)  # whose X-Forwarded-For is believed
    admin_token: str | None = _setting("http", None, _optional_str)  # /_admin/ is 404 while unset
    default_locale: str = _setting("http", "en-US", _one_of(*LOCALES))  # when a request names none
    busy_timeout: float = _setting("service", 5.0, _between(float, 0.001, 600))  # then S503
    synchronous: str = _setting("service", "FULL", _one_of("FULL", "NORMAL"))  # file databases' pragma
    settlement: str = _setting("service", Settlement.IMMEDIATE.value, _one_of(*Settlement))  # manual, delayed
    settlement_delay: float = _setting("service", 5.0, _between(float, 0, 366 * 86400))  # delayed: PENDING
    id_seed: int | None = _setting("service", None, _between(int, *ID_SEEDS, optional=True))  # tests only
    journal_size: int = _setting("service", 0, _between(int, 0, 100_000))  # serve keeps SANDBOX_JOURNAL_SIZE
    magic_values: bool = _setting("service", False, _boolean)  # amount 666.66, wallet wal_magic_busy

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            try:
                object.__setattr__(self, field.name, field.metadata["convert"](value))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"setting {field.name}={value!r}: {exc}") from None

    @classmethod
    def names(cls, layer: str | None = None) -> list[str]:
        """Every setting's name, or those of one layer."""
        return [field.name for field in dataclasses.fields(cls) if layer in (None, field.metadata["layer"])]

    @classmethod
    def layer_of(cls, name: str) -> str:
        return next(field.metadata["layer"] for field in dataclasses.fields(cls) if field.name == name)

    def replace(self, layer: str | None = None, **changes: Any) -> Settings:
        """A copy with ``changes``; with ``layer``, only that layer's settings are accepted."""
        if unknown := sorted(set(changes) - set(self.names())):
            raise ValueError(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(self.names())}")
        for name in changes:
            if layer is not None and (where := self.layer_of(name)) != layer:
                raise ValueError(f"{name} is a setting of the {'HTTP layer' if where == 'http' else where}:"
                                 f" pass it to {LAYERS[where]}")
        return dataclasses.replace(self, **changes)


def split_settings(values: Mapping[str, Any]) -> tuple[dict, dict]:
    """Settings by layer: (the service's, the HTTP layer's); an unknown name is a ValueError."""
    Settings().replace(**values)
    service = {name: value for name, value in values.items() if Settings.layer_of(name) == "service"}
    return service, {name: value for name, value in values.items() if name not in service}


###############################################################################
# Money and time ###############################################################
###############################################################################

# ISO 4217 active codes by minor-unit exponent.
CURRENCY_EXPONENTS: Mapping[str, int] = {code: exponent for exponent, codes in (
    (0, "BIF CLP DJF GNF ISK JPY KMF KRW PYG RWF UGX UYI VND VUV XAF XOF XPF"),
    (2, ("AED AFN ALL AMD ANG AOA ARS AUD AWG AZN BAM BBD BDT BGN BMD BND BOB BOV BRL BSD BTN BWP BYN BZD "
         "CAD CDF CHE CHF CHW CNY COP COU CRC CUP CVE CZK DKK DOP DZD EGP ERN ETB EUR FJD FKP GBP GEL GHS "
         "GIP GMD GTQ GYD HKD HNL HTG HUF IDR ILS INR IRR JMD KES KGS KHR KPW KYD KZT LAK LBP LKR LRD LSL "
         "MAD MDL MGA MKD MMK MNT MOP MRU MUR MVR MWK MXN MXV MYR MZN NAD NGN NIO NOK NPR NZD PAB PEN PGK "
         "PHP PKR PLN QAR RON RSD RUB SAR SBD SCR SDG SEK SGD SHP SLE SOS SRD SSP STN SVC SYP SZL THB TJS "
         "TMT TOP TRY TTD TWD TZS UAH USD USN UYU UZS VED VES WST XCD XCG YER ZAR ZMW ZWG")),
    (3, "BHD IQD JOD KWD LYD OMR TND"), (4, "CLF UYW")) for code in codes.split()}
_AMOUNT_FORMATS = {code: (10**exponent, f"%d.%0{exponent}d" if exponent else "%d")
                   for code, exponent in CURRENCY_EXPONENTS.items()}
MAX_MINOR_UNITS = 10**18  # keeps every balance inside SQLite's 64-bit integers
MINOR_DIGITS = len(str(MAX_MINOR_UNITS)) - 1  # an amount's minor units, at most: under MAX_MINOR_UNITS
AMOUNT_DIGITS = 15  # integer digits of an amount, at most (fewer where its minor units would pass that)


def _whole_digits(exponent: int) -> int:
    return min(AMOUNT_DIGITS, MINOR_DIGITS - exponent)


def amount_pattern(exponent: int) -> str:
    """The regex of an amount with this exponent: positive, no sign, exponent or leading zero, at most
    ``exponent`` decimals, under 10**18 minor units (the service checks it, the document states it)."""
    def up_to(digits: int) -> str:
        return f"[0-9]{{0,{digits}}}" if digits else ""
    whole = "[1-9]" + up_to(_whole_digits(exponent) - 1)
    if not exponent:
        return f"^{whole}$"
    tiny = "|".join("0" * zeros + "[1-9]" + up_to(exponent - zeros - 1) for zeros in range(exponent))
    return f"^({whole}(\\.[0-9]{{1,{exponent}}})?|0\\.({tiny}))$"


_AMOUNTS = {exponent: re.compile(amount_pattern(exponent)) for exponent in set(CURRENCY_EXPONENTS.values())}
_DECIMAL = re.compile(r"([0-9]+)(?:\.([0-9]+))?")


def currency_exponent(currency: Any, field: str = "currency") -> int:
    if not isinstance(currency, str):
        raise invalid(field, "string")
    if currency not in CURRENCY_EXPONENTS:
        raise invalid(field, "currency", value=currency[:16])
    return CURRENCY_EXPONENTS[currency]


def parse_amount(amount: Any, currency: str, field: str = "amount") -> int:
    """An amount (amount_pattern: a ``str``, or from Python a ``decimal.Decimal``) as integer minor units,
    never rounded; S012 otherwise (docs/reference.md, POST /api/v1/transfer/command/create)."""
    exponent = currency_exponent(currency)
    if isinstance(amount, decimal.Decimal) and amount.is_finite():
        amount = format(amount, "f")
    if not isinstance(amount, str):
        raise invalid(field, "string")
    if _AMOUNTS[exponent].fullmatch(amount) is None:
        decimal_string = _DECIMAL.fullmatch(amount)
        if decimal_string and len(decimal_string.group(2) or "") > exponent:
            raise invalid(field, "decimals", currency=currency, exponent=exponent)
        if decimal_string and len(decimal_string.group(1).lstrip("0")) > _whole_digits(exponent):
            raise invalid(field, "too_large")
        raise invalid(field, "amount")
    whole, _, fraction = amount.partition(".")
    return int(whole) * 10**exponent + int(fraction.ljust(exponent, "0") or "0")


def format_amount(minor: int, currency: str) -> str:
    divisor, template = _AMOUNT_FORMATS[currency]
    return template % divmod(minor, divisor) if divisor > 1 else template % minor


def iso_time(ms: int | None) -> str | None:
    """Epoch milliseconds as ISO-8601 UTC with milliseconds and ``Z``."""
    if ms is None:
        return None
    seconds, millis = divmod(ms, 1000)
    return f"{_iso_second(seconds)}.{millis:03d}Z"


@functools.lru_cache(maxsize=4096)  # a page of rows, and each request's now, share few seconds
def _iso_second(seconds: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))


EPOCH_MS_PATTERN = "[0-9]{1,15}"  # a time as epoch milliseconds
# RFC 3339: a full-date (midnight UTC), or a date-time with Z or an offset ([tT] and [zZ], as it allows).
_RFC3339 = re.compile(r"([0-9]{4})-([0-9]{2})-([0-9]{2})"
                      r"(?:[Tt]([0-9]{2}):([0-9]{2}):([0-9]{2})(?:\.([0-9]+))?(?:[Zz]|([+-])([0-9]{2}):([0-9]{2})))?")


def parse_time(text: str) -> int | None:
    """Epoch milliseconds (EPOCH_MS_PATTERN), or an RFC 3339 date-time or full-date, as epoch ms;
    None if it is neither. (A leap second, 23:59:60 UTC, is the second after 23:59:59.)"""
    if re.fullmatch(EPOCH_MS_PATTERN, text):
        return int(text)
    if (match := _RFC3339.fullmatch(text)) is None:
        return None
    year, month, day, hour, minute, second, fraction, sign, offset_hour, offset_minute = match.groups()
    try:  # (year 0000, which datetime lacks, as 0400: the same calendar, 146097 days later)
        moment = datetime.datetime(int(year) or 400, int(month), int(day), tzinfo=datetime.UTC)
    except ValueError:
        return None
    day_ms = int(moment.timestamp()) * 1000 - (0 if int(year) else 146097 * 86_400_000)
    if hour is None:
        return day_ms
    if (int(hour) > 23 or int(minute) > 59 or int(second) > 60 or int(offset_hour or 0) > 23
            or int(offset_minute or 0) > 59):
        return None
    offset = (int(offset_hour or 0) * 60 + int(offset_minute or 0)) * 60_000
    minute_ms = day_ms + (int(hour) * 60 + int(minute)) * 60_000 - (offset if sign == "+" else -offset)
    if second == "60" and minute_ms // 60_000 % 1440 != 1439:  # a leap second ends a UTC day
        return None
    return minute_ms + int(second) * 1000 + int((fraction or "0")[:3].ljust(3, "0"))


CLOCK_RANGE = (0.0, 253402300799.0)  # epoch seconds a datetime can hold: 1970-01-01 to 9999-12-31
MILLISECONDS_FROM = 10**11  # an epoch "second" this large (the year 5138) is taken for milliseconds


def admin_time(value: Any, field: str) -> float | None:
    """A time the admin surface takes (docs/sandbox.md), in epoch seconds: JSON seconds, or RFC 3339; a value
    that looks like milliseconds is refused, saying so."""
    if value is None:
        return None
    if isinstance(value, datetime.datetime):  # (a TOML datetime; naive means UTC)
        return (value if value.tzinfo else value.replace(tzinfo=datetime.UTC)).timestamp()
    if isinstance(value, (bool, datetime.date, datetime.time)) or not isinstance(value, (int, float, str)):
        raise invalid(field, "time_iso")
    if isinstance(value, str):
        if re.fullmatch(r"[0-9]+", value):
            raise invalid(field, "time_digits")
        if (moment := parse_time(value)) is None:
            raise invalid(field, "time_iso")
        return moment / 1000
    if MILLISECONDS_FROM <= value <= CLOCK_RANGE[1] * 1000:
        raise invalid(field, "time_ms")
    return value


def _clock_time(at: float) -> float:
    try:
        at = float(at)
    except OverflowError:  # an integer of hundreds of digits
        raise ValueError(f"{str(at)[:20]}... is outside the clock's range"
                         " (1970-01-01 to 9999-12-31)") from None
    if not CLOCK_RANGE[0] <= at <= CLOCK_RANGE[1]:  # NaN fails both comparisons
        raise ValueError(f"{at!r} is outside the clock's range (1970-01-01 to 9999-12-31)")
    return at


###############################################################################
# Storage ######################################################################
###############################################################################

def _schema_sql() -> str:
    """schema.sql beside this module (a checkout), else where pip installed it."""
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "schema.sql")
    if os.path.exists(here):
        with open(here, encoding="utf-8") as handle:
            return handle.read()
    for path in importlib.metadata.files("walletsvc") or ():
        if path.name == "schema.sql":
            return path.read_text(encoding="utf-8")
    raise RuntimeError("schema.sql is missing from the walletsvc installation")


def _version_of(conn: sqlite3.Connection) -> int | None:
    try:
        row = conn.execute("SELECT version FROM schema_version").fetchone()
    except sqlite3.OperationalError:  # (no such table: a new file)
        return None
    return row[0] if row else None


@functools.lru_cache(maxsize=1)
def _schema_image() -> tuple[bytes, int]:
    """An empty database with the schema applied, serialized (immutable, made once), and its version."""
    with contextlib.closing(sqlite3.connect(":memory:", isolation_level=None)) as conn:
        conn.executescript(_schema_sql())
        return conn.serialize(), _version_of(conn)


def schema_version() -> int:
    """The schema version schema.sql makes (its schema_version row): the one place it is written."""
    return _schema_image()[1]


def _upgrade_schema(conn: sqlite3.Connection) -> int:
    """The unit that makes or upgrades the schema (from version 4, the first released), and its version after;
    run under the write lock, so that of two processes upgrading one file the second finds nothing to do."""
    version = _version_of(conn)
    if version is not None and version >= schema_version():
        return version
    script = _schema_sql() + "\nDROP TABLE IF EXISTS file_signature;\n"  # (version 6's copy guard)
    if "nonce_tolerance" in {column[1] for column in conn.execute("PRAGMA table_info(sandbox)")}:
        script += "ALTER TABLE sandbox DROP COLUMN nonce_tolerance;\n"  # (unused since version 4)
    script += f"UPDATE schema_version SET version = {schema_version()};"
    statement = ""
    for line in script.splitlines(keepends=True):  # one statement at a time (executescript would commit)
        statement += line
        if sqlite3.complete_statement(statement):
            conn.execute(statement)
            statement = ""
    return _version_of(conn)


# SQLite results that mean another connection holds the lock, those that mean "the storage
# cannot take this now" (S503; extended codes included: a prefix match), and a malformed file.
_LOCKED = ("SQLITE_BUSY", "SQLITE_LOCKED")
_UNAVAILABLE = (*_LOCKED, "SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_IOERR", "SQLITE_FULL")
_CORRUPT = ("SQLITE_CORRUPT", "SQLITE_NOTADB")


def _error_name(exc: BaseException) -> str:
    return getattr(exc, "sqlite_errorname", None) or ""


def _is_locked(exc: sqlite3.Error) -> bool:
    return _error_name(exc).startswith(_LOCKED)


def _is_busy(exc: sqlite3.Error) -> bool:
    return isinstance(exc, sqlite3.OperationalError) and _error_name(exc).startswith(_UNAVAILABLE)


class BatchLost(sqlite3.OperationalError):
    """A write waited past its patience for the writer, or the batch it was in failed as a whole (its
    leader interrupted, its transaction lost): nothing of it was kept; trying again may succeed (S503)."""

    sqlite_errorname = "SQLITE_BUSY"


class FileGone(sqlite3.OperationalError):
    """The database file, -wal or -shm was swapped since this process opened it, or is malformed (S503)."""

    sqlite_errorname = "SQLITE_CANTOPEN"


class _ExactSum:
    """SQL ``exact_sum(x)``: integers added as Python adds them, exact however large (SQLite's
    sum() stops at 2^63 with "integer overflow"), as decimal text (a subquery of no rows is NULL)."""

    def __init__(self) -> None:
        self.total = 0

    def step(self, value: int | None) -> None:
        self.total += 0 if value is None else value

    def finalize(self) -> str:
        return str(self.total)


def _identity(path: str) -> tuple[int, int] | None:
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_dev, status.st_ino


@contextlib.contextmanager
def _written_whole(path: str) -> Iterator[tuple[int, str]]:
    """A new file beside ``path``, private (0600) and never made through a planted symlink (mkstemp): its
    descriptor and name, renamed over ``path`` whole once the block ends, removed if the block fails."""
    descriptor, temporary = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)),
                                             prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        yield descriptor, temporary
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise


def _lock_holders(locks: str, path: str) -> set[int]:
    """The processes /proc/locks (``locks``) shows holding a POSIX lock on the file at ``path``."""
    if (identity := _identity(path)) is None:
        return set()
    device, inode = identity
    file = f"{os.major(device):02x}:{os.minor(device):02x}:{inode}"
    return {int(fields[4]) for fields in map(str.split, locks.splitlines())
            if len(fields) > 5 and fields[1] == "POSIX" and fields[5] == file}


def _no_checkpoint_on_close(conn: sqlite3.Connection) -> None:
    """SQLite's NO_CKPT_ON_CLOSE: the last connection to close must not move the -wal into the file by a lost
    -shm, over other processes' frames (3.11 lacks setconfig: sqlite3_db_config on the handle)."""
    if hasattr(conn, "setconfig"):
        conn.setconfig(1006, True)  # SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE
        return
    if sys.platform != "linux" or sys.implementation.name != "cpython":
        return  # (the layout below is CPython's; elsewhere refuse_lost_shm finds none either)
    import _sqlite3
    import ctypes
    handle = ctypes.c_void_p.from_address(id(conn) + 2 * ctypes.sizeof(ctypes.c_void_p)).value
    if handle:  # (not closed)
        config = ctypes.CDLL(_sqlite3.__file__).sqlite3_db_config
        config.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        config(handle, 1006, 1, None)


EMPTY_NEW = 2.0  # seconds an empty database file may be a starting peer's, not yet written (refuse_empty)


class DatabaseFile:
    """The database file, -wal and -shm as this process opened them, checked by identity before each COMMIT;
    once one is swapped or malformed, every later use fails with ``gone`` (docs/operations.md)."""

    def __init__(self, path: str, shm_lost: Callable[[], None]) -> None:
        self.path = path
        self._shm_lost = shm_lost  # (none of this process's connections on the file checkpoints as it closes)
        self._file = _identity(path)
        # The -wal and -shm as first seen (made with the first connection, removed with the last).
        self._companions = {suffix: _identity(path + suffix) for suffix in ("-wal", "-shm")}
        self.gone: FileGone | None = None

    @staticmethod
    def refuse_lost_shm(path: str) -> None:
        """FileGone when another process serves ``path`` through a -shm that is no longer the one at the path:
        it locks the file but not the -shm, still after 50 ms (docs/operations.md; Linux only)."""
        for _ in range(6):
            try:
                with open("/proc/locks", encoding="ascii", errors="replace") as table:
                    locks = table.read()
            except OSError:
                return
            holders = [_lock_holders(locks, path + suffix) for suffix in ("", "-shm")]
            if (lost := min(holders[0] - holders[1] - {os.getpid()}, default=None)) is None:
                return
            time.sleep(0.01)
        raise FileGone(f"{path}: process {lost} still serves it through a -shm that was deleted; a process"
                       " that joined it now would no longer coordinate with that one, and both would"
                       " corrupt the file. Stop that process first.")

    @staticmethod
    def refuse_empty(path: str) -> None:
        """FileGone for an empty file given as a database (docs/operations.md); one made in the last EMPTY_NEW
        seconds may be a starting peer's, and is waited for, 5 s at most."""
        deadline = time.monotonic() + 5
        while True:
            try:
                status = os.stat(path)
            except OSError:  # (no file: a new database is made)
                return
            if status.st_size > 0:
                return
            if (os.path.exists(path + "-wal") or time.time() - status.st_mtime > EMPTY_NEW
                    or time.monotonic() > deadline):
                break  # (a -wal beside an empty file: it was a database)
            time.sleep(0.01)
        raise FileGone(f"{path}: the file is empty, so it is no walletsvc database (one truncated, or a file"
                       " made by another program): restore a backup there while no server runs, or give a"
                       " new path (--db) for a new sandbox")

    def check(self) -> None:
        """FileGone unless the file, its -wal and its -shm are still the ones this process opened."""
        if self.gone is None:
            what = "file" if _identity(self.path) != self._file else None
            for suffix in ("-wal", "-shm"):
                now = _identity(self.path + suffix)
                if (known := self._companions.get(suffix)) is None:
                    self._companions[suffix] = known = now
                if what is None and now != known:
                    what = f"file's {suffix}"
            if what is not None:
                self.gone = FileGone(f"{self.path}: the database {what} was deleted or replaced while the"
                                     " server ran; nothing more is read from or written to it. Restart the"
                                     " server.")
                if not self.shm_kept():
                    with contextlib.suppress(Exception):  # (gone stands whatever this meets)
                        self._shm_lost()
        if self.gone is not None:
            raise copy.copy(self.gone)  # (one object raised again and again would pile up tracebacks)

    def shm_kept(self) -> bool:
        """Whether this process's -shm is still the one at the path (the -wal index others write by)."""
        return _identity(self.path + "-shm") == self._companions.get("-shm")

    def malformed(self, exc: sqlite3.Error) -> None:
        if self.gone is None and _error_name(exc).startswith(_CORRUPT):
            self.gone = FileGone(
                f"{self.path}: the database file is malformed ({exc}): nothing more is read from or written"
                " to it. Restore it from a copy, or serve a new file (--db); walletsvc audit and sqlite3's"
                " PRAGMA integrity_check say what is wrong.")

    def closed(self) -> None:
        self._companions = {}  # (SQLite removes the -wal and -shm when the last connection closes)


TURN_RECHECK = 0.005  # seconds between a waiting process's looks at the turn when no wake-up comes


class _Turns:
    """The turn to write of the processes forked from one ``share``: a POSIX lock (the kernel drops a killed
    holder's) and an eventfd that wakes a waiter as the turn is given back. Not shared: nothing to take."""

    lock: IO[bytes] | None = None

    def share(self) -> None:
        if self.lock is None and hasattr(os, "eventfd"):  # (elsewhere processes retry SQLite's lock)
            self.given_back = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            self.lock = tempfile.TemporaryFile()  # noqa: SIM115 - open for good; nameless: for forked ones only

    def take(self, deadline: float) -> None:
        """This process's turn, waited for asleep (looking again every TURN_RECHECK: a killed holder gives
        it back without a wake-up); BatchLost once ``deadline`` passes."""
        while self.lock is not None:
            with contextlib.suppress(BlockingIOError, PermissionError):  # (EAGAIN, EACCES: another's turn)
                return fcntl.lockf(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if (left := deadline - time.monotonic()) <= 0:
                raise BatchLost("database is locked: the write waited its whole patience for its turn")
            (poller := select.poll()).register(self.given_back, select.POLLIN)  # (one per wait: fork-safe)
            if poller.poll(min(left, TURN_RECHECK) * 1000):
                with contextlib.suppress(BlockingIOError):  # (another waiter read it first)
                    os.eventfd_read(self.given_back)

    def give(self) -> None:
        if self.lock is not None:
            fcntl.lockf(self.lock, fcntl.LOCK_UN)
            os.eventfd_write(self.given_back, 1)


class _Write:
    """One caller's place in the write queue: its units, then their results or the error that undid them."""

    __slots__ = ("done", "durable", "error", "own_error", "results", "taken", "units")

    def __init__(self, units: Sequence[Unit], durable: bool) -> None:
        self.units, self.durable = units, durable
        self.taken = self.done = False
        self.results: list = []
        self.error: BaseException | None = None
        self.own_error = False  # raised by one of its own units (else: the batch's failure, shared)


# A write unit: a plain function of the write connection, run inside a transaction it does not own
# (it sets no pragma: a batch's durability is the connection's synchronous, which Database._writer sets).
Unit = Callable[[sqlite3.Connection], Any]


def savepoint(conn: sqlite3.Connection, unit: Unit) -> Any:
    """Run ``unit`` inside another unit's transaction, in a savepoint of its own: if it raises,
    its writes alone are rolled back (and if they cannot be, nothing of the batch is kept)."""
    conn.execute("SAVEPOINT unit")
    try:
        result = unit(conn)
    except BaseException:
        if conn.in_transaction:
            try:
                conn.execute("ROLLBACK TO unit")
                conn.execute("RELEASE unit")
            except sqlite3.Error:
                conn.execute("ROLLBACK")
        raise
    conn.execute("RELEASE unit")
    return result


CHECKPOINT_SECONDS = 0.1  # the most time between a process's checkpoints (docs/operations.md, Benchmarks)
# Units one leader takes into one transaction: enough to share a commit among every request
# thread, small enough that a batch holds the lock for a few milliseconds at most.
MAX_BATCH = 64


class Database:
    """SQLite one way: WAL, foreign keys, one door for writes (``write``; docs/contributing.md); a read
    connection per thread and process (``:memory:``: one, locked); only the leader waits for others."""

    def __init__(self, path: str, busy_timeout: float = 5.0, synchronous: str = "FULL") -> None:
        self.path, self.busy_timeout, self.synchronous = path, busy_timeout, synchronous
        self.memory = path == ":memory:"
        self._local = threading.local()
        self._held: weakref.WeakSet[_Held] = weakref.WeakSet()  # every thread's read connection
        self._lock = threading.RLock() if self.memory else contextlib.nullcontext()
        self._shared: _Held | None = None
        self.file: DatabaseFile | None = None  # once made (a file database)
        self.full, self._fulls = False, 0  # the last write failed for a full disk; how many did
        self._turns = _Turns()  # the turn to write of the processes forked after ``share_turns``
        self._writer_state()
        _DATABASES.add(self)
        if not self.memory:  # it holds API secrets: private from the start, and never made through a symlink
            if os.path.islink(path) and not os.path.exists(path):
                raise RuntimeError(f"{path} is a symbolic link to nothing: no database is made through it")
            DatabaseFile.refuse_empty(path)
            with contextlib.suppress(OSError):  # (there already, or not makeable: SQLite says what is wrong)
                os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_WRONLY, 0o600))
            DatabaseFile.refuse_lost_shm(path)
        deadline = time.monotonic() + busy_timeout
        while True:  # two servers starting on one new file: the loser waits its turn (docs/operations.md)
            try:
                self._apply_schema()
                break
            except sqlite3.OperationalError as exc:
                self.close()
                if not _is_busy(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        if not self.memory:
            self.file = DatabaseFile(path, self._shm_lost)

    def _writer_state(self) -> None:
        """The write queue and this process's write connections (anew in a forked child)."""
        self._queue: collections.deque[_Write] = collections.deque()
        self._turn = threading.Condition(threading.Lock())
        self._writers: dict[str, _Held] = {}  # by synchronous: a writer for threads inside a read
        self._writer_pid = os.getpid()
        self._leader: int | None = None  # the thread running a batch's units, while it does
        self._checkpoint_at = 0.0  # time.monotonic() from which the next checkpoint is due

    def check_file(self) -> None:
        if self.file is not None:
            self.file.check()

    def unavailable(self, exc: sqlite3.Error) -> ServiceBusy | None:
        """What a storage error answers: S503 saying why once the file is gone or malformed, S503 "busy" when
        it is locked, read-only, full or failing, None for a bug."""
        if self.file is not None:
            self.file.malformed(exc)
            try:
                self.file.check()
            except FileGone:
                return ServiceBusy(str(self.file.gone),
                                   zh_extra=f"数据库文件 {self.path}（或其 -wal、-shm）已被删除、替换或损坏；"
                                   "不再读写。请重启服务器，或从副本恢复。")
        if _error_name(exc).startswith("SQLITE_FULL"):
            self.full, self._fulls = True, self._fulls + 1  # (until a write commits again: /healthz says so)
            return ServiceBusy(f"{self.path}: the disk is full: writes fail until there is room again;"
                               " nothing of a failed write was kept.",
                               zh_extra=f"{self.path}：磁盘已满：在腾出空间之前写入都会失败；失败的写入不会留下任何"
                               "内容。")
        return ServiceBusy() if _is_busy(exc) else None

    def _connect(self) -> sqlite3.Connection:
        target, uri = self.path, False
        if self.file is not None:  # made: a thread opening it later must not make a new empty file there
            self.file.check()  # nor open another file put there (its -wal would be this one's)
            target, uri = f"file:{urllib.parse.quote(os.path.abspath(self.path))}?mode=rw", True
        conn = sqlite3.connect(target, timeout=self.busy_timeout, isolation_level=None,
                               check_same_thread=False, uri=uri)
        self._prepare_connection(conn)
        return conn

    def _prepare_connection(self, conn: sqlite3.Connection) -> None:
        conn.row_factory = sqlite3.Row
        conn.create_aggregate("exact_sum", 1, _ExactSum)
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute("PRAGMA temp_store = MEMORY")  # no statement journal file made and unlinked per transfer
        if not self.memory:  # new files: 2 KB pages, a transfer's commit 71 KB, not 122 (docs/operations.md)
            conn.execute("PRAGMA page_size = 2048")  # (before WAL fixes it; an existing file keeps its own)
            conn.execute("PRAGMA journal_mode = WAL")  # (waits the busy timeout: a process may hold the file)
            conn.execute("PRAGMA synchronous = NORMAL")  # (a durable batch's writer's is set in _writer)
            conn.execute("PRAGMA wal_autocheckpoint = 0")  # (the leader checkpoints, after: write)
        # From now on no statement waits in SQLite's busy handler (it sleeps in steps of up to 100 ms): a
        # writer waits in _run, asleep on its turn or in steps of at most 250 us; a WAL reader never waits.
        conn.execute("PRAGMA busy_timeout = 0")

    def _apply_schema(self) -> None:
        """Make or upgrade the schema (one unit through ``write``), or check the version it has."""
        with self.connection() as conn:
            if self.memory:  # a copy of a ready-made image: 10x faster than running the script
                conn.deserialize(_schema_image()[0])
            version = _version_of(conn)
        if version is None or 4 <= version < schema_version():  # (4: the first released)
            # (no sync: a power cut only undoes it, and the next open does it again)
            version = self.write([_upgrade_schema], durable=False)[0]
        if version != schema_version():
            raise RuntimeError(f"{self.path} has schema version {version}; "
                               f"this walletsvc expects {schema_version()}")

    def connection(self) -> _Held:
        """``with db.connection() as conn``: this thread's read connection (``:memory:``: the shared one)."""
        if self.memory:
            if self._shared is None:
                with self._lock:
                    if self._shared is None:
                        self._shared = _Held(self._connect(), self._lock)
            return self._shared
        if self.file is not None and self.file.gone is not None:  # (a new connection would open
            raise copy.copy(self.file.gone)                           # whatever file is at the path now)
        local, pid = self._local, os.getpid()
        if getattr(local, "pid", None) != pid:  # a new thread, or a child of os.fork: its own connection
            local.held, local.pid = _Held(self._connect(), None), pid
            self._held.add(local.held)
        return local.held

    def _shm_lost(self) -> None:
        """No connection of this process on the file (any database's, any thread's) checkpoints on close."""
        for database in list(_DATABASES):
            if database.file is not None and self.file is not None and database.file._file == self.file._file:
                for held in [*database._writers.values(), *list(database._held)]:
                    _no_checkpoint_on_close(held.conn)

    def write(self, units: Sequence[Unit], *, durable: bool = True) -> list:
        """The one door for writes: ``units`` in the next batch's transaction, each caller's in a savepoint;
        their results once committed (docs/contract.md). ``durable=False``: no sync needed."""
        if self._leader == threading.get_ident():
            raise RuntimeError("a write unit wrote through Database.write: give its writes to its own unit")
        write, fulls = _Write(units, durable), self._fulls
        if batch := self._wait_for_turn(write):  # the leader: run the callers queued behind it
            self._lead(batch)
        if write.error is not None:  # a batch's failure is each caller's: each raises a copy of its own
            raise write.error if write.own_error else copy.copy(write.error)
        if self.full and self._fulls == fulls:  # (one committed, and none failed for a full disk meanwhile)
            self.full = False
        return write.results

    def _wait_for_turn(self, write: _Write) -> list[_Write]:
        """Queue ``write`` till a leader ran it ([]) or it leads: then the batch it takes, itself first, in
        the same hold of the lock; BatchLost past this thread's patience untaken."""
        deadline = time.monotonic() + self._patience()
        with self._turn:
            if os.getpid() != self._writer_pid:
                raise RuntimeError("a database's writer is its process's: open the database anew after fork")
            self._queue.append(write)
            try:
                while not write.done and self._queue[0] is not write:
                    left = deadline - time.monotonic()
                    if left <= 0 and not write.taken:
                        raise BatchLost("database is locked: the write waited its whole patience")
                    self._turn.wait(left if left > 0 else 0.05)
                if write.done:
                    return []
                batch = list(itertools.islice(self._queue, MAX_BATCH))
                for waiting in batch[1:]:
                    waiting.taken = True
                return batch
            except BaseException:  # (a timeout, or an interrupt of this thread): out of the queue if untaken
                if not write.taken and write in self._queue:
                    self._queue.remove(write)
                    self._turn.notify_all()
                    raise
                while not write.done:  # taken into a batch: it is run and answered, whatever this thread does
                    self._turn.wait(0.05)
                raise

    def _lead(self, batch: list[_Write]) -> None:
        """Run the leader's batch (``_run``; its own write first); each caller gets its outcome whatever
        interrupts the leader, which then checkpoints if one is due."""
        try:
            with self._lock:
                conn = self._writer(any(write.durable for write in batch))
                self._run(conn, batch)
        except BaseException as exc:
            shared = exc if isinstance(exc, Exception) else BatchLost("the batch was interrupted")
            for write in batch:
                write.results, write.error, write.own_error = [], shared, False
            if not isinstance(exc, Exception):  # (an interrupt is the leader's own, raised after the turn)
                self._pass_turn(batch)
                raise
            conn = None
        if conn is None or self.memory or time.monotonic() < self._checkpoint_at:
            self._pass_turn(batch)
            return
        self._pass_turn(batch[1:])  # its callers have their answers while the leader checkpoints
        try:
            self._checkpoint(conn)
        finally:
            self._pass_turn(batch[:1])

    def _run(self, conn: sqlite3.Connection, batch: list[_Write]) -> None:
        """BEGIN (on this process's turn, then in 50-250 us steps), every caller's units, COMMIT: the only
        transaction that writes. The file is checked just before COMMIT: found swapped, the -wal goes into the
        file this process opened, left empty: no stale one corrupts a new file there (-shm lost or not)."""
        deadline, pause = time.monotonic() + self._patience(), 0.00005
        try:
            while True:
                self._turns.take(deadline)  # (given back while another program holds SQLite's lock)
                try:
                    conn.execute("BEGIN IMMEDIATE")
                    break
                except sqlite3.OperationalError as exc:
                    self._turns.give()
                    if not _is_locked(exc) or time.monotonic() + pause > deadline:
                        raise
                time.sleep(pause)
                pause = min(pause * 2, 0.00025)
            self._leader = threading.get_ident()
            for write in batch:
                try:
                    write.results = savepoint(conn, lambda conn, units=write.units: [
                        unit(conn) for unit in units])
                except Exception as exc:
                    write.error, write.own_error = exc, True
                    if not conn.in_transaction:  # SQLite rolled the whole batch back (a full disk)
                        raise
                if not conn.in_transaction:  # a unit that swallowed a failure of the transaction
                    raise BatchLost("the batch's transaction was lost")
            try:
                self.check_file()
            except FileGone:
                conn.execute("ROLLBACK")
                if self.file.shm_kept():
                    with contextlib.suppress(sqlite3.Error):
                        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                raise
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        finally:
            self._turns.give()
            self._leader = None

    def _checkpoint(self, conn: sqlite3.Connection) -> None:
        """Move the -wal into the file after a batch once one is due (``_lead`` looks: CHECKPOINT_SECONDS
        after the last) while the leader holds the turn: RESTART, 5 ms at most for readers."""
        self._checkpoint_at = time.monotonic() + CHECKPOINT_SECONDS
        with contextlib.suppress(sqlite3.Error):
            conn.execute("PRAGMA busy_timeout = 5")
            try:
                conn.execute("PRAGMA wal_checkpoint(RESTART)")
            finally:
                conn.execute("PRAGMA busy_timeout = 0")

    def share_turns(self) -> None:
        """Processes forked from now on (``serve --workers``) take turns to write (Linux: ``_Turns``)."""
        self._turns.share()

    def _pass_turn(self, batch: list[_Write]) -> None:
        """These writes are done: out of the queue, and the next in line leads."""
        with self._turn:
            for write in batch:
                write.done = True
                self._queue.remove(write)
            self._turn.notify_all()

    def _writer(self, durable: bool) -> sqlite3.Connection:
        """A batch's connection: the leader's own, so that its cache stays warm for its reads, at the batch's
        ``synchronous`` (as configured if durable, else NORMAL: no fsync at commit in WAL mode), set when it
        changes; a process writer of that level for a thread inside a read of its own."""
        if self.memory:
            return self.connection().conn
        level, held = self.synchronous if durable else "NORMAL", self.connection()
        if held.conn.in_transaction:
            held = self._writers.get(level) or self._writers.setdefault(level, _Held(self._connect(), None))
        if held.synchronous != level:
            held.synchronous = None  # (unknown till the pragma ran: a batch after an interrupt sets it again)
            held.conn.execute(f"PRAGMA synchronous = {level}")
            held.synchronous = level
        return held.conn

    @contextlib.contextmanager
    def patience(self, seconds: float) -> Iterator[None]:
        """This thread's writes wait at most ``seconds`` (if less than the busy timeout) for
        their turn: the admin surface answers S503 within a second rather than wait with the API."""
        self._local.patience = seconds
        try:
            yield
        finally:
            self._local.patience = None

    def _patience(self) -> float:
        return min(getattr(self._local, "patience", None) or self.busy_timeout, self.busy_timeout)

    def one(self, sql: str, params: Sequence = ()) -> sqlite3.Row | None:
        with self.connection() as conn:
            return conn.execute(sql, params).fetchone()

    def check_writable(self) -> None:
        """sqlite3.OperationalError unless this process can write the database (a read-only file, a full
        disk): a value written over itself; locked by another writer passes (S503 until free)."""
        try:
            self.write([lambda conn: conn.execute("UPDATE schema_version SET version = version")],
                       durable=False)
        except sqlite3.OperationalError as exc:
            if not _is_locked(exc):
                raise

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[sqlite3.Connection]:
        """A read transaction: the statements inside see one consistent state."""
        with self.connection() as conn:
            if conn.in_transaction:
                yield conn
                return
            conn.execute("BEGIN")
            try:
                yield conn
            finally:
                if conn.in_transaction:
                    conn.execute("COMMIT")

    def close(self) -> None:
        """Close this thread's connection (all, for ``:memory:``) and, no write under way, the write
        connections; the file is looked at first (a lost -shm: none of them checkpoints as it closes)."""
        with contextlib.suppress(FileGone):
            self.check_file()
        with self._lock:
            if self.memory and self._shared is not None:
                self._shared.conn.close()
                self._shared = None
            if (held := getattr(self._local, "held", None)) is not None:
                held.conn.close()
                self._local.held = self._local.pid = None
        with self._turn:
            if not self._queue and os.getpid() == self._writer_pid:
                for held in self._writers.values():
                    held.conn.close()
                self._writers.clear()
                if self.file is not None:
                    self.file.closed()


_DATABASES: weakref.WeakSet[Database] = weakref.WeakSet()
# A child of os.fork has no writer yet: the parent's connections and queue (and a lock another
# thread may have held at the fork) are the parent's.
os.register_at_fork(after_in_child=lambda: [database._writer_state() for database in list(_DATABASES)])


class _Held:
    """A connection as a context manager, optionally under a lock (cheaper than a generator)."""

    __slots__ = ("__weakref__", "conn", "lock", "synchronous")

    def __init__(self, conn: sqlite3.Connection, lock: Any) -> None:
        self.conn, self.lock, self.synchronous = conn, lock, "NORMAL"  # (as _prepare_connection sets it)

    def __enter__(self) -> sqlite3.Connection:
        if self.lock is not None:
            self.lock.acquire()
        return self.conn

    def __exit__(self, *exc_info: object) -> None:
        if self.lock is not None:
            self.lock.release()


###############################################################################
# Signing and replay protection ################################################
###############################################################################

EMPTY_BODY_HASH = hashlib.sha256(b"").hexdigest()  # every GET signs it


def body_hash(body: bytes) -> str:
    """Lowercase hex SHA-256 of the exact body bytes (of b"" for no body)."""
    return hashlib.sha256(body).hexdigest() if body else EMPTY_BODY_HASH


def canonical_message(method: str, path: str | bytes, timestamp: str, nonce: str, body_sha256: str) -> bytes:
    """The five lines of docs/contract.md (Signing) joined by LF, no trailing LF; ``path`` exactly as sent
    (percent-encoding kept, no query). The one function both the server's check and the clients use."""
    if isinstance(path, str):
        path = path.encode("utf-8")
    return b"\n".join((method.upper().encode("ascii"), path, timestamp.encode("ascii"),
                       nonce.encode("ascii"), body_sha256.encode("ascii")))


def sign_request(method: str, path: str, body: bytes | str | None, api_key: str, secret: str, *,
                 timestamp: int | None = None, nonce: str | None = None) -> dict[str, str]:
    """The four authentication headers for one request (docs/contract.md, Signing): ``path`` without the
    query string, ``body`` the exact bytes that will be sent (a str is sent as UTF-8)."""
    if isinstance(body, str):
        body = body.encode("utf-8")
    timestamp_text = str(int(time.time()) if timestamp is None else timestamp)
    nonce = nonce or str(uuid.uuid4())
    message = canonical_message(method, path.split("?", 1)[0], timestamp_text, nonce, body_hash(body or b""))
    signature = hmac.digest(secret.encode("utf-8"), message, "sha256")
    return {"X-Api-Key": api_key, "X-Timestamp": timestamp_text, "X-Nonce": nonce,
            "X-Signature": base64.b64encode(signature).decode("ascii")}


class Diagnosis(NamedTuple):
    """The common signing mistake a refused signature matches (``debug_signatures``)."""

    english: str
    chinese: str


def diagnose_signature(secret: str, environ: Mapping[str, Any], path: bytes, body: bytes, timestamp: str,
                       nonce: str, provided: str) -> Diagnosis | None:
    """The common signing mistake the client's signature matches, in English and Chinese, or None
    (docs/signing.md): each mistaken message signed and compared with what it sent."""
    method = environ["REQUEST_METHOD"]

    def message(path_: bytes = path, digest: str | None = None, tail: bytes = b"") -> bytes:
        return canonical_message(method, path_, timestamp, nonce, digest or body_hash(body)) + tail

    given = provided.strip()
    correct = hmac.digest(secret.encode("utf-8"), message(), "sha256")
    if hmac.compare_digest(given.lower().encode("latin-1", "replace"), correct.hex().encode()):
        return Diagnosis("the signature is hex, not Base64", "签名是十六进制而不是 Base64")
    try:
        decoded = binascii.a2b_base64(given.encode("ascii"))
    except (UnicodeEncodeError, binascii.Error, ValueError):
        return None
    for candidate, english, chinese in _signing_mistakes(message, environ, path, body):
        if hmac.compare_digest(hmac.digest(secret.encode("utf-8"), candidate, "sha256"), decoded):
            return Diagnosis(english, chinese)
    for padded in {secret + "\n", secret + " ", " " + secret, secret.strip()} - {secret}:
        if hmac.compare_digest(hmac.digest(padded.encode("utf-8"), message(), "sha256"), decoded):
            return Diagnosis("the secret was used with surrounding whitespace", "使用的密钥带有首尾空白")
    if _signed_in_milliseconds(secret, method, path, body, timestamp, nonce, decoded):
        return Diagnosis("the timestamp was signed in milliseconds (sign X-Timestamp as sent: epoch seconds)",
                         "签名使用了毫秒时间戳（请按发送的 X-Timestamp 签名：秒级时间戳）")
    return None


def _signing_mistakes(message: Callable[..., bytes], environ: Mapping[str, Any], path: bytes,
                      body: bytes) -> Iterator[tuple[bytes, str, str]]:
    """Each mistake's (message, mistake, mistake in Chinese), as a client who made it signs."""
    method = environ["REQUEST_METHOD"]
    if query := environ.get("QUERY_STRING", ""):
        yield (message(path_=path + b"?" + query.encode("latin-1", "replace")),
               "the query string was signed (sign the path only)", "签名包含了查询字符串（只签名路径）")
    cuts = [match.start() for _, match in zip(range(8), re.finditer(rb"(?<!^)/", path))]  # prefixes are short
    for cut in cuts:
        yield (message(path_=path[cut:]),
               f"the mount prefix {path[:cut].decode('latin-1')!r} was left out of the signed path",
               f"签名路径缺少挂载前缀 {path[:cut].decode('latin-1')!r}")
    if body:
        yield from _body_mistakes(message, body)
    yield (message(tail=b"\n"), "the canonical message ended with a line feed", "规范消息末尾多了换行符")
    yield (method.lower().encode("latin-1") + message()[len(method):],
           "the method was signed in lower case", "方法名以小写签名")
    if not (environ.get("REQUEST_URI") or environ.get("RAW_URI")):  # a server that gives no raw path
        over = urllib.parse.quote(urllib.parse.unquote_to_bytes(path), safe="/").encode("ascii")
        if over != path:
            yield (message(path_=over),
                   ("the path was percent-encoded where this server cannot see the encoding;"
                    " send it as RFC 3986 requires"),
                   "路径中做了百分号编码，而此服务器看不到该编码；请按 RFC 3986 的要求发送路径")


def _body_mistakes(message: Callable[..., bytes], body: bytes) -> Iterator[tuple[bytes, str, str]]:
    """The mistakes of a request with a body: the empty body's hash, or the body re-serialised."""
    yield (message(digest=EMPTY_BODY_HASH), "the empty-body hash was signed on a request with a body",
           "有请求体的请求签名了空请求体的哈希")
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return
    for dumped in {json.dumps(document), json.dumps(document, separators=(",", ":")),
                   json.dumps(document, sort_keys=True), json.dumps(document, ensure_ascii=False)}:
        encoded = dumped.encode("utf-8", "surrogatepass")  # ("\ud800" unescaped: no client sends it, no 500)
        if encoded != body:
            yield (message(digest=body_hash(encoded)),
                   "the body was re-serialised after hashing (sign the exact bytes sent)",
                   "哈希之后请求体被重新序列化（请对发送的原始字节签名）")


def _signed_in_milliseconds(secret: str, method: str, path: bytes, body: bytes, timestamp: str, nonce: str,
                            decoded: bytes) -> bool:
    """Whether the signed message had one of that second's thousand milliseconds: the key and path absorbed
    once, copied per millisecond (1.5 ms, 3.5 ms with hmac.digest)."""
    signed = hmac.new(secret.encode("utf-8"), f"{method}\n".encode("latin-1") + path + b"\n", "sha256")
    tail = f"\n{nonce}\n{body_hash(body)}".encode("ascii")  # (the path absorbed once, however long)
    for millis in range(int(timestamp) * 1000, int(timestamp) * 1000 + 1000):
        mac = signed.copy()
        mac.update(str(millis).encode("ascii") + tail)
        if hmac.compare_digest(mac.digest(), decoded):
            return True
    return False


class PendingNonce(NamedTuple):
    """A nonce that passed step 5 and the signature, not recorded yet."""

    api_key: str
    nonce: str
    stamp: int  # its X-Timestamp, epoch seconds


class Nonces:
    """Replay protection in one place (docs/contract.md, step 5 and Replay protection): the lookup's nonce
    check, the record, and forgetting by count. Nothing else names the nonce tables."""

    # What step 1's key lookup reads for step 5 (``k`` the key's row; :nonce, :digest, :stamp the
    # request's, ``parameters`` gives them). A key's runs never overlap: the one that could hold
    # :stamp is the last to start at or before it.
    _FORGOTTEN = ("EXISTS (SELECT 1 FROM nonces_forgotten f WHERE f.api_key IN ({key}, '*') AND f.lo = ("
                  "SELECT max(lo) FROM nonces_forgotten WHERE api_key = f.api_key AND lo <= :stamp)"
                  " AND f.hi >= :stamp)")
    _DIGESTED = "EXISTS (SELECT 1 FROM nonce_digests WHERE digest = :digest)"
    LOOKUP = ("(EXISTS (SELECT 1 FROM nonce_records WHERE api_key = k.id AND nonce = :nonce)"
              f" OR {_DIGESTED}) AS nonce_used, " + _FORGOTTEN.format(key="k.id") + " AS nonce_forgotten")
    # One statement, so that of two racing requests one wins; refused when digested, or in a forgotten second.
    _RECORD = ("INSERT INTO nonce_records (api_key, nonce, ts) SELECT :api_key, :nonce, :stamp"
               f" WHERE NOT {_DIGESTED} AND NOT {_FORGOTTEN.format(key=':api_key')}"
               " ON CONFLICT (api_key, nonce) DO NOTHING RETURNING seq")
    FORGET_EVERY = 256  # records between two forgettings (one DELETE of this many rows, ~0.3 ms)
    DIGESTS = 10  # digests kept, in bounds (docs/contract.md: ten times the records' bound)

    def __init__(self, bound: int) -> None:
        self.bound = bound

    @staticmethod
    def digest(api_key: str, nonce: str) -> int:
        """(key, nonce) in 64 bits, as SQLite keeps an integer: two of a million collide once in 10^7 years
        of a request a second (a collision refuses one fresh request; it never lets a replay in)."""
        value = hashlib.blake2b(f"{api_key}\n{nonce}".encode("utf-8", "replace"), digest_size=8).digest()
        return int.from_bytes(value, "big", signed=True)

    @classmethod
    def parameters(cls, api_key: str, nonce: str, stamp: int) -> dict[str, Any]:
        """The named parameters LOOKUP and the record read."""
        return {"api_key": api_key, "nonce": nonce, "stamp": stamp, "digest": cls.digest(api_key, nonce)}

    def record(self, conn: sqlite3.Connection, pending: PendingNonce) -> None:
        """Record ``pending`` in ``conn``'s transaction; GA2013 if recorded first or its second forgotten."""
        parameters = self.parameters(*pending)
        recorded = conn.execute(self._RECORD, parameters).fetchone()
        if recorded is None:  # (used, or its second forgotten since the lookup: the detail says which)
            used = conn.execute("SELECT EXISTS (SELECT 1 FROM nonce_records WHERE api_key = :api_key AND"
                                f" nonce = :nonce) OR {self._DIGESTED}", parameters).fetchone()[0]
            raise _nonce_used() if used else _nonce_forgotten()
        seq = recorded[0]
        if seq > self.bound and seq % self.FORGET_EVERY == 0:
            self._digest(conn, seq - self.bound)

    def _digest(self, conn: sqlite3.Connection, through: int) -> None:
        """The records up to seq ``through`` become digests, their keys' seconds noted with the batch's last
        digest; past the digests' bound, the oldest batches are forgotten."""
        records = conn.execute("DELETE FROM nonce_records WHERE seq <= ? RETURNING seq, api_key, nonce, ts",
                               (through,)).fetchall()
        records = sorted(map(tuple, records))  # (RETURNING promises no order)
        conn.executemany("INSERT INTO nonce_digests (digest) VALUES (?)",
                         [(self.digest(api_key, nonce),) for _, api_key, nonce, _ in records])
        oldest, newest = conn.execute("SELECT min(seq), max(seq) FROM nonce_digests").fetchone()
        conn.executemany("INSERT INTO nonce_digest_seconds (upto, api_key, ts) VALUES (?, ?, ?)"
                         " ON CONFLICT (upto, api_key, ts) DO NOTHING",
                         sorted({(newest, api_key, ts) for _, api_key, _, ts in records}))
        if newest is not None and newest - oldest + 1 > self.bound * self.DIGESTS:
            self._forget(conn, newest - self.bound * self.DIGESTS)

    @staticmethod
    def _forget(conn: sqlite3.Connection, before: int) -> None:
        """Forget the digests of the batches ended at or before digest ``before``, each key's seconds joined
        to its runs (a run grows by an adjacent second; touching runs merge)."""
        (through,) = conn.execute("SELECT max(upto) FROM nonce_digest_seconds WHERE upto <= ?",
                                  (before,)).fetchone()
        if through is None:
            return
        seconds = sorted(set(map(tuple, conn.execute("DELETE FROM nonce_digest_seconds WHERE upto <= ?"
                                                     " RETURNING api_key, ts", (through,)).fetchall())))
        conn.execute("DELETE FROM nonce_digests WHERE seq <= ?", (through,))
        for api_key, ts in seconds:
            touching = conn.execute("DELETE FROM nonces_forgotten WHERE api_key = ? AND lo <= ? AND hi >= ?"
                                    " RETURNING lo, hi", (api_key, ts + 1, ts - 1)).fetchall()
            lo, hi = min([ts, *(row[0] for row in touching)]), max([ts, *(row[1] for row in touching)])
            conn.execute("INSERT INTO nonces_forgotten (api_key, lo, hi) VALUES (?, ?, ?)", (api_key, lo, hi))

    @staticmethod
    def clear(conn: sqlite3.Connection) -> None:
        """Forget every record, digest and forgotten second (the sandbox's reset)."""
        for table in ("nonce_records", "nonce_digests", "nonce_digest_seconds", "nonces_forgotten"):
            conn.execute(f"DELETE FROM {table}")

    @staticmethod
    def drop_keys(conn: sqlite3.Connection, api_keys: Sequence[str]) -> None:
        """Forget what was recorded of keys that no longer exist (their digests age out unread)."""
        for table in ("nonce_records", "nonce_digest_seconds", "nonces_forgotten"):
            conn.execute(f"DELETE FROM {table} WHERE api_key IN ({', '.join('?' * len(api_keys))})", api_keys)


def _nonce_used() -> RequestExpired:
    return expired("X-Nonce was already used.", "X-Nonce 已被使用。")


def _nonce_forgotten() -> RequestExpired:
    return expired(
        "This key's nonces of this X-Timestamp second were forgotten: at least eleven times nonce_records"
        " requests were recorded since (a frozen clock puts every request in one second). A request"
        " signed in that second may be a replay and is refused. Move the sandbox clock (POST /_admin/clock)"
        " and sign at its new second, raise the nonce_records setting, or reset the sandbox.",
        "该密钥在此 X-Timestamp 秒内的 nonce 已被遗忘：此后记录的请求已达到 nonce_records 的十一倍"
        "（冻结的时钟让所有请求落在同一秒）。以该秒签名的请求可能是重放，因此被拒绝。请调整沙箱时钟"
        "（POST /_admin/clock）并以新的秒签名，或调大 nonce_records 设置，或重置沙箱。")


###############################################################################
# Pagination ###################################################################
###############################################################################

DEFAULT_PAGE_SIZE = 20
MAX_PAGE_SIZE = 100
MAX_SORT_KEYS = 10  # sort keys a list takes (each list has at most 6 sortable fields; SQLite stops at 2000)
Query = Mapping[str, Sequence[str]]


def parse_query_string(query_string: str) -> dict[str, list[str]]:
    """Every value of every parameter, UTF-8 decoded, blanks kept."""
    return urllib.parse.parse_qs(query_string, keep_blank_values=True, errors="replace")


def normalize_query(query: Mapping[str, Any] | None) -> dict[str, list[str]]:
    """Python callers may pass ``{"size": 5}``; HTTP passes lists of strings. Anything else is S012."""
    if query is not None and not isinstance(query, Mapping):
        raise invalid("query", "mapping")
    normal = {}
    for name, value in (query or {}).items():
        values = value if isinstance(value, (list, tuple)) else [value]
        try:
            normal[str(name)] = [str(item) for item in values]
        except ValueError:  # an int of more digits than Python writes out (sys.get_int_max_str_digits)
            raise invalid(str(name), "too_large") from None
    return normal


def first(query: Query, name: str) -> str | None:
    values = query.get(name)
    return values[0] if values else None


def _page_integer(query: Query, name: str, default: int, minimum: int) -> int:
    if (text := first(query, name)) is None:
        return default
    if not re.fullmatch(r"-?[0-9]+", text):  # no upper bound (docs/contract.md): any number of digits
        raise invalid(name, "integer")
    try:
        value = int(text)
    except ValueError:  # more digits than Python turns into an int (sys.get_int_max_str_digits)
        raise invalid(name, "too_large") from None
    if value < minimum:
        raise invalid(name, "minimum", minimum=minimum)
    return value


@dataclasses.dataclass(frozen=True)
class PageRequest:
    """A validated page, size and sort (docs/contract.md, Paging)."""

    number: int
    size: int
    order: tuple  # ((column, "ASC" | "DESC"), ...), primary first

    @property
    def offset(self) -> int:
        return self.number * self.size

    def order_by(self) -> str:
        """The ORDER BY clause; a final tie-break on id keeps pages stable."""
        terms = [f"{column} {direction}" for column, direction in self.order]
        return ", ".join(terms + [f"id {self.order[-1][1]}"])


def _page_and_size(query: Query) -> tuple[int, int]:
    """page (default 0, >= 0) and size (default DEFAULT_PAGE_SIZE, >= 1, capped at MAX_PAGE_SIZE)."""
    return _page_integer(query, "page", 0, 0), min(_page_integer(query, "size", DEFAULT_PAGE_SIZE, 1),
                                                   MAX_PAGE_SIZE)


def parse_page_request(query: Query, sortable: Mapping[str, str]) -> PageRequest:
    """page, size and sort (docs/contract.md, Paging); ``sortable``: API field name to column."""
    number, size = _page_and_size(query)
    order = []
    if len(query.get("sort", ())) > MAX_SORT_KEYS:
        raise invalid("sort", "sort_keys", maximum=MAX_SORT_KEYS)
    for text in query.get("sort", ()):
        field, comma, direction = text.partition(",")
        if field not in sortable:
            raise invalid("sort", "sort_field", value=field[:40], choices=", ".join(sortable))
        if comma and direction.upper() not in ("ASC", "DESC"):  # in any case, as the document's pattern says
            raise invalid("sort", "sort_direction")
        order.append((sortable[field], (direction or "asc").upper()))
    return PageRequest(number, size, tuple(order) or (("created_at", "DESC"),))


def filter_time(text: str, name: str) -> tuple:
    if (parsed := parse_time(text)) is None:
        raise invalid(name, "time")
    return (parsed,)


@dataclasses.dataclass(frozen=True)
class ListFilter:
    """One query parameter of a list: the rows it keeps (``clauses``, one ? each) for the values ``read``
    makes of the parameter's first value, when given; its ``choices``. The list and OpenAPI both read it."""

    clauses: tuple[str, ...]
    read: Callable[[str, str], tuple]
    choices: tuple[str, ...] = ()
    counted: bool = False  # the triggers keep a count per value (``counter:value``, ListQuery.total)

    @classmethod
    def one_of(cls, column: str, choices: Sequence[str], *, counted: bool = False) -> ListFilter:
        def read(value: str, name: str) -> tuple:
            if value not in choices:
                raise invalid(name, "one_of", choices=", ".join(choices))
            return (value,)
        return cls((f"{column} = ?",), read, tuple(choices), counted)


FROM_FILTER = ListFilter(("created_at >= ?",), filter_time)
TO_FILTER = ListFilter(("created_at < ?",), filter_time)


class ListQuery:
    """One list's query, built one way: the rows of ``table`` an owner holds (in any of ``columns``), narrowed
    by ``narrow``, counted (``total``), one page ordered and cut (``page``)."""

    def __init__(self, table: str, owner_id: str, *columns: str, counter: str | None = None) -> None:
        self.table, self.owner_id, self.columns, self.counter = table, owner_id, columns, counter
        self.clauses: list[str] = []
        self.params: list = []
        self.counted: list[str] = []  # values of the filters the counters are kept by

    def narrow(self, filters: Mapping[str, ListFilter], query: Query) -> None:
        """Keep the rows each filter given in ``query`` keeps (a wrong value: S012 naming it)."""
        for name, list_filter in filters.items():
            if (given := first(query, name)) is None:
                continue
            for clause, value in zip(list_filter.clauses, list_filter.read(given, name), strict=True):
                self.clauses.append(clause)
                self.params.append(value)
                if list_filter.counted:
                    self.counted.append(str(value))

    def select(self) -> tuple[str, list]:
        """The matching rows as SQL and its parameters: a SELECT per owner column, merged by
        SQLite (a wallet is either side of a transfer, never both: two index-ordered halves)."""
        selects = [" AND ".join([f"SELECT * FROM {self.table} WHERE {column} = ?", *self.clauses])
                   for column in self.columns]
        return " UNION ALL ".join(selects), [p for _ in self.columns for p in (self.owner_id, *self.params)]

    def total(self, conn: sqlite3.Connection) -> int:
        """How many rows match: the triggers' count when only counted filters are used, else SQLite's."""
        if self.counter is not None and len(self.counted) == len(self.params):  # (every filter counted)
            row = conn.execute("SELECT n FROM counters WHERE owner_id = ? AND name = ?",
                               (self.owner_id, ":".join([self.counter, *self.counted]))).fetchone()
            return row[0] if row else 0
        sql, params = self.select()
        return conn.execute(f"SELECT count(*) FROM ({sql})", params).fetchone()[0]

    def page(self, conn: sqlite3.Connection, page: PageRequest, total: int) -> list:
        if page.offset >= total:  # past the last page: no query, no OFFSET overflow
            return []
        sql, params = self.select()
        return conn.execute(f"{sql} ORDER BY {page.order_by()} LIMIT ? OFFSET ?",
                            [*params, page.size, page.offset]).fetchall()


def page_response(items: list, request: PageRequest, total: int) -> dict:
    """The page object of docs/contract.md: content plus accurate page metadata."""
    return {"content": items, "page": {"size": request.size, "number": request.number, "totalElements": total,
                                       "totalPages": -(-total // request.size)}}


###############################################################################
# The ledger's invariants ######################################################
###############################################################################

# Each a query returning the rows that break it (WalletService.audit): (check, detail template over the row,
# SQL). Sums of money are exact_sum's, decimal text: ten wallets of 10^18 minor units sum past int64.
_SIGNED_FLOW = "CASE f.direction WHEN 'CREDIT' THEN f.amount ELSE -f.amount END"
_AUDITS = (
    ("conservation", "{currency}: deposits - withdrawals = {external}, balances sum to {balances}",
     ("SELECT w.currency, exact_sum(w.balance) AS balances,"
     "       coalesce((SELECT exact_sum(CASE f.type WHEN 'DEPOSIT' THEN f.amount ELSE -f.amount END)"
     "                   FROM flows f JOIN wallets v ON v.id = f.wallet_id"
     "                  WHERE v.currency = w.currency AND f.type IN ('DEPOSIT', 'WITHDRAWAL')), '0')"
     "         AS external"
     "  FROM wallets w GROUP BY w.currency HAVING balances <> external")),
    ("negative", "wallet {id}: balance {balance}, pending {pending}",
     "SELECT id, balance, pending FROM wallets WHERE balance < 0 OR pending < 0 OR balance - pending < 0"),
    ("flows_sum", "wallet {id}: flows sum to {flows}, balance is {balance}",
     (f"SELECT w.id, w.balance, exact_sum({_SIGNED_FLOW}) AS flows FROM wallets w"
     "  LEFT JOIN flows f ON f.wallet_id = w.id GROUP BY w.id HAVING flows <> CAST(w.balance AS TEXT)")),
    ("running_balance", "flow {id} of wallet {wallet_id}: {before} then {signed} gives {balance_after}",
     (f"SELECT id, wallet_id, before, signed, balance_after FROM ("
     f"  SELECT f.id, f.wallet_id, f.balance_after, {_SIGNED_FLOW} AS signed,"
     "         coalesce(lag(f.balance_after) OVER (PARTITION BY f.wallet_id ORDER BY f.created_at, f.id), 0)"
     "           AS before"
     "    FROM flows f) WHERE before + signed <> balance_after")),
    ("newest_flow", "wallet {id}: newest flow says {balance_after}, balance is {balance}",
     ("SELECT w.id, w.balance, (SELECT f.balance_after FROM flows f WHERE f.wallet_id = w.id"
     "                         ORDER BY f.created_at DESC, f.id DESC LIMIT 1) AS balance_after"
     "  FROM wallets w WHERE balance_after IS NOT NULL AND balance_after <> w.balance")),
    ("pending", "wallet {id}: pending {pending}, PENDING orders hold {held}",
     ("SELECT w.id, w.pending, coalesce((SELECT exact_sum(t.amount) FROM transfers t"
     "                                   WHERE t.source_wallet_id = w.id AND t.status = 'PENDING'), '0')"
     "         AS held"
     "  FROM wallets w WHERE held <> CAST(w.pending AS TEXT)")),
    ("order_flows", "order {id} ({status}): {outs} TRANSFER_OUT and {ins} TRANSFER_IN flows",
     ("SELECT t.id, t.status,"
      "       coalesce(sum(f.type = 'TRANSFER_OUT' AND f.wallet_id = t.source_wallet_id"
      "                    AND f.amount = t.amount), 0) AS outs,"
      "       coalesce(sum(f.type = 'TRANSFER_IN' AND f.wallet_id = t.target_wallet_id"
      "                    AND f.amount = t.amount), 0) AS ins,"
      "       count(f.id) AS flows"
      "  FROM transfers t LEFT JOIN flows f ON f.transfer_id = t.id GROUP BY t.id"
      " HAVING (t.status = 'COMPLETED' AND (outs <> 1 OR ins <> 1 OR flows <> 2))"
      "    OR (t.status <> 'COMPLETED' AND flows <> 0)")),
    ("counters", "counter {owner_id} {name}: {n}, rows {actual}",
     ("WITH actual (owner_id, name, n) AS ("
     "  SELECT workspace_id, 'transfers', count(*) FROM transfers GROUP BY workspace_id"
     "  UNION ALL SELECT workspace_id, 'transfers:' || status, count(*) FROM transfers GROUP BY 1, 2"
     "  UNION ALL SELECT wallet, 'transfers', count(*) FROM (SELECT source_wallet_id AS wallet FROM transfers"
     "            UNION ALL SELECT target_wallet_id FROM transfers) GROUP BY wallet"
     "  UNION ALL SELECT wallet, 'transfers:' || status, count(*) FROM ("
     "            SELECT source_wallet_id AS wallet, status FROM transfers"
     "            UNION ALL SELECT target_wallet_id, status FROM transfers) GROUP BY 1, 2"
     "  UNION ALL SELECT wallet_id, 'flows', count(*) FROM flows GROUP BY wallet_id"
     "  UNION ALL SELECT wallet_id, 'flows:' || type, count(*) FROM flows GROUP BY 1, 2)"
     " SELECT owner_id, name, n, actual FROM ("
     "   SELECT c.owner_id, c.name, c.n, coalesce(a.n, 0) AS actual FROM counters c"
     "     LEFT JOIN actual a ON a.owner_id = c.owner_id AND a.name = c.name"
     "   UNION ALL SELECT a.owner_id, a.name, 0, a.n FROM actual a"
     "     WHERE NOT EXISTS (SELECT 1 FROM counters c WHERE c.owner_id = a.owner_id AND c.name = a.name))"
     " WHERE n <> actual")),
    ("biz_id", "workspace {workspace_id}: bizId {biz_id} used {n} times",
     "SELECT workspace_id, biz_id, count(*) AS n FROM transfers GROUP BY workspace_id, biz_id HAVING n > 1"),
)


###############################################################################
# Wallets and transfers ########################################################
###############################################################################

WALLET_SORTS = {"createdAt": "created_at", "updatedAt": "updated_at", "name": "name",
                "currency": "currency", "status": "status", "balance": "balance"}
TRANSFER_SORTS = {"createdAt": "created_at", "updatedAt": "updated_at", "amount": "amount",
                  "status": "status"}
FLOW_SORTS = {"createdAt": "created_at", "amount": "amount", "type": "type"}


def _text(value: Any, field: str, maximum: int, minimum: int = 1) -> str:
    if not isinstance(value, str):
        raise invalid(field, "string")
    if not minimum <= len(value) <= maximum:
        raise invalid(field, "length" if minimum else "max_length", maximum=maximum)
    if "\0" in value:  # SQLite's length() stops at a NUL: refused before it can trip a CHECK
        raise invalid(field, "nul")
    return value


def _biz_id(value: Any, field: str = "bizId") -> str:
    if not isinstance(value, str):
        raise invalid(field, "string")
    if not _ID.fullmatch(value):
        raise invalid(field, "biz_id")
    return value


def ip_whitelist_entries(value: Any, field: str = "ipWhitelist") -> list[str]:
    """A key's whitelist as stored: each entry an address or a CIDR block without host bits, at
    least one (None, not an empty list, means no whitelist); S012 naming the entry otherwise."""
    entries = [value] if isinstance(value, str) else value
    if not isinstance(entries, list | tuple):
        raise invalid(field, "array")
    if not entries:
        raise invalid(field, "empty_whitelist")
    kept = []
    for entry in entries:
        try:
            kept.append(str(parse_network(entry)))
        except HostBitsSet as wide:
            raise invalid(field, "host_bits", value=str(entry)[:60], network=str(wide.network)) from None
        except ValueError:
            raise invalid(field, "ip", value=str(entry)[:60]) from None
    return list(dict.fromkeys(kept))


def api_key_scopes(value: Any, field: str = "scopes") -> list[str]:
    """A key's scopes as stored: each of SCOPES, at least one, each once; else S012."""
    if not isinstance(value, Iterable):
        raise invalid(field, "array")
    scopes = [value] if isinstance(value, str) else list(value)
    for scope in scopes:
        if scope not in SCOPES:
            raise invalid(field, "scope", value=str(scope)[:40], choices=", ".join(SCOPES))
    if not scopes:
        raise invalid(field, "required")
    return list(dict.fromkeys(scopes))


def _currency_filter(currency: str, name: str) -> tuple:
    currency_exponent(currency)
    return (currency,)


# Each list's filters (docs/contract.md), by query parameter, in the order they are checked.
WALLET_FILTERS = {"currency": ListFilter(("currency = ?",), _currency_filter),
                  "status": ListFilter.one_of("status", WALLET_STATUSES)}
FLOW_FILTERS = {"type": ListFilter.one_of("type", FLOW_TYPES, counted=True),
                "direction": ListFilter.one_of("direction", FLOW_DIRECTIONS),
                "createdFrom": FROM_FILTER, "createdTo": TO_FILTER}
TRANSFER_FILTERS = {"status": ListFilter.one_of("status", TRANSFER_STATUSES, counted=True),
                    "createdFrom": FROM_FILTER, "createdTo": TO_FILTER,
                    "bizIdPrefix": ListFilter(("biz_id >= ?", "biz_id < ?"),
                                              lambda prefix, name: (_biz_id(prefix, name), prefix + "\x7f"))}


class TransferRequest(NamedTuple):
    """A transfer's values, checked (``checked``): what ``WalletService.transfer_unit`` moves."""

    source: str
    target: str
    amount: int  # minor units
    currency: str
    biz_id: str | None
    description: str | None

    @classmethod
    def checked(cls, source_wallet_id: Any, target_wallet_id: Any, amount: Any, currency: Any,
                biz_id: Any = None, description: Any = None) -> TransferRequest:
        """Check a transfer's values; S012 naming the first bad field (as the API names it)."""
        source = _text(source_wallet_id, "sourceWalletId", ID_MAX)
        target = _text(target_wallet_id, "targetWalletId", ID_MAX)
        minor = parse_amount(amount, currency)  # (the currency first; a number is never an amount: S012)
        if biz_id is not None:
            _biz_id(biz_id)
        if description is not None:
            if not isinstance(description, str):
                raise invalid("description", "string")
            if len(description) > DESCRIPTION_MAX:
                raise invalid("description", "max_length", maximum=DESCRIPTION_MAX)
        return cls(source, target, minor, currency, biz_id, description)

    def replayed_by(self, existing: sqlite3.Row) -> sqlite3.Row:
        """The order already made with this bizId, if it is this request again; else T2004."""
        same = (existing["source_wallet_id"], existing["target_wallet_id"], existing["amount"],
                existing["currency"], existing["description"]) == (
                self.source, self.target, self.amount, self.currency, self.description)
        if not same:
            raise IdempotencyConflict(biz_id=existing["biz_id"])
        return existing


###############################################################################
# Request journal ##############################################################
###############################################################################

class Verdict(enum.StrEnum):
    """A request's signature, as the journal keeps it."""

    VALID = "valid"
    INVALID = "invalid"
    UNCHECKED = "unchecked"


class JournalEntry(NamedTuple):
    """One request as the journal keeps it, before capping (path, canonical message: raw bytes)."""

    at: int
    method: str
    path: bytes
    query: str
    api_key: str | None
    status: int
    code: str | None
    canonical: bytes | None  # the canonical message the server computed
    signature: str  # valid, invalid or unchecked
    replayed: bool  # an idempotent replay
    headers: tuple
    body: bytes
    response_body: bytes
    elapsed_ms: float
    diagnosis: str | None  # the signing mistake a GA2012 matched


def _utf8_size(value: str) -> int:
    return len(value.encode("utf-8", "surrogatepass"))


def _utf8_cut(value: str, limit: int) -> str:
    """``value``'s first ``limit`` bytes as stored (UTF-8), no character cut in two."""
    return value.encode("utf-8", "surrogatepass")[:max(limit, 0)].decode("utf-8", "ignore")


def _capped(value: Any, limit: int) -> Any:
    """``value`` (bytes, or str as stored in UTF-8) cut to ``limit`` bytes, saying how many were cut."""
    if isinstance(value, bytes) and len(value) > limit:
        return value[:limit] + f"...[{len(value) - limit} more]".encode()
    if isinstance(value, str) and _utf8_size(value) > limit:
        cut = _utf8_cut(value, limit)
        return f"{cut}...[{_utf8_size(value) - _utf8_size(cut)} more]"
    return value


def _capped_headers(headers: Iterable[tuple[str, str]], limit: int) -> str:
    """The headers as a JSON list of pairs, cut together at ``limit`` bytes (escapes and UTF-8 counted)."""
    headers = tuple(headers)
    whole = _JSON.encode(headers)
    if len(whole) <= limit // 4 or _utf8_size(whole) <= limit:  # (as nearly every request's: 12 us less)
        return whole
    kept, left = [], limit
    for name, value in headers:
        if left <= 0:  # (it only falls: every header after it is left out too)
            break
        name = _utf8_cut(name, left)
        value = _capped(value, left - _utf8_size(_JSON.encode([name, ""])))
        if _utf8_size(_JSON.encode([name, value])) > left:  # escapes: the longest prefix that fits
            def size(end: int, name: str = name, value: str = value) -> int:  # (of the pair, value[:end])
                return _utf8_size(_JSON.encode([name, value[:end]]))
            value = value[:bisect.bisect_right(range(1, len(value) + 1), left, key=size)]
        kept.append((name, value))
        left -= _utf8_size(_JSON.encode([name, value]))
    if len(kept) < len(headers):
        kept.append(("X-Walletsvc-Cut", f"{len(headers) - len(kept)} more header(s)"))
    return _JSON.encode(kept)


def _same(value: Any, *limit: int) -> Any:
    return value


def _text_of(encoding: str) -> Callable[[Any], str | None]:
    return lambda value: None if value is None else bytes(value).decode(encoding, "replace")


# The journal's columns are JournalEntry's fields: how each is kept, if not as it comes (a field a client
# controls is cut at FIELD_BYTES), and shown, if not as kept, under its name (camelCase, or the one here).
_JOURNAL_KEPT: Mapping[str, Callable[[Any, int], Any]] = {
    **dict.fromkeys(("method", "path", "query", "api_key", "canonical", "body", "response_body"), _capped),
    "replayed": lambda value, limit: int(value), "headers": _capped_headers}
_JOURNAL_SHOWN: Mapping[str, Callable[[Any], Any]] = {
    "at": iso_time, "path": _text_of("latin-1"), "canonical": _text_of("latin-1"), "replayed": bool,
    "headers": lambda value: dict(json.loads(value)), "body": _text_of("utf-8"),
    "response_body": _text_of("utf-8")}
_JOURNAL_NAMES = {"canonical": "canonicalMessage"}
_JOURNAL_KEEP = tuple(_JOURNAL_KEPT.get(name, _same) for name in JournalEntry._fields)
_JOURNAL_SHOW = tuple((name, _JOURNAL_NAMES.get(name) or re.sub("_(.)", lambda match: match[1].upper(), name),
                       _JOURNAL_SHOWN.get(name, _same)) for name in JournalEntry._fields)


class Journal:
    """The last ``size`` requests the API surface received, in the database (every process shares it), with
    assertion helpers; entries and their caps: docs/sandbox.md (The journal)."""

    FIELD_BYTES = 2048
    _INSERT = (f"INSERT INTO journal (seq, {', '.join(JournalEntry._fields)}) VALUES"
               " (coalesce((SELECT max(seq) FROM journal), (SELECT journal_floor FROM sandbox)) + 1,"
               f" {', '.join('?' * len(JournalEntry._fields))}) RETURNING seq")
    TRIM_EVERY = 32  # entries between trims of a large journal (measured: a trim per insert costs 15 us)

    def __init__(self, db: Database, size: int) -> None:
        self.db, self.size, self.enabled = db, size, size > 0

    def record(self, conn: sqlite3.Connection, entry: JournalEntry) -> None:
        """Keep ``entry`` in ``conn``'s transaction and forget the oldest beyond ``size``."""
        cap = self.FIELD_BYTES
        values = tuple(keep(value, cap) for keep, value in zip(_JOURNAL_KEEP, entry, strict=True))
        seq = conn.execute(self._INSERT, values).fetchone()[0]
        if seq > self.size and (self.size < 2 * self.TRIM_EVERY or seq % self.TRIM_EVERY == 0):
            conn.execute("DELETE FROM journal WHERE seq <= ?", (seq - self.size,))

    def clear(self) -> None:
        """Forget every entry (seq goes on from where it was)."""
        self.db.write([self.emptied], durable=False)

    @staticmethod
    def emptied(conn: sqlite3.Connection, api_keys: Sequence[str] | None = None) -> None:
        """The unit that forgets every entry, or those of ``api_keys``: seq goes on, never back."""
        conn.execute("UPDATE sandbox SET journal_floor = max(journal_floor,"
                     " coalesce((SELECT max(seq) FROM journal), 0))")
        if api_keys is None:
            conn.execute("DELETE FROM journal")
        else:
            conn.execute(f"DELETE FROM journal WHERE api_key IN ({', '.join('?' * len(api_keys))})", api_keys)

    def entries(self, method: str | None = None, path: str | None = None, *, after: int | None = None,
                **criteria: Any) -> list[dict]:
        """Matching entries, oldest first (``request_misses``): ``path`` may be a glob; ``query``,
        ``headers``, ``body`` (a JSON subset), ``code``; ``after``: seq greater than it."""
        sql = "SELECT * FROM journal WHERE seq > ? AND seq > (SELECT max(seq) FROM journal) - ?"
        params = [min(after or 0, 1 << 62), self.size]  # (up to TRIM_EVERY more are kept until the next trim)
        if method not in (None, "*"):
            sql += " AND method = ?"
            params.append(method.upper())
        with self.db.connection() as conn:
            rows = conn.execute(sql + " ORDER BY seq", params).fetchall()
        wanted = {"method": method, "path": path, **criteria}
        return [entry for entry in map(_journal_entry, rows) if not request_misses(entry, wanted)]

    def assert_called(self, method: str | None = None, path: str | None = None, *, times: int | None = None,
                      at_least: int | None = None, never: bool = False, **criteria: Any) -> list[dict]:
        """Fail unless matching requests were received (at least once, ``times``, ``at_least`` or ``never``),
        listing the closest entries and what differed, as WireMock does."""
        __tracebackhide__ = True  # pytest shows the test's line, not walletsvc's frames
        calls = self.entries(method, path, **criteria)
        times = 0 if never else times
        if times is not None:
            passed, wanted = len(calls) == times, f"{times} time(s)"
        else:
            at_least = 1 if at_least is None else at_least
            passed, wanted = len(calls) >= at_least, f"at least {at_least} time(s)"
        if not passed:
            raise AssertionError(self.describe_miss(wanted, len(calls),
                                                    {"method": method, "path": path, **criteria}))
        return calls

    def assert_not_called(self, method: str | None = None, path: str | None = None, **criteria: Any) -> None:
        """Fail if a matching request was received."""
        __tracebackhide__ = True
        self.assert_called(method, path, never=True, **criteria)

    def describe_miss(self, wanted: str, got: int, criteria: Mapping[str, Any]) -> str:
        shown = " ".join(f"{name}={value!r}" for name, value in criteria.items() if value is not None)
        near = sorted(((request_misses(entry, criteria), entry) for entry in self.entries()),
                      key=lambda pair: len(pair[0]))[:3]
        lines = [f"  {e['method']} {e['path']} -> {e['status']} {e['code']}: "
                 f"{'; '.join(misses) or 'matches'}" for misses, e in near] or ["  (the journal is empty)"]
        return (f"expected a request with {shown} {wanted}, got {got}; the closest entries:\n"
                + "\n".join(lines))


def _journal_entry(row: sqlite3.Row) -> dict:
    """A journal row as the Python API and /_admin/journal show it."""
    return {"seq": row["seq"], **{shown: show(row[name]) for name, shown, show in _JOURNAL_SHOW}}


def request_misses(request: Mapping[str, Any], criteria: Mapping[str, Any]) -> list[str]:
    """What of ``criteria`` a request (a journal entry's shape) does not match (empty: a match), by the
    matchers journal assertions and fault rules share (docs/sandbox.md, Faults)."""
    misses = []
    method, path = criteria.get("method"), criteria.get("path")
    if method not in (None, "*") and request["method"] != method.upper():
        misses.append(f"method is {request['method']}")
    if path is not None and not fnmatch.fnmatchcase(request["path"], path):
        misses.append(f"path is {request['path']}")
    if criteria.get("query"):
        query = {name: values[0] for name, values in parse_query_string(request.get("query") or "").items()}
        misses += [f"query {name} is {query.get(name)!r}" for name, value in criteria["query"].items()
                   if query.get(name) != str(value)]
    if criteria.get("headers"):
        headers = {name.lower(): value for name, value in (request.get("headers") or {}).items()}
        misses += [f"header {name} is {headers.get(name.lower())!r}"
                   for name, value in criteria["headers"].items() if headers.get(name.lower()) != str(value)]
    if criteria.get("body") is not None:
        misses += filter(None, [_body_miss(criteria["body"], request.get("body"))])
    if criteria.get("code") is not None and request.get("code") != str(criteria["code"]):
        misses.append(f"code is {request.get('code')}")
    return misses


def _body_miss(expected: Any, body: str | None) -> str | None:
    """The first field where the JSON ``body`` differs from the subset ``expected``, with both values, else
    None; a body that cannot be read (however deep) does not match."""
    try:
        actual = json.loads(body or "null")
    except (ValueError, RecursionError):
        return f"body is not JSON: {(body or '')[:80]!r}"
    try:
        return _json_difference(expected, actual, "body")
    except RecursionError:
        return "body is nested too deep to compare"


def _json_difference(expected: Any, actual: Any, where: str) -> str | None:
    def shown(value: Any) -> str:
        text = json.dumps(value, ensure_ascii=False)
        return text if len(text) <= 60 else text[:57] + "..."

    if not isinstance(expected, dict):
        return None if expected == actual else f"{where} is {shown(actual)}, expected {shown(expected)}"
    if not isinstance(actual, dict):
        return f"{where} is {shown(actual)}, expected an object"
    for name, value in expected.items():
        if name not in actual:
            return f"{where}.{name} is missing, expected {shown(value)}"
        if difference := _json_difference(value, actual[name], f"{where}.{name}"):
            return difference
    return None


###############################################################################
# Fault rules ##################################################################
###############################################################################

class FaultAction(enum.StrEnum):
    """What a fault rule does to a request it matches (``Faults``)."""

    ERROR = "error"  # answers a forced code instead of running the request
    COMMIT_THEN_FAIL = "commit_then_fail"  # runs the request (a transfer commits), answers S500
    COMMIT_THEN_DROP = "commit_then_drop"  # runs it and drops the connection mid-response
    LATENCY = "latency"  # only delays


class FaultRule(NamedTuple):
    """A fault rule as the request path reads it (``Faults.take``)."""

    id: str  # fault_N
    number: int
    action: FaultAction
    method: str
    path: str
    workspace_id: str | None
    code: str | None
    status: int | None
    latency: float
    query: Mapping | None
    headers: Mapping | None
    body: Mapping | None

    @classmethod
    def stored(cls, number: int, rule: str) -> FaultRule:
        """The rule numbered ``number`` as its row keeps it (JSON, as ``Faults.add`` answers it)."""
        fields = json.loads(rule)
        return cls(f"fault_{number}", number, FaultAction(fields["action"]), fields["method"], fields["path"],
                   fields["workspaceId"], fields["code"], fields["status"], fields["latency"],
                   fields["query"], fields["headers"], fields["body"])


class Faults:
    """Fault rules applied to authenticated /api/ requests that match them, kept in the database for every
    process on the file (docs/sandbox.md, Faults; One sandbox, however many processes)."""

    MAX_RULES = 100
    MAX_TIMES = 2**31  # (None: always)
    MAX_LATENCY = 60  # seconds
    STATUSES = (400, 599)  # the statuses a rule may force

    def __init__(self, db: Database, magic_values: bool = False) -> None:
        self.db = db
        self.builtin = MAGIC_RULES if magic_values else ()  # tried first, never spent, never listed
        # (fault_version, the rules, those seen spent) as this process last read them: spent stays spent
        self._cache: tuple[int, list[FaultRule], set[int]] = (-1, [], set())

    def add(self, *, action: FaultAction | str = FaultAction.ERROR, method: str = "*", path: str = "*",
            workspace_id: str | None = None, code: str | None = None, status: int | None = None,
            latency: float = 0.0, times: int | None = None, query: Mapping | None = None,
            headers: Mapping | None = None, body: Mapping | None = None) -> dict:
        """Add a rule (see the class); the rule as stored, with its ``id`` (matchers: ``request_misses``)."""
        if action not in tuple(FaultAction):
            raise invalid("action", "one_of", choices=", ".join(FaultAction))
        if isinstance(code, str) and not 1 <= len(code) <= 64:  # whatever the action (/openapi.json)
            raise invalid("code", "length", maximum=64)
        if action == FaultAction.ERROR:
            code, status = self._error(code, status)
        for name, value in (("method", method), ("path", path), ("code", code)):
            if value is not None and not isinstance(value, str):
                raise invalid(name, "string")
        self._check_numbers(status, latency, times)
        for name, value in (("query", query), ("headers", headers), ("body", body)):
            if value is not None and not isinstance(value, dict):
                raise invalid(name, "type", kinds="object")
        rule = {"action": action, "method": method.upper(), "path": path, "workspaceId": workspace_id,
                "code": code, "status": status, "latency": float(latency), "times": times, "query": query,
                "headers": headers, "body": body}
        def add(conn: sqlite3.Connection) -> int:
            count, number = conn.execute("SELECT fault_rules, fault_next + 1 FROM sandbox").fetchone()
            if count >= self.MAX_RULES:
                raise invalid("faults", "too_many", maximum=self.MAX_RULES)
            conn.execute("INSERT INTO fault_rules (id, rule, times) VALUES (?, ?, ?)",
                         (number, json.dumps(rule), times))
            self.changed(conn)
            return number
        number = self.db.write([add], durable=False)[0]
        return {"id": f"fault_{number}", **rule, "fired": 0}

    @staticmethod
    def _error(code: Any, status: Any) -> tuple[Any, Any]:
        """An error rule's code (S500 if none) and status (the catalog's for a code it has)."""
        code = code or "S500"
        known = ERRORS_BY_CODE.get(code)
        if known is None and status is None:
            raise invalid("status", "status_of_code", code=str(code)[:64])
        return code, status or known.status

    @classmethod
    def _check_numbers(cls, status: Any, latency: Any, times: Any) -> None:
        low, high = cls.STATUSES
        if status is not None and not (isinstance(status, int) and low <= status <= high):
            raise invalid("status", "one_of", choices=f"{low}-{high}")
        if not isinstance(latency, (int, float)) or not 0 <= latency <= cls.MAX_LATENCY:
            raise invalid("latency", "one_of", choices=f"0-{cls.MAX_LATENCY} seconds")
        if times is not None and not (isinstance(times, int) and not isinstance(times, bool) and times >= 1):
            raise invalid("times", "minimum", minimum=1)
        if times is not None and times > cls.MAX_TIMES:
            raise invalid("times", "maximum", maximum=cls.MAX_TIMES)

    def rules(self) -> list[dict]:
        """The rules in force, in the order they are tried, each with how often it ``fired``."""
        with self.db.connection() as conn:
            rows = conn.execute("SELECT id, rule, fired FROM fault_rules ORDER BY id").fetchall()
        return [{"id": f"fault_{number}", **json.loads(rule), "fired": fired} for number, rule, fired in rows]

    def remove(self, fault_id: str) -> None:
        """Remove one rule; S404 if there is none with that id."""
        number = (fault_id[len("fault_"):] if isinstance(fault_id, str) and fault_id.startswith("fault_")
                  else "")
        def remove(conn: sqlite3.Connection) -> None:
            if not number.isdigit() or not conn.execute("DELETE FROM fault_rules WHERE id = ?",
                                                        (int(number[:18]),)).rowcount:
                raise not_found("fault rule")
            self.changed(conn)
        self.db.write([remove], durable=False)

    def clear(self) -> None:
        """Remove every rule; ids start again from fault_1."""
        self.db.write([self.cleared], durable=False)

    @staticmethod
    def cleared(conn: sqlite3.Connection, workspace_id: str | None = None) -> None:
        """The unit that removes every rule (ids restart at fault_1), or one workspace's (its reset)."""
        if workspace_id is None:
            conn.execute("DELETE FROM fault_rules")
            conn.execute("UPDATE sandbox SET fault_next = 0")
        else:
            conn.execute("DELETE FROM fault_rules WHERE json_extract(rule, '$.workspaceId') = ?",
                         (workspace_id,))
        Faults.changed(conn)

    @staticmethod
    def changed(conn: sqlite3.Connection) -> None:
        """After the rules changed: their count anew, numbering past the highest, and a new version."""
        conn.execute("UPDATE sandbox SET fault_rules = (SELECT count(*) FROM fault_rules),"
                     " fault_next = max(fault_next, coalesce((SELECT max(id) FROM fault_rules), 0)),"
                     " fault_version = fault_version + 1")

    def take(self, method: str, path: str, workspace_id: str,
             request: Callable[[], Mapping[str, Any]] = dict) -> FaultRule | None:
        """The first unspent rule matching this request, counted as fired once across processes (in the
        database); asked only when the key's lookup says a rule is in force."""
        _, rules, spent = self._rules()
        for rule in (*self.builtin, *rules):
            if rule.number in spent or not (
                    rule.method in ("*", method) and fnmatch.fnmatchcase(path, rule.path)
                    and rule.workspace_id in (None, workspace_id)):
                continue
            matchers = {"query": rule.query, "headers": rule.headers, "body": rule.body}
            if any(value is not None for value in matchers.values()) and request_misses(request(), matchers):
                continue
            if rule.number < 0:  # (built in)
                return rule
            fired = self.db.write([lambda conn, number=rule.number: conn.execute(
                "UPDATE fault_rules SET fired = fired + 1 WHERE id = ? AND (times IS NULL OR fired < times)",
                (number,)).rowcount], durable=False)[0]
            if fired:
                return rule
            spent.add(rule.number)  # (the set of this version of the rules)
        return None

    def _rules(self) -> tuple[int, list[FaultRule], set[int]]:
        """The rules in force, read again only when another change made them stale."""
        with self.db.connection() as conn:
            version, count = conn.execute("SELECT fault_version, fault_rules FROM sandbox").fetchone()
            if not count:
                return version, [], set()
            if version != self._cache[0]:  # (a change after the version was read is read at the next)
                rows = conn.execute("SELECT id, rule FROM fault_rules ORDER BY id").fetchall()
                rules = [FaultRule.stored(number, rule) for number, rule in rows]
                self._cache = (version, rules, set())
        return self._cache


# The sandbox's magic values (the magic_values setting; docs/sandbox.md): built-in fault rules, decided
# before the handler as every rule is (numbered below 0; a magic rule's id is the detail it answers).
MAGIC_DECLINED, MAGIC_BUSY_WALLET = "666.66", "wal_magic_busy"
_DECLINED = f"A transfer of the magic amount {MAGIC_DECLINED} is always declined (magic_values)."
_BUSY = f"The magic wallet {MAGIC_BUSY_WALLET} is always busy (magic_values)."
_TRANSFER = ("POST", "/api/v1/transfer/command/create")
MAGIC_RULES = tuple(
    FaultRule(why, -1, FaultAction.ERROR, method, path, None, code, ERRORS_BY_CODE[code].status, 0.0, None,
              None, body)
    for method, path, body, code, why in (
        (*_TRANSFER, {"amount": MAGIC_DECLINED}, "T2001", _DECLINED),
        ("*", f"*/{MAGIC_BUSY_WALLET}", None, "S503", _BUSY),
        ("*", f"*/{MAGIC_BUSY_WALLET}/*", None, "S503", _BUSY),
        (*_TRANSFER, {"sourceWalletId": MAGIC_BUSY_WALLET}, "S503", _BUSY),
        (*_TRANSFER, {"targetWalletId": MAGIC_BUSY_WALLET}, "S503", _BUSY)))


def forced_error(rule: FaultRule) -> WalletError:
    """The error a fault rule forces: the catalog's, or an ad-hoc code and status."""
    cls = ERRORS_BY_CODE.get(rule.code)
    if rule.number < 0:  # (a magic value's)
        return cls(text=rule.id)
    if cls is None or cls.status != rule.status:
        cls = type("ForcedError", (WalletError,), {"code": rule.code, "status": rule.status,
                                                   "name": cls.name if cls else "FORCED_ERROR"})
    return cls(text=f"Forced by fault rule {rule.id}.")


###############################################################################
# Scenarios and the starting state #############################################
###############################################################################

# The tables of one workspace's world, parents first (what reset_workspace restores), each with the column
# that ties a row to the world and what it holds: the workspace's id, one of its wallets' ids, or either.
_WORLD_TABLES = {"workspaces": ("id", "workspace"), "members": ("workspace_id", "workspace"),
                 "api_keys": ("workspace_id", "workspace"), "wallets": ("workspace_id", "workspace"),
                 "transfers": ("workspace_id", "workspace"), "flows": ("wallet_id", "wallets"),
                 "counters": ("owner_id", "either")}
_ID_TABLES = ("workspaces", "members", "api_keys", "wallets")  # the tables whose ids a scenario may fix
# The tables of the sandbox's world: what save_start copies and reset restores.
_STARTING_STATE = (*_WORLD_TABLES, "ledger_clock")
# What WalletService.restore takes from a backup, parents first: the sandbox's world, its fault rules, and
# the starting state reset returns to (and of the sandbox's row, its clock and id sequence).
_RESTORED = (*_WORLD_TABLES, "fault_rules", *(f"start_{table}" for table in _STARTING_STATE),
             "start_sandbox", "world_starts", "start_scenario")


def _copy_backup(path: str, source: sqlite3.Connection) -> None:
    """Copy the backup at ``path`` into ``source`` (SQLite's backup API: one state of it), once found whole,
    of this schema version and with sane sandbox rows (``_backup_problem``)."""
    if not os.path.isfile(path):
        raise RuntimeError(f"no backup at {path}")
    try:
        with contextlib.closing(sqlite3.connect(
                f"file:{urllib.parse.quote(os.path.abspath(path))}?mode=ro", uri=True)) as backup:
            backup.backup(source)  # (one state of it, even if something writes to it meanwhile)
        problems = [row[0] for row in source.execute("PRAGMA integrity_check")]
        version = source.execute("SELECT version FROM schema_version").fetchone()
    except sqlite3.Error as exc:
        raise RuntimeError(f"{path} is no walletsvc database ({exc}): nothing was restored") from None
    if problems != ["ok"]:
        raise RuntimeError(f"{path} is malformed ({'; '.join(problems[:3])}): nothing was restored;"
                           " restore another backup")
    version = version and version[0]
    if version != schema_version():
        how = ((f"open it once with this walletsvc (walletsvc audit --db {path} upgrades it), then"
                " restore it") if isinstance(version, int) and 4 <= version < schema_version()
               else "restore it with the walletsvc that made it")
        raise RuntimeError(f"{path} has schema version {version}; this walletsvc restores"
                           f" {schema_version()}: {how}")
    if problem := _backup_problem(source):
        raise RuntimeError(f"{path}: {problem}: nothing was restored")


def _backup_problem(source: sqlite3.Connection) -> str | None:
    """What in a backup's sandbox rows walletsvc never writes (a hand-edited copy), else None: the ledger
    clock, the clock and id sequence, the fault rules."""
    clock = source.execute("SELECT last_ms, last_id FROM ledger_clock").fetchall()
    state = source.execute("SELECT clock_frozen_at, clock_offset, id_seed, id_drawn FROM sandbox").fetchall()
    if len(clock) != 1 or len(state) != 1:
        return "it has not one ledger_clock row and one sandbox row"
    (last_ms, last_id), (frozen_at, offset, seed, drawn) = clock[0], state[0]
    if not (isinstance(last_ms, int) and last_ms >= 0 and isinstance(last_id, str)
            and re.fullmatch("([0-9a-f]{32})?", last_id)):
        return "its ledger_clock row is not a time and an id"
    numbers = ((frozen_at is None or (isinstance(frozen_at, (int, float))
                                      and CLOCK_RANGE[0] <= frozen_at <= CLOCK_RANGE[1]))
               and isinstance(offset, (int, float)) and abs(offset) <= CLOCK_RANGE[1]
               and (seed is None or (isinstance(seed, int) and ID_SEEDS[0] <= seed <= ID_SEEDS[1]))
               and isinstance(drawn, int) and drawn >= 0)
    if not numbers:
        return "its sandbox row's clock or id sequence is out of range"
    for number, rule in source.execute("SELECT id, rule FROM fault_rules"):
        try:
            FaultRule.stored(number, rule)
        except (TypeError, ValueError, KeyError):
            return f"its fault rule {number} is no rule walletsvc wrote"
    return None


def _world_sql(verb: str, table: str, workspace_id: str, wallets: list[str]) -> tuple[str, list[str]]:
    """``verb`` (``SELECT *``, ``DELETE``) on ``table``'s rows of one workspace's world; its parameters."""
    column, holds = _WORLD_TABLES[table]
    ids = {"workspace": [workspace_id], "wallets": wallets, "either": [workspace_id, *wallets]}[holds]
    return f"{verb} FROM {table} WHERE {column} IN ({', '.join('?' * len(ids))})", ids


# Scenarios (docs/sandbox.md): each object's fields (no other is taken) and the kind each holds: a nested
# object or list of them (named as the field), an id with its type prefix, or a key of _SCENARIO_KINDS.
_SCENARIO_OBJECTS: Mapping[str, Mapping[str, str]] = {
    "scenario": {"workspaces": "list", "clock": "object", "settings": "settings"},
    "clock": {"at": "time", "frozen": "boolean"},
    "workspaces": {"id": "ws_", "name": "name", "members": "list", "keys": "list", "wallets": "list"},
    "members": {"id": "mem_", "name": "name"},
    "keys": {"id": "ak_", "secret": "secret", "scopes": "scopes", "member": "string",
             "ipWhitelist": "networks"},
    "wallets": {"id": "wal_", "name": "wallet_name", "currency": "currency", "balance": "amount",
                "status": "status"},
}
_SCENARIO_REQUIRED = {"scenario": ("workspaces",), "workspaces": ("name",), "members": ("name",),
                      "wallets": ("name", "currency")}


def _typed(check: Callable[[Any], bool], problem: str, **params: str) -> Callable[[Any, str], None]:
    """A kind's check that ``check(value)`` holds, else S012 ``problem`` naming the field."""
    def checked(value: Any, field: str) -> None:
        if not check(value):
            raise invalid(field, problem, **params)
    return checked


_scenario_object = _typed(lambda value: isinstance(value, Mapping), "type", kinds="object")


def _scenario_clock_time(value: Any, field: str) -> None:
    try:
        _clock_time(admin_time(value, field))
    except ValueError:
        raise invalid(field, "clock_range") from None


def _scenario_scopes(value: Any, field: str) -> None:
    _typed(_JSON_TYPES["array"], "array")(value, field)
    api_key_scopes(value, field)


_SCENARIO_KINDS: Mapping[str, Callable[[Any, str], Any]] = {
    "boolean": _typed(_JSON_TYPES["boolean"], "boolean"),
    "string": _typed(_JSON_TYPES["string"], "string"),
    "name": lambda value, field: _text(value, field, NAME_MAX),
    "wallet_name": lambda value, field: _text(value, field, NAME_MAX, minimum=0),
    "secret": _typed(lambda value: isinstance(value, str) and bool(_NONCE.fullmatch(value)), "secret"),
    "scopes": _scenario_scopes,
    "networks": ip_whitelist_entries,
    "currency": currency_exponent,
    "amount": _typed(_JSON_TYPES["string"], "scenario_amount"),
    "status": _typed(lambda value: value in WALLET_STATUSES, "one_of", choices=", ".join(WalletStatus)),
    "time": _scenario_clock_time,
    "settings": _scenario_object,  # each setting: once the whole scenario's ids are (_check_whole_scenario)
}


def check_scenario(scenario: Any, kind: str = "scenario", where: str = "") -> dict:
    """The scenario, checked: S012 naming the first wrong field by its path
    (``workspaces[0].wallets[2].currency``); a fixed id used twice is refused too."""
    _scenario_object(scenario, where or "scenario")
    fields = _SCENARIO_OBJECTS[kind]
    path = f"{where}." if where else ""
    for name in scenario:
        if name not in fields:
            raise invalid(path + name, "unknown_field")
    for name in _SCENARIO_REQUIRED.get(kind, ()):
        if scenario.get(name) is None:
            raise invalid(path + name, "required")
    for name, value in scenario.items():
        if fields[name] == "list":
            _typed(_JSON_TYPES["array"], "array")(value, path + name)
            for index, item in enumerate(value):
                check_scenario(item, name, f"{path}{name}[{index}]")
        elif fields[name] == "object":  # (its fields are _SCENARIO_OBJECTS[name])
            check_scenario(value, name, path + name)
        elif fields[name].endswith("_"):  # an id with its type prefix
            if not isinstance(value, str) or not value.startswith(fields[name]) or not _ID.fullmatch(value):
                raise invalid(path + name, "scenario_id", prefix=fields[name])
        else:
            _SCENARIO_KINDS[fields[name]](value, path + name)
    _SCENARIO_WHOLE.get(kind, lambda scenario, where: None)(scenario, where)
    return dict(scenario)


def _check_scenario_wallet(wallet: Mapping[str, Any], where: str) -> None:
    if wallet.get("balance") is not None and not _zero(wallet["balance"], wallet["currency"]):
        parse_amount(wallet["balance"], wallet["currency"], f"{where}.balance")


def _zero(amount: str, currency: str) -> bool:
    """Whether ``amount`` is zero as the currency writes it ("0", "0.00"): a balance, not a transfer's."""
    match = _DECIMAL.fullmatch(amount)
    return (bool(match) and not int(match.group(1)) and not int(match.group(2) or "0")
            and len(match.group(2) or "") <= CURRENCY_EXPONENTS[currency] and len(match.group(1)) == 1)


def _check_scenario_member(member: Mapping[str, Any], where: str) -> None:
    if member["name"] == OWNER_NAME:
        raise invalid(f"{where}.name", "taken", value=OWNER_NAME)


def _check_scenario_workspace(workspace: Mapping[str, Any], where: str) -> None:
    members = [OWNER_NAME, *(name for member in workspace.get("members", ())
                             for name in (member["name"], member.get("id")) if name)]
    for index, key in enumerate(workspace.get("keys", ())):
        if key.get("member", OWNER_NAME) not in members:
            raise invalid(f"{where}.keys[{index}].member", "one_of", choices=", ".join(members))


def _check_whole_scenario(scenario: Mapping[str, Any], where: str) -> None:
    """Its fixed ids each used once, then its settings: each a setting, in its range or choices."""
    _check_fixed_ids(scenario["workspaces"])
    for name, value in (scenario.get("settings") or {}).items():
        if name not in Settings.names():
            raise invalid(f"settings.{name}", "unknown_field")
        try:
            Settings().replace(**{name: value})
        except ValueError as exc:  # (its range, or its choices)
            raise invalid(f"settings.{name}", "setting", problem=str(exc).split(": ", 1)[-1]) from None


def _check_fixed_ids(workspaces: list) -> None:
    """A fixed id is used once in a scenario: S012 naming the second use (linear, however many)."""
    seen: set[str] = set()
    for index, workspace in enumerate(workspaces):
        items = [(f"workspaces[{index}]", workspace)] + [
            (f"workspaces[{index}].{part}[{number}]", item)
            for part in ("members", "keys", "wallets") for number, item in enumerate(workspace.get(part, ()))]
        for place, item in items:
            if item.get("id"):
                if item["id"] in seen:
                    raise invalid(f"{place}.id", "taken", value=item["id"])
                seen.add(item["id"])


# What a scenario's object must hold beyond its fields, checked once its fields are.
_SCENARIO_WHOLE: Mapping[str, Callable[[Mapping[str, Any], str], None]] = {
    "wallets": _check_scenario_wallet, "members": _check_scenario_member,
    "workspaces": _check_scenario_workspace, "scenario": _check_whole_scenario}


# The demo's fixed credentials, as stripe-mock's test key: `walletsvc request` and Client() use them
# when no WALLETSVC_URL / WALLETSVC_KEY / WALLETSVC_SECRET is set, so a first request needs nothing filled in.
DEMO_URL, DEMO_KEY, DEMO_SECRET = "http://127.0.0.1:8080", "ak_demo", "sk_demo"
# The built-in scenario: `walletsvc serve --demo` and the pytest sandbox start from it (the sandbox,
# like every world made over HTTP, with fresh ids and a fresh secret).
DEMO_SCENARIO: Mapping[str, Any] = {"workspaces": [{
    "name": "walletsvc demo", "keys": [{"id": DEMO_KEY, "secret": DEMO_SECRET, "scopes": list(SCOPES)}],
    "wallets": [{"name": "alice", "currency": "USD", "balance": "1000.00"},
                {"name": "bob", "currency": "USD", "balance": "1000.00"},
                {"name": "yen", "currency": "JPY", "balance": "100000"}]}]}


def read_scenario(source: str | os.PathLike | Mapping[str, Any]) -> dict:
    """A scenario from a TOML or JSON (``.json``) file, or a dict, checked (``check_scenario``); a ValueError
    names the file, the line and the field otherwise."""
    if isinstance(source, Mapping):
        return check_scenario(source)
    path = os.fspath(source)
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"scenario {path}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        scenario = json.loads(text) if path.endswith(".json") else tomllib.loads(text)
    except RecursionError:
        raise ValueError(f"scenario {path}: line {_too_deep(text, not path.endswith('.json'))}: nested deeper"
                         f" than a scenario can be (at most {SCENARIO_DEPTH} levels)") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"scenario {path}: line {exc.lineno}: {exc.msg}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"scenario {path}: {exc}") from None
    try:
        return check_scenario(scenario)
    except InvalidParameter as exc:
        try:
            line = _line_of(text, scenario, exc.params["field"])
        except (LookupError, TypeError, ValueError):  # a path it cannot follow: no line, still the field
            line = None
        raise ValueError(f"scenario {path}: {f'line {line}: ' if line else ''}{exc.detail()}") from None


SCENARIO_DEPTH = 8  # levels of [ and { a scenario's values need at most (an ipWhitelist in a key)


def _too_deep(text: str, toml: bool) -> int:
    """The line where brackets first nest deeper than SCENARIO_DEPTH (strings, TOML headers left out)."""
    depth = 0
    for number, line in enumerate(text.splitlines(), 1):
        if toml and line.lstrip().startswith("["):
            continue
        for char in re.sub(r'"(\\.|[^"\\])*"', "", line):
            depth += {"[": 1, "{": 1, "]": -1, "}": -1}.get(char, 0)
            if depth > SCENARIO_DEPTH:
                return number
    return 1


def _line_of(text: str, scenario: Any, field: str) -> int | None:
    """The line that sets ``field`` (``workspaces[0].wallets[2].currency``) in ``text``: the n-th line setting
    its key, in document order; a missing field: its object's first key."""
    steps = [int(index) if index else name for name, index in re.findall(r"([A-Za-z_]\w*)|\[(\d+)\]", field)]
    key, parent = steps[-1], scenario
    for step in steps[:-1]:
        parent = parent[step] if isinstance(parent, (dict, list)) else None
    if isinstance(parent, dict) and key not in parent:  # a required field missing: where its object starts
        if not parent or not steps[:-1]:
            return None
        path = "".join(f"[{step}]" if isinstance(step, int) else f".{step}"
                       for step in steps[:-1]).lstrip(".")
        return _line_of(text, scenario, f"{path}.{next(iter(parent))}")

    def setters(node: Any) -> Iterator[Any]:  # each object that sets the key, in document order
        for name, value in node.items() if isinstance(node, dict) else ():
            if name == key:
                yield node
            yield from setters(value)
        for item in node if isinstance(node, list) else ():
            yield from setters(item)
    count = next((count for count, node in enumerate(setters(scenario)) if node is parent), None)
    lines = [number for number, line in enumerate(text.splitlines(), 1)  # each place that sets the key
             for _ in re.finditer(rf"(^|[{{,])\s*\"?{re.escape(str(key))}\"?\s*[=:]", line)]
    return lines[count] if count is not None and count < len(lines) else None


###############################################################################
# The service ##################################################################
###############################################################################

def workspace_resource(row: sqlite3.Row) -> dict:
    return {"id": row["id"], "name": row["name"], "ownerMemberId": row["owner_member_id"],
            "createdAt": iso_time(row["created_at"])}


def member_resource(row: sqlite3.Row) -> dict:
    return {"id": row["id"], "workspaceId": row["workspace_id"], "name": row["name"],
            "role": row["role"], "createdAt": iso_time(row["created_at"])}


def api_key_resource(row: sqlite3.Row) -> dict:
    return {"apiKey": row["id"], "workspaceId": row["workspace_id"], "memberId": row["member_id"],
            "scopes": row["scopes"].split(), "enabled": bool(row["enabled"]),
            "ipWhitelist": json.loads(row["ip_whitelist"]) if row["ip_whitelist"] else None,
            "createdAt": iso_time(row["created_at"])}


def wallet_resource(row: sqlite3.Row) -> dict:
    return {"id": row["id"], "workspaceId": row["workspace_id"], "name": row["name"],
            "currency": row["currency"], "status": row["status"],
            "balance": format_amount(row["balance"], row["currency"]),
            "createdAt": iso_time(row["created_at"]), "updatedAt": iso_time(row["updated_at"])}


def balance_resource(row: sqlite3.Row) -> dict:
    currency = row["currency"]
    return {"walletId": row["id"], "currency": currency, "balance": format_amount(row["balance"], currency),
            "available": format_amount(row["balance"] - row["pending"], currency),
            "pending": format_amount(row["pending"], currency), "updatedAt": iso_time(row["updated_at"])}


def flow_resource(row: sqlite3.Row, currency: str) -> dict:
    return {"id": row["id"], "walletId": row["wallet_id"], "type": row["type"],
            "direction": row["direction"], "amount": format_amount(row["amount"], currency),
            "balanceAfter": format_amount(row["balance_after"], currency),
            "transferId": row["transfer_id"], "bizId": row["biz_id"],
            "counterpartyWalletId": row["counterparty_wallet_id"], "createdAt": iso_time(row["created_at"])}


def transfer_resource(row: sqlite3.Row) -> dict:
    return {"transferId": row["id"], "bizId": row["biz_id"],
            "sourceWalletId": row["source_wallet_id"], "targetWalletId": row["target_wallet_id"],
            "amount": format_amount(row["amount"], row["currency"]), "currency": row["currency"],
            "status": row["status"], "description": row["description"],
            "createdAt": iso_time(row["created_at"]), "updatedAt": iso_time(row["updated_at"]),
            "completedAt": iso_time(row["completed_at"])}


_WORKSPACE_SELECT = ("SELECT w.*, (SELECT id FROM members m WHERE m.workspace_id = w.id"
                     f" AND m.role = '{Role.OWNER}' ORDER BY created_at LIMIT 1) AS owner_member_id"
                     " FROM workspaces w")


def new_id(prefix: str, now_ms: int, random_bits: int) -> str:
    """A type-prefixed, time-ordered id: 12 hex digits of time (48 bits), 20 of randomness (80 bits)."""
    return f"{prefix}{now_ms:012x}{random_bits:020x}"


class IdSequence:
    """The ids and secrets of one write transaction (docs/sandbox.md): 48 bits of time (or sequence) and 80
    random or from the seed's sequence, each sorting after ``last_id``."""

    __slots__ = ("drawn", "first", "high", "low", "now", "seed")

    def __init__(self, conn: sqlite3.Connection, last_id: str, now: int) -> None:
        """At ``now`` (ms), after ``last_id``; the seed as the sandbox row keeps it (``seed_ids``)."""
        self.high, self.low = (int(last_id[-32:-20], 16), int(last_id[-20:], 16)) if last_id else (0, 0)
        self.seed, self.drawn = conn.execute("SELECT id_seed, id_drawn FROM sandbox").fetchone()
        self.now, self.first = now, self.drawn  # (how far the seed's sequence was drawn when it began)

    def next(self, prefix: str, now_ms: int) -> str:
        if self.seed is not None:
            self.high, self.low = self.high + 1, int.from_bytes(self._draw(10), "big")
        elif now_ms > self.high:
            self.high, self.low = now_ms, secrets.randbits(79)
        elif self.low + 1 < 1 << 80:
            self.low += 1
        else:
            self.high, self.low = self.high + 1, 0
        return new_id(prefix, self.high, self.low)

    def secret(self) -> str:
        if self.seed is None:
            return secrets.token_urlsafe(32)
        return base64.urlsafe_b64encode(self._draw(32)).decode().rstrip("=")

    def _draw(self, size: int) -> bytes:
        """The next ``size`` bytes of the seed's sequence, the same on every run and process."""
        self.drawn += 1
        return hashlib.blake2b(f"{self.seed}:{self.drawn - 1}".encode(), digest_size=size).digest()

    @property
    def last(self) -> str:
        return new_id("", self.high, self.low) if self.high else ""

    def keep(self, conn: sqlite3.Connection) -> None:
        """Before the transaction commits: note how far it drew from the seed (every process counts on)."""
        if self.drawn != self.first:
            conn.execute("UPDATE sandbox SET id_drawn = ?", (self.drawn,))


T = TypeVar("T")


class Tx(NamedTuple):
    """One write unit's transaction: the connection, the ledger's time (epoch ms) and the ids it issues."""

    conn: sqlite3.Connection
    now: int
    ids: IdSequence
    clock_reading: int  # the service clock's (``now``, the ledger's time, is never before the last write's)

    def new_id(self, prefix: str) -> str:
        """A fresh id, sorting after every id committed before: the id tie-break orders rows by commit."""
        return self.ids.next(prefix, self.now)


class Transferred(NamedTuple):
    """A transfer's outcome: the order, and whether it is an idempotent replay of an earlier request."""

    order: dict
    replayed: bool


class Clock:
    """The service clock (docs/sandbox.md): real time plus an offset, or frozen, kept in the service's
    database once bound (in memory till then), within CLOCK_RANGE."""

    def __init__(self, frozen_at: float | None = None) -> None:
        self._lock = threading.Lock()
        self._state = self.start = (None if frozen_at is None else _clock_time(frozen_at), 0.0)
        self._db: Database | None = None
        self._source: Callable[[], float] = time.time
        self.controllable = True

    @classmethod
    def following(cls, source: Callable[[], float]) -> Clock:
        """A clock that shows what ``source`` says: not moved from outside, kept in no database."""
        clock = cls()
        clock._source, clock.controllable = source, False
        return clock

    def bind(self, db: Database) -> None:
        """Keep the state in ``db`` from now on (its own, if it has one); another database's: ValueError."""
        if not self.controllable:
            return
        if self._db is not None and self._db is not db:
            raise ValueError("this Clock is another service's (its state lives in that service's database):"
                             " give each service a Clock of its own")
        if self._state != (None, 0.0):  # (a running clock needs no write: a locked database still starts)
            db.write([lambda conn: conn.execute(
                "UPDATE sandbox SET clock_frozen_at = ?, clock_offset = ?"
                " WHERE clock_frozen_at IS NULL AND clock_offset = 0 AND NOT has_start", self._state)],
                durable=False)
        self._db = db

    def reading_in(self, conn: sqlite3.Connection) -> float:
        """The time it shows now, as ``conn``'s transaction holds its state (``WalletService.unit``)."""
        return self() if self._db is None else self.reading_of(
            conn.execute("SELECT clock_frozen_at, clock_offset FROM sandbox").fetchone())

    def reading_of(self, row: Mapping[str, Any] | None) -> float:
        """The time it shows now, by ``row``'s clock columns (a request's key lookup: no read of its own)."""
        if row is None or self._db is None:
            return self()
        return self.reading(row["clock_frozen_at"], row["clock_offset"])

    def reading(self, frozen_at: float | None, offset: float) -> float:
        """The time this clock shows now in this state."""
        return frozen_at if frozen_at is not None else self._source() + offset

    def state(self) -> tuple[float | None, float]:
        """(frozen_at or None, offset): where the clock stands."""
        if self._db is None:
            return self._state
        return tuple(self._db.one("SELECT clock_frozen_at, clock_offset FROM sandbox"))

    def __call__(self) -> float:
        return self.reading(*self.state())

    @property
    def frozen(self) -> bool:
        return self.state()[0] is not None

    def _change(self, move: Callable[[float | None, float], tuple[float | None, float]]) -> None:
        """Apply ``move`` to the state, atomically (in the database when bound)."""
        if self._db is None:
            with self._lock:
                self._state = move(*self._state)
            return
        self._db.write([self.moved(move)], durable=False)

    @staticmethod
    def moved(move: Callable[[float | None, float], tuple[float | None, float]]) -> Unit:
        """The unit that applies ``move`` to the clock's state in the database."""
        def unit(conn: sqlite3.Connection) -> None:
            state = conn.execute("SELECT clock_frozen_at, clock_offset FROM sandbox").fetchone()
            conn.execute("UPDATE sandbox SET clock_frozen_at = ?, clock_offset = ?", move(*state))
        return unit

    @staticmethod
    def starting_at(at: float, frozen: bool) -> Callable[[float | None, float], tuple[float | None, float]]:
        """The move that starts a clock at ``at``, frozen or running (a frozen clock stays frozen)."""
        at = _clock_time(at)
        return lambda frozen_at, offset: ((at, offset) if frozen or frozen_at is not None
                                          else (None, at - time.time()))

    def freeze(self, at: float | None = None) -> None:
        """Stop the clock, at ``at`` (epoch seconds) or now."""
        self._change(self.starting_at(at, frozen=True) if at is not None
                     else lambda frozen_at, offset: (self.reading(frozen_at, offset), offset))

    def set(self, at: float) -> None:
        """Jump to ``at``; a running clock keeps running from there."""
        self._change(self.starting_at(at, frozen=False))

    def advance(self, seconds: float) -> None:
        """Move ``seconds`` forward (negative: back)."""
        seconds = float(seconds)
        self._change(lambda frozen_at, offset: self.starting_at(self.reading(frozen_at, offset) + seconds,
                                                                frozen=False)(frozen_at, offset))

    def unfreeze(self) -> None:
        """Run again from the frozen moment."""
        self._change(lambda frozen_at, offset: (None, frozen_at - time.time()) if frozen_at is not None
                     else (None, offset))

    def reset(self) -> None:
        """Back to where it started: the sandbox's starting clock when bound (see
        ``WalletService.save_start``), else real time, running (or frozen where it was made frozen)."""
        if self._db is None:
            self._change(lambda frozen_at, offset: self.start)
            return
        def reset(conn: sqlite3.Connection) -> None:
            start = conn.execute("SELECT clock_frozen_at, clock_offset FROM start_sandbox").fetchone()
            conn.execute("UPDATE sandbox SET clock_frozen_at = ?, clock_offset = ?", start or self.start)
        self._db.write([reset], durable=False)


class WalletService:
    """The service over one SQLite database, the sandbox's state included (docs/sandbox.md): thread- and
    process-safe; its time from ``clock``, ids from an IdSequence (docs/embedding.md)."""

    def __init__(self, database: str = ":memory:", *, settings: Settings | None = None,
                 clock: Callable[[], float] | None = None, **setting_values: Any) -> None:
        settings = settings or Settings()
        self.settings = settings.replace("service", **setting_values) if setting_values else settings
        self.clock = clock if isinstance(clock, Clock) else Clock.following(clock or time.time)
        self.db = Database(database, self.settings.busy_timeout, self.settings.synchronous)
        self.clock.bind(self.db)  # a controllable clock lives in the database (docs/sandbox.md)
        self.journal = Journal(self.db, self.settings.journal_size)
        self.faults = Faults(self.db, self.settings.magic_values)
        seed = self.settings.id_seed  # (drawn anew only when it changed: a restart keeps its place)
        if seed is not None and self.db.one("SELECT id_seed FROM sandbox")[0] != seed:
            self.db.write([lambda conn: conn.execute(
                "UPDATE sandbox SET id_seed = ?, id_drawn = 0 WHERE id_seed IS NOT ?", (seed, seed))],
                durable=False)

    def now_ms(self) -> int:
        """The service clock, in epoch milliseconds."""
        return int(self.clock() * 1000)

    def unit(self, work: Callable[[Tx], T], *, settle: bool = True) -> Callable[[sqlite3.Connection], T]:
        """``work`` as a write unit, given a Tx: the service clock read inside it (never before
        ``ledger_clock``'s: docs/operations.md) and ids; delayed orders due settle first."""
        def run(conn: sqlite3.Connection) -> T:
            last_ms, last_id = conn.execute("SELECT last_ms, last_id FROM ledger_clock").fetchone()
            now = int(self.clock.reading_in(conn) * 1000)  # (a clock moved earlier in it counts)
            ids = IdSequence(conn, last_id, max(now, last_ms))
            tx = Tx(conn, ids.now, ids, now)
            if settle and self.settings.settlement == Settlement.DELAYED:
                self._settle_due(tx, now)
            result = work(tx)
            conn.execute("UPDATE ledger_clock SET last_ms = ?, last_id = ?", (ids.now, ids.last))
            ids.keep(conn)
            return result
        return run

    def write(self, work: Callable[[Tx], T]) -> T:
        """Run ``work`` as one write (``unit``), returning its result: how the Python API writes."""
        return self.db.write([self.unit(work)])[0]

    def close(self) -> None:
        """Close this thread's database connection."""
        self.db.close()

    # Workspaces and members ##################################################

    def create_workspace(self, name: str) -> dict:
        """A workspace with its default owner member (``ownerMemberId``)."""
        name = _text(name, "name", NAME_MAX)

        def create(tx: Tx) -> dict:
            workspace_id, _ = self._insert_workspace(tx, name)
            return workspace_resource(self._workspace(tx.conn, workspace_id))
        return self.write(create)

    def _insert_workspace(self, tx: Tx, name: str, workspace_id: str | None = None) -> tuple[str, str]:
        """The one INSERT of a workspace (``name`` checked) with its owner member: their ids."""
        workspace_id = workspace_id or tx.new_id("ws_")
        tx.conn.execute("INSERT INTO workspaces (id, name, created_at) VALUES (?, ?, ?)",
                        (workspace_id, name, tx.now))
        return workspace_id, self._insert_member(tx, workspace_id, OWNER_NAME, Role.OWNER)["id"]

    def get_workspace(self, workspace_id: str) -> dict:
        """The workspace; GA2032 once deleted."""
        with self.db.connection() as conn:
            return workspace_resource(self._workspace(conn, workspace_id))

    def list_workspaces(self) -> list[dict]:
        """Every workspace not deleted, oldest first."""
        with self.db.connection() as conn:
            rows = conn.execute(_WORKSPACE_SELECT + " WHERE w.deleted_at IS NULL"
                                " ORDER BY w.created_at, w.id").fetchall()
        return [workspace_resource(row) for row in rows]

    def delete_workspace(self, workspace_id: str) -> None:
        """From now on the workspace's keys answer GA2032; its ledger is kept."""
        def delete(tx: Tx) -> None:
            self._workspace(tx.conn, workspace_id)
            tx.conn.execute("UPDATE workspaces SET deleted_at = ? WHERE id = ?", (tx.now, workspace_id))
        self.write(delete)

    def add_member(self, workspace_id: str, name: str) -> dict:
        """A MEMBER of the workspace; keys can be issued to it (``create_api_key(member_id=...)``)."""
        name = _text(name, "name", NAME_MAX)

        def add(tx: Tx) -> dict:
            self._workspace(tx.conn, workspace_id)
            return member_resource(self._insert_member(tx, workspace_id, name, Role.MEMBER))
        return self.write(add)

    @staticmethod
    def _insert_member(tx: Tx, workspace_id: str, name: str, role: Role,
                       member_id: str | None = None) -> sqlite3.Row:
        """The one INSERT of a member (its ``name`` checked by the caller); its row."""
        return tx.conn.execute("INSERT INTO members (id, workspace_id, name, role, created_at)"
                               " VALUES (?, ?, ?, ?, ?) RETURNING *",
                               (member_id or tx.new_id("mem_"), workspace_id, name, role, tx.now)).fetchone()

    def list_members(self, workspace_id: str) -> list[dict]:
        """The workspace's members, oldest first (removed ones left out)."""
        rows = self._workspace_rows("members", workspace_id, "removed_at IS NULL")
        return [member_resource(row) for row in rows]

    def remove_member(self, workspace_id: str, member_id: str) -> None:
        """From now on the member's keys answer GA2034."""
        def remove(tx: Tx) -> None:
            self._workspace(tx.conn, workspace_id)
            self._member(tx.conn, workspace_id, member_id)
            tx.conn.execute("UPDATE members SET removed_at = ? WHERE id = ?", (tx.now, member_id))
        self.write(remove)

    # API keys ################################################################

    def create_api_key(self, workspace_id: str, scopes: Iterable[str] = SCOPES, *,
                       member_id: str | None = None, ip_whitelist: Iterable[str] | None = None) -> dict:
        """A key with its ``secret``: the only time the secret is returned."""
        scopes = api_key_scopes(scopes)
        whitelist = None if ip_whitelist is None else ip_whitelist_entries(ip_whitelist)

        def create(tx: Tx) -> dict:
            workspace = self._workspace(tx.conn, workspace_id)
            member = workspace["owner_member_id"] if member_id is None else member_id
            self._member(tx.conn, workspace_id, member)
            row = self._insert_api_key(tx, workspace_id, member, scopes, whitelist)
            return {**api_key_resource(row), "secret": row["secret"]}
        return self.write(create)

    @staticmethod
    def _insert_api_key(tx: Tx, workspace_id: str, member_id: str, scopes: list[str],
                        whitelist: list[str] | None, key_id: str | None = None,
                        secret: str | None = None) -> sqlite3.Row:
        """The one INSERT of a key, ``scopes`` and ``whitelist`` as checked (api_key_scopes...); its row."""
        return tx.conn.execute(
            "INSERT INTO api_keys (id, secret, workspace_id, member_id, scopes, ip_whitelist, created_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING *",
            (key_id or tx.new_id("ak_"), secret or tx.ids.secret(), workspace_id, member_id, " ".join(scopes),
             None if whitelist is None else json.dumps(whitelist), tx.now)).fetchone()

    def list_api_keys(self, workspace_id: str) -> list[dict]:
        """The workspace's keys, oldest first, without their secrets."""
        return [api_key_resource(row) for row in self._workspace_rows("api_keys", workspace_id)]

    def set_api_key_enabled(self, api_key: str, enabled: bool) -> dict:
        """Disable (GA2021 from then on) or re-enable a key."""
        def switch(conn: sqlite3.Connection) -> dict:
            row = conn.execute("UPDATE api_keys SET enabled = ? WHERE id = ? RETURNING *",
                               (int(bool(enabled)), api_key)).fetchone()
            if row is None:
                raise not_found("API key")
            return api_key_resource(row)
        return self.db.write([switch])[0]

    # Wallets and their ledger ################################################

    def create_wallet(self, workspace_id: str, currency: str, *, name: str | None = None) -> dict:
        """An ACTIVE wallet in an ISO 4217 ``currency``, balance zero."""
        currency_exponent(currency)
        name = _text(f"{currency} wallet" if name is None else name, "name", NAME_MAX, minimum=0)

        def create(tx: Tx) -> dict:
            self._workspace(tx.conn, workspace_id)
            return wallet_resource(self._insert_wallet(tx, workspace_id, currency, name))
        return self.write(create)

    @staticmethod
    def _insert_wallet(tx: Tx, workspace_id: str, currency: str, name: str,
                       wallet_id: str | None = None) -> sqlite3.Row:
        """The one INSERT of an ACTIVE wallet (``currency`` and ``name`` checked by the caller); its row."""
        return tx.conn.execute(
            "INSERT INTO wallets (id, workspace_id, name, currency, status, created_at, updated_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING *",
            (wallet_id or tx.new_id("wal_"), workspace_id, name, currency, WalletStatus.ACTIVE,
             tx.now, tx.now)).fetchone()

    def set_wallet_status(self, wallet_id: str, status: str) -> dict:
        """ACTIVE, FROZEN or CLOSED; only ACTIVE wallets move money (else W1002)."""
        if status not in WALLET_STATUSES:
            raise invalid("status", "one_of", choices=", ".join(WALLET_STATUSES))
        return self.write(lambda tx: self._set_wallet_status(tx, wallet_id, status))

    def _set_wallet_status(self, tx: Tx, wallet_id: str, status: str) -> dict:
        closed = self._wallet(tx.conn, wallet_id)["status"] == WalletStatus.CLOSED
        if closed and status != WalletStatus.CLOSED:
            raise invalid("status", "closed")
        return wallet_resource(tx.conn.execute("UPDATE wallets SET status = ?, updated_at = ? WHERE id = ?"
                                               " RETURNING *", (status, tx.now, wallet_id)).fetchone())

    def get_wallet(self, wallet_id: str, *, workspace_id: str | None = None) -> dict:
        """The wallet; W1001 if missing or outside ``workspace_id`` (when given)."""
        self.settle_due()
        return wallet_resource(self._wallet(None, wallet_id, workspace_id))

    def get_balance(self, wallet_id: str, *, workspace_id: str | None = None) -> dict:
        """``{walletId, currency, balance, available, pending, updatedAt}``; W1001 outside the workspace."""
        self.settle_due()
        return balance_resource(self._wallet(None, wallet_id, workspace_id))

    def list_wallets(self, workspace_id: str, query: Mapping[str, Any] | None = None, *,
                     balances: bool = False) -> dict:
        """One page of the workspace's wallets (``currency``, ``status``); ``balances``: as balances."""
        return self._page(ListQuery("wallets", workspace_id, "workspace_id"), query, WALLET_SORTS,
                          WALLET_FILTERS, balance_resource if balances else wallet_resource)

    def _page(self, listing: ListQuery, query: Mapping[str, Any] | None, sorts: Mapping[str, str],
              filters: Mapping[str, ListFilter], resource: Callable[[sqlite3.Row], dict],
              check: Callable[[sqlite3.Connection], Any] = lambda conn: None) -> dict:
        """One page of a list, its sorts and filters read from ``query``, in one read snapshot that
        ``check``s first (the wallet a list is of): what every list of the service answers."""
        self.settle_due()
        query = normalize_query(query)
        page = parse_page_request(query, sorts)
        listing.narrow(filters, query)
        with self.db.snapshot() as conn:
            check(conn)
            total = listing.total(conn)
            rows = listing.page(conn, page, total)
        return page_response([resource(row) for row in rows], page, total)

    def deposit(self, wallet_id: str, amount: str, *, workspace_id: str | None = None) -> dict:
        """Money enters from outside; returns the DEPOSIT flow."""
        return self.write(lambda tx: self._external_move(tx, wallet_id, amount, FlowType.DEPOSIT,
                                                          workspace_id))

    def withdraw(self, wallet_id: str, amount: str, *, workspace_id: str | None = None) -> dict:
        """Money leaves; never below the available balance (T2001); returns the flow."""
        return self.write(lambda tx: self._external_move(tx, wallet_id, amount, FlowType.WITHDRAWAL,
                                                          workspace_id))

    def _external_move(self, tx: Tx, wallet_id: str, amount: str, flow_type: FlowType,
                       workspace_id: str | None) -> dict:
        wallet = self._active_wallet(tx.conn, wallet_id, workspace_id)
        minor = parse_amount(amount, wallet["currency"])
        if flow_type == FlowType.DEPOSIT and wallet["balance"] + minor > MAX_MINOR_UNITS:
            raise invalid("amount", "too_large")
        if flow_type == FlowType.WITHDRAWAL and wallet["balance"] - wallet["pending"] < minor:
            raise InsufficientBalance(wallet_id=wallet_id)
        delta = minor if flow_type == FlowType.DEPOSIT else -minor
        balance = self._add_to_balance(tx, wallet_id, wallet["balance"], delta)
        return flow_resource(self._write_flow(tx, wallet_id, flow_type, minor, balance), wallet["currency"])

    def list_flows(self, wallet_id: str, query: Mapping[str, Any] | None = None, *,
                   workspace_id: str | None = None) -> dict:
        """One page of a wallet's ledger; filters type, direction, createdFrom/To."""
        wallet: dict = {}  # (read in the page's snapshot: its currency shows each flow's amount)
        return self._page(ListQuery("flows", wallet_id, "wallet_id", counter="flows"), query, FLOW_SORTS,
                          FLOW_FILTERS, lambda row: flow_resource(row, wallet["currency"]),
                          lambda conn: wallet.update(self._wallet(conn, wallet_id, workspace_id)))

    # Transfers ###############################################################

    def create_transfer(self, workspace_id: str, source_wallet_id: str, target_wallet_id: str,
                        amount: str | decimal.Decimal, currency: str, *, biz_id: str | None = None,
                        description: str | None = None) -> dict:
        """Move ``amount`` (a str or Decimal, never rounded) between two wallets; the order."""
        if not isinstance(workspace_id, str):  # (as create_wallet answers: no such workspace, never a crash)
            raise WorkspaceNotFound()
        return self.db.write([self.transfer_unit(workspace_id, TransferRequest.checked(
            source_wallet_id, target_wallet_id, amount, currency, biz_id, description))])[0].order

    def create_transfers(self, workspace_id: str, transfers: Iterable[Mapping[str, Any]]) -> list[dict]:
        """Many transfers in one write, all or nothing (docs/embedding.md), each a dict of
        ``create_transfer``'s arguments; one that fails is named in the error's notes (``transfers[N]``)."""
        def noted(n: int, call: Callable[[], T]) -> T:
            try:
                return call()
            except (WalletError, TypeError) as exc:
                exc.add_note(f"in transfers[{n}]")
                raise

        if not isinstance(workspace_id, str):
            raise WorkspaceNotFound()
        units = [self.transfer_unit(workspace_id, noted(n, lambda item=item: TransferRequest.checked(**item)))
                 for n, item in enumerate(transfers)]
        moved = self.db.write([lambda conn, n=n, unit=unit: noted(n, lambda: unit(conn))
                               for n, unit in enumerate(units)])
        return [transferred.order for transferred in moved]

    def transfer_unit(self, workspace_id: str, request: TransferRequest) -> Unit:
        """The write unit of a transfer, the one way money moves: Transferred (the order, whether it is a
        replay); checked and moved in its transaction, so a refusal leaves nothing."""
        def move(tx: Tx) -> Transferred:
            conn = tx.conn
            if request.biz_id is not None:
                existing = conn.execute("SELECT * FROM transfers WHERE workspace_id = ? AND biz_id = ?",
                                        (workspace_id, request.biz_id)).fetchone()
                if existing is not None:
                    return Transferred(transfer_resource(request.replayed_by(existing)), True)
            if request.source == request.target:
                raise SameWallet()
            source = self._active_wallet(conn, request.source, workspace_id)
            target = self._active_wallet(conn, request.target, workspace_id)
            for wallet in (source, target):
                if wallet["currency"] != request.currency:
                    raise CurrencyMismatch(wallet_id=wallet["id"], wallet_currency=wallet["currency"],
                                           currency=request.currency)
            amount = request.amount
            if source["balance"] - source["pending"] < amount:
                raise InsufficientBalance(wallet_id=source["id"])
            if target["balance"] + amount > MAX_MINOR_UNITS:
                raise invalid("amount", "too_large")
            transfer_id = tx.new_id("tr_")
            mode = self.settings.settlement
            # Due on the service clock, from its own reading now (docs/contract.md): not from the ledger's
            # time, which a clock moved back and forth before may have left ahead.
            settle_at = (tx.clock_reading + int(self.settings.settlement_delay * 1000)
                         if mode == Settlement.DELAYED else None)
            now, immediate = tx.now, mode == Settlement.IMMEDIATE
            row = {"id": transfer_id, "workspace_id": workspace_id, "biz_id": request.biz_id or transfer_id,
                   "source_wallet_id": source["id"], "target_wallet_id": target["id"], "amount": amount,
                   "currency": request.currency,
                   "status": TransferStatus.COMPLETED if immediate else TransferStatus.PENDING,
                   "description": request.description, "created_at": now, "updated_at": now,
                   "completed_at": now if immediate else None, "settle_at": settle_at}
            conn.execute(f"INSERT INTO transfers ({', '.join(row)}) VALUES (:{', :'.join(row)})", row)
            if immediate:
                self._move(tx, row, source["balance"], target["balance"])
            else:
                self._hold(tx, source["id"], amount)
            return Transferred(transfer_resource(row), False)
        return self.unit(move)

    def _finish(self, tx: Tx, order: sqlite3.Row, status: str) -> sqlite3.Row:
        """Settle a PENDING order: COMPLETED moves the held money (a flow per wallet), FAILED releases it."""
        self._hold(tx, order["source_wallet_id"], -order["amount"])
        if status == TransferStatus.COMPLETED:
            source, target = (self._wallet(tx.conn, order[side])["balance"]
                              for side in ("source_wallet_id", "target_wallet_id"))
            self._move(tx, order, source, target)
        return tx.conn.execute("UPDATE transfers SET status = ?, updated_at = ?, completed_at = ?,"
                               " settle_at = NULL WHERE id = ? RETURNING *",
                               (status, tx.now, tx.now if status == TransferStatus.COMPLETED else None,
                                order["id"])).fetchone()

    def _move(self, tx: Tx, order: Mapping[str, Any], source_balance: int, target_balance: int) -> None:
        """Move an order's money and write a flow per wallet, from the balances read in this transaction."""
        amount, source_id, target_id = order["amount"], order["source_wallet_id"], order["target_wallet_id"]
        source_balance = self._add_to_balance(tx, source_id, source_balance, -amount)
        target_balance = self._add_to_balance(tx, target_id, target_balance, amount)
        self._write_flow(tx, source_id, FlowType.TRANSFER_OUT, amount, source_balance,
                         order["id"], order["biz_id"], target_id)
        self._write_flow(tx, target_id, FlowType.TRANSFER_IN, amount, target_balance,
                         order["id"], order["biz_id"], source_id)

    def complete_transfer(self, biz_id: str, *, workspace_id: str | None = None) -> dict:
        """Complete a PENDING order (manual or delayed settlement): the money moves."""
        return self.write(lambda tx: self._settle_order(tx, biz_id, workspace_id, TransferStatus.COMPLETED))

    def fail_transfer(self, biz_id: str, *, workspace_id: str | None = None) -> dict:
        """Fail a PENDING order: the held amount is released, no money moves."""
        return self.write(lambda tx: self._settle_order(tx, biz_id, workspace_id, TransferStatus.FAILED))

    def _settle_order(self, tx: Tx, biz_id: str, workspace_id: str | None, status: str) -> dict:
        if workspace_id is not None:
            order = self._order(tx.conn, workspace_id, biz_id)
        else:  # bizIds are unique per workspace: accept a transferId, or a bizId used once
            rows = tx.conn.execute("SELECT * FROM transfers WHERE id = ? OR biz_id = ? LIMIT 2",
                                   (biz_id, biz_id)).fetchall()
            if len(rows) > 1:
                raise invalid("workspaceId", "required")
            if not rows:
                raise TransferNotFound(biz_id=str(biz_id)[:64])
            order = rows[0]
        if order["status"] != TransferStatus.PENDING:
            raise invalid("bizId", "state", state=order["status"])
        return transfer_resource(self._finish(tx, order, status))

    def settle_due(self) -> int:
        """Complete delayed-settlement orders whose time has come (docs/sandbox.md, Settlement, ids and magic
        values); how many. Every write settles them first (``unit``), every read calls this."""
        if self.settings.settlement != Settlement.DELAYED:
            return 0
        now = self.now_ms()
        if self.db.one("SELECT 1 FROM transfers WHERE settle_at <= ? LIMIT 1", (now,)) is None:
            return 0
        return self.db.write([self.unit(lambda tx: self._settle_due(tx, now), settle=False)])[0]

    def _settle_due(self, tx: Tx, now: int) -> int:
        due = tx.conn.execute("SELECT * FROM transfers WHERE settle_at <= ? AND status = ?",
                              (now, TransferStatus.PENDING)).fetchall()
        for order in due:
            self._finish(tx, order, TransferStatus.COMPLETED)
        return len(due)

    def get_transfer(self, workspace_id: str, biz_id: str) -> dict:
        """The order with this bizId in the workspace; T1001 if none (another workspace's too)."""
        self.settle_due()
        with self.db.connection() as conn:
            return transfer_resource(self._order(conn, workspace_id, biz_id))

    def transfer_completion(self, workspace_id: str, biz_id: str) -> dict:
        """``{bizId, transferId, status, completed}``: of the order ``get_transfer`` answers."""
        order = self.get_transfer(workspace_id, biz_id)
        return {"bizId": order["bizId"], "transferId": order["transferId"], "status": order["status"],
                "completed": order["status"] == TransferStatus.COMPLETED}

    def list_transfers(self, workspace_id: str, query: Mapping[str, Any] | None = None, *,
                       wallet_id: str | None = None) -> dict:
        """One page of the workspace's transfer orders, or of one wallet's (either side)."""
        owner, columns, check = ((workspace_id, ["workspace_id"], lambda conn: None) if wallet_id is None else
                                 (wallet_id, ["source_wallet_id", "target_wallet_id"],
                                  lambda conn: self._wallet(conn, wallet_id, workspace_id)))
        return self._page(ListQuery("transfers", owner, *columns, counter="transfers"), query, TRANSFER_SORTS,
                          TRANSFER_FILTERS, transfer_resource, check)

    # The auditor ############################################################

    def audit(self, progress: Callable[[str], Any] = lambda doing: None) -> list[dict]:
        """Every ledger invariant (_AUDITS; docs/operations.md) in one read transaction: each violation as
        ``{"check", "detail", "rows"}``; a malformed file is reported alone."""
        violations, problems = [], ["ok"]
        if not self.db.memory:
            progress("the file's integrity")
            with self.db.connection() as conn:
                try:  # (a file too malformed to be read says so itself)
                    problems = [row[0] for row in conn.execute("PRAGMA integrity_check")]
                except sqlite3.DatabaseError as exc:
                    problems = [str(exc)]
        if problems != ["ok"]:
            detail = f"the database file is malformed: {'; '.join(problems[:3])}"
            return [{"check": "integrity", "detail": detail, "rows": {"problems": problems[:20]}}]
        with self.db.snapshot() as conn:
            for number, (check, detail, sql) in enumerate(_AUDITS, 1):
                progress(f"{check} ({number} of {len(_AUDITS)})")
                violations += [{"check": check, "detail": detail.format(**dict(row)), "rows": dict(row)}
                               for row in conn.execute(sql).fetchall()]
        return violations

    def assert_audit_clean(self) -> None:
        """AssertionError listing the violations, unless ``audit()`` finds none."""
        if violations := self.audit():
            shown = "\n".join(f"  {v['check']}: {v['detail']}" for v in violations[:20])
            raise AssertionError(f"walletsvc's ledger audit found {len(violations)} violation(s):\n{shown}")

    # Row access ##############################################################

    def _workspace_rows(self, table: str, workspace_id: str, condition: str = "1") -> list[sqlite3.Row]:
        """The rows of ``table`` a workspace holds (which must exist), oldest first."""
        with self.db.connection() as conn:
            self._workspace(conn, workspace_id)
            return conn.execute(f"SELECT * FROM {table} WHERE workspace_id = ? AND {condition}"
                                " ORDER BY created_at, id", (workspace_id,)).fetchall()

    @staticmethod
    def _workspace(conn: sqlite3.Connection, workspace_id: str) -> sqlite3.Row:
        row = conn.execute(_WORKSPACE_SELECT + " WHERE w.id = ? AND w.deleted_at IS NULL",
                           (workspace_id,)).fetchone()
        if row is None:
            raise WorkspaceNotFound()
        return row

    @staticmethod
    def _member(conn: sqlite3.Connection, workspace_id: str, member_id: str) -> sqlite3.Row:
        row = conn.execute("SELECT * FROM members WHERE id = ? AND workspace_id = ?"
                           " AND removed_at IS NULL", (member_id, workspace_id)).fetchone()
        if row is None:
            raise not_found("member")
        return row

    def _wallet(self, conn: sqlite3.Connection | None, wallet_id: str,
                workspace_id: str | None = None) -> sqlite3.Row:
        """The wallet; W1001 if it is missing or of another workspace (``conn`` None: a lone statement)."""
        sql = "SELECT * FROM wallets WHERE id = ?"
        row = self.db.one(sql, (wallet_id,)) if conn is None else conn.execute(sql, (wallet_id,)).fetchone()
        if row is None or (workspace_id is not None and row["workspace_id"] != workspace_id):
            raise WalletNotFound(wallet_id=str(wallet_id)[:64])
        return row

    def _active_wallet(self, conn: sqlite3.Connection, wallet_id: str,
                       workspace_id: str | None) -> sqlite3.Row:
        row = self._wallet(conn, wallet_id, workspace_id)
        if row["status"] != WalletStatus.ACTIVE:
            raise WalletNotActive(wallet_id=wallet_id, state=row["status"])
        return row

    @staticmethod
    def _order(conn: sqlite3.Connection, workspace_id: str, biz_id: str) -> sqlite3.Row:
        """The order; T1001 if missing or of another workspace (never leak existence)."""
        row = conn.execute("SELECT * FROM transfers WHERE workspace_id = ? AND biz_id = ?",
                           (workspace_id, biz_id)).fetchone()
        if row is None:
            raise TransferNotFound(biz_id=str(biz_id)[:64])
        return row

    @staticmethod
    def _hold(tx: Tx, wallet_id: str, amount: int) -> None:
        tx.conn.execute("UPDATE wallets SET pending = pending + ?, updated_at = ? WHERE id = ?",
                        (amount, tx.now, wallet_id))

    @staticmethod
    def _add_to_balance(tx: Tx, wallet_id: str, balance: int, delta: int) -> int:
        """Add ``delta`` to a wallet whose ``balance`` was read in this transaction; the new balance."""
        tx.conn.execute("UPDATE wallets SET balance = balance + ?, updated_at = ? WHERE id = ?",
                        (delta, tx.now, wallet_id))
        return balance + delta

    @staticmethod
    def _write_flow(tx: Tx, wallet_id: str, flow_type: FlowType, amount: int, balance_after: int,
                    transfer_id: str | None = None, biz_id: str | None = None,
                    counterparty: str | None = None) -> sqlite3.Row:
        return tx.conn.execute(
            "INSERT INTO flows (id, wallet_id, type, direction, amount, balance_after, transfer_id,"
            " biz_id, counterparty_wallet_id, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING *",
            (tx.new_id("fl_"), wallet_id, flow_type, flow_type.direction, amount, balance_after, transfer_id,
             biz_id, counterparty, tx.now)).fetchone()

    def seed_ids(self, seed: int | None) -> None:
        """Make the ids and secrets that follow repeatable from ``seed`` (None: random again), as the
        ``id_seed`` setting does; ids still sort after those issued. Tests only."""
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise invalid("seed", "integer")
        if seed is not None and not ID_SEEDS[0] <= seed <= ID_SEEDS[1]:
            raise invalid("seed", "range", minimum=f"{ID_SEEDS[0]:,}", maximum=f"{ID_SEEDS[1]:,}")
        self.db.write([lambda conn: conn.execute("UPDATE sandbox SET id_seed = ?, id_drawn = 0", (seed,))],
                      durable=False)

    # The starting state ######################################################

    def save_start(self) -> None:
        """Make the state as it is now the starting state ``reset`` returns to (docs/sandbox.md, Reset)."""
        self.db.write([self.saving_start])

    def saving_start(self, conn: sqlite3.Connection) -> None:
        """The unit of ``save_start``."""
        for table in _STARTING_STATE:
            conn.execute(f"DELETE FROM start_{table}")
            conn.execute(f"INSERT INTO start_{table} SELECT * FROM {table}")
        conn.execute("DELETE FROM start_sandbox")
        conn.execute("INSERT INTO start_sandbox SELECT clock_frozen_at, clock_offset, id_seed, id_drawn"
                     " FROM sandbox")
        conn.execute("UPDATE sandbox SET has_start = 1")
        conn.execute("DELETE FROM world_starts")  # every workspace is a world that can be reset alone
        for (workspace_id,) in conn.execute("SELECT id FROM workspaces").fetchall():
            self._save_world(conn, workspace_id)

    def reset(self) -> None:
        """Back to the starting state (``save_start``; none: an empty database), in one transaction."""
        def reset(conn: sqlite3.Connection) -> None:
            for clear in (Journal.emptied, Nonces.clear, Faults.cleared):
                clear(conn)
            for table in reversed(_STARTING_STATE):
                conn.execute(f"DELETE FROM {table}")
            for table in _STARTING_STATE:
                if table == "counters":  # the triggers counted the rows in again: the saved counts instead
                    conn.execute("DELETE FROM counters")
                conn.execute(f"INSERT INTO {table} SELECT * FROM start_{table}")
            if conn.execute("SELECT 1 FROM ledger_clock").fetchone() is None:
                conn.execute("INSERT INTO ledger_clock (last_ms, last_id) VALUES (0, '')")
            start = conn.execute("SELECT clock_frozen_at, clock_offset, id_seed, id_drawn FROM start_sandbox"
                                 " WHERE (SELECT has_start FROM sandbox)").fetchone()
            conn.execute("UPDATE sandbox SET clock_frozen_at = ?, clock_offset = ?, id_seed = ?,"
                         " id_drawn = ?", tuple(start or (*self.clock.start, self.settings.id_seed, 0)))
            conn.execute("DELETE FROM world_starts WHERE workspace_id NOT IN (SELECT id FROM workspaces)")
        self.db.write([reset])

    # Backup and restore (docs/operations.md) #################################

    def backup(self, path: str) -> None:
        """Copy the database to ``path`` while it is served: SQLite's online backup, made private beside it
        and renamed over it whole (docs/operations.md, When things go wrong)."""
        if self.db.memory:
            raise RuntimeError("an in-memory database has no file to back up")
        target = os.path.abspath(path)
        if os.path.exists(target) and os.path.samefile(target, self.db.path) or any(
                target == os.path.abspath(self.db.path) + suffix for suffix in ("-wal", "-shm", "-journal")):
            raise RuntimeError(f"{path} is the database itself, or a file of its own: back it up to another"
                               " file")
        with _written_whole(target) as (descriptor, temporary):
            os.close(descriptor)
            with contextlib.closing(sqlite3.connect(temporary)) as copy_, self.db.connection() as conn:
                conn.backup(copy_)
                copy_.execute("PRAGMA journal_mode = DELETE")  # (one file: no -wal beside the copy)

    def restore(self, path: str) -> None:
        """Make the sandbox what the backup at ``path`` holds, in one write through the write door, keeping
        what guards access; or refuse it, changing nothing (docs/operations.md, When things go wrong)."""
        if self.db.memory:
            raise RuntimeError("an in-memory database has no file to restore into")
        with contextlib.closing(sqlite3.connect(":memory:")) as source:
            _copy_backup(path, source)
            def restore(conn: sqlite3.Connection) -> None:
                for table in reversed(_RESTORED):
                    conn.execute(f"DELETE FROM {table}")
                for table in _RESTORED:
                    if table == "counters":  # (the triggers counted the rows in again: the copy's instead)
                        conn.execute("DELETE FROM counters")
                    rows = source.execute(f"SELECT * FROM {table}")
                    names = [column[0] for column in rows.description]
                    conn.executemany(f"INSERT INTO {table} ({', '.join(names)})"
                                     f" VALUES ({', '.join('?' * len(names))})", rows)
                Faults.changed(conn)
                # Of the sandbox's row, the clock and the id sequence: the rest is Faults' and the Journal's.
                kept = "clock_frozen_at, clock_offset, id_seed, id_drawn, has_start"
                conn.execute(f"UPDATE sandbox SET ({kept}) = (?, ?, ?, ?, ?)",
                             tuple(source.execute(f"SELECT {kept} FROM sandbox").fetchone()))
                last_ms, last_id = source.execute("SELECT last_ms, last_id FROM ledger_clock").fetchone()
                conn.execute("UPDATE ledger_clock SET last_ms = max(last_ms, ?), last_id = max(last_id, ?)",
                             (last_ms, last_id))
                for check, detail, sql in _AUDITS:  # (a hand-edited copy: refused, the transaction undone)
                    if (row := conn.execute(sql).fetchone()) is not None:
                        raise RuntimeError(f"{path}: its ledger fails the audit ({check}:"
                                           f" {detail.format(**dict(row))}): nothing was restored")
            self.db.write([restore])

    # Worlds: scenarios, instantiated side by side (docs/sandbox.md) ##############

    def load_scenario(self, scenario: Mapping[str, Any], *, fresh_ids: bool = False) -> dict:
        """Make a scenario's worlds in one transaction (``reset_workspace`` returns to each); ``fresh_ids``: a
        second copy, as ``POST /_admin/scenarios`` does (docs/sandbox.md)."""
        scenario = check_scenario(scenario)
        made = self.write(self.loading_scenario(scenario, fresh_ids))
        return {"workspaces": [self.describe_world(workspace_id) for workspace_id in made]}

    def loading_scenario(self, scenario: Mapping[str, Any], fresh_ids: bool = False) -> Callable[[Tx], list]:
        """What ``load_scenario`` writes (its ``scenario`` checked): the ids of the workspaces made."""
        def load(tx: Tx) -> list[str]:
            made = [self._load_workspace(tx, spec, f"workspaces[{index}]", fresh_ids)
                    for index, spec in enumerate(scenario["workspaces"])]
            for workspace_id in made:
                self._save_world(tx.conn, workspace_id)
            return made
        return load

    def _load_workspace(self, tx: Tx, spec: Mapping[str, Any], where: str, fresh_ids: bool) -> str:
        """One checked scenario workspace, made by the admin API's inserts; its id."""
        def fixed(item: Mapping[str, Any], field: str) -> str | None:
            """The id the scenario fixes for ``item`` (None: a fresh one), S012 if it is taken."""
            wanted = None if fresh_ids else item.get("id")
            if wanted and any(tx.conn.execute(f"SELECT 1 FROM {table} WHERE id = ?", (wanted,)).fetchone()
                              for table in _ID_TABLES):
                raise invalid(f"{field}.id", "taken", value=wanted)
            return wanted

        workspace_id, owner_id = self._insert_workspace(tx, spec["name"], fixed(spec, where))
        members = {OWNER_NAME: owner_id}
        for index, member in enumerate(spec.get("members", ())):
            member_id = self._insert_member(tx, workspace_id, member["name"], Role.MEMBER,
                                            fixed(member, f"{where}.members[{index}]"))["id"]
            for alias in filter(None, (member["name"], member_id, member.get("id"))):  # a key's member
                members[alias] = member_id
        for index, key in enumerate(spec.get("keys", ())):
            field, whitelist = f"{where}.keys[{index}]", key.get("ipWhitelist")
            self._insert_api_key(tx, workspace_id, members[key.get("member", OWNER_NAME)],
                                 api_key_scopes(key.get("scopes", SCOPES), f"{field}.scopes"),
                                 None if whitelist is None else ip_whitelist_entries(whitelist,
                                                                                     f"{field}.ipWhitelist"),
                                 fixed(key, field), None if fresh_ids else key.get("secret"))
        for index, wallet in enumerate(spec.get("wallets", ())):
            wallet_id = self._insert_wallet(tx, workspace_id, wallet["currency"], wallet["name"],
                                            fixed(wallet, f"{where}.wallets[{index}]"))["id"]
            if wallet.get("balance") is not None and not _zero(wallet["balance"], wallet["currency"]):
                self._external_move(tx, wallet_id, wallet["balance"], FlowType.DEPOSIT, None)
            if wallet.get("status", WalletStatus.ACTIVE) != WalletStatus.ACTIVE:
                self._set_wallet_status(tx, wallet_id, wallet["status"])
        return workspace_id

    def start_scenario(self) -> dict:
        """The scenario this sandbox started from (``start_world``), else the built-in DEMO_SCENARIO."""
        row = self.db.one("SELECT body FROM start_scenario")
        return json.loads(row[0]) if row else dict(DEMO_SCENARIO)

    def describe_world(self, workspace_id: str) -> dict:
        """A workspace with its members, keys (secrets included: this is the sandbox's) and wallets."""
        with self.db.snapshot() as conn:
            workspace = workspace_resource(self._workspace(conn, workspace_id))
            keys, wallets = (conn.execute(f"SELECT * FROM {table} WHERE workspace_id = ?"
                                          " ORDER BY created_at, rowid", (workspace_id,)).fetchall()
                             for table in ("api_keys", "wallets"))
        return {**workspace, "members": self.list_members(workspace_id),
                "keys": [{**api_key_resource(row), "secret": row["secret"]} for row in keys],
                "wallets": [wallet_resource(row) for row in wallets]}

    def reset_workspace(self, workspace_id: str) -> dict:
        """Return one workspace to the state its world began in, in one transaction (docs/sandbox.md,
        Parallel worlds). GA2032 for no such workspace, S404 for one no world began with."""
        def reset(conn: sqlite3.Connection) -> None:
            saved = conn.execute("SELECT rows FROM world_starts WHERE workspace_id = ?",
                                 (workspace_id,)).fetchone()
            if saved is None:
                if conn.execute("SELECT 1 FROM workspaces WHERE id = ?", (workspace_id,)).fetchone() is None:
                    raise WorkspaceNotFound()  # as the admin API answers for any unknown workspace
                raise not_found("world")
            saved, current = json.loads(saved[0]), self._world_rows(conn, workspace_id)
            keys = sorted({row[0] for rows in (saved, current) for row in rows["api_keys"]})
            gone = sorted({row[0] for row in current["api_keys"]} - {row[0] for row in saved["api_keys"]})
            wallets = sorted({row[0] for rows in (saved, current) for row in rows["wallets"]})
            # The nonce records of the keys that stay stay (the clock was not reset): a request
            # captured before the reset is refused after it.
            Nonces.drop_keys(conn, gone)
            Journal.emptied(conn, keys)
            Faults.cleared(conn, workspace_id)
            for table in reversed(_WORLD_TABLES):
                conn.execute(*_world_sql("DELETE", table, workspace_id, wallets))
            for table in _WORLD_TABLES:
                if table == "counters":  # the triggers counted the rows in again: the saved counts instead
                    conn.execute(*_world_sql("DELETE", table, workspace_id, wallets))
                for row in saved[table]:
                    conn.execute(f"INSERT INTO {table} VALUES ({', '.join('?' * len(row))})", row)
        self.db.write([reset])
        return self.describe_world(workspace_id)

    @staticmethod
    def _world_rows(conn: sqlite3.Connection, workspace_id: str) -> dict:
        """Every row of one workspace's world, table by table, as lists of column values."""
        wallets = [row[0] for row in conn.execute("SELECT id FROM wallets WHERE workspace_id = ?",
                                                  (workspace_id,))]
        return {table: list(map(list, conn.execute(*_world_sql("SELECT *", table, workspace_id, wallets))))
                for table in _WORLD_TABLES}

    def _save_world(self, conn: sqlite3.Connection, workspace_id: str) -> None:
        conn.execute("INSERT INTO world_starts (workspace_id, rows) VALUES (?, ?)"
                     " ON CONFLICT (workspace_id) DO UPDATE SET rows = excluded.rows",
                     (workspace_id, json.dumps(self._world_rows(conn, workspace_id))))


def start_world(svc: WalletService, scenario: Mapping[str, Any]) -> list[dict]:
    """The sandbox's world at start, in one write: unless a starting state is saved, set the scenario's clock,
    load it (unless there already) and save the start; the workspaces, described."""
    body = json.dumps(scenario, default=str)
    clock = scenario.get("clock") or {}
    at = admin_time(clock.get("at"), "clock.at") if svc.clock.controllable else None

    def start(conn: sqlite3.Connection) -> list[str]:
        if conn.execute("SELECT has_start FROM sandbox").fetchone()[0]:
            stored = conn.execute("SELECT body FROM start_scenario").fetchone()
            if stored is not None and json.loads(stored[0]) != json.loads(body):
                log.warning("this database started from another scenario, and resets to it: a new scenario"
                            " needs a new database (--db)")
        else:
            name = scenario["workspaces"][0]["name"] if scenario["workspaces"] else None
            if conn.execute("SELECT 1 FROM workspaces WHERE name = ? AND deleted_at IS NULL",
                            (name,)).fetchone() is None:
                if at is not None:
                    Clock.moved(Clock.starting_at(at, clock.get("frozen", True)))(conn)
                svc.unit(svc.loading_scenario(scenario))(conn)
                conn.execute("DELETE FROM start_scenario")
                conn.execute("INSERT INTO start_scenario (body) VALUES (?)", (body,))
            svc.saving_start(conn)  # (a world an older walletsvc made starts from where it is)
        return [row[0] for row in conn.execute("SELECT id FROM start_workspaces WHERE deleted_at IS NULL"
                                               " ORDER BY created_at, id")]
    return [svc.describe_world(workspace_id) for workspace_id in svc.db.write([start])[0]]


###############################################################################
# HTTP schemas #################################################################
###############################################################################

# The JSON shapes of both surfaces, named once: endpoint declarations name them, /openapi.json publishes
# them, and a request body is checked against its endpoint's schema (fields, JSON types) before its handler.

_STRING, _INTEGER, _BOOLEAN = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}


def _ref(name: str) -> dict:
    """A reference to the named schema (SCHEMAS): generators make one type of it, shared."""
    return {"$ref": f"#/components/schemas/{name}"}


def _id_pattern(prefix: str) -> str:
    """An id with its type prefix (docs/reference.md): 1-64 of A-Z a-z 0-9 _ . : -, prefix included."""
    return f"^{prefix}[A-Za-z0-9._:-]{{0,{ID_MAX - len(prefix)}}}$"


def _map(values: dict | bool, description: str) -> dict:
    return {"type": "object", "additionalProperties": values, "description": description}


_ID_SCHEMA = {"type": "string", "minLength": 1, "maxLength": ID_MAX, "pattern": "^[^\\x00]*$"}  # no NUL
_NAME_SCHEMA = {"type": "string", "minLength": 1, "maxLength": NAME_MAX, "pattern": "^[^\\x00]*$"}
_TIME = {"type": "string", "format": "date-time"}
# An amount as answered (a balance may be 0.00); amounts a request sends are amount_pattern's.
_AMOUNT_SCHEMA = {"type": "string", "pattern": r"^(0|[1-9][0-9]*)(\.[0-9]+)?$", "examples": ["10.00"]}
_NETWORK_SCHEMA = {"type": "string", "pattern": f"^{NETWORK_PATTERN}$", "examples": ["10.0.0.0/8"]}
_TIME_FILTER = {"anyOf": [
    {"type": "string", "pattern": f"^{EPOCH_MS_PATTERN}$", "description": "epoch milliseconds"},
    {"type": "string", "format": "date-time"}, {"type": "string", "format": "date"}]}
# A time the admin surface takes (admin_time) inside CLOCK_RANGE: a JSON number of epoch seconds, or RFC 3339.
_CLOCK_AT_SCHEMA = {"anyOf": [
    {"type": "number", "minimum": 0, "exclusiveMaximum": MILLISECONDS_FROM, "description": "epoch seconds"},
    *({"type": "string", "format": form, "pattern": "^(19[7-9][0-9]|[2-9][0-9]{3})-"}  # CLOCK_RANGE's years
      for form in ("date-time", "date"))],
    "description": "epoch seconds (a number) or RFC 3339 (a date-time or a date), 1970 to 9999 UTC"}
# What a request's query, headers and JSON body are matched on (request_misses): a value compared as text.
_MATCHED_VALUE = {"type": ["string", "number", "integer", "boolean"]}
_MATCH = {"query": _map(_MATCHED_VALUE, "query parameters the request must carry (name: value)"),
          "headers": _map(_MATCHED_VALUE, "headers the request must carry (name in any case: value)"),
          "body": _map(True, "fields the request's JSON body must hold (a subset of it)")}


def _part(schema: dict) -> dict:
    """A body's if, then or not, open and said so: no tool (Redocly's example check) closes it as a body."""
    return {**schema, "additionalProperties": True}


def _amount_rules(currencies: Sequence[str], field: str = "amount") -> dict:
    """An amount's decimals tied to its currency: ``allOf`` ``if``/``then`` per exponent, still one body."""
    by_exponent = itertools.groupby(sorted(currencies, key=CURRENCY_EXPONENTS.get), CURRENCY_EXPONENTS.get)
    return {"allOf": [{"if": _part({"properties": {"currency": {"enum": list(codes)}},
                                    "required": ["currency"]}),
                       "then": _part({"properties": {field: {"pattern": amount_pattern(exponent)}}})}
                      for exponent, codes in by_exponent]}


def _any_amount() -> dict:
    """An amount in a wallet's currency, not named in the body: any exponent's, one pattern."""
    branches = "|".join(amount_pattern(exponent)[1:-1] for exponent in sorted(_AMOUNTS))
    return {"type": "string", "pattern": f"^({branches})$", "examples": ["10.00"],
            "description": "as the wallet's currency allows: at most its decimals"}


def _object(properties: dict, required: Sequence[str] | None = None, description: str = "") -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else list(required),
            "additionalProperties": False, **({"description": description} if description else {})}


def _enum(values: Sequence[str], description: str = "") -> dict:
    return {"type": "string", "enum": list(values), **({"description": description} if description else {})}


def _array(item: str | dict) -> dict:
    return {"type": "array", "items": _ref(item) if isinstance(item, str) else item}


# The components several schemas share, named once (SCHEMAS holds them): enums, ids with their patterns (no
# empty segment in a path).
SHARED_SCHEMAS: Mapping[str, dict] = {
    "Currency": _enum(sorted(CURRENCY_EXPONENTS),
                      "an ISO 4217 code; an amount has at most its decimals (USD 10.00, JPY 10)"),
    "WalletStatus": _enum(WALLET_STATUSES, "ACTIVE and FROZEN go back and forth; CLOSED is final"),
    "TransferStatus": _enum(TRANSFER_STATUSES, "PENDING until the order is completed or failed"),
    "FlowType": _enum(FLOW_TYPES, "what moved the money"),
    "FlowDirection": _enum(FLOW_DIRECTIONS, "DEBIT takes from the wallet, CREDIT adds to it"),
    "Scope": _enum(SCOPES, "what an API key may call (docs/contract.md, Scopes)"),
    "BizId": {"type": "string", "pattern": f"^{_ID.pattern}$", "examples": ["order-1001"],
              "description": "the caller's id of a transfer order (an order without one: its transferId)"},
    "WalletId": {"type": "string", "pattern": _id_pattern("wal_"),
                 "examples": ["wal_0190c2d5a1b2c3d4e5f6a7b8c9d0e1f2"], "description": "a wallet's id"},
    "WorkspaceId": {"type": "string", "pattern": _id_pattern("ws_"), "description": "a workspace's id"},
    "MemberId": {"type": "string", "pattern": _id_pattern("mem_"), "description": "a member's id"},
    "ApiKeyId": {"type": "string", "pattern": _id_pattern("ak_"), "description": "an API key (X-Api-Key)"},
    "FaultId": {"type": "string", "pattern": "^fault_[0-9]{1,18}$", "description": "a fault rule's id"},
    "FaultAction": _enum(FaultAction, "what a fault rule does to a request it matches"),
}


def _scenario_schema(kind: str) -> dict:
    """The schema of a scenario's object of this kind, from _SCENARIO_OBJECTS (what check_scenario checks)."""
    kinds = {"name": _NAME_SCHEMA, "wallet_name": {**_NAME_SCHEMA, "minLength": 0}, "string": _STRING,
             "boolean": _BOOLEAN, "secret": {"type": "string", "pattern": f"^{_NONCE.pattern}$"},
             "scopes": {"type": "array", "items": _ref("Scope"), "minItems": 1}, "currency": _ref("Currency"),
             "networks": {"type": "array", "items": _NETWORK_SCHEMA, "minItems": 1},
             "amount": _STRING, "status": _ref("WalletStatus"), "time": _CLOCK_AT_SCHEMA,
             "settings": _map(True, "settings of the service, by name (docs/reference.md)")}
    fields = {}
    for name, field_kind in _SCENARIO_OBJECTS[kind].items():
        if field_kind == "list":
            fields[name] = {"type": "array", "items": _scenario_schema(name)}
        elif field_kind == "object":
            fields[name] = _scenario_schema(name) if name in _SCENARIO_OBJECTS else kinds["settings"]
        elif field_kind.endswith("_"):  # an id with its type prefix
            fields[name] = {"type": "string", "pattern": _id_pattern(field_kind)}
        else:
            fields[name] = kinds[field_kind]
    if kind == "members":
        fields["name"] = {**_NAME_SCHEMA, "not": {"const": OWNER_NAME}}  # made with the workspace
    rules = _amount_rules(sorted(CURRENCY_EXPONENTS), "balance") if kind == "wallets" else {}
    return {**_object(fields, _SCENARIO_REQUIRED.get(kind, ())), **rules}


_NULLABLE_STRING = {"type": ["string", "null"]}
_ERROR_RULE = {  # an error rule names its status, unless its code (S500 by default) is the catalog's
    "if": _part({"properties": {"action": {"const": FaultAction.ERROR},
                                "code": {"not": {"enum": list(ERRORS_BY_CODE)}}}, "required": ["code"]}),
    "then": _part({"properties": {"status": _INTEGER}, "required": ["status"]})}

_WORKSPACE = {"id": _STRING, "name": _STRING, "ownerMemberId": _STRING, "createdAt": _TIME}
SCHEMAS: Mapping[str, dict] = {
    **SHARED_SCHEMAS,
    "Wallet": _object({"id": _STRING, "workspaceId": _STRING, "name": _STRING, "currency": _ref("Currency"),
                       "status": _ref("WalletStatus"), "balance": _AMOUNT_SCHEMA, "createdAt": _TIME,
                       "updatedAt": _TIME}, description="A wallet: money in one currency"),
    "Balance": _object({"walletId": _STRING, "currency": _ref("Currency"), "balance": _AMOUNT_SCHEMA,
                        "available": _AMOUNT_SCHEMA, "pending": _AMOUNT_SCHEMA, "updatedAt": _TIME},
                       description="A wallet's balance: posted money; pending, held by PENDING outgoing"
                                   " transfers; available = balance - pending"),
    "Flow": _object({"id": _STRING, "walletId": _STRING, "type": _ref("FlowType"),
                     "direction": _ref("FlowDirection"), "amount": _AMOUNT_SCHEMA,
                     "balanceAfter": _AMOUNT_SCHEMA, "transferId": _NULLABLE_STRING,
                     "bizId": _NULLABLE_STRING, "counterpartyWalletId": _NULLABLE_STRING, "createdAt": _TIME},
                    description="An immutable ledger entry: every balance change writes one"),
    "TransferOrder": _object({
        "transferId": _STRING, "bizId": _STRING, "sourceWalletId": _STRING,
        "targetWalletId": _STRING, "amount": _AMOUNT_SCHEMA, "currency": _ref("Currency"),
        "status": _ref("TransferStatus"), "description": _NULLABLE_STRING,
        "createdAt": _TIME, "updatedAt": _TIME, "completedAt": {**_TIME, "type": ["string", "null"]}},
        description="A transfer order between two wallets of one workspace"),
    "Completion": _object({"bizId": _STRING, "transferId": _STRING, "status": _ref("TransferStatus"),
                           "completed": _BOOLEAN}, description="Whether a transfer order is completed"),
    "CreateTransfer": {**_object({
        "sourceWalletId": _ID_SCHEMA, "targetWalletId": _ID_SCHEMA,
        "amount": {"type": "string", "examples": ["10.00"],
                   "description": "a positive decimal string with at most the currency's decimals"},
        "currency": _ref("Currency"), "bizId": _ref("BizId"),
        "description": {"type": "string", "maxLength": DESCRIPTION_MAX}},
        ["sourceWalletId", "targetWalletId", "amount", "currency"],
        description="A transfer to make; a bizId makes it idempotent (the same body again answers the same"
                    " order, another body T2004)"), **_amount_rules(sorted(CURRENCY_EXPONENTS))},
    "PageInfo": _object({"size": _INTEGER, "number": _INTEGER, "totalElements": _INTEGER,
                         "totalPages": _INTEGER},
                        description="The page answered: its size and number (from 0), and the totals"),
    "Workspace": _object(_WORKSPACE, description="A workspace: its members, keys and wallets"),
    "Member": _object({"id": _STRING, "workspaceId": _STRING, "name": _STRING,
                       "role": _enum(Role), "createdAt": _TIME}, description="A member of a workspace"),
    "ApiKey": _object({"apiKey": _STRING, "secret": {"type": "string", "description": "at creation only"},
                       "workspaceId": _STRING, "memberId": _STRING,
                       "scopes": {"type": "array", "items": _ref("Scope")}, "enabled": _BOOLEAN,
                       "ipWhitelist": {"type": ["array", "null"], "items": _STRING}, "createdAt": _TIME},
                      ["apiKey", "workspaceId", "memberId", "scopes", "enabled", "createdAt"],
                      description="An API key of a member; its secret is shown once, when it is made"),
    "Health": _object({"status": _STRING, "version": _STRING}, description="The service is up"),
    "Error": _object({"version": _STRING, "timestamp": _INTEGER, "success": {"const": False},
                      "code": {"type": "string", "examples": ["W1001"],
                               "description": "the error's code: each operation lists those it answers"},
                      "message": {"type": "string", "examples": ["WALLET_NOT_FOUND"],
                                  "description": "the error's name"}, "data": {"type": "null"},
                      "detail": {"type": "string",
                                 "description": "a sentence in the language of Content-Language"}},
                     description="The error envelope of every error answer"),
    "NameBody": _object({"name": _NAME_SCHEMA}, description="A name"),
    "NewKeyBody": _object({"scopes": {**_array("Scope"), "minItems": 1}, "memberId": _STRING,
                           "ipWhitelist": {"type": ["array", "null"], "items": _NETWORK_SCHEMA, "minItems": 1,
                                           "description": "addresses or CIDR blocks without host bits"
                                                          " (10.0.0.1/8 is S012); null: no whitelist"}},
                          [], description="A key to make: every scope and the owner's unless given"),
    "NewWalletBody": _object({"currency": _ref("Currency"), "name": {**_NAME_SCHEMA, "minLength": 0}},
                             ["currency"], description="A wallet to make"),
    "StatusBody": _object({"status": _ref("WalletStatus")}, description="A wallet's new status"),
    "AmountBody": _object({"amount": _any_amount()}, description="An amount in the wallet's currency"),
    "SettleBody": _object({"workspaceId": _STRING}, [],
                            description="The order's workspace, where a bizId is in more than one"),
    "FaultBody": {**_object({"action": _ref("FaultAction"), "method": _STRING, "path": _STRING,
                             "workspaceId": _STRING,
                             "code": {"type": "string", "minLength": 1, "maxLength": 64},
                             "status": {"type": "integer", "minimum": Faults.STATUSES[0],
                                        "maximum": Faults.STATUSES[1]},
                             "latency": {"type": "number", "minimum": 0, "maximum": Faults.MAX_LATENCY},
                             "times": {"type": "integer", "minimum": 1, "maximum": Faults.MAX_TIMES},
                             **_MATCH}, [],
                            description="A fault rule: the requests it matches (method, path glob, workspace,"
                                        " query, headers, body) and what it does to them"),
                  "allOf": [_ERROR_RULE]},
    "JournalAssertBody": _object({"method": _STRING, "path": _STRING, **_MATCH, "code": _STRING,
                                  "times": _INTEGER, "atLeast": _INTEGER, "never": _BOOLEAN}, [],
                                 description="What the journal must hold: the requests (as a fault rule"
                                             " matches them) and how many"),
    "JournalVerdict": _object({"passed": _BOOLEAN, "count": _INTEGER, "message": _NULLABLE_STRING},
                              description="An assertion's verdict"),
    "Fault": _object({"id": _STRING, "action": _ref("FaultAction"), "method": _STRING, "path": _STRING,
                      "workspaceId": _NULLABLE_STRING, "code": _NULLABLE_STRING,
                      "status": {"type": ["integer", "null"]}, "latency": {"type": "number"},
                      "times": {"type": ["integer", "null"]},
                      **{name: {**schema, "type": ["object", "null"]} for name, schema in _MATCH.items()},
                      "fired": _INTEGER}, description="A fault rule in force, and how often it fired"),
    "SeedBody": _object({"seed": {"type": ["integer", "null"], "minimum": ID_SEEDS[0],
                                  "maximum": ID_SEEDS[1]}},
                        description="A seed for the ids and secrets that follow (null: random again)"),
    "ScenarioBody": {**_object({"scenario": _enum(("demo",)), "workspaces": {
                                    "type": "array", "items": _scenario_schema("workspaces")}}, [],
                               description="A scenario: the built-in demo, or workspaces (docs/sandbox.md);"
                                           " neither: the scenario the sandbox started from"),
                     "not": _part({"properties": {"scenario": {}, "workspaces": {}},
                                   "required": ["scenario", "workspaces"]})},
    "WorldWorkspace": _object({**_WORKSPACE, "members": _array("Member"), "keys": _array("ApiKey"),
                               "wallets": _array("Wallet")},
                              description="A workspace with its members, keys (with secrets) and wallets"),
    "World": _object({"workspaces": _array("WorldWorkspace")}, description="The workspaces a scenario made"),
    "ClockBody": _object({"freeze": _BOOLEAN, "at": _CLOCK_AT_SCHEMA, "advance": {
        "type": "number", "minimum": -CLOCK_RANGE[1], "maximum": CLOCK_RANGE[1],
        "description": "seconds; the clock stays between 1970-01-01 and 9999-12-31"}}, [],
        description="Freeze or unfreeze the service clock, set it (at) or move it (advance)"),
    "Violation": _object({"check": _STRING, "detail": _STRING, "rows": _map(
        {"type": ["string", "integer", "number", "null"]}, "the row that breaks the invariant, by column")},
        description="An invariant of the ledger that does not hold"),
    "ClockState": _object({"now": _TIME, "epochMillis": _INTEGER, "frozen": _BOOLEAN,
                           "controllable": _BOOLEAN}, description="The service clock"),
    "JournalEntry": _object({"seq": _INTEGER, "at": _TIME, "method": _STRING, "path": _STRING,
                             "query": _STRING, "apiKey": _NULLABLE_STRING, "status": _INTEGER,
                             "code": _NULLABLE_STRING, "canonicalMessage": _NULLABLE_STRING,
                             "signature": _enum(Verdict), "replayed": _BOOLEAN,
                             "headers": _map(_STRING, "the request's headers, by name"),
                             "body": _STRING, "responseBody": _STRING, "elapsedMs": {"type": "number"},
                             "diagnosis": _NULLABLE_STRING},
                            description="A request the API received, and what it answered"),
    **{item + "Page": _object({"content": _array(item), "page": _ref("PageInfo")},
                              description=f"A page of {item} items")
       for item in ("Wallet", "Balance", "Flow", "TransferOrder", "JournalEntry")},
}


def check_body(body: dict, schema: Mapping[str, Any]) -> dict:
    """S012 unless ``body`` has only the schema's fields, every required one (null only where its type
    allows), each of its JSON type (an integer may be written 465.0, then the int: docs/contract.md,
    Choices where the contract is silent). Values are the service's to check."""
    properties = schema["properties"]
    if unknown := [name for name in body if name not in properties]:
        raise invalid(str(unknown[0])[:64], "unknown_field")
    for name in schema["required"]:
        if body.get(name) is None and not (name in body and "null" in _type_names(properties[name])):
            raise invalid(name, "required")
    for name, value in body.items():
        if isinstance(value, float) and value.is_integer() and "integer" in _type_names(properties[name]):
            body[name] = value = int(value)
        _check_type(name, value, properties[name])
    return body


def _type_names(schema: Mapping[str, Any]) -> list[str]:
    """The JSON types a schema allows (of each branch, for an anyOf; of the schema named, for a $ref)."""
    if "$ref" in schema:
        return _type_names(SHARED_SCHEMAS[schema["$ref"].rsplit("/", 1)[1]])
    kinds = schema.get("type", ())
    if not kinds and "anyOf" in schema:
        return [kind for branch in schema["anyOf"] for kind in _type_names(branch)]
    return [kinds] if isinstance(kinds, str) else list(kinds)


def _check_type(name: str, value: Any, schema: Mapping[str, Any]) -> None:
    types = list(dict.fromkeys(_type_names(schema)))
    if types and not any(_JSON_TYPES[kind](value) for kind in types):
        if len(types) == 1 and types[0] in _REASONS:
            raise invalid(name, types[0])
        raise invalid(name, "type", kinds=" or ".join(types))
    if isinstance(value, list) and "items" in schema:
        for item in value:
            _check_type(name, item, schema["items"])
    if isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):  # a map's values
        for item in value.values():
            _check_type(name, item, schema["additionalProperties"])


# Each path parameter (a bottle rule's name): its name as the contract writes it, its schema, what it is.
PATH_PARAMETERS = {
    "wallet_id": ("walletId", "WalletId", "the wallet's id"),
    "biz_id": ("bizId", "BizId", "the order's bizId (an order made without one: its transferId)"),
    "workspace_id": ("workspaceId", "WorkspaceId", "the workspace's id"),
    "member_id": ("memberId", "MemberId", "the member's id"),
    "api_key": ("apiKey", "ApiKeyId", "the API key"),
    "fault_id": ("faultId", "FaultId", "the fault rule's id"),
}

_PAGE_PARAMETERS = (
    {"name": "page", "in": "query", "schema": {"type": "integer", "minimum": 0, "default": 0},
     "description": "the page's number, from 0; past the last page: no content"},
    {"name": "size", "in": "query", "schema": {"type": "integer", "minimum": 1, "default": DEFAULT_PAGE_SIZE},
     "description": f"items per page; values above {MAX_PAGE_SIZE} are capped at {MAX_PAGE_SIZE}"},
)


# Filters taking more than a choice (ListFilter.choices): what filter_time, currency_exponent, _biz_id accept.
_FILTER_SCHEMAS = {
    "currency": (_ref("Currency"), "only in this currency"),
    "bizIdPrefix": (_ref("BizId"), "only orders whose bizId starts so"),
    "createdFrom": ({**_TIME_FILTER, "description": "RFC 3339 or epoch milliseconds (inclusive)"},
                    "only created at or after this time"),
    "createdTo": ({**_TIME_FILTER, "description": "RFC 3339 or epoch milliseconds (exclusive)"},
                  "only created before this time")}


def _filters(sortable: Mapping[str, str], filters: Mapping[str, ListFilter]) -> tuple:
    """A list's query parameters; a choice's schema: the named enum (SCHEMAS) of its values, if any."""
    sort = {"name": "sort", "in": "query", "style": "form", "explode": True,
            "description": f"field,asc|desc (asc if left out; any case); repeatable, the first sorts first;"
                           f" fields: {', '.join(sortable)}",
            "schema": {"type": "array", "maxItems": MAX_SORT_KEYS, "items": {
                "type": "string", "pattern": f"^({'|'.join(sortable)})(,([aA][sS][cC]|[dD][eE][sS][cC]))?$"}}}
    enums = {tuple(schema["enum"]): _ref(name) for name, schema in SHARED_SCHEMAS.items() if "enum" in schema}
    return (*_PAGE_PARAMETERS, sort,
            *({"name": name, "in": "query", "schema": schema, "description": description}
              for name, list_filter in filters.items()
              for schema, description in [_FILTER_SCHEMAS.get(name) or (
                  enums.get(tuple(list_filter.choices)) or _enum(list_filter.choices),
                  f"only those whose {name} is this")]))


_TRANSFER_PARAMETERS = _filters(TRANSFER_SORTS, TRANSFER_FILTERS)
_FLOW_PARAMETERS = _filters(FLOW_SORTS, FLOW_FILTERS)
_WALLET_PARAMETERS = _filters(WALLET_SORTS, WALLET_FILTERS)


###############################################################################
# Declared endpoints and the envelope ##########################################
###############################################################################

class Surface(enum.StrEnum):
    """The surfaces an endpoint can belong to (``Endpoint.surface``), each authenticated its own way."""

    API = "api"  # /api/: the contract's signed pipeline
    ADMIN = "admin"  # /_admin/: the admin token, or the console's session
    CONSOLE = "console"  # the console's login page and form
    PUBLIC = "public"  # /healthz and /openapi.json


JSON_CONTENT_TYPE = "application/json; charset=utf-8"
HTML_CONTENT_TYPE = "text/html; charset=utf-8"
CONSOLE_PATH = "/_admin/console"  # the sandbox console's page (Console)
_STATUS_LINES = {status.value: f"{status.value} {status.phrase}" for status in HTTPStatus}


def console_cookie(environ: Mapping[str, Any]) -> str:
    """The name of the console's session cookie (Console) for the request's port, as /openapi.json has it."""
    port = (environ.get("HTTP_HOST") or "").rpartition(":")[2]
    if not port.isdigit():
        port = "443" if environ.get("wsgi.url_scheme") == "https" else "80"
    return f"walletsvc_console_{port}"


# The errors any request can meet (a Content-Length that is no number, an oversized body, a failure, a busy
# or missing database), and each surface's (the contract's pipeline; the admin token or console session).
ANY_REQUEST_ERRORS = (InvalidParameter, PayloadTooLarge, InternalError, ServiceBusy)
# What serve's waitress refuses before the app sees the request: the status it answers, with S012 in the
# envelope (answering_in_envelopes; any other refusal is a 400), and when. /openapi.json lists them all.
HOST_REFUSALS = {400: "a request line or header it cannot parse, or a Transfer-Encoding other than chunked",
                 431: "headers over 64 KiB (waitress's max_request_header_size)"}
SURFACE_ERRORS = {
    Surface.API: (ApiKeyMissing, ApiKeyNotFound, ApiKeyDisabled, WorkspaceNotFound, NotWorkspaceMember,
                  RequestExpired, SignatureInvalid, IpNotWhitelisted, ScopeRequired),
    Surface.ADMIN: (Unauthorized, CrossSiteRefused), Surface.CONSOLE: (), Surface.PUBLIC: ()}


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """One HTTP endpoint as declared on its handler (``@endpoint``): routing, the scope check, body checks,
    /openapi.json and Client read this and nothing else of it (docs/contributing.md, Adding an endpoint)."""

    method: str
    path: str  # a bottle rule: /api/v1/wallets/<wallet_id>
    summary: str
    response: str | dict | None  # the schema of the envelope's data: a name in SCHEMAS, inline, or None
    scope: str | None = None  # /api/ only: the scope a key needs (docs/contract.md, Scopes)
    request: str | None = None  # the JSON body's schema, a name in SCHEMAS
    query: tuple = ()  # query parameters, as OpenAPI parameter objects
    media: str | None = None  # answered as is in this media type, no envelope (/openapi.json, the console)
    name: str = ""  # the handler's name: the operation and the Client method
    links: tuple = ()  # (link name, operation name, {its parameter: where in this answer}), OpenAPI links
    form: tuple = ()  # an HTML form's fields (the console's login), instead of a JSON body
    answers: tuple = ()  # (status, description) of answers other than 200 and the error envelope
    errors: tuple = ()  # the WalletErrors its handler answers besides every operation's (errors_answered)
    rules: tuple = ()  # (field, rule): why a body its schema allows is still S012, stated in the document

    @functools.cached_property
    def surface(self) -> Surface:
        if re.match(r"/api(/|<|$)", self.path):
            return Surface.API
        if self.path == CONSOLE_PATH:
            return Surface.CONSOLE
        return Surface.ADMIN if self.path.startswith("/_admin/") else Surface.PUBLIC

    @property
    def path_names(self) -> list[str]:
        return re.findall(r"<(\w+)", self.path)

    @property
    def errors_answered(self) -> tuple[type[WalletError], ...]:
        """Every error this endpoint can answer (/openapi.json lists them): those of any request, of its
        surface, then its own (a sandbox fault rule can make an /api/ endpoint answer any: see Faults)."""
        return tuple(dict.fromkeys((*ANY_REQUEST_ERRORS, *SURFACE_ERRORS[self.surface], *self.errors)))


def endpoint(method: str, path: str, summary: str, *, response: str | dict | None, scope: str | None = None,
             request: str | None = None, query: Iterable[dict] = (), media: str | None = None,
             links: Iterable[tuple] = (), form: Iterable[str] = (), answers: Iterable[tuple] = (),
             errors: Iterable[type[WalletError]] = (), rules: Iterable[tuple[str, str]] = ()) -> Callable:
    """Declare the decorated handler as ``method path`` (see Endpoint)."""
    def declare(handler: Callable) -> Callable:
        handler.endpoint = Endpoint(method, path, summary, response, scope, request, tuple(query), media,
                                    handler.__name__, *map(tuple, (links, form, answers, errors, rules)))
        return handler
    return declare


def declared(handlers: object) -> list[tuple[Endpoint, Callable]]:
    """The endpoints a handler class (or an instance) declares, in declaration order: bottle's route order."""
    cls = handlers if isinstance(handlers, type) else type(handlers)
    return [(handler.endpoint, handler) for name in vars(cls)
            if isinstance(getattr(handler := getattr(handlers, name), "endpoint", None), Endpoint)]


def check_declaration(declaration: Endpoint, handler: Callable) -> None:
    """ValueError, when the app is created, for a declaration that could not be served."""
    problems = []
    if declaration.method not in ("GET", "POST", "PUT", "PATCH", "DELETE"):
        problems.append(f"method {declaration.method!r} is not an HTTP method")
    if not declaration.summary:
        problems.append("it has no summary")
    if declaration.surface is Surface.API and declaration.scope not in SCOPES:
        problems.append(f"an /api/ endpoint needs a scope, one of {', '.join(SCOPES)}")
    if declaration.surface is not Surface.API and declaration.scope is not None:
        problems.append("only /api/ endpoints take a scope")
    problems += [f"schema {name!r} is not in SCHEMAS" for name in (declaration.response, declaration.request)
                 if isinstance(name, str) and name not in SCHEMAS]
    problems += [f"its path parameter {name!r} is not in PATH_PARAMETERS (its name and schema)"
                 for name in declaration.path_names if name not in PATH_PARAMETERS]
    parameters = list(inspect.signature(handler).parameters)[1:]  # after the Call
    if parameters != declaration.path_names:
        problems.append(f"the handler takes {parameters} after the call,"
                        f" the path names {declaration.path_names}")
    if problems:
        raise ValueError(f"endpoint {declaration.method} {declaration.path} ({handler.__qualname__}): "
                         + "; ".join(problems))


class Reply(NamedTuple):
    """A handler's answer when more than data (handlers return data, a Reply, or a unit returning either)."""

    data: Any
    status: int = 200  # of a success (the console's login answers 303 or 401)
    headers: tuple[tuple[str, str], ...] = ()
    replayed: bool = False  # an idempotent replay of a transfer


###############################################################################
# The request path #############################################################
###############################################################################

def negotiate_locale(x_locale: str | None, accept_language: str | None, default: str) -> str:
    """en-US or zh-CN from X-LOCALE, then Accept-Language (by q, then in order), then the default."""
    def weight(part: str) -> float:  # (sorted is stable: equal weights keep their order)
        q = part.partition(";q=")[2]
        with contextlib.suppress(ValueError):
            return -float(q) if q else -1.0
        return 0.0

    for tag in [x_locale or "", *sorted((accept_language or "").split(","), key=weight)]:
        language = tag.strip()[:2].lower()
        if language in ("zh", "en"):
            return "zh-CN" if language == "zh" else "en-US"
    return default


@dataclasses.dataclass(frozen=True)
class Principal:
    """Who a request authenticated as: one key, bound to one workspace."""

    api_key: str
    workspace_id: str
    member_id: str
    scopes: frozenset


def environ_key(header: str) -> str:
    """A request header's key in the WSGI environ (PEP 3333): HTTP_, the name upper-cased, - as _."""
    return "HTTP_" + header.upper().replace("-", "_")


def received_headers(environ: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """The request's headers as (name, value) pairs, each name as HTTP writes it (X-Api-Key)."""
    pairs = tuple((name[5:].replace("_", "-").title(), value) for name, value in environ.items()
                  if name.startswith("HTTP_"))
    return pairs + (("Content-Type", environ["CONTENT_TYPE"]),) if environ.get("CONTENT_TYPE") else pairs


class Rendered(NamedTuple):
    """A rendered response, and what the journal and the access log say of it."""

    status: int
    headers: list
    body: bytes
    code: str | None
    now: int  # the envelope's timestamp


@dataclasses.dataclass(frozen=True, eq=False)
class Received:
    """A request as it arrived (and, for /api/, who it authenticated as): never changed after."""

    environ: Mapping[str, Any]
    endpoint: Endpoint | None  # None: bottle's router found nothing (404, 405)
    locale: str
    started: float  # time.perf_counter()
    path: bytes  # as sent, prefix included: the signed path
    body: bytes = b""
    principal: Principal | None = None  # set (in a copy) once the contract's pipeline passed

    @functools.cached_property
    def query(self) -> dict[str, list[str]]:
        return parse_query_string(self.environ.get("QUERY_STRING", ""))

    def json(self) -> dict:
        """The body, checked against the endpoint's request schema (an empty admin body is ``{}``)."""
        empty = not self.body.strip() and self.endpoint.surface is Surface.ADMIN
        return check_body({} if empty else json_object(self.body), SCHEMAS[self.endpoint.request])

    def header(self, name: str) -> str:
        return self.environ.get(environ_key(name), "")


class Authenticated(NamedTuple):
    """What the contract's pipeline found of a request: who it is, or why it was refused."""

    now_ms: int  # the service clock as step 1 read it
    principal: Principal | None = None
    refused: WalletError | None = None  # the first failure of steps 1-7
    canonical: bytes | None = None  # the canonical message the server computed
    verdict: Verdict = Verdict.UNCHECKED  # of the signature
    nonce: PendingNonce | None = None  # passed step 5 and the signature: recorded by the request's write
    diagnosis: Diagnosis | None = None  # the signing mistake a GA2012 matched (debug_signatures)
    faults: bool = False  # whether fault rules were in force when the key was read


class Decision(NamedTuple):
    """A request decided: the handler's data or Reply, the write unit answering instead, or the error."""

    data: Any = None
    unit: Unit | None = None  # a write endpoint's: run by the request's one write
    error: WalletError | None = None
    auth: Authenticated | None = None  # (an /api/ request's)
    fault: FaultRule | None = None  # a rule acting after the handler (commit_then_fail or _drop)
    quiet: bool = False  # left out of the access log (the console's polling)
    headers: tuple[tuple[str, str], ...] = ()  # on the answer, whatever it is (a 405's Allow)


def as_reply(data: Any) -> Reply:
    """What a handler (or its write unit) answered, as a Reply: a transfer says whether it is a replay."""
    if isinstance(data, Reply):
        return data
    return Reply(data.order, replayed=data.replayed) if isinstance(data, Transferred) else Reply(data)


def to_json(value: Any) -> bytes:
    """Compact UTF-8 JSON, as every response is sent."""
    return _JSON.encode(value).encode("utf-8")


def envelope(data: Any, now_ms: int) -> dict:
    """The success envelope of docs/contract.md."""
    return {"version": API_VERSION, "timestamp": now_ms, "success": True,
            "code": SUCCESS_CODE, "message": "SUCCESS", "data": data}


def error_envelope(error: WalletError, locale: str, now_ms: int) -> dict:
    """The error envelope: the catalog's code and name, data null, a localized detail."""
    return {"version": API_VERSION, "timestamp": now_ms, "success": False,
            "code": error.code, "message": error.name, "data": None, "detail": error.detail(locale)}


def json_object(body: bytes) -> dict:
    """The body as a JSON object; duplicate keys are refused, not silently merged."""
    def no_duplicates(pairs: list) -> dict:
        seen = {}
        for name, value in pairs:
            if name in seen:
                raise invalid(str(name)[:64], "duplicate")
            seen[name] = value
        return seen

    try:
        value = json.loads(body.decode("utf-8"), object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise invalid("body", "json") from None
    if not isinstance(value, dict):
        raise invalid("body", "json")
    if b"\\u" in body:  # an escaped lone surrogate decodes to a str no database or UTF-8 answer can hold
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise invalid("body", "surrogate") from None
    return value


def raw_request_path(environ: Mapping[str, Any]) -> bytes:
    """The path as the client sent it, including any mount prefix (docs/signing.md)."""
    if raw := environ.get("REQUEST_URI") or environ.get("RAW_URI"):
        if not raw.startswith("/"):  # absolute-form request target
            raw = urllib.parse.urlsplit(raw).path or "/"
        return raw.split("?", 1)[0].encode("latin-1", "replace")
    # A server that hands over only the decoded path (wsgiref, Django's runserver, a2wsgi under
    # uvicorn): that path encoded the minimal RFC 3986 way, which is what Client sends.
    decoded = environ.get("SCRIPT_NAME", "") + environ.get("bottle.raw_path", environ.get("PATH_INFO", ""))
    return urllib.parse.quote(decoded.encode("latin-1", "replace"), safe="/" + PCHAR_DELIMS).encode("ascii")


# What RFC 3986 lets a path segment carry unencoded besides the unreserved characters (pchar: sub-delims,
# ":" and "@"): Client leaves them so, and every server hands the app the path signed (docs/signing.md).
PCHAR_DELIMS = "!$&'()*+,;=:@"


def _ip(text: str | None) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        address = ipaddress.ip_address((text or "").strip().strip("[]"))
    except ValueError:
        return None
    return getattr(address, "ipv4_mapped", None) or address


def _in_any(address: Any, networks: Iterable) -> bool:
    return address is not None and any(address.version == net.version and address in net for net in networks)


def client_ip(environ: Mapping[str, Any], trusted_proxies: Sequence) -> Any:
    """REMOTE_ADDR, or, when that is a trusted proxy, X-Forwarded-For read from the right (docs/contract.md,
    Choices where the contract is silent); an unparsable hop yields None, which no whitelist admits."""
    remote, forwarded = _ip(environ.get("REMOTE_ADDR")), environ.get("HTTP_X_FORWARDED_FOR")
    if not forwarded or not _in_any(remote, trusted_proxies):
        return remote
    hops = [_ip(hop) for hop in forwarded.split(",")]
    return next((hop for hop in reversed(hops) if not _in_any(hop, trusted_proxies)), hops[0])


_TIMESTAMP = re.compile(r"[0-9]{1,12}")


class SignedHeaders(NamedTuple):
    """the contract's four request headers as received ("" when absent), read once per request."""

    api_key: str
    timestamp: str
    nonce: str
    signature: str
    stamp: int  # X-Timestamp as epoch seconds; -1 when it is not 1-12 digits (step 4 says why)

    @classmethod
    def of(cls, environ: Mapping[str, Any]) -> SignedHeaders:
        api_key, timestamp, nonce, signature = map(environ.get, _SIGNED_KEYS, ("", "", "", ""))
        return cls(api_key, timestamp, nonce, signature,
                   int(timestamp) if _TIMESTAMP.fullmatch(timestamp) else -1)


_SIGNED_KEYS = tuple(environ_key(name) for name in ("X-Api-Key", "X-Timestamp", "X-Nonce", "X-Signature"))


class Authenticator:
    """Steps 1-7 of the contract's pipeline (docs/contract.md, The validation pipeline); step 8 needs the
    route (``HttpApi.check_scope``). Nothing here writes: a nonce that passed awaits the request's write."""

    def __init__(self, svc: WalletService, settings: Settings) -> None:
        self.svc, self.db, self.settings, self.nonces = svc, svc.db, settings, Nonces(settings.nonce_records)

    def authenticate(self, request: Received) -> Authenticated:
        """Steps 1-7: the Principal or first failure (``refused``), what the journal keeps, the nonce."""
        signed = SignedHeaders.of(request.environ)
        canonical = (canonical_message(request.environ["REQUEST_METHOD"], request.path, signed.timestamp,
                                       signed.nonce, body_hash(request.body))
                     if (signed.timestamp + signed.nonce).isascii() else None)  # (else steps 4, 5 refuse it)
        lookup = Nonces.parameters(signed.api_key, signed.nonce, signed.stamp)
        key = self.db.one(self._KEY, lookup) if 0 < len(signed.api_key) <= 128 else None
        now_ms = int(self.svc.clock.reading_of(key) * 1000)
        try:
            self.key(signed, key)
            self.timestamp(now_ms, signed)
            self.nonce(signed, key)
        except WalletError as exc:
            return Authenticated(now_ms, refused=exc)
        if not self._signature_matches(key["secret"], canonical, signed.signature):
            return self.signature_refused(request, key, signed, canonical, now_ms)
        nonce = PendingNonce(key["id"], signed.nonce, signed.stamp)
        whitelist = json.loads(key["ip_whitelist"]) if key["ip_whitelist"] else None
        if whitelist and not _in_any(client_ip(request.environ, self.settings.trusted_proxies),
                                     (ipaddress.ip_network(entry, strict=False) for entry in whitelist)):
            return Authenticated(now_ms, None, IpNotWhitelisted(), canonical, Verdict.VALID, nonce)  # step 7
        principal = Principal(key["id"], key["workspace_id"], key["member_id"],
                              frozenset(key["scopes"].split()))
        faults = bool(key["faults"] or self.svc.faults.builtin)
        return Authenticated(now_ms, principal, None, canonical, Verdict.VALID, nonce, faults=faults)

    # One statement: the key, its workspace's and member's state, step 5's nonce (Nonces.LOOKUP), whether
    # fault rules are in force (none: a request pays nothing for them), the clock's state (Clock.reading_of).
    _KEY = ("SELECT k.id, k.secret, k.workspace_id, k.member_id, k.scopes, k.ip_whitelist, k.enabled,"
            "       w.deleted_at IS NOT NULL AS workspace_deleted,"
            "       m.removed_at IS NOT NULL AS member_removed,"
            f"      {Nonces.LOOKUP}, s.fault_rules AS faults, s.clock_frozen_at, s.clock_offset"
            "  FROM api_keys k JOIN workspaces w ON w.id = k.workspace_id"
            "                  JOIN members m ON m.id = k.member_id LEFT JOIN sandbox s"
            " WHERE k.id = :api_key")

    @staticmethod
    def key(signed: SignedHeaders, key: sqlite3.Row | None) -> None:
        """Steps 1-3: the key given, known, enabled; its workspace, and its member still in it."""
        if not signed.api_key:
            raise ApiKeyMissing()
        if key is None:
            raise ApiKeyNotFound()
        if not key["enabled"]:
            raise ApiKeyDisabled()
        if key["workspace_deleted"]:
            raise WorkspaceNotFound()
        if key["member_removed"]:
            raise NotWorkspaceMember()

    def timestamp(self, now_ms: int, signed: SignedHeaders) -> None:
        """Step 4: X-Timestamp within the window of the machine's clock or of the service clock's
        (docs/signing.md, The server's time; docs/contract.md, Signing)."""
        timestamp, tolerance = signed.timestamp, self.settings.timestamp_tolerance
        if signed.stamp < 0:
            if re.fullmatch(r"1[0-9]{12}", timestamp):  # 13 digits: milliseconds
                raise expired("X-Timestamp must be Unix epoch seconds; this one looks like milliseconds.",
                              "X-Timestamp 必须是 Unix 秒级时间戳；该值看起来是毫秒。")
            raise expired("X-Timestamp must be Unix epoch seconds.", "X-Timestamp 必须是 Unix 秒级时间戳。")
        now, wall = now_ms // 1000, int(time.time())
        if abs(wall - signed.stamp) > tolerance and abs(now - signed.stamp) > tolerance:
            raise self.outside_window(now, wall, signed.stamp, tolerance)

    @staticmethod
    def nonce(signed: SignedHeaders, key: sqlite3.Row) -> None:
        """Step 5: X-Nonce well formed, not recorded for this key, its second not forgotten (``Nonces``)."""
        if not _NONCE.fullmatch(signed.nonce):
            raise expired("X-Nonce must be 1-128 printable ASCII characters.",
                          "X-Nonce 必须是 1-128 个可打印 ASCII 字符。")
        if key["nonce_used"]:
            raise _nonce_used()
        if key["nonce_forgotten"]:
            raise _nonce_forgotten()

    def outside_window(self, now: int, wall: int, stamp: int, tolerance: int) -> RequestExpired:
        """Step 4's refusal: the server's time, and the machine's when the service clock stands elsewhere."""
        english = (f"X-Timestamp is more than {tolerance} s from server time: the server's time is"
                   f" {now} ({iso_time(now * 1000)}), the request's is {stamp - now:+d} s from it.")
        chinese = (f"X-Timestamp 与服务器时间相差超过 {tolerance} 秒：服务器时间为 {now}"
                   f"（{iso_time(now * 1000)}），请求时间与其相差 {stamp - now:+d} 秒。")
        if abs(now - wall) > tolerance:
            clock = self.svc.clock
            state = ("frozen" if clock.frozen else "moved") if clock.controllable else "its own"
            english += (f" The sandbox clock is {state}; a request signed at the machine's time ({wall},"
                        f" {iso_time(wall * 1000)}), as an app in production signs, is accepted too"
                        f" ({stamp - wall:+d} s from it).")
            zh_state = {"frozen": "已冻结", "moved": "已调整"}.get(state, "自行计时")
            chinese += (f"沙箱时钟{zh_state}；"
                        f"以本机时间（{wall}，{iso_time(wall * 1000)}）签名的请求同样被接受，"
                        f"如生产环境中的应用（请求与其相差 {stamp - wall:+d} 秒）。")
        return expired(english, chinese)

    def signature_refused(self, request: Received, key: sqlite3.Row, signed: SignedHeaders, canonical: bytes,
                          now_ms: int) -> Authenticated:
        """Step 6 failed: GA2012; a sandbox with ``debug_signatures`` shows the message and the signing
        mistake it matches, never the secret or the expected signature."""
        if not self.settings.debug_signatures:
            return Authenticated(now_ms, None, SignatureInvalid(), canonical, Verdict.INVALID)
        body = request.body
        shown = canonical.decode("latin-1").replace("\n", "\\n")
        english = f"Canonical message: {shown} ({len(body)} body bytes received)."
        chinese = f"规范消息：{shown}（收到请求体 {len(body)} 字节）。"
        diagnosis = diagnose_signature(key["secret"], request.environ, request.path, body, signed.timestamp,
                                       signed.nonce, signed.signature)
        if diagnosis:
            english += f" The signature matches a common mistake: {diagnosis.english}."
            chinese += f"签名符合一个常见错误：{diagnosis.chinese}。"
        return Authenticated(now_ms, None, SignatureInvalid(extra=english, zh_extra=chinese), canonical,
                             Verdict.INVALID, diagnosis=diagnosis)

    @staticmethod
    def _signature_matches(secret: str, message: bytes, provided: str) -> bool:
        try:
            given = binascii.a2b_base64(provided.encode("ascii"), strict_mode=True)
        except (UnicodeEncodeError, binascii.Error, ValueError):
            return False
        return hmac.compare_digest(hmac.digest(secret.encode("utf-8"), message, "sha256"), given)


ADMIN_PATIENCE = 0.5  # seconds an admin write waits for the lock before S503 (the API waits busy_timeout)


class HttpApi:
    """The one request path: ``respond`` decides, commits, renders and logs (docs/contributing.md). It is
    the bottle plugin too, so bottle's own dispatch (a route-merging ``mount``, an added hook) ends in it."""

    name = "walletsvc"
    api = 2

    def __init__(self, svc: WalletService, settings: Settings, console: Any) -> None:
        self.svc, self.settings = svc, settings
        self.auth = Authenticator(svc, settings)
        self.console = console  # the console's sessions (Console), for the admin surface
        self.endpoints: list[Endpoint] = []  # every declared endpoint the app serves
        self.access_log: logging.Logger | None = None  # one line per request when set (walletsvc serve)
        self.sleep: Callable[[float], None] = time.sleep  # a latency rule's wait (serve's frees a thread)

    def apply(self, callback: Callable, route: bottle.Route) -> Callable:
        """bottle's plugin API: declared routes answer through ``respond``; others are left alone."""
        if "endpoint" not in route.config:
            return callback

        def through_serve(**url_args: Any) -> bottle.HTTPResponse:
            status, headers, body = self.respond(bottle.request.environ, route.config["endpoint"], url_args,
                                               callback)
            return bottle.HTTPResponse(body, status, headers)
        return through_serve

    def respond(self, environ: Mapping[str, Any], endpoint: Endpoint, url_args: dict,
                handler: Callable) -> tuple[int, list, Iterable[bytes]]:
        """Answer one request routed to a declared ``endpoint``: status, headers, body."""
        request, refused = self.receive(environ, endpoint)
        decision = Decision(error=refused) if refused is not None else self.decide(request, url_args, handler)
        answer = self.commit(request, decision)
        dropped = (decision.fault is not None and decision.fault.action == FaultAction.COMMIT_THEN_DROP
                   and answer.code == SUCCESS_CODE)
        self.log(request, answer, decision.quiet, decision.fault if dropped else None)
        return answer.status, answer.headers, _dropped(answer.body) if dropped else [answer.body]

    def fail(self, environ: Mapping[str, Any], exc: BaseException) -> tuple[int, list, Iterable[bytes]]:
        """Answer what no endpoint took: bottle's 404 (saying where the API and console are), 405 or 500."""
        request, too_large = self.receive(environ, None)  # the size limit comes first, a 404's too (contract)
        error, headers = too_large or exc, ()
        if too_large is None and isinstance(exc, bottle.HTTPError):
            where = NotFound(f"The API is under /api/v1/ (GET /openapi.json lists its paths); the sandbox"
                             f" console is at {CONSOLE_PATH}.", thing="path", thing_zh=_THINGS_ZH["path"],
                             zh_extra=f"API 位于 /api/v1/（GET /openapi.json 列出其路径）；沙箱控制台位于"
                                      f" {CONSOLE_PATH}。")
            error = {404: where, 405: MethodNotAllowed()}.get(
                exc.status_code, exc.exception or RuntimeError(exc.body))
            if exc.status_code == 405 and exc.get_header("Allow"):
                headers = (("Allow", exc.get_header("Allow")),)
        answer = self.commit(request, Decision(error=self.as_wallet_error(error), headers=headers))
        self.log(request, answer, False)
        return answer.status, answer.headers, [answer.body]

    def receive(self, environ: Mapping[str, Any],
                endpoint: Endpoint | None) -> tuple[Received, WalletError | None]:
        """The request as received, its body read, its locale chosen; the error if the body was refused."""
        started, refused, body = time.perf_counter(), None, b""
        try:
            body = self.read_body(environ)
        except WalletError as exc:
            refused = exc
        locale = self.settings.default_locale
        if "HTTP_X_LOCALE" in environ or "HTTP_ACCEPT_LANGUAGE" in environ:
            locale = negotiate_locale(environ.get("HTTP_X_LOCALE"), environ.get("HTTP_ACCEPT_LANGUAGE"),
                                      locale)
        return Received(environ, endpoint, locale, started, raw_request_path(environ), body), refused

    # 1. Decide ###############################################################

    def decide(self, request: Received, url_args: dict, handler: Callable) -> Decision:
        """Who asks (/api/: the contract's pipeline; /_admin/: the admin token), then the handler's answer."""
        if request.endpoint.surface is Surface.API:
            return self.decide_api(request, url_args, handler)
        quiet = False
        try:
            if request.endpoint.surface is Surface.ADMIN:
                quiet = self.check_admin(request)
            with self.svc.db.patience(ADMIN_PATIENCE):
                return Decision(handler(request, **url_args), quiet=quiet)
        except Exception as exc:  # noqa: BLE001 - every failure becomes the envelope
            return Decision(error=self.as_wallet_error(exc), quiet=quiet)

    def decide_api(self, request: Received, url_args: dict, handler: Callable) -> Decision:
        """The contract's pipeline (steps 1-8), the fault rules, then the endpoint."""
        try:
            auth = self.auth.authenticate(request)
        except Exception as exc:  # noqa: BLE001 - (a database that cannot be read)
            return Decision(error=self.as_wallet_error(exc))
        if auth.refused is not None:
            return Decision(error=auth.refused, auth=auth)
        request = dataclasses.replace(request, principal=auth.principal)
        try:
            self.check_scope(request)
            fault = self.take_fault(request) if auth.faults else None
            if fault is not None:
                self.sleep(fault.latency)  # (outside any transaction; ``walletsvc serve`` frees a thread)
                if fault.action == FaultAction.ERROR:
                    raise forced_error(fault)
            result = handler(request, **url_args)
        except Exception as exc:  # noqa: BLE001 - every failure becomes the envelope
            return Decision(error=self.as_wallet_error(exc), auth=auth)
        if callable(result):
            return Decision(unit=result, auth=auth, fault=fault)
        return self.after_fault(Decision(result, auth=auth, fault=fault))

    @staticmethod
    def after_fault(decision: Decision) -> Decision:
        """A commit_then_fail rule's S500 once the handler applied the request, its writes kept
        (commit_then_drop acts on the answer, in ``serve()``)."""
        fault = decision.fault
        if fault is None or fault.action != FaultAction.COMMIT_THEN_FAIL:
            return decision
        return decision._replace(error=InternalError(
            text=f"Forced by fault rule {fault.id} after the request was applied."))

    @staticmethod
    def check_scope(request: Received) -> None:
        """Step 8: the endpoint's scope; what no endpoint declares is denied (docs/contract.md, Scopes)."""
        scope, method = request.endpoint.scope, request.environ["REQUEST_METHOD"]
        if scope is None or method != request.endpoint.method:  # deny by default, saying what is there
            path = request.path.decode("latin-1")
            slash = " (without its trailing /?)" if path.endswith("/") and len(path) > 1 else ""
            zh_slash = "（去掉末尾的 /？）" if slash else ""
            raise ApiAccessDenied(f"No endpoint is {method} {path}{slash}; /openapi.json lists them.",
                                  zh_extra=f"不存在接口 {method} {path}{zh_slash}；见 /openapi.json。")
        if scope not in request.principal.scopes:
            raise ScopeRequired(scope=scope)

    def take_fault(self, request: Received) -> FaultRule | None:
        """The fault rule this request fires, if any. Rules name the app's own paths: PATH_INFO's last
        segments, as many as the endpoint's path has, leave out any prefix a mount put there."""
        environ, depth = request.environ, request.endpoint.path.count("/")
        path = "/" + "/".join(environ.get("PATH_INFO", "").split("/")[-depth:])
        return self.svc.faults.take(environ["REQUEST_METHOD"], path, request.principal.workspace_id, lambda: {
            "query": environ.get("QUERY_STRING", ""), "body": request.body.decode("utf-8", "replace"),
            "headers": dict(received_headers(environ))})

    def check_admin(self, request: Received) -> bool:
        """The bearer token, or a valid console session cookie with the page's CSRF header from the same
        origin (else S403). True for the console's polling, left out of the access log (not its actions)."""
        environ = request.environ
        nonce = self.console.session(environ)
        if nonce is None or "HTTP_AUTHORIZATION" in environ:  # (an invalid cookie: S401, as no token)
            scheme, _, token = environ.get("HTTP_AUTHORIZATION", "").partition(" ")
            expected = (self.settings.admin_token or "").encode("utf-8")
            given = token.strip().encode("latin-1", "replace")
            if scheme.lower() != "bearer" or not expected or not hmac.compare_digest(given, expected):
                raise Unauthorized()
            return False
        if not self.console.same_origin(environ, nonce):
            raise CrossSiteRefused()
        return environ["REQUEST_METHOD"] == "GET"

    # 2. Commit ###############################################################

    def commit(self, request: Received, decision: Decision) -> Rendered:
        """The request's one write, as one unit: its nonce record, write unit and journal entry. Rendered
        again only when the nonce lost a race or the write failed; with nothing to write, without one."""
        nonce = decision.auth.nonce if decision.auth is not None else None
        journal = (self.svc.journal.enabled and request.endpoint is not None
                   and request.endpoint.surface is Surface.API)
        known = self.render(request, decision) if decision.unit is None else None
        if nonce is None and decision.unit is None and not journal:
            return known

        def unit(conn: sqlite3.Connection) -> Rendered:
            outcome = decision
            try:
                if nonce is not None:
                    self.auth.nonces.record(conn, nonce)  # a replay that lost the race: GA2013, no more
                if decision.unit is not None:
                    outcome = self.applied(conn, decision)
            except WalletError as exc:
                outcome = decision._replace(unit=None, error=exc)
            answer = known if outcome is decision else self.render(request, outcome)
            if journal:
                self.svc.journal.record(conn, self.journal_entry(request, outcome, answer))
            return answer

        try:
            return self.svc.db.write([unit], durable=decision.unit is not None)[0]
        except Exception as exc:  # noqa: BLE001 - the write failed: nothing of it was kept
            if nonce is None and decision.unit is None:
                log.warning("request not journaled: %s", exc)
                return known
            # (an unrecorded nonce is not trusted)
            return self.render(request, decision._replace(unit=None, error=self.as_wallet_error(exc)))

    def applied(self, conn: sqlite3.Connection, decision: Decision) -> Decision:
        """The write unit in its own savepoint (a failure undoes only its writes), then ``after_fault``."""
        try:
            data = savepoint(conn, decision.unit)
        except Exception as exc:
            if isinstance(exc, sqlite3.Error) and not conn.in_transaction:
                raise  # the whole batch was lost (a full disk): S503 for each of its requests
            return decision._replace(unit=None, error=self.as_wallet_error(exc))
        return self.after_fault(decision._replace(data=data, unit=None))

    # 3. Render ###############################################################

    def render(self, request: Received, outcome: Decision) -> Rendered:
        """The one renderer: the envelope (or a bare document), its status and headers."""
        now = outcome.auth.now_ms if outcome.auth is not None else self.now_ms()
        error, reply = outcome.error, as_reply(outcome.data)
        media = request.endpoint.media if error is None else None
        if error is None:
            status, payload = reply.status, reply.data if media else envelope(reply.data, now)
        else:
            status, payload = error.status, error_envelope(error, request.locale, now)
        body = payload.encode("utf-8") if isinstance(payload, str) else to_json(payload)
        headers = [("Content-Type", media or JSON_CONTENT_TYPE), ("Content-Language", request.locale),
                   ("Cache-Control", "no-store"), ("Content-Length", str(len(body))), *outcome.headers]
        if error is None:
            headers.extend(reply.headers)
            if reply.replayed:
                headers.append(("Idempotent-Replayed", "true"))
        code = error.code if error is not None else (None if media else SUCCESS_CODE)
        return Rendered(status, headers, body, code, now)

    def now_ms(self) -> int:
        try:
            return self.svc.now_ms()
        except (sqlite3.Error, WalletError):  # a sandbox clock the database cannot show: real time
            return int(time.time() * 1000)

    @staticmethod
    def journal_entry(request: Received, outcome: Decision, answer: Rendered) -> JournalEntry:
        environ, auth = request.environ, outcome.auth or Authenticated(answer.now)
        replayed = as_reply(outcome.data).replayed and answer.code == SUCCESS_CODE
        return JournalEntry(
            answer.now, environ["REQUEST_METHOD"], request.path, environ.get("QUERY_STRING", ""),
            environ.get("HTTP_X_API_KEY") or None, answer.status, answer.code, auth.canonical, auth.verdict,
            replayed, received_headers(environ), request.body, answer.body,
            round((time.perf_counter() - request.started) * 1000, 3),
            auth.diagnosis.english if auth.diagnosis else None)

    # 4. Log ##################################################################

    def log(self, request: Received, answer: Rendered, quiet: bool, dropped: FaultRule | None = None) -> None:
        """The access log line (``walletsvc serve``) unless quiet; a dropped answer's line names the rule."""
        if self.access_log is not None and not quiet:
            outcome = (f"{answer.status} {answer.code or '-'}" if dropped is None
                       else f"dropped by fault rule {dropped.id} after the commit")
            self.access_log.info("%s %s %s %.1fms", request.environ.get("REQUEST_METHOD"),
                                 request.path.decode("latin-1"), outcome,
                                 (time.perf_counter() - request.started) * 1000)

    # What every step shares ##################################################

    def read_body(self, environ: Mapping[str, Any]) -> bytes:
        """The body, read once, exactly, within the size limit, checked before all else (docs/contract.md)."""
        length_text = environ.get("CONTENT_LENGTH") or ""
        chunked = "chunked" in environ.get("HTTP_TRANSFER_ENCODING", "").lower()
        if not chunked and length_text in ("", "0"):
            return b""
        limit = self.settings.max_body_bytes
        if length_text and not length_text.isdigit():
            raise invalid("Content-Length", "integer")
        length = int(length_text or 0)
        if length > limit:
            raise PayloadTooLarge(limit=limit)
        stream = environ.get("wsgi.input")
        body = stream.read(length or limit + 1) if stream is not None and (length or chunked) else b""
        if len(body) > limit:
            raise PayloadTooLarge(limit=limit)
        return body

    def as_wallet_error(self, exc: BaseException) -> WalletError:
        if isinstance(exc, WalletError):
            return exc
        if isinstance(exc, sqlite3.Error) and (busy := self.svc.db.unavailable(exc)) is not None:
            return busy
        log.error("unexpected error while serving a request", exc_info=exc)
        return InternalError()

    def bottle_error(self, error: bottle.HTTPError) -> list[bytes]:
        """bottle's error handler: its own 404, 405 and 500, rendered by ``commit``."""
        status, headers, body = self.fail(bottle.request.environ, error)
        bottle.response.status = status
        for name, value in headers:
            bottle.response.set_header(name, value)
        return list(body)


class ConnectionDropped(ConnectionAbortedError):
    """A commit_then_drop rule's abort: the access log says so in its line, the server logs no traceback."""


def _dropped(body: bytes) -> Iterator[bytes]:
    """Half the body, then an abort: the server closes the connection mid-response."""
    yield body[: len(body) // 2]
    raise ConnectionDropped("walletsvc fault rule: connection dropped after the commit")


def _not_a_dropped_connection(record: logging.LogRecord) -> bool:
    """waitress's logger filter: its "Exception while serving" for a ConnectionDropped goes."""
    return not (record.exc_info and isinstance(record.exc_info[1], ConnectionDropped))


class WalletApp(bottle.Bottle):
    """The WSGI app: a ``bottle.Bottle`` that hands a declared route straight to ``http.respond``, without
    bottle's ``_handle`` but doing first what it does (docs/embedding.md, How a request is served)."""

    built_with: list | None = None  # the plugins create_app installed: any other needs bottle's dispatch

    def __init__(self, http: HttpApi, **options: Any) -> None:
        self.http = http
        self.hooks_added: list[str] = []  # hooks someone added (bottle runs them in its dispatch)
        super().__init__(**options)

    def add_hook(self, name: str, func: Callable) -> None:
        self.hooks_added.append(name)
        super().add_hook(name, func)

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        if self.plugins != self.built_with or self.hooks_added or environ.get("REQUEST_METHOD") == "HEAD":
            return self.wsgi(environ, start_response)
        raw = environ.get("PATH_INFO", "")
        try:  # what bottle's _handle does to the path before routing
            environ["PATH_INFO"] = raw.encode("latin-1").decode("utf-8", "ignore")
            route, url_args = self.router.match(environ)
        except UnicodeError:
            environ["PATH_INFO"] = raw
            return self.wsgi(environ, start_response)
        except bottle.HTTPError as exc:  # bottle's 404 or 405
            environ["bottle.raw_path"] = raw
            status, headers, body = self.http.fail(environ, exc)
        else:
            if "endpoint" not in route.config:  # not ours: bottle's dispatch, as it expects
                environ["PATH_INFO"] = raw
                return self.wsgi(environ, start_response)
            environ["bottle.raw_path"], environ["bottle.app"] = raw, self
            status, headers, body = self.http.respond(environ, route.config["endpoint"], url_args,
                                                    route.callback)
        start_response(_STATUS_LINES.get(status) or f"{status} Error", headers)
        return body


###############################################################################
# OpenAPI document #############################################################
###############################################################################

SURFACE_TAGS = {
    Surface.API: ("The contract's nine endpoints, each request signed (see the security scheme Signature)"),
    Surface.ADMIN: "The sandbox's control surface: only with an admin token, sent as Authorization: Bearer",
    Surface.CONSOLE: "The sandbox console, an HTML page behind a login form",
    Surface.PUBLIC: "Health and this document, without authentication",
}
_SURFACE_AUTH = {
    Surface.API: "Signed (the security scheme Signature says how); the key needs the scope `{scope}`.",
    Surface.ADMIN: "Needs the admin token (Authorization: Bearer) or the console's session.",
    Surface.CONSOLE: "Open: the page asks for the admin token.",
    Surface.PUBLIC: "Open: no authentication.",
}
# The recipe of docs/signing.md, complete: a reader of the document alone can sign.
SIGNING_RECIPE = """\
Every /api/ request carries four headers: X-Api-Key (the key), X-Timestamp (Unix seconds, as a decimal \
integer of 1-12 digits), X-Nonce (1-128 printable ASCII characters without whitespace, unique per key; \
UUID v4 recommended) and X-Signature:

    X-Signature = Base64( HMAC-SHA256( secret, canonical ) )
    canonical   = METHOD + "\\n" + PATH + "\\n" + TIMESTAMP + "\\n" + NONCE + "\\n" + SHA256_HEX(body)

- METHOD: the HTTP method in upper case (GET, POST).
- PATH: the path exactly as sent, without the query string (query parameters are not signed) and with \
any prefix the service is mounted under (the path of this document's server URL comes first): \
`/payments/api/v1/wallets` for a server `http://host/payments`. Percent-encode a path segment only where \
RFC 3986 requires it.
- TIMESTAMP and NONCE: the X-Timestamp and X-Nonce header values.
- SHA256_HEX(body): the lowercase hex SHA-256 of the exact body bytes sent; for an empty body (every GET) \
`e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855`.
- The five lines are joined with LF (\\n), with no trailing LF; the HMAC's key is the secret's UTF-8 bytes; \
Base64 is the standard alphabet with padding (not hex, not URL-safe).
- The clock: sign at the service's time. A timestamp more than {tolerance} s from it is GA2013; every \
answer's envelope carries the service's time (`timestamp`, epoch milliseconds; GET /healthz answers it \
unsigned): a client whose clock differs signs at that time (in a sandbox, the service clock may be \
frozen or moved).
- A nonce is refused (GA2013) once used with that key; a failed signature does not use it up.
"""


def _example(schema: Any) -> Any:
    """A value valid against ``schema``: its own example if it has one (patterns need one), else by type."""
    if "$ref" in schema:
        return _example(SCHEMAS[schema["$ref"].rsplit("/", 1)[1]])
    for keyword, pick in (("examples", 0), ("const", None), ("default", None), ("enum", 0)):
        if keyword in schema:
            return schema[keyword] if pick is None else schema[keyword][pick]
    if "anyOf" in schema:
        return _example(schema["anyOf"][0])
    kind = next((kind for kind in _type_names(schema) if kind != "null"), "null")
    if kind == "object":
        wanted = schema["required"] if "not" in schema else schema.get("properties", {})
        return {name: _example(schema["properties"][name]) for name in wanted}
    if kind == "array":
        return [_example(schema["items"])]
    formats = {"date-time": "2024-05-01T12:00:00.000Z", "date": "2024-05-01"}
    return {"string": formats.get(schema.get("format"), "text"), "integer": schema.get("minimum", 0),
            "number": schema.get("minimum", 0), "boolean": True, "null": None}[kind]


_HEADERS = {
    "Content-Language": {"description": "the language of an error's detail (from X-LOCALE, then"
                                        " Accept-Language)", "schema": _enum(LOCALES)},
    "Cache-Control": {"description": "answers are never cached", "schema": {"const": "no-store"}},
}
_REPLAYED = {"Idempotent-Replayed": {"description": "true: the same request came before, and this is its"
                                                   " order, unchanged (docs/contract.md)",
                                    "schema": {"const": "true"}}}
_LANGUAGE_PARAMETERS = [
    {"name": "X-LOCALE", "in": "header", "required": False,
     "schema": {"type": "string", "examples": ["zh-CN"]},
     "description": "the language of an error's detail: en-US (default) or zh-CN (zh, zh_CN understood;"
                    " any other: en-US). Not signed"},
    {"name": "Accept-Language", "in": "header", "required": False,
     "schema": {"type": "string", "examples": ["zh-CN,zh;q=0.9"]},
     "description": "used when X-LOCALE is absent; not signed"}]


def _headers(*names: str) -> dict:
    return {name: {"$ref": f"#/components/headers/{name}"} for name in names}


def _error_responses(errors: Iterable[type[WalletError]], head: bool = False) -> dict:
    """Error answers by status: the Error envelope with the codes it answers (an example each, listed
    in the description), and what serve's server refuses first (HOST_REFUSALS); a HEAD answer has no body."""
    statuses: dict[int, list] = {}
    for error in errors:
        statuses.setdefault(error.status, []).append(error)
    for status in HOST_REFUSALS:
        if InvalidParameter not in statuses.setdefault(status, []):
            statuses[status].append(InvalidParameter)
    answers = {}
    for status, answered in sorted(statuses.items()):
        answer: dict[str, Any] = {"description": "; ".join(f"{error.code} {error.name}" for error in answered)
                                  + (f" ({HOST_REFUSALS[status]})" if status in HOST_REFUSALS else ""),
                                  "headers": _headers(*_HEADERS)}
        if not head:
            answer["content"] = {"application/json": {"schema": _ref("Error"), "examples": {
                error.code: {"$ref": f"#/components/examples/{error.code}"} for error in answered}}}
        answers[str(status)] = answer
    return answers


def _error_examples(endpoints: list[Endpoint]) -> dict:
    """An example of each error ``endpoints`` answer (components/examples; every operation lists S012)."""
    answered = {InvalidParameter}.union(*(declaration.errors_answered for declaration in endpoints))
    return {error.code: {"summary": error.name, "value": {
        "version": API_VERSION, "timestamp": 1714564800000, "success": False, "code": error.code,
        "message": error.name, "data": None, "detail": re.sub(r"\{\w*\}", "...", error.messages[0])}}
        for error in ERRORS if error in answered}


def openapi_document(endpoints: Iterable[Endpoint], base_url: str) -> dict:
    """OpenAPI 3.1 of ``endpoints``, from their declarations, with ``base_url`` as the server."""
    paths: dict[str, dict] = {}
    endpoints = list(endpoints)
    for ep in endpoints:
        operations = paths.setdefault(re.sub(r"<(\w+)>", lambda name: "{" + PATH_PARAMETERS[name[1]][0] + "}",
                                             ep.path), {})
        operations[ep.method.lower()] = _operation(ep)
        if ep.method == "GET" and ep.surface is not Surface.API:
            # bottle answers HEAD wherever GET is served, but under /api/: the contract denies what it
            # does not declare (403 50090201), so no client generator makes a method that cannot work
            operations["head"] = _operation(ep, head=True)
    header = {"type": "apiKey", "in": "header"}
    see_signature = "one of the four signing headers: see the scheme Signature"
    return {
        "openapi": "3.1.0",
        "info": {"title": "walletsvc", "version": __version__,
                 "summary": "A wallet-and-transfer service: signed HTTP API, SQLite ledger, sandbox",
                 "description": "Wallet and Transfer Service. Every /api/ request is signed (the security"
                                " scheme Signature says how). /_admin/ exists only when an admin token is"
                                " set. Each operation lists every status and error it answers; in a sandbox,"
                                " a fault rule (/_admin/faults) can also make an /api/ operation answer any"
                                " error, wait, or drop the connection. A method a path does not list answers"
                                " 405 S405 METHOD_NOT_ALLOWED with an Allow header naming those it does"
                                " (under /api/: 403 50090201, deny by default).",
                 "license": {"name": "MIT", "identifier": "MIT"}, "contact": {"name": "walletsvc"}},
        "externalDocs": {"description": "docs/signing.md and docs/reference.md of walletsvc's source",
                         "url": "docs/reference.md"},
        "servers": [{"url": base_url}],
        "tags": [{"name": surface, "description": SURFACE_TAGS[surface]}
                 for surface in dict.fromkeys(ep.surface for ep in endpoints)],
        "paths": paths,
        "components": {
            "schemas": dict(SCHEMAS),
            "headers": {**_HEADERS, **_REPLAYED},
            "examples": _error_examples(endpoints),
            "securitySchemes": {
                "ApiKey": {**header, "name": "X-Api-Key", "description": f"the API key; {see_signature}"},
                "Timestamp": {**header, "name": "X-Timestamp",
                              "description": f"Unix seconds at the service's clock; {see_signature}"},
                "Nonce": {**header, "name": "X-Nonce",
                          "description": f"unique per key; UUID v4 recommended; {see_signature}"},
                "Signature": {**header, "name": "X-Signature", "description": SIGNING_RECIPE.format(
                    tolerance=Settings().timestamp_tolerance)},
                "AdminToken": {"type": "http", "scheme": "bearer",
                               "description": "the admin token (serve prints it; --admin-token sets it)"},
                "ConsoleSession": {"type": "apiKey", "in": "cookie", "name": console_cookie(
                    {"HTTP_HOST": urllib.parse.urlsplit(base_url).netloc,
                     "wsgi.url_scheme": urllib.parse.urlsplit(base_url).scheme}),
                                   "description": "the console's session, set by its login form; with it,"
                                                  " the page's X-Console-Csrf header on a write"},
            },
        },
    }


def _operation(ep: Endpoint, head: bool = False) -> dict:
    """The declared endpoint as an OpenAPI operation (HEAD: a GET's, answered without a body)."""
    media = (ep.media or JSON_CONTENT_TYPE).split(";")[0]
    data_schema = _ref(ep.response) if isinstance(ep.response, str) else ep.response or {"type": "null"}
    success = data_schema if ep.media else {
        "type": "object", "required": ["version", "timestamp", "success", "code", "message", "data"],
        "properties": {"version": {"const": API_VERSION}, "timestamp": {"type": "integer"},
                       "success": {"const": True}, "code": {"const": SUCCESS_CODE},
                       "message": {"const": "SUCCESS"}, "data": data_schema}}
    name = ("head_" if head else "") + ep.name
    description = [f"As GET (`{ep.name}`), without the body: the same status and headers." if head
                   else ep.summary + ".", _SURFACE_AUTH[ep.surface].format(scope=ep.scope)]
    if ep.rules:  # what no JSON Schema can say, stated so that a client knows
        description.append("Beyond the schema, S012 INVALID_PARAMETER names the field when:\n" + "\n".join(
            f"- `{field}`: {rule}" for field, rule in ep.rules))
    ok: dict[str, Any] = {"description": "SUCCESS",
                          "headers": _headers(*_HEADERS, *(_REPLAYED if name == "create_transfer" else ()))}
    if not head:
        example = _example(success) if success.get("type") != "string" else "<!doctype html>"
        ok["content"] = {media: {"schema": success, "example": example}}
    in_path = [{"name": public, "in": "path", "required": True, "schema": _ref(schema), "description": about}
               for public, schema, about in map(PATH_PARAMETERS.get, ep.path_names)]
    operation: dict[str, Any] = {
        "operationId": name if ep.surface is not Surface.ADMIN else f"admin_{name}",
        "summary": ep.summary + (" (HEAD)" if head else ""), "description": "\n\n".join(description),
        "tags": [ep.surface], "parameters": in_path + list(ep.query) + _LANGUAGE_PARAMETERS,
        "responses": {"200": ok, **_error_responses(ep.errors_answered, head)},
        "security": {Surface.API: [{"ApiKey": [], "Timestamp": [], "Nonce": [], "Signature": []}],
                     Surface.ADMIN: [{"AdminToken": []}, {"ConsoleSession": []}]}.get(ep.surface, [])}
    if ep.links and not head:  # (to an operation of the same surface)
        operation["responses"]["200"]["links"] = {
            link: {"operationId": f"admin_{target}" if ep.surface is Surface.ADMIN else target,
                   "parameters": {PATH_PARAMETERS[name][0]: where for name, where in parameters.items()}}
            for link, target, parameters in ep.links}
    for status, answer in ep.answers:
        operation["responses"][str(status)] = {"description": answer, "headers": _headers(*_HEADERS),
                                               "content": {media: {"schema": data_schema}}}
    if ep.form:
        operation["requestBody"] = {"required": True, "content": {"application/x-www-form-urlencoded": {
            "schema": {"type": "object", "required": list(ep.form),
                       "properties": dict.fromkeys(ep.form, _STRING)}}}}
    if ep.request:  # required where its schema requires a field (an empty body is {})
        required = ep.surface is Surface.API or bool(SCHEMAS[ep.request]["required"])
        operation["requestBody"] = {"required": required, "content": {"application/json": {
            "schema": _ref(ep.request), "example": _example(_ref(ep.request))}}}
    return operation


###############################################################################
# API handlers #################################################################
###############################################################################

class WalletApi:
    """Handlers of the contract's nine endpoints and of /healthz and /openapi.json: each one service call."""

    def __init__(self, svc: WalletService, http: HttpApi) -> None:
        self.svc, self.http = svc, http

    @endpoint("GET", "/api/v1/wallets", "List wallets", scope="wallet:read", response="WalletPage",
              query=_WALLET_PARAMETERS,
              links=(("Wallet", "get_wallet", {"wallet_id": "$response.body#/data/content/0/id"}),))
    def list_wallets(self, request: Received) -> dict:
        return self.svc.list_wallets(request.principal.workspace_id, request.query)

    @endpoint("GET", "/api/v1/wallets/<wallet_id>", "Get a wallet", scope="wallet:read", response="Wallet",
              links=(("Balance", "get_balance", {"wallet_id": "$response.body#/data/id"}),
                     ("Flows", "list_flows", {"wallet_id": "$response.body#/data/id"})),
              errors=(WalletNotFound,))
    def get_wallet(self, request: Received, wallet_id: str) -> dict:
        return self.svc.get_wallet(wallet_id, workspace_id=request.principal.workspace_id)

    @endpoint("GET", "/api/v1/wallets/<wallet_id>/balance", "Get a wallet balance", scope="wallet:read",
              response="Balance", errors=(WalletNotFound,))
    def get_balance(self, request: Received, wallet_id: str) -> dict:
        return self.svc.get_balance(wallet_id, workspace_id=request.principal.workspace_id)

    @endpoint("GET", "/api/v1/wallets/<wallet_id>/flows", "List a wallet's flows", scope="wallet:read",
              response="FlowPage", query=_FLOW_PARAMETERS, errors=(WalletNotFound,))
    def list_flows(self, request: Received, wallet_id: str) -> dict:
        return self.svc.list_flows(wallet_id, request.query, workspace_id=request.principal.workspace_id)

    @endpoint("GET", "/api/v1/transfer/query/orders", "List transfer orders", scope="transfer:read",
              response="TransferOrderPage", query=_TRANSFER_PARAMETERS,
              links=(("Order", "get_transfer", {"biz_id": "$response.body#/data/content/0/bizId"}),))
    def list_transfers(self, request: Received) -> dict:
        return self.svc.list_transfers(request.principal.workspace_id, request.query)

    @endpoint("GET", "/api/v1/transfer/query/orders/<biz_id>", "Get a transfer order", scope="transfer:read",
              response="TransferOrder", errors=(TransferNotFound,))
    def get_transfer(self, request: Received, biz_id: str) -> dict:
        return self.svc.get_transfer(request.principal.workspace_id, biz_id)

    @endpoint("GET", "/api/v1/transfer/query/orders/<biz_id>/completed",
              "Check whether a transfer order is completed", scope="transfer:read", response="Completion",
              errors=(TransferNotFound,))
    def transfer_completed(self, request: Received, biz_id: str) -> dict:
        return self.svc.transfer_completion(request.principal.workspace_id, biz_id)

    # After the order's completion check: /orders/wallet/completed is the order "wallet"'s check, as
    # "completed" is no wallet id (WalletId); docs/contract.md, Endpoints.
    @endpoint("GET", "/api/v1/transfer/query/orders/wallet/<wallet_id>", "List a wallet's transfer orders",
              scope="transfer:read", response="TransferOrderPage", query=_TRANSFER_PARAMETERS,
              errors=(WalletNotFound,))
    def list_wallet_transfers(self, request: Received, wallet_id: str) -> dict:
        return self.svc.list_transfers(request.principal.workspace_id, request.query, wallet_id=wallet_id)

    @endpoint("POST", "/api/v1/transfer/command/create", "Create a transfer order", scope="transfer:create",
              request="CreateTransfer", response="TransferOrder",
              links=(("Order", "get_transfer", {"biz_id": "$response.body#/data/bizId"}),
                     ("Completed", "transfer_completed", {"biz_id": "$response.body#/data/bizId"})),
              query=({"name": "Idempotency-Key", "in": "header",
                      "schema": {"type": "string", "pattern": f"^({_ID.pattern})?$"},
                      "description": "unsigned: accepted only equal to the body's bizId"
                                     " (empty: as if absent)"},),
              rules=(("Idempotency-Key", ("the header is not signed: it is accepted only equal to the signed"
                                         " body's bizId")),),
              errors=(UnsupportedMediaType, WalletNotFound, WalletNotActive, InsufficientBalance,
                      CurrencyMismatch, SameWallet, IdempotencyConflict))
    def create_transfer(self, request: Received) -> Unit:
        if request.environ.get("CONTENT_TYPE", "").split(";", 1)[0].strip().lower() != "application/json":
            raise UnsupportedMediaType()
        header_key = request.header("Idempotency-Key")
        body = request.json()
        if header_key and header_key != body.get("bizId"):  # unsigned: it cannot change the request
            raise invalid("Idempotency-Key", "unsigned_key")
        return self.svc.transfer_unit(request.principal.workspace_id, TransferRequest.checked(
            body["sourceWalletId"], body["targetWalletId"], body["amount"], body["currency"],
            body.get("bizId"), body.get("description")))

    @endpoint("GET", "/healthz", "Health check: S503 once the database file is gone or replaced",
              response="Health")
    def healthz(self, request: Received) -> dict:
        self.svc.db.check_file()
        if self.svc.db.full:
            raise ServiceBusy(f"{self.svc.db.path}: the disk is full: the sandbox cannot write until there is"
                              " room again.", zh_extra="磁盘已满：在腾出空间之前沙箱无法写入。")
        self.svc.db.one("SELECT version FROM schema_version")  # (a malformed file fails here: S503)
        return {"status": "ok", "version": __version__}

    @endpoint("GET", "/openapi.json", "This document (bare, without the envelope)",
              response={"type": "object", "additionalProperties": True,
                        "description": "an OpenAPI 3.1 document"}, media=JSON_CONTENT_TYPE)
    def openapi(self, request: Received) -> dict:
        environ = request.environ
        host = (environ.get("HTTP_HOST")
                or f"{environ.get('SERVER_NAME', 'localhost')}:{environ.get('SERVER_PORT', '80')}")
        prefix = request.path.decode("latin-1")[: -len("/openapi.json")]
        return openapi_document(self.http.endpoints, f"{environ.get('wsgi.url_scheme', 'http')}://{host}{prefix}")


# Deny by default (docs/contract.md, Scopes): anything else under /api/ answers 50090201 once authenticated.
_UNDECLARED = Endpoint("ANY", "/api<rest:re:(/.*)?>", "", None, name="undeclared")


###############################################################################
# The console's session ########################################################
###############################################################################

class Console:
    """The sandbox console at /_admin/console: one HTML page and its session cookie, kept in the
    database, and the CSRF check (docs/sandbox.md, The console, says how and why)."""

    SESSION_SECONDS = 12 * 3600

    def __init__(self, admin_token: str, db: Database) -> None:
        self.key, self.db = admin_token.encode("utf-8"), db

    def mac(self, purpose: str, nonce: str) -> str:
        digest = hmac.new(self.key, f"walletsvc console {purpose} {nonce}".encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")

    def session(self, environ: Mapping[str, Any]) -> str | None:
        """The nonce of the cookie's session if valid (signed, unexpired, not logged out), else None."""
        name = console_cookie(environ) + "="
        value = next((part.strip()[len(name):] for part in environ.get("HTTP_COOKIE", "").split(";")
                      if part.strip().startswith(name)), "")
        nonce, _, expires = value.rpartition(".")[0].partition(".")
        valid = (self.key and nonce and expires.isdigit() and int(expires) > time.time()
                 and hmac.compare_digest(value.encode("latin-1", "replace"),
                                         self.session_value(nonce, expires).encode())
                 and self.db.one("SELECT 1 FROM console_sessions WHERE nonce = ?", (nonce,)) is not None)
        return nonce if valid else None

    def session_value(self, nonce: str, expires: str) -> str:
        return f"{nonce}.{expires}.{self.mac('session', f'{nonce}.{expires}')}"

    def same_origin(self, environ: Mapping[str, Any], nonce: str) -> bool:
        """The page's CSRF header is right and the browser does not say another site sent it."""
        token = environ.get("HTTP_X_CONSOLE_CSRF", "").encode("latin-1", "replace")
        try:
            origin = environ.get("HTTP_ORIGIN")
            origin_host = None if origin is None else urllib.parse.urlsplit(origin).netloc
        except ValueError:  # not a URL (http://a]): not this origin
            return False
        return (hmac.compare_digest(token, self.mac("csrf", nonce).encode())
                and environ.get("HTTP_SEC_FETCH_SITE", "same-origin") in ("same-origin", "none")
                and origin_host in (None, environ.get("HTTP_HOST")))

    def cookie(self, request: Received, value: str, max_age: int) -> str:
        """A Set-Cookie for /_admin/ under any mount prefix (/_admin/ itself if the path sent is unclear)."""
        head, found, _ = request.path.decode("latin-1").rpartition("/_admin/")
        path = head + found if found and re.fullmatch(r"[\w./~-]*", head) else "/_admin/"
        secure = ["Secure"] if request.environ.get("wsgi.url_scheme") == "https" else []
        return "; ".join([f"{console_cookie(request.environ)}={value}", f"Path={path}", f"Max-Age={max_age}",
                          "HttpOnly", "SameSite=Strict", *secure])

    def log_in(self, request: Received) -> Reply:
        """The login form's POST: a session cookie and a redirect to the console, or the form again."""
        form = {}
        with contextlib.suppress(ValueError):
            form = urllib.parse.parse_qs(request.body.decode("utf-8", "replace"), max_num_fields=20)
        token = (form.get("token") or [""])[0].strip().encode("utf-8")
        if not self.key or not hmac.compare_digest(token, self.key):
            return self.login_form("That is not the admin token.")._replace(status=401)
        nonce, expires = secrets.token_urlsafe(18), str(int(time.time()) + self.SESSION_SECONDS)

        def begin(conn: sqlite3.Connection) -> None:  # (and forget the sessions that expired)
            conn.execute("DELETE FROM console_sessions WHERE expires <= ?", (int(time.time()),))
            conn.execute("INSERT INTO console_sessions (nonce, expires) VALUES (?, ?)", (nonce, int(expires)))
        self.db.write([begin], durable=False)
        cookie = self.cookie(request, self.session_value(nonce, expires), self.SESSION_SECONDS)
        return Reply("", 303, (("Location", "console"), ("Set-Cookie", cookie)))

    def log_out(self, request: Received) -> Reply:
        nonce = self.session(request.environ)
        if nonce is not None:  # (in every process: a copied cookie stops working too)
            self.db.write([lambda conn: conn.execute("DELETE FROM console_sessions WHERE nonce = ?",
                                                     (nonce,))], durable=False)
        return Reply(None, headers=(("Set-Cookie", self.cookie(request, "", 0)),))

    @staticmethod
    def login_form(message: str = "") -> Reply:
        return Reply(_CONSOLE_LOGIN.replace("__MESSAGE__", html.escape(message)), headers=_PAGE_HEADERS)

    def page(self, nonce: str) -> Reply:
        return Reply(_CONSOLE_PAGE.replace("__CSRF__", self.mac("csrf", nonce)), headers=_PAGE_HEADERS)


###############################################################################
# Admin surface ################################################################
###############################################################################

# Rules a schema cannot state, shared by several operations (Endpoint.rules).
_WHITELIST_RULE = ("ipWhitelist", ("each entry is an address or a CIDR block without host bits (10.0.0.1/8 is"
                                  " refused, not widened); an empty list is refused (null: no whitelist)"))
_DECIDED_RULE = ("bizId", "only a PENDING order is completed or failed")
_SCENARIO_RULES = (("id", "the fixed ids of one scenario differ from each other"),
                   ("member", "a key's member is a member of its workspace (or owner)"), _WHITELIST_RULE)


class AdminApi:
    """/_admin/: the Python admin API over HTTP, with an admin token (docs/sandbox.md, The admin surface)."""

    def __init__(self, svc: WalletService, console: Console) -> None:
        self.svc, self.console = svc, console

    @endpoint("GET", CONSOLE_PATH, "The sandbox console (HTML): its login form, or the console once"
              " logged in", response={"type": "string"}, media=HTML_CONTENT_TYPE)
    def console_page(self, request: Received) -> Reply:
        nonce = self.console.session(request.environ)
        return self.console.login_form() if nonce is None else self.console.page(nonce)

    @endpoint("POST", CONSOLE_PATH, "Log in to the console: the form field token, the admin token",
              response={"type": "string"}, media=HTML_CONTENT_TYPE, form=("token",),
              answers=((303, ("Logged in: the session cookie (Set-Cookie), and back to the console"
                              " (Location)")),
                       (401, "Not the admin token: the login form again (HTML)")))
    def console_login(self, request: Received) -> Reply:
        return self.console.log_in(request)

    @endpoint("POST", CONSOLE_PATH + "/logout", "Log out of the console (ends the session cookie)",
              response=None)
    def console_logout(self, request: Received) -> Reply:
        return self.console.log_out(request)

    @endpoint("GET", "/_admin/workspaces", "List workspaces", response=_array("Workspace"))
    def list_workspaces(self, request: Received) -> list:
        return self.svc.list_workspaces()

    @endpoint("POST", "/_admin/workspaces", "Create a workspace", request="NameBody", response="Workspace",
              links=[(name, name, {"workspace_id": "$response.body#/data/id"})
                     for name in ("get_workspace", "list_members", "create_api_key", "create_wallet")])
    def create_workspace(self, request: Received) -> dict:
        return self.svc.create_workspace(request.json()["name"])

    @endpoint("GET", "/_admin/workspaces/<workspace_id>", "Get a workspace", response="Workspace",
              errors=(WorkspaceNotFound,))
    def get_workspace(self, request: Received, workspace_id: str) -> dict:
        return self.svc.get_workspace(workspace_id)

    @endpoint("DELETE", "/_admin/workspaces/<workspace_id>", "Delete a workspace (its keys answer GA2032)",
              response=None, errors=(WorkspaceNotFound,))
    def delete_workspace(self, request: Received, workspace_id: str) -> None:
        self.svc.delete_workspace(workspace_id)

    @endpoint("GET", "/_admin/workspaces/<workspace_id>/members", "List members", response=_array("Member"),
              errors=(WorkspaceNotFound,))
    def list_members(self, request: Received, workspace_id: str) -> list:
        return self.svc.list_members(workspace_id)

    @endpoint("POST", "/_admin/workspaces/<workspace_id>/members", "Add a member", request="NameBody",
              response="Member", errors=(WorkspaceNotFound,))
    def add_member(self, request: Received, workspace_id: str) -> dict:
        return self.svc.add_member(workspace_id, request.json()["name"])

    @endpoint("DELETE", "/_admin/workspaces/<workspace_id>/members/<member_id>",
              "Remove a member (its keys answer GA2034)", response=None, errors=(WorkspaceNotFound, NotFound))
    def remove_member(self, request: Received, workspace_id: str, member_id: str) -> None:
        self.svc.remove_member(workspace_id, member_id)

    @endpoint("GET", "/_admin/workspaces/<workspace_id>/keys", "List API keys", response=_array("ApiKey"),
              errors=(WorkspaceNotFound,))
    def list_api_keys(self, request: Received, workspace_id: str) -> list:
        return self.svc.list_api_keys(workspace_id)

    @endpoint("POST", "/_admin/workspaces/<workspace_id>/keys",
              "Create an API key (the secret is returned once)", request="NewKeyBody", response="ApiKey",
              errors=(WorkspaceNotFound, NotFound), rules=(_WHITELIST_RULE,))
    def create_api_key(self, request: Received, workspace_id: str) -> dict:
        body = request.json()
        return self.svc.create_api_key(workspace_id, body.get("scopes", SCOPES),
                                       member_id=body.get("memberId"), ip_whitelist=body.get("ipWhitelist"))

    @endpoint("POST", "/_admin/keys/<api_key>/enable", "Enable an API key", response="ApiKey",
              errors=(NotFound,))
    def enable_api_key(self, request: Received, api_key: str) -> dict:
        return self.svc.set_api_key_enabled(api_key, True)

    @endpoint("POST", "/_admin/keys/<api_key>/disable", "Disable an API key (GA2021)", response="ApiKey",
              errors=(NotFound,))
    def disable_api_key(self, request: Received, api_key: str) -> dict:
        return self.svc.set_api_key_enabled(api_key, False)

    @endpoint("GET", "/_admin/workspaces/<workspace_id>/wallets", "List a workspace's wallets",
              response="WalletPage", query=_WALLET_PARAMETERS, errors=(WorkspaceNotFound,))
    def list_wallets(self, request: Received, workspace_id: str) -> dict:
        self.svc.get_workspace(workspace_id)
        return self.svc.list_wallets(workspace_id, request.query)

    @endpoint("POST", "/_admin/workspaces/<workspace_id>/wallets", "Create a wallet", request="NewWalletBody",
              response="Wallet", errors=(WorkspaceNotFound,),
              links=[(name, name, {"wallet_id": "$response.body#/data/id"})
                     for name in ("get_wallet", "deposit", "withdraw", "set_wallet_status")])
    def create_wallet(self, request: Received, workspace_id: str) -> dict:
        body = request.json()
        return self.svc.create_wallet(workspace_id, body["currency"], name=body.get("name"))

    @endpoint("GET", "/_admin/wallets/<wallet_id>", "Get a wallet", response="Wallet",
              errors=(WalletNotFound,))
    def get_wallet(self, request: Received, wallet_id: str) -> dict:
        return self.svc.get_wallet(wallet_id)

    @endpoint("GET", "/_admin/wallets/<wallet_id>/balance", "Get a wallet's balance", response="Balance",
              errors=(WalletNotFound,))
    def get_balance(self, request: Received, wallet_id: str) -> dict:
        return self.svc.get_balance(wallet_id)

    @endpoint("GET", "/_admin/wallets/<wallet_id>/flows", "List a wallet's flows", response="FlowPage",
              query=_FLOW_PARAMETERS, errors=(WalletNotFound,))
    def list_flows(self, request: Received, wallet_id: str) -> dict:
        return self.svc.list_flows(wallet_id, request.query)

    @endpoint("GET", "/_admin/workspaces/<workspace_id>/balances",
              "List a workspace's wallets as balances (the same pages, filters and sorts as its wallets)",
              response="BalancePage", query=_WALLET_PARAMETERS, errors=(WorkspaceNotFound,))
    def list_balances(self, request: Received, workspace_id: str) -> dict:
        self.svc.get_workspace(workspace_id)
        return self.svc.list_wallets(workspace_id, request.query, balances=True)

    @endpoint("GET", "/_admin/workspaces/<workspace_id>/transfers", "List a workspace's transfer orders",
              response="TransferOrderPage", query=_TRANSFER_PARAMETERS, errors=(WorkspaceNotFound,))
    def list_transfers(self, request: Received, workspace_id: str) -> dict:
        self.svc.get_workspace(workspace_id)
        return self.svc.list_transfers(workspace_id, request.query)

    @endpoint("POST", "/_admin/wallets/<wallet_id>/status", "Freeze, unfreeze or close a wallet",
              request="StatusBody", response="Wallet", errors=(WalletNotFound,),
              rules=(("status", "a CLOSED wallet stays CLOSED: CLOSED is final"),))
    def set_wallet_status(self, request: Received, wallet_id: str) -> dict:
        return self.svc.set_wallet_status(wallet_id, request.json()["status"])

    @endpoint("POST", "/_admin/wallets/<wallet_id>/deposit", "Deposit money from outside",
              request="AmountBody", response="Flow", errors=(WalletNotFound, WalletNotActive),
              rules=(("amount", ("has the wallet's currency's decimals, and the balance stays within"
                                " 999999999999999999 minor units")),))
    def deposit(self, request: Received, wallet_id: str) -> dict:
        return self.svc.deposit(wallet_id, request.json()["amount"])

    @endpoint("POST", "/_admin/wallets/<wallet_id>/withdraw", "Withdraw money", request="AmountBody",
              response="Flow", errors=(WalletNotFound, WalletNotActive, InsufficientBalance),
              rules=(("amount", "has the wallet's currency's decimals"),))
    def withdraw(self, request: Received, wallet_id: str) -> dict:
        return self.svc.withdraw(wallet_id, request.json()["amount"])

    @endpoint("POST", "/_admin/transfers/<biz_id>/complete", "Complete a PENDING order", request="SettleBody",
              response="TransferOrder", errors=(TransferNotFound,), rules=(_DECIDED_RULE,))
    def complete_transfer(self, request: Received, biz_id: str) -> dict:
        return self.svc.complete_transfer(biz_id, workspace_id=request.json().get("workspaceId"))

    @endpoint("POST", "/_admin/transfers/<biz_id>/fail", "Fail a PENDING order", request="SettleBody",
              response="TransferOrder", errors=(TransferNotFound,), rules=(_DECIDED_RULE,))
    def fail_transfer(self, request: Received, biz_id: str) -> dict:
        return self.svc.fail_transfer(biz_id, workspace_id=request.json().get("workspaceId"))

    @endpoint("POST", "/_admin/reset", "Back to the starting state (one transaction): its data and clock,"
              " no journal, no fault rules", response=None)
    def reset(self, request: Received) -> None:
        self.svc.reset()

    @endpoint("POST", "/_admin/scenarios", "Make a world beside the others, with fresh ids and keys: the"
              " scenario the sandbox started from, the built-in demo, or the one given",
              request="ScenarioBody", response="World", rules=_SCENARIO_RULES)
    def instantiate(self, request: Received) -> dict:
        body = request.json()
        if "workspaces" in body and "scenario" in body or body.get("scenario", "demo") != "demo":
            raise invalid("scenario", "one_of", choices="demo (or no scenario, and workspaces or none)")
        scenario = (body if "workspaces" in body else DEMO_SCENARIO if body.get("scenario") == "demo"
                    else {"workspaces": self.svc.start_scenario()["workspaces"]})  # (clock, settings: ours)
        return self.svc.load_scenario(scenario, fresh_ids=True)

    @endpoint("POST", "/_admin/workspaces/<workspace_id>/reset", "Return one workspace to the state its world"
              " began in (other workspaces and the clock untouched)", response="WorldWorkspace",
              errors=(WorkspaceNotFound, NotFound))
    def reset_workspace(self, request: Received, workspace_id: str) -> dict:
        return self.svc.reset_workspace(workspace_id)

    @endpoint("GET", "/_admin/audit", "Audit the ledger: the violations of its invariants (none: clean)",
              response=_array("Violation"))
    def audit(self, request: Received) -> list:
        return self.svc.audit()

    @endpoint("GET", "/_admin/journal", "The request journal, oldest first, a page at a time",
              response="JournalEntryPage",
              query=[*_PAGE_PARAMETERS[:2],
                     *({"name": name, "in": "query", "schema": _STRING, "description": description}
                       for name, description in (("method", "only requests of this method"),
                                                 ("path", "only requests whose path matches this glob"),
                                                 ("code", "only answers of this code"))),
                     *({"name": name, "in": "query", "style": "deepObject", "explode": True,
                        # (a query string carries text only: true, 1 or null are the text they spell)
                        "schema": {"type": "object", "additionalProperties": {
                            "type": ["string", "number", "boolean", "null"],
                            "description": "compared as text"}},
                        "description": f"only requests with these {what} ({name}[NAME]=VALUE;"
                                       f" {name}.NAME=VALUE works too)"}
                       for name, what in (("query", "query parameters"), ("header", "headers"))),
                     {"name": "body", "in": "query",
                      "description": "body fields the entries must have (JSON)",
                      "content": {"application/json": {"schema": _MATCH["body"]}}},
                     *({"name": name, "in": "query", "schema": {"type": "integer", "minimum": 0},
                        "description": description}
                       for name, description in (("after", "only entries whose seq is greater"),
                                                 ("last", "only the newest so many matching entries")))])
    def journal(self, request: Received) -> dict:
        """The journal's page, filtered as docs/sandbox.md says (The admin surface); ``query[NAME]`` and
        ``header[NAME]`` are taken for ``query.NAME`` and ``header.NAME``."""
        query = request.query
        after, last = (_page_integer(query, name, -1, 0) for name in ("after", "last"))
        number, size = _page_and_size(query)
        criteria: dict[str, Any] = {name: first(query, name) for name in ("method", "path", "code")}
        for kind, field in (("query", "query"), ("header", "headers")):
            criteria[field] = {}
            for name, values in query.items():
                if match := re.fullmatch(kind + r"(?:\.(.+)|\[(.+)\])", name, re.DOTALL):
                    if match[2] and "][" in match[2]:  # deepObject: a[b][c] is a nested object
                        raise invalid(name[:64], "one_name", kind=kind)
                    criteria[field][match[1] or match[2]] = values[0]
        if first(query, "body") is not None:
            criteria["body"] = json_object(first(query, "body").encode("utf-8"))
        found = self.svc.journal.entries(after=max(after, 0), **criteria)
        entries, page = found[max(len(found) - last, 0) if last >= 0 else 0:], PageRequest(number, size, ())
        return page_response(entries[page.offset:page.offset + size], page, len(entries))

    @endpoint("POST", "/_admin/journal/assert", "Assert on the journal: passed, the count, the near misses",
              request="JournalAssertBody", response="JournalVerdict")
    def assert_journal(self, request: Received) -> dict:
        body = request.json()
        counts = {"times": body.pop("times", None), "at_least": body.pop("atLeast", None),
                  "never": body.pop("never", False)}
        try:
            calls = self.svc.journal.assert_called(**counts, **body)
        except AssertionError as failed:
            return {"passed": False, "count": len(self.svc.journal.entries(**body)), "message": str(failed)}
        return {"passed": True, "count": len(calls), "message": None}

    @endpoint("DELETE", "/_admin/journal", "Empty the request journal", response=None)
    def clear_journal(self, request: Received) -> None:
        self.svc.journal.clear()

    @endpoint("GET", "/_admin/faults", "List fault rules", response=_array("Fault"))
    def list_faults(self, request: Received) -> list:
        return self.svc.faults.rules()

    @endpoint("POST", "/_admin/faults", "Add a fault rule", request="FaultBody", response="Fault",
              rules=(("faults", f"at most {Faults.MAX_RULES} rules are in force at a time"),))
    def add_fault(self, request: Received) -> dict:
        body = request.json()
        if "workspaceId" in body:
            body["workspace_id"] = body.pop("workspaceId")
        return self.svc.faults.add(**body)

    @endpoint("DELETE", "/_admin/faults", "Remove every fault rule", response=None)
    def clear_faults(self, request: Received) -> None:
        self.svc.faults.clear()

    @endpoint("DELETE", "/_admin/faults/<fault_id>", "Remove one fault rule", response=None,
              errors=(NotFound,))
    def remove_fault(self, request: Received, fault_id: str) -> None:
        self.svc.faults.remove(fault_id)

    @endpoint("POST", "/_admin/ids", "Seed the ids and secrets that follow (null: random again)",
              request="SeedBody", response=None)
    def seed_ids(self, request: Received) -> None:
        self.svc.seed_ids(request.json()["seed"])

    @endpoint("GET", "/_admin/clock", "The service clock", response="ClockState")
    def get_clock(self, request: Received) -> dict:
        return {"now": iso_time(self.svc.now_ms()), "epochMillis": self.svc.now_ms(),
                "frozen": self.svc.clock.frozen, "controllable": self.svc.clock.controllable}

    @endpoint("POST", "/_admin/clock", "Freeze, set, advance or unfreeze the service clock",
              request="ClockBody", response="ClockState",
              rules=(("at", "the clock stays between 1970 and 9999 UTC"),
                     ("advance", "the clock stays between 1970 and 9999 UTC, wherever it stands")))
    def set_clock(self, request: Received) -> dict:
        body, clock = request.json(), self.svc.clock
        if not clock.controllable:
            raise invalid("clock", "state",
                          state="not controllable (start the service with a walletsvc.Clock)")
        at = admin_time(body.get("at"), "at")
        try:  # (freeze and set check ``at`` before they change anything)
            if body.get("freeze") is True:
                clock.freeze(at)
            elif at is not None:
                clock.set(at)
            if "advance" in body:
                clock.advance(body["advance"])
        except (ValueError, OverflowError):
            raise invalid("advance" if "advance" in body else "at", "clock_range") from None
        if body.get("freeze") is False:
            clock.unfreeze()
        return self.get_clock(request)


###############################################################################
# App factory ##################################################################
###############################################################################

def create_app(svc: WalletService, **settings: Any) -> WalletApp:
    """The WSGI app (a ``bottle.Bottle``) serving ``svc``, with the HTTP layer's ``settings``
    (docs/reference.md, Settings), to serve or mount anywhere (docs/embedding.md, Mounting under a prefix)."""
    layer = svc.settings.replace("http", **settings)
    http = HttpApi(svc, layer, Console(layer.admin_token or "", svc.db))
    app = WalletApp(http)
    for handlers in [WalletApi(svc, http), *([AdminApi(svc, http.console)] if layer.admin_token else [])]:
        for declaration, handler in declared(handlers):
            check_declaration(declaration, handler)
            app.route(declaration.path, declaration.method, handler, endpoint=declaration)
            http.endpoints.append(declaration)
    app.route(_UNDECLARED.path, "ANY", lambda request, rest="": None, endpoint=_UNDECLARED)
    app.default_error_handler = http.bottle_error
    app.install(http)
    app.built_with = list(app.plugins)
    return app


###############################################################################
# Client #######################################################################
###############################################################################

def error_for(code: str, detail: str = "", status: int | None = None) -> WalletError:
    """The WalletError subclass of a catalog code, carrying the server's detail."""
    if (cls := ERRORS_BY_CODE.get(code)) is None:
        cls = type("UnknownError", (WalletError,), {"code": code, "name": "UNKNOWN", "status": status or 500})
    elif status is not None and status != cls.status:  # a fault rule forced another status: the wire's
        cls = type(cls.__name__, (cls,), {"status": status})
    return cls(text=detail)


HEALTH_PATH = "/healthz"  # unsigned and never journaled: its envelope's timestamp is the server's clock


def envelope_seconds(payload: bytes) -> int | None:
    """The epoch seconds of an envelope's ``timestamp`` (milliseconds), None if ``payload`` is none."""
    try:
        millis = json.loads(payload).get("timestamp")
    except (ValueError, AttributeError):
        return None
    return millis // 1000 if isinstance(millis, int) and not isinstance(millis, bool) else None


def server_time(url: str, timeout: float = 10.0) -> int:
    """The server's clock in epoch seconds (a sandbox's, frozen or moved) from ``GET /healthz`` beside ``url``
    (a base URL, or any URL of its API): unsigned and never journaled, so learning the time before signing
    leaves no failed request behind (docs/signing.md). ConnectionError if no walletsvc answers there."""
    parts = urllib.parse.urlsplit(url)  # /healthz below the same mount prefix (the path before /api/)
    prefix = parts.path.split("/api/", 1)[0] if "/api/" in parts.path else parts.path.rstrip("/")
    target = f"{parts.scheme}://{parts.netloc}{prefix}{HEALTH_PATH}"
    try:
        with urllib.request.urlopen(urllib.request.Request(target), timeout=timeout) as reply:
            payload = reply.read()
    except urllib.error.HTTPError as reply:  # a 503 (a replaced database) still tells the time
        payload = reply.read()
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:  # (a server killed mid-answer)
        raise ConnectionError(f"cannot reach {target}: {getattr(exc, 'reason', exc)!s} (is walletsvc serve"
                              " running there? check WALLETSVC_URL or --url)") from None
    if (seconds := envelope_seconds(payload)) is None:
        raise ConnectionError(f"{target} did not answer walletsvc's envelope: is it a walletsvc server?")
    return seconds


class HmacAuth:
    """Signs ``requests`` and ``httpx`` requests (``auth=HmacAuth(key, secret)``), importing neither, at the
    server's clock read from its /healthz (else this machine's), or at ``clock`` (docs/signing.md)."""

    def __init__(self, api_key: str, secret: str, *, clock: Callable[[], float] | None = None) -> None:
        self.api_key, self.secret, self.clock = api_key, secret, clock

    def __call__(self, request: Any) -> Any:
        """Sign ``request`` (a requests PreparedRequest, or an httpx Request: httpx calls it too)."""
        stamp = None
        if self.clock is None:
            with contextlib.suppress(ConnectionError):
                stamp = server_time(str(request.url))
        return self.sign(request, stamp)

    def sign(self, request: Any, stamp: int | None) -> Any:
        """Add the signature headers to ``request``, at ``stamp`` (None: this auth's clock)."""
        if hasattr(request, "path_url"):  # requests
            path, body = request.path_url, request.body
        else:  # httpx
            path, body = request.url.raw_path.decode("ascii"), request.content
        if body is not None and not isinstance(body, (bytes, str)):
            raise TypeError("HmacAuth signs the exact body bytes; streamed bodies cannot be signed")
        if stamp is None:
            stamp = int(self.clock()) if self.clock is not None else int(time.time())
        request.headers.update(sign_request(request.method, path, body, self.api_key, self.secret,
                                            timestamp=stamp))
        return request


def _segment(value: str) -> str:
    """A path segment as RFC 3986 requires it, and no more (``inv:1`` stays ``inv:1``)."""
    return urllib.parse.quote(str(value), safe=PCHAR_DELIMS)


class Client:
    """A signed client of the nine endpoints, standard library only (docs/signing.md): ``target`` a base URL
    (a path prefix in it is signed) or a WSGI app (``prefix=`` where mounted); unset, WALLETSVC_URL, _KEY and
    _SECRET, else the demo's. Signs at the server's clock (or ``clock``'s), again at a GA2013 answer's."""

    def __init__(self, target: str | Callable | None = None, api_key: str | None = None,
                 secret: str | None = None, *, prefix: str = "", timeout: float = 10.0,
                 clock: Callable[[], float] | None = None) -> None:
        target = target or os.environ.get("WALLETSVC_URL") or DEMO_URL
        if isinstance(target, str):
            parts = urllib.parse.urlsplit(target)
            target, prefix = f"{parts.scheme}://{parts.netloc}", parts.path + prefix
        self.target, self.prefix = target, prefix.rstrip("/")
        self.api_key = api_key or os.environ.get("WALLETSVC_KEY") or DEMO_KEY
        self.secret = secret or os.environ.get("WALLETSVC_SECRET") or DEMO_SECRET
        if clock is None and isinstance(target, WalletApp):  # in process: its service's clock
            clock = target.http.svc.clock
        self.timeout, self.clock = timeout, clock
        self.offset = 0  # seconds the sandbox's clock is from ``clock``, as its last GA2013 said
        self.last_headers: dict[str, str] = {}

    # The nine endpoints, a method each (a test holds them to the declarations): path parameters, the body's
    # required fields, then by keyword its optional ones and the query's (page, size, sort, filters).

    def list_wallets(self, **query: Any) -> dict:
        """List wallets: GET /api/v1/wallets."""
        return self.request("GET", "/api/v1/wallets", query=query)

    def get_wallet(self, wallet_id: str) -> dict:
        """Get a wallet: GET /api/v1/wallets/<wallet_id>."""
        return self.request("GET", f"/api/v1/wallets/{_segment(wallet_id)}")

    def get_balance(self, wallet_id: str) -> dict:
        """Get a wallet balance: GET /api/v1/wallets/<wallet_id>/balance."""
        return self.request("GET", f"/api/v1/wallets/{_segment(wallet_id)}/balance")

    def list_flows(self, wallet_id: str, **query: Any) -> dict:
        """List a wallet's flows: GET /api/v1/wallets/<wallet_id>/flows."""
        return self.request("GET", f"/api/v1/wallets/{_segment(wallet_id)}/flows", query=query)

    def list_transfers(self, **query: Any) -> dict:
        """List transfer orders: GET /api/v1/transfer/query/orders."""
        return self.request("GET", "/api/v1/transfer/query/orders", query=query)

    def list_wallet_transfers(self, wallet_id: str, **query: Any) -> dict:
        """List a wallet's transfer orders: GET /api/v1/transfer/query/orders/wallet/<wallet_id>."""
        return self.request("GET", f"/api/v1/transfer/query/orders/wallet/{_segment(wallet_id)}", query=query)

    def get_transfer(self, biz_id: str) -> dict:
        """Get a transfer order: GET /api/v1/transfer/query/orders/<biz_id>."""
        return self.request("GET", f"/api/v1/transfer/query/orders/{_segment(biz_id)}")

    def transfer_completed(self, biz_id: str) -> dict:
        """Whether a transfer order is completed: GET /api/v1/transfer/query/orders/<biz_id>/completed."""
        return self.request("GET", f"/api/v1/transfer/query/orders/{_segment(biz_id)}/completed")

    def create_transfer(self, source_wallet_id: str, target_wallet_id: str, amount: str | decimal.Decimal,
                        currency: str, *, biz_id: str | None = None, description: str | None = None) -> dict:
        """Create a transfer order: POST /api/v1/transfer/command/create."""
        body = {"sourceWalletId": source_wallet_id, "targetWalletId": target_wallet_id, "amount": amount,
                "currency": currency, "bizId": biz_id, "description": description}
        return self.request("POST", "/api/v1/transfer/command/create",
                            body={name: value for name, value in body.items() if value is not None})

    # Signing and sending ####################################################

    def request(self, method: str, path: str, *, query: Mapping[str, Any] | None = None,
                body: Any = None) -> Any:
        """Sign and send one request; the envelope's data, or a typed error."""
        if isinstance(body, dict):  # an amount may be given as the service takes it: str or Decimal
            body = {name: format(value, "f") if isinstance(value, decimal.Decimal) else value
                    for name, value in body.items()}
        raw = b"" if body is None else (body if isinstance(body, bytes) else to_json(body))
        status, self.last_headers, answer = self.send(method, path, query=query, body=raw)
        if not answer.get("success"):
            raise error_for(str(answer.get("code")), answer.get("detail", ""), status)
        return answer["data"]

    def send(self, method: str, path: str, *, query: Mapping[str, Any] | str | None = None,
             body: bytes | None = None) -> tuple[int, dict, dict]:
        """Sign and send ``path`` below the prefix: (HTTP status, headers, envelope), whatever the outcome."""
        raw = body or b""
        if not isinstance(query, str):
            query = urllib.parse.urlencode(
                {name: value for name, value in (query or {}).items() if value is not None}, doseq=True)
        stamp = self.server_time() if self.clock is None else int(self.clock()) + self.offset
        status, response_headers, answer = self._signed(method, path, query, raw, stamp)
        server = answer.get("timestamp")
        if answer.get("code") == RequestExpired.code and isinstance(server, int) and server // 1000 != stamp:
            # The sandbox's clock moved since: sign at its time (a refused request did nothing).
            if self.clock is not None:
                self.offset = server // 1000 - int(self.clock())
            status, response_headers, answer = self._signed(method, path, query, raw, server // 1000)
        return status, response_headers, answer

    def server_time(self) -> int:
        """The server's clock, in epoch seconds: the timestamp of its ``/healthz`` envelope."""
        _, _, payload = self._send("GET", self.prefix + HEALTH_PATH, "", {}, b"")
        seconds = envelope_seconds(payload)
        return int(time.time()) if seconds is None else seconds

    def _signed(self, method: str, path: str, query: str, raw: bytes, stamp: int) -> tuple[int, dict, dict]:
        full_path = self.prefix + path
        headers = sign_request(method, full_path, raw, self.api_key, self.secret, timestamp=stamp)
        if raw:
            headers["Content-Type"] = "application/json"
        status, response_headers, payload = self._send(method, full_path, query, headers, raw)
        try:
            return status, response_headers, json.loads(payload)
        except ValueError:
            return status, response_headers, {"success": False, "code": "S500",
                                               "detail": f"HTTP {status}: not a JSON envelope"}

    def _send(self, method: str, path: str, query: str, headers: dict,
              body: bytes) -> tuple[int, dict, bytes]:
        if isinstance(self.target, str):
            url = self.target + path + (f"?{query}" if query else "")
            request = urllib.request.Request(url, data=body or None, method=method, headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as reply:
                    return reply.status, dict(reply.headers), reply.read()
            except urllib.error.HTTPError as reply:
                return reply.code, dict(reply.headers), reply.read()
            except (urllib.error.URLError, OSError) as exc:  # no answer at all: say where it went
                reason = getattr(exc, "reason", exc)
                raise ConnectionError(f"cannot reach {self.target}{self.prefix}: {reason} (is walletsvc serve"
                                      " running there? check WALLETSVC_URL or --url)") from None
        environ = {"REQUEST_METHOD": method, "SCRIPT_NAME": "", "REQUEST_URI": path, "QUERY_STRING": query,
                   "PATH_INFO": urllib.parse.unquote(path, "latin-1"), "SERVER_NAME": "walletsvc",
                   "SERVER_PORT": "80", "SERVER_PROTOCOL": "HTTP/1.1", "REMOTE_ADDR": "127.0.0.1",
                   "CONTENT_LENGTH": str(len(body)), "CONTENT_TYPE": headers.pop("Content-Type", ""),
                   "wsgi.input": io.BytesIO(body), "wsgi.errors": sys.stderr, "wsgi.version": (1, 0),
                   "wsgi.url_scheme": "http", "wsgi.multithread": True, "wsgi.multiprocess": False,
                   "wsgi.run_once": False}
        environ.update((environ_key(name), value) for name, value in headers.items())
        started: list = []
        chunks = self.target(environ, lambda status, response_headers, exc_info=None:
                             started.extend((status, response_headers)))
        try:
            payload = b"".join(chunks)
        finally:
            getattr(chunks, "close", lambda: None)()
        return int(started[0].split()[0]), dict(started[1]), payload


###############################################################################
# Serving ######################################################################
###############################################################################

# The banner's curl: the sandbox's time from /healthz's envelope (epoch ms, unsigned, never journaled), then
# a GET signed at it. Tools found on Linux, macOS and WSL alike (no sha256sum, no /proc).
CURL_SIGNED_GET = """\
TS=$(curl -s "$WALLETSVC_URL/healthz" | sed -E 's/.*"timestamp":([0-9]+)[0-9]{3}.*/\\1/')
NONCE=$(openssl rand -hex 16) P=/api/v1/wallets H=$(printf '' | openssl dgst -sha256 | sed 's/.* //')
SIG=$(printf 'GET\\n%s\\n%s\\n%s\\n%s' "$P" "$TS" "$NONCE" "$H" \\
  | openssl dgst -sha256 -hmac "$WALLETSVC_SECRET" -binary | base64)
curl -s "$WALLETSVC_URL$P" -H "X-Api-Key: $WALLETSVC_KEY" -H "X-Timestamp: $TS" -H "X-Nonce: $NONCE" \\
  -H "X-Signature: $SIG"
"""


# waitress's settings for `walletsvc serve`, each against one attack: docs/operations.md (When things go
# wrong, A hostile network) says what each protects against, with the figures.
WAITRESS_LIMITS = {
    "connection_limit": 1000,  # idle and slowloris connections: read by the event loop, not worker threads
    "channel_timeout": 30, "cleanup_interval": 5, "max_request_header_size": 65536,
}
BODY_BUFFER_BYTES = 1 << 20  # the largest body waitress buffers; larger ones get its 413 unread
# A request line and headers not complete this many seconds after their first byte close the connection
# (checked every cleanup_interval): a slow sender's header line every 10 s keeps channel_timeout away.
HEADERS_WITHIN = 10.0


def _raise_file_limit(needed: int) -> None:
    """Raise this process's soft limit on open files to ``needed`` (within the hard limit)."""
    from resource import RLIM_INFINITY, RLIMIT_NOFILE, getrlimit, setrlimit

    soft, hard = getrlimit(RLIMIT_NOFILE)
    if soft != RLIM_INFINITY and soft < needed:
        setrlimit(RLIMIT_NOFILE, (needed if hard == RLIM_INFINITY else min(needed, hard), hard))


CONTROL_THREADS = 2  # waitress threads of their own for /_admin/** and the console (and one for /healthz)
_CONTROL_PATH = re.compile(r"(/(?!api/)[^/]+)*/(_admin/.*|healthz)")  # below any mount prefix but /api/
MAX_SLEEPERS = 256  # requests a latency rule keeps waiting at once, each with a thread started beside it

# waitress's internals this section leans on, where waitress has no public API for the need (why each, and
# the test that names them: docs/operations.md, When things go wrong, Which waitress): create_server's
# _dispatcher; HTTPChannel.error_task_class and ErrorTask.execute; server._map, server.trigger and
# wasyncore.close_all (server.close() closes only the listener); a server's readable, maintenance and
# active_channels, and a channel's parser state (guarding_slow_senders).


def _control_dispatcher(threads: int) -> Any:
    """waitress's dispatcher, with threads kept for /healthz and /_admin/** (docs/operations.md): requests
    that a latency fault rule or a held lock keep waiting occupy the ``threads`` workers, never these."""
    from waitress.task import ThreadedTaskDispatcher

    class Dispatcher(ThreadedTaskDispatcher):
        def __init__(self) -> None:
            super().__init__()
            self.control, self.health = ThreadedTaskDispatcher(), ThreadedTaskDispatcher()
            self.sleepers, self.sleepers_lock = 0, threading.Lock()
            self.set_thread_count(threads)
            self.control.set_thread_count(CONTROL_THREADS)
            self.health.set_thread_count(1)

        def add_task(self, task: Any) -> None:
            requests = getattr(task, "requests", None)  # (waitress hands it a channel per request)
            matched = _CONTROL_PATH.fullmatch(getattr(requests[0], "path", "") if requests else "")
            pool = super() if matched is None else self.health if matched[2] == "healthz" else self.control
            pool.add_task(task)  # (/healthz: never behind an admin write waiting for the lock)

        def sleep(self, seconds: float) -> None:
            """A request's latency rule, with one more worker thread while it sleeps; past MAX_SLEEPERS, S503
            at once (docs/sandbox.md, Faults): a sleeper without a thread of its own would hold a worker."""
            with self.sleepers_lock:
                if self.sleepers >= MAX_SLEEPERS:
                    raise ServiceBusy(text=f"{MAX_SLEEPERS} requests are already held by latency fault rules"
                                           " in this process; this one is answered at once instead of"
                                           " waiting. Retry it, or hold fewer requests at a time.")
                self.sleepers += 1
                self.set_thread_count(threads + self.sleepers)
            try:
                time.sleep(seconds)
            finally:
                with self.sleepers_lock:
                    self.sleepers -= 1
                    self.set_thread_count(threads + self.sleepers)

        def idle(self) -> bool:
            """No request waiting for a thread, none being answered."""
            return all(not pool.queue and not pool.active_count for pool in (self, self.control, self.health))

        def shutdown(self, cancel_pending: bool = True, timeout: float = 5) -> bool:
            self.health.shutdown(cancel_pending, timeout)
            self.control.shutdown(cancel_pending, timeout)
            return super().shutdown(cancel_pending, timeout)

    return Dispatcher()


SERVE_THREADS = 1  # waitress's request threads by default: more only hand the GIL around (docs/operations.md)


def serve(svc: WalletService, host: str = "127.0.0.1", port: int = 8080, threads: int = SERVE_THREADS, *,
          workers: int = 1, on_ready: Callable[[str], None] | None = None, **settings: Any) -> None:
    """Serve ``svc`` on waitress until interrupted (Ctrl-C or SIGTERM), with WAITRESS_LIMITS; ``workers`` > 1
    forks that many on one socket and one database (docs/sandbox.md, One sandbox, however many processes)."""
    import socket

    if workers > 1 and svc.db.memory:
        raise ValueError("--workers needs a database file: processes share nothing else")
    app = create_app(svc, **settings)
    _raise_file_limit(WAITRESS_LIMITS["connection_limit"] + 64)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as exc:
        listener.close()
        if exc.errno == errno.EADDRINUSE:
            raise RuntimeError(f"port {port} on {host} is already in use: stop what holds it,"
                               " or pass --port 0 to pick a free one") from None
        raise
    listener.listen(1024)
    base_url = f"http://{host if family == socket.AF_INET else f'[{host}]'}:{listener.getsockname()[1]}"
    app.http.access_log = logging.getLogger("walletsvc.access")
    main_thread = threading.current_thread() is threading.main_thread()

    def stop(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second signal must not cut the cleanup short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    previous = (signal.signal(signal.SIGTERM, stop), signal.getsignal(signal.SIGINT)) if main_thread else None
    try:
        if workers == 1:
            server = _waitress_server(app, listener, threads)
            if main_thread:  # (the drained loop ends by SIGTERM's handler: SIGINT's may be ignored)
                drained = functools.partial(_thread.interrupt_main, signal.SIGTERM)
                signal.signal(signal.SIGTERM, _draining(server, drained))
            if on_ready:
                on_ready(base_url)
            log.info("serving on %s", base_url)
            try:
                server.run()
            finally:
                server.close()
                svc.close()
        else:
            svc.db.close()  # a child must not inherit an open connection: SQLite's locks would not be its own
            svc.db.share_turns()
            _run_workers(app, listener, threads, workers, lambda: on_ready and on_ready(base_url),
                         lambda: DatabaseFile.refuse_lost_shm(svc.db.path))
    except KeyboardInterrupt:
        log.info("stopped")
    finally:
        if previous:
            signal.signal(signal.SIGTERM, previous[0])
            signal.signal(signal.SIGINT, previous[1])
        listener.close()


# How long a stopping server answers the requests it has (SIGTERM, Ctrl-C): a latency rule's whole wait
# is longer (docs/operations.md).
DRAIN_SECONDS = 5.0


def _draining(server: Any, then: Callable[[], Any]) -> Callable[..., None]:
    """A SIGTERM handler: the server stops accepting at once; a thread waits until what it has is
    answered (DRAIN_SECONDS at most), then calls ``then`` (the serving loop goes on meanwhile). A
    SIGTERM while it drains changes nothing; one delivered after (``then`` may send it) stops the loop."""
    drained = threading.Event()

    def drain() -> None:
        deadline = time.monotonic() + DRAIN_SECONDS
        while time.monotonic() < deadline:
            if server.task_dispatcher.idle() and not any(
                    getattr(channel, "requests", None) or getattr(channel, "total_outbufs_len", 0)
                    for channel in list(server._map.values()) if channel is not server):
                break
            time.sleep(0.02)
        drained.set()
        then()

    def stop(signum: int, frame: Any) -> None:
        if drained.is_set():
            raise KeyboardInterrupt
        if not server.accepting:
            return
        server.accepting = False
        with contextlib.suppress(Exception):
            server.del_channel()  # (the listening socket, left open: another worker may still serve it)
        threading.Thread(target=drain, daemon=True).start()
    return stop


def _leave_with(parent: int) -> None:
    """A worker's watch: when its parent is gone (killed -9), it stops too, within half a second,
    rather than serve on alone beside processes that take it for gone."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGTERM)


def _waitress_answering(app: Callable, limit: int | None = None, **options: Any) -> Any:
    """waitress's server of ``app`` with ``options``, its own answers in envelopes, its log quiet."""
    from waitress import create_server

    logging.getLogger("waitress.queue").setLevel(logging.ERROR)  # no queue-depth floods
    logging.getLogger("waitress").addFilter(_not_a_dropped_connection)  # (once, however often it is called)
    return answering_in_envelopes(create_server(app, **options), limit)


def _waitress_server(app: WalletApp, listener: Any, threads: int) -> Any:
    dispatcher = _control_dispatcher(threads)
    app.http.sleep = dispatcher.sleep
    limit = app.http.settings.max_body_bytes
    return guarding_slow_senders(_waitress_answering(
        app, limit, sockets=[listener], _dispatcher=dispatcher, clear_untrusted_proxy_headers=False,
        ident="walletsvc", max_request_body_size=max(BODY_BUFFER_BYTES, limit + 1), **WAITRESS_LIMITS))


def guarding_slow_senders(server: Any) -> Any:
    """A waitress ``server`` that slow senders cannot fill (docs/operations.md, When things go wrong: A
    hostile network): no waitress option does, as it bounds a connection's silence, not how long its headers
    take, and stops accepting at its limit."""
    class GuardedChannel(server.channel_class):
        headers_since: float | None = None  # when the first byte of unfinished headers came

        def received(self, data: bytes) -> bool:
            result = super().received(data)
            unfinished = self.request is not None and not self.request.headers_finished
            if not unfinished:
                self.headers_since = None
            elif self.headers_since is None:
                self.headers_since = time.time()
            elif time.time() - self.headers_since > HEADERS_WITHIN:
                self.will_close = True
            return result

        def staleness(self) -> float:
            return self.last_activity if self.headers_since is None else self.headers_since

    def maintenance(now: float, closing_idle: Callable[[float], None] = server.maintenance) -> None:
        closing_idle(now)
        for channel in list(server.active_channels.values()):
            if (getattr(channel, "headers_since", None) or now) < now - HEADERS_WITHIN:
                channel.will_close = True

    def readable(accepting: Callable[[], bool] = server.readable) -> bool:
        if server.accepting and len(server._map) >= server.adj.connection_limit:
            channels = list(server.active_channels.values())
            waiting = [each for each in channels if not each.requests and hasattr(each, "staleness")]
            if waiting and not any(each.will_close for each in channels):  # (it closes on the next turn)
                min(waiting, key=lambda each: each.staleness()).will_close = True
        return accepting()

    server.channel_class = GuardedChannel
    server.maintenance, server.readable = maintenance, readable
    return server


def answering_in_envelopes(server: Any, limit: int | None = None) -> Any:
    """A waitress ``server`` whose own answers to what it cannot parse are the error envelope too
    (docs/contract.md, Choices where the contract is silent): S413 says the app's ``limit``, not the size
    waitress buffers; its 501 for a Transfer-Encoding is a 400 (the client's to change, so a 4xx)."""
    from waitress.channel import HTTPChannel
    from waitress.task import ErrorTask

    class EnvelopeErrorTask(ErrorTask):
        def execute(self) -> None:
            refusal = self.request.error
            problem = str(refusal.body)[:200].rstrip(".")
            error = (PayloadTooLarge(limit=limit or self.channel.server.adj.max_request_body_size)
                     if refusal.code == 413 else invalid("request", "http", problem=problem))
            status = refusal.code if refusal.code in HOST_REFUSALS or refusal.code == 413 else 400
            body = to_json(error_envelope(error, LOCALES[0], int(time.time() * 1000)))
            self.status = _STATUS_LINES[status]
            self.response_headers.extend([("Content-Type", JSON_CONTENT_TYPE),
                                          ("Content-Language", LOCALES[0]), ("Cache-Control", "no-store")])
            self.set_close_on_finish()
            self.content_length = len(body)
            self.write(body)

    class EnvelopeChannel(HTTPChannel):
        error_task_class = EnvelopeErrorTask

    server.channel_class = EnvelopeChannel
    return server


REFUSED_WORKER = 3  # exit status of a worker refuse_lost_shm kept from a file it must not join: not restarted


def _run_workers(app: WalletApp, listener: Any, threads: int, workers: int, ready: Callable[[], Any],
                 may_join: Callable[[], None]) -> None:
    """Fork ``workers`` processes serving ``listener``, each with its own connections; start another when one
    dies, unless refused (``may_join`` raised FileGone in it); on Ctrl-C or SIGTERM, stop them all."""
    def start() -> int:
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the child: serve until told to stop, then leave without running the parent's cleanup
            code = 0
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                may_join()
                threading.Thread(target=_leave_with, args=(parent,), daemon=True).start()
                server = _waitress_server(app, listener, threads)
                signal.signal(signal.SIGTERM, _draining(server, lambda: os._exit(0)))
                log.info("worker %d serving", os.getpid())
                server.run()
            except FileGone as exc:
                log.error("worker %d not started: %s", os.getpid(), exc)
                code = REFUSED_WORKER
            except BaseException:  # reported, and the parent starts another
                log.exception("worker %d stopped", os.getpid())
                code = 1
            finally:
                os._exit(code)
        return pid

    children = {start() for _ in range(workers)}
    ready()
    log.info("serving with %d workers", workers)
    try:
        while children:
            pid, status = os.wait()
            if pid in children:
                children.discard(pid)
                if os.waitstatus_to_exitcode(status) != REFUSED_WORKER:
                    time.sleep(0.2)  # a worker that cannot start does not make the parent spin
                    children.add(start())
        raise RuntimeError("no worker serves any longer: each was refused (the log says why)")
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        for pid in children:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


###############################################################################
# pytest plugin ################################################################
###############################################################################

@dataclasses.dataclass
class Sandbox:
    """A ready fake wallet backend for one test (docs/testing.md says what each field holds). Ids are
    seeded: the same test sees the same ids on every run."""

    service: WalletService
    app: bottle.Bottle
    clock: Clock
    workspace: dict = dataclasses.field(default_factory=dict)
    key: dict = dataclasses.field(default_factory=dict)
    wallets: dict = dataclasses.field(default_factory=dict)
    client: Client | None = None
    url: str | None = None
    admin_token: str | None = None  # the bearer token of the sandbox's /_admin/ surface
    server: Any = None  # the LiveServer of a live sandbox
    world_id: str | None = None  # a world beside the sandbox's (``world()``): its workspace, reset alone

    @classmethod
    def create(cls, database: str = ":memory:", *,
               scenario: str | os.PathLike | Mapping[str, Any] | None = None, **settings: Any) -> Sandbox:
        """A sandbox started from ``scenario`` (a TOML or JSON file, or a dict; by default the
        built-in DEMO_SCENARIO); the scenario's settings under ``settings``."""
        scenario = read_scenario(DEMO_SCENARIO if scenario is None else scenario)
        settings = {"id_seed": 0, "debug_signatures": True, "admin_token": "walletsvc-test-admin",
                    "journal_size": SANDBOX_JOURNAL_SIZE, **(scenario.get("settings") or {}), **settings}
        service_settings, http_settings = split_settings(settings)
        service = WalletService(database, clock=Clock(), **service_settings)
        return cls(service, create_app(service, **http_settings), service.clock,
                   admin_token=http_settings.get("admin_token"))._enter(start_world(service, scenario)[0])

    def _enter(self, workspace: dict) -> Sandbox:
        """This sandbox's workspace, key and wallets are ``workspace``'s (a world's description)."""
        self.workspace = {name: workspace[name] for name in ("id", "name", "ownerMemberId", "createdAt")}
        self.key = workspace["keys"][0] if workspace["keys"] else {}
        self.wallets = {wallet["name"]: wallet for wallet in workspace["wallets"]}
        self.client = self.client_for(self.key) if self.key else None
        return self

    def world(self, scenario: str | os.PathLike | Mapping[str, Any] | None = None) -> Sandbox:
        """A world of its own beside this one (``POST /_admin/scenarios``): the scenario (by default
        the one the sandbox started from) made again with fresh ids and a fresh key, sharing the service,
        the app, the clock and the server; its ``reset()`` resets only its workspace."""
        if scenario is None:
            scenario = {"workspaces": self.service.start_scenario()["workspaces"]}
        made = self.service.load_scenario(read_scenario(scenario), fresh_ids=True)["workspaces"][0]
        return dataclasses.replace(self, world_id=made["id"])._enter(made)

    def reset(self) -> Sandbox:
        """Back to the world as it was made, in one transaction: the same ids, balances and clock
        (a ``world()``: only its workspace, the clock untouched)."""
        self.service.reset() if self.world_id is None else self.service.reset_workspace(self.world_id)
        return self

    def client_for(self, key: dict) -> Client:
        """A signed client for another key (signing on the sandbox clock)."""
        return Client(self.url or self.app, key["apiKey"], key["secret"], clock=self.clock)

    def headers(self, method: str, path: str, body: bytes = b"") -> dict[str, str]:
        """Signed headers for the sandbox key, timestamped on the sandbox clock."""
        return sign_request(method, path, body, self.key["apiKey"], self.key["secret"],
                            timestamp=int(self.clock()))

    @property
    def journal(self) -> Journal:
        return self.service.journal

    @property
    def faults(self) -> Faults:
        return self.service.faults

    def assert_called(self, method: str | None = None, path: str | None = None, *, times: int | None = None,
                      at_least: int | None = None, never: bool = False, **criteria: Any) -> list[dict]:
        """The journal's ``assert_called``, with its signature."""
        __tracebackhide__ = True
        return self.service.journal.assert_called(method, path, times=times, at_least=at_least, never=never,
                                                  **criteria)

    def audit(self) -> None:
        """The fixtures call this after each test: a violation is a bug in walletsvc, not in the test."""
        try:
            self.service.assert_audit_clean()
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nThis is a bug in walletsvc, not in your test: please report it "
                                 "with the test that found it.") from None


class LiveServer:
    """An app on waitress, on a free port of 127.0.0.1, in a daemon thread."""

    def __init__(self, app: Callable, threads: int = 4) -> None:
        self._server = _waitress_answering(app, host="127.0.0.1", port=0, threads=threads)
        self.url = f"http://127.0.0.1:{self._server.effective_port}"
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="walletsvc-live", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._server.run()
        except OSError:  # (EBADF: stop closed what the loop was about to select on; it is done)
            if not self._stopping:
                raise

    def stop(self) -> None:
        """Close the listener and every open connection, in the server's own thread (so that its
        loop ends at once, keep-alive clients or not), then its worker threads."""
        from waitress import wasyncore

        server = self._server
        self._stopping = True
        server.task_dispatcher.shutdown(timeout=1)  # the requests in hand are answered first
        if self._thread.is_alive():
            with contextlib.suppress(OSError):  # EBADF: the loop ended meanwhile and closed its trigger
                server.trigger.pull_trigger(lambda: wasyncore.close_all(server._map))
            self._thread.join(timeout=5)


# The plugin's fixtures: plain functions, each declared with its scope by @_fixture; ``pytest_plugin``
# makes them pytest fixtures when pytest loads it, so that importing walletsvc never imports pytest.
_FIXTURES: dict[str, tuple[str, Callable[..., Any]]] = {}


def _fixture(scope: str = "function") -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def declare(function: Callable[..., Any]) -> Callable[..., Any]:
        _FIXTURES[function.__name__] = (scope, function)
        return function
    return declare


def _for_test(request: Any, default: Sandbox, cache: dict, make: Callable[[dict], Sandbox]) -> Iterator:
    """The test's sandbox, reset then audited: ``default``, or ``make``'s for its marker's settings (once)."""
    marker = request.node.get_closest_marker("walletsvc")
    settings, key = (dict(marker.kwargs), repr(sorted(marker.kwargs.items()))) if marker else ({}, "")
    if settings and key not in cache:
        cache[key] = make(settings)
    sandbox = cache[key] if settings else default
    yield sandbox.reset()
    sandbox.audit()


def _live_sandbox(settings: dict) -> Sandbox:
    sandbox = Sandbox.create(**settings)
    sandbox.server = LiveServer(sandbox.app)
    sandbox.url = sandbox.server.url
    sandbox.client = sandbox.client_for(sandbox.key) if sandbox.key else None  # (made before: in process)
    return sandbox


@_fixture("session")
def walletsvc_session_sandbox() -> Sandbox:
    """The session's in-process Sandbox at default settings (one per xdist worker);
    ``walletsvc_sandbox`` resets it before each test. Override it to change every test's."""
    return Sandbox.create()


@_fixture("session")
def walletsvc_session_sandboxes() -> dict:
    """In-process Sandboxes made for ``@pytest.mark.walletsvc(...)`` settings, one per distinct settings."""
    return {}


@_fixture()
def walletsvc_sandbox(request: Any, walletsvc_session_sandbox: Sandbox,
                      walletsvc_session_sandboxes: dict) -> Iterator[Sandbox]:
    """A walletsvc.Sandbox in process (no socket): ``.service``, ``.app``, ``.client``, ``.key``, ``.wallets``
    (alice, bob: USD 1000.00; yen: JPY 100000), ``.clock``, ``.journal``, ``.faults``, ``.admin_token``. Reset
    before the test, audited after it; settings from ``@pytest.mark.walletsvc(...)``."""
    yield from _for_test(request, walletsvc_session_sandbox, walletsvc_session_sandboxes,
                         lambda settings: Sandbox.create(**settings))


@_fixture("session")
def walletsvc_session_live() -> Iterator[Sandbox]:
    """The session's live Sandbox at default settings, on waitress on a random port of 127.0.0.1."""
    sandbox = _live_sandbox({})
    yield sandbox
    sandbox.server.stop()


@_fixture("session")
def walletsvc_session_lives() -> Iterator[dict]:
    """Live Sandboxes for ``@pytest.mark.walletsvc(...)`` settings; their servers stop with the session."""
    cache: dict = {}
    yield cache
    for sandbox in cache.values():
        sandbox.server.stop()


@_fixture()
def walletsvc_live(request: Any, walletsvc_session_live: Sandbox,
                   walletsvc_session_lives: dict) -> Iterator[Sandbox]:
    """``walletsvc_sandbox`` served over HTTP (``.url``; ``.client`` talks HTTP), for code under test
    that makes real requests. Reset before the test, audited after it; settings from the marker."""
    yield from _for_test(request, walletsvc_session_live, walletsvc_session_lives, _live_sandbox)


@functools.cache
def _pytest_plugin() -> Any:
    """walletsvc's pytest plugin (entry point ``pytest11``): fake wallet backends for tests.

    ``walletsvc_sandbox`` (in process) and ``walletsvc_live`` (on a socket) are made once per session and per
    xdist worker, reset before each test in about a millisecond and audited after it.
    ``@pytest.mark.walletsvc(**settings)`` gives a test a sandbox with those settings (service or HTTP layer,
    e.g. ``settlement="manual"``), made once per distinct settings."""
    import types

    import pytest

    plugin = types.ModuleType("walletsvc.pytest_plugin", _pytest_plugin.__doc__)
    plugin.pytest_configure = lambda config: config.addinivalue_line(
        "markers", "walletsvc(**settings): the walletsvc sandbox of this test gets these settings"
                   " (e.g. settlement='manual', magic_values=True)")
    for name, (scope, function) in _FIXTURES.items():
        setattr(plugin, name, pytest.fixture(function, scope=scope))
    return plugin


def __getattr__(name: str) -> Any:
    """``walletsvc.pytest_plugin`` is built on demand, so that importing walletsvc never imports pytest."""
    if name == "pytest_plugin":
        return _pytest_plugin()
    raise AttributeError(f"module 'walletsvc' has no attribute {name!r}")


###############################################################################
# Command line #################################################################
###############################################################################

def stored_admin_token(db: Database) -> str:
    """The admin token of a sandbox served without ``--admin-token``: random, drawn once per database and kept
    in it, so every worker, server and restart agree and no key holder can derive it (docs/sandbox.md)."""
    def draw(conn: sqlite3.Connection) -> str:
        conn.execute("INSERT INTO admin_token (token) SELECT ? WHERE NOT EXISTS (SELECT 1 FROM admin_token)",
                     (secrets.token_hex(16),))
        return conn.execute("SELECT token FROM admin_token").fetchone()[0]
    return db.write([draw])[0]


def _whole_number(minimum: int, maximum: int, name: str) -> Callable[[str], int]:
    """An argparse type: a whole number in [minimum, maximum], or a one-line error naming the range."""
    def convert(text: str) -> int:
        try:
            number = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not minimum <= number <= maximum:
            raise argparse.ArgumentTypeError(f"{number} is not {name}: at least {minimum}, at most {maximum}")
        return number
    return convert


BANNER_WALLETS = 5  # wallets the banner names; it says how many more


def demo_instructions(base_url: str, workspace: dict, admin_token: str | None, database: str) -> str:
    """What ``serve --demo`` (or ``--scenario``) prints of its first ``workspace``: an export line of the
    names the examples read; examples that paste as printed and sign at the sandbox's clock as it moves (the
    curl reads it from /healthz first: bash or zsh, curl, openssl and sed)."""
    key = workspace["keys"][0]
    names = {"WALLETSVC_URL": base_url, "WALLETSVC_KEY": key["apiKey"], "WALLETSVC_SECRET": key["secret"],
             **({"WALLETSVC_ADMIN_TOKEN": admin_token} if admin_token else {})}
    shown = workspace["wallets"][:BANNER_WALLETS]  # (the ready file keeps them all)
    wallets = ", ".join(f"{wallet['name']} {wallet['id']}" for wallet in shown)
    if more := len(workspace["wallets"]) - len(shown):
        wallets += f" and {more:,} more (walletsvc wallet list, or --ready-file)"
    return f"""walletsvc sandbox at {base_url}
database : {os.path.abspath(database)}
wallets  : {wallets or "(none)"}
console  : {f"{base_url}{CONSOLE_PATH} (log in with WALLETSVC_ADMIN_TOKEN)" if admin_token
            else "(off: it needs an admin token)"}

What walletsvc request, walletsvc.Client() and the examples below read:
export {" ".join(f"{name}={shlex.quote(value)}" for name, value in names.items())}

A signed request, from another shell:
walletsvc request GET /api/v1/wallets

Signed by hand (openssl + curl), at the sandbox's clock (read from /healthz first):
{CURL_SIGNED_GET}
From Python:
import walletsvc
print(walletsvc.Client().list_wallets())
"""


def _cell(value: Any) -> str:
    """A value as people write it in a table: lists comma-separated, booleans in lower case."""
    if isinstance(value, (list, tuple)):
        return ", ".join(map(_cell, value))
    return "" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _table(value: Any) -> str:
    """A human table of a resource, a list of them or a page."""
    if isinstance(value, dict) and "content" in value and "page" in value:
        page = value["page"]
        return (_table(value["content"]) + f"\npage {page['number']} of {page['totalPages']},"
                f" {page['totalElements']} in all")
    if isinstance(value, dict):
        value = [{"field": name, "value": item} for name, item in value.items()]
    if not isinstance(value, list):
        return json.dumps(value)
    if not value:
        return "(none)"
    columns = list(value[0])
    rows = [columns, *([_cell(row.get(c)) for c in columns] for row in value)]
    widths = [max(map(len, column)) for column in zip(*rows)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def _on_service(path: str, action: Callable[[WalletService], Any], existing: bool = True) -> Any:
    """What ``action`` answers of the database at ``path``, closed after; with ``existing``, one must be
    there: a command that only reads never makes one (docs/sandbox.md)."""
    if existing and path != ":memory:" and not os.path.exists(path):
        raise RuntimeError(f"no database at {path} (this command only reads, so it makes none): check --db or"
                           " $WALLETSVC_DB")
    with contextlib.closing(WalletService(path)) as svc:
        return action(svc)


def _admin_command(action: Callable[[WalletService, argparse.Namespace], Any], reads_only: bool,
                   args: argparse.Namespace) -> int:
    result = _on_service(args.db, lambda svc: action(svc, args), existing=reads_only)
    print(_table(result) if args.table else json.dumps(result, indent=2, ensure_ascii=False))
    return 0


class LogFormatter(logging.Formatter):
    """`walletsvc serve`'s lines on stderr, the access log's too, the date and time of each second formatted
    once (4 us less an access-log line)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(name)s %(message)s")
        self._second: tuple[int, str] = (-1, "")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        second, text = self._second
        if int(record.created) != second:
            second = int(record.created)
            text = time.strftime(self.default_time_format, self.converter(second))
            self._second = (second, text)
        return self.default_msec_format % (text, record.msecs)


def lean_log_records() -> None:
    """Log records keep nothing no line of `walletsvc serve` shows (thread, process, caller; the logging
    HOWTO, Optimization): 5 us less an access-log line. Set as serve starts: it changes every logger's."""
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    logging._srcfile = None


def _serve_command(args: argparse.Namespace) -> int:
    handler = logging.StreamHandler()
    handler.setFormatter(LogFormatter())
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    made = [path for path in (args.db, f"{args.db}-wal", f"{args.db}-shm") if not os.path.exists(path)]
    scenario = DEMO_SCENARIO if args.demo else read_scenario(args.scenario) if args.scenario else None
    token = {} if args.admin_token is None else {"admin_token": args.admin_token}  # ('' is refused)
    service_settings, settings = split_settings({"journal_size": SANDBOX_JOURNAL_SIZE,
                                                 **_command_line_settings(args, scenario), **token})
    if args.ready_file and (os.path.isdir(args.ready_file)
                            or not os.path.isdir(os.path.dirname(os.path.abspath(args.ready_file)))):
        raise RuntimeError(f"cannot write --ready-file {args.ready_file}: give a file's path in an existing"
                           " folder")
    svc = None
    try:  # every request records its nonce: refuse to start on storage that cannot be written
        svc = WalletService(args.db, clock=Clock(), **service_settings)  # controllable over /_admin/clock
        svc.db.check_writable()
    except sqlite3.DatabaseError as exc:  # (FileGone; unwritable; not a database, or a malformed one)
        _undo_start(svc, made)
        gone, unwritable = isinstance(exc, FileGone), isinstance(exc, sqlite3.OperationalError)
        raise RuntimeError(f"cannot serve {exc}" if gone else f"cannot serve {args.db}: {exc}" + (
            " (the database file and its directory must be writable)" if unwritable
            else ": restore it from a copy, or serve a new file (--db)")) from exc
    ready: list[str] = []
    try:
        with _progress(f"loading {args.scenario or 'the demo'} into {args.db}"):
            world = start_world(svc, scenario) if scenario else None
        if world is not None:
            if "admin_token" not in settings:
                settings["admin_token"] = stored_admin_token(svc.db)
            settings.setdefault("debug_signatures", True)
        counts = svc.db.one("SELECT (SELECT count(*) FROM api_keys), (SELECT count(*) FROM workspaces"
                            " WHERE deleted_at IS NULL)")

        def banner(base_url: str) -> None:
            ready.append(base_url)
            _serve_banner(args, settings, world, counts, base_url)

        lean_log_records()
        serve(svc, args.host, args.port, args.threads, workers=args.workers, on_ready=banner, **settings)
    except BaseException:
        if not ready:  # refused before serving (a bad scenario, a busy port): undone (docs/contract.md)
            _undo_start(svc, made)
        raise
    return 0


def _command_line_settings(args: argparse.Namespace, scenario: Mapping[str, Any] | None) -> dict:
    """``--set`` with the sandbox's settings, which win where they disagree (docs/sandbox.md, Scenarios): a
    file started from a scenario keeps its own, whatever this command's ``scenario`` says (start_world)."""
    given, stored = dict(args.set or ()), None
    with contextlib.suppress(sqlite3.Error, ValueError, OSError), contextlib.closing(sqlite3.connect(
            f"file:{urllib.parse.quote(os.path.abspath(args.db))}?mode=ro", uri=True)) as conn:
        stored = conn.execute("SELECT body FROM start_scenario").fetchone()
    sandbox = (json.loads(stored[0]) if stored else scenario or {}).get("settings") or {}
    def converted(name: str, value: Any) -> Any:
        return getattr(Settings(**{name: value}), name)

    for name, value in given.items():
        if name in sandbox and converted(name, value) != converted(name, sandbox[name]):
            print(f"walletsvc: --set {name}={value} is not this sandbox's: its scenario says {name}="
                  f"{sandbox[name]!r}, which every process on {args.db} serves", file=sys.stderr, flush=True)
    return {**given, **sandbox}


def _undo_start(svc: WalletService | None, made: list[str]) -> None:
    """A refused start removes what it made: SQLite's files (with the file's mode) would block the next."""
    if svc is not None:
        svc.close()
    for path in made:
        with contextlib.suppress(OSError):
            os.remove(path)


def _serve_banner(args: argparse.Namespace, settings: dict, world: list[dict] | None, counts: tuple[int, int],
                  base_url: str) -> None:
    """What ``walletsvc serve`` prints (and writes to ``--ready-file``) once its socket listens."""
    keys, workspaces = counts
    if args.ready_file:
        _write_ready_file(args.ready_file, base_url, settings.get("admin_token"), world or [])
    if world and world[0]["keys"]:
        print(demo_instructions(base_url, world[0], settings.get("admin_token"), args.db), flush=True)
    elif keys:
        print(f"walletsvc serving {args.db} at {base_url}\nIt holds {keys} API key(s) in {workspaces}"
              f" workspace(s): walletsvc workspace list --db {args.db}, walletsvc key list WORKSPACE_ID"
              f" --db {args.db} (a secret is printed once, when its key is made; a new one: walletsvc key"
              " create WORKSPACE_ID).", flush=True)
    else:
        print(f"walletsvc serving {args.db} at {base_url}\nTo sign requests you need a key: "
              f"walletsvc workspace create NAME --db {args.db}, then walletsvc key create WORKSPACE_ID"
              f" --db {args.db} (it prints the secret once); or start with --demo.", flush=True)
        if settings.get("admin_token"):
            print(f"Sandbox console: {base_url}{CONSOLE_PATH} (log in with the admin token)", flush=True)


def _write_ready_file(path: str, base_url: str, admin_token: str | None, world: list[dict]) -> None:
    """``--ready-file``: what a suite in another language needs, as JSON, written whole (a rename) once
    the socket listens: base URL, port, admin token, the scenario's keys and wallets (and its workspaces)."""
    def each(kind: str, *fields: str) -> list[dict]:
        return [{field: item[field] for field in fields} for workspace in world for item in workspace[kind]]

    ready = {"url": base_url, "port": int(base_url.rsplit(":", 1)[1]), "adminToken": admin_token,
             "keys": each("keys", "apiKey", "secret", "scopes", "workspaceId"),
             "wallets": each("wallets", "id", "name", "currency", "workspaceId"),
             "workspaces": [{"id": workspace["id"], "name": workspace["name"]} for workspace in world],
             "version": __version__}
    with _written_whole(path) as (descriptor, _), os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        json.dump(ready, handle, indent=2)  # (secrets inside: a private file)


PROGRESS_AFTER = 1.5  # seconds long work runs before a terminal is told what it is doing (_progress)


@contextlib.contextmanager
def _progress(what: str) -> Iterator[Callable[[str], None]]:
    """A line on stderr saying what long work does, for how long, from PROGRESS_AFTER seconds on: rewritten
    every second, cleared at the end, only on a terminal; yields the function the work tells what it does."""
    stream, doing, done, started = sys.stderr, [""], threading.Event(), time.monotonic()

    def show() -> None:
        wait, shown = PROGRESS_AFTER, False
        while not done.wait(wait):
            now = f": {doing[0]}" if doing[0] else ""
            print(f"\r\x1b[Kwalletsvc: {what}{now} ({time.monotonic() - started:.0f} s)", end="", file=stream,
                  flush=True)
            wait, shown = 1.0, True
        if shown:
            print("\r\x1b[K", end="", file=stream, flush=True)

    thread = threading.Thread(target=show, daemon=True)
    if stream.isatty():
        thread.start()
    try:
        yield lambda now: doing.__setitem__(0, now)
    finally:
        done.set()
        if thread.is_alive():
            thread.join()


def _audit_command(args: argparse.Namespace) -> int:
    with _progress(f"auditing {args.db}") as progress:
        violations = _on_service(args.db, lambda svc: svc.audit(progress))
    print((_table(violations) if violations else "clean: every invariant holds") if args.table
          else json.dumps(violations, indent=2, ensure_ascii=False))
    return 1 if violations else 0


def _copy_command(args: argparse.Namespace) -> int:
    """``walletsvc backup FILE`` and ``walletsvc restore FILE``, on the database at --db."""
    _on_service(args.db, lambda svc: getattr(svc, args.command)(args.file))
    print(f"backed up {args.db} to {args.file}" if args.command == "backup" else
          f"restored {args.file} into {args.db}: every server on it serves it from its next request")
    return 0


def _setting_pair(text: str) -> tuple[str, str]:
    name, equals, value = text.partition("=")
    if not equals or name.strip() not in Settings.names():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE with NAME one of"
                                         f" {', '.join(Settings.names())}")
    return name.strip(), value


def _base_url(given_url: str, parser: argparse.ArgumentParser) -> str:
    """The server's URL of ``request`` and ``sign``: http if it names no scheme, its path prefix
    percent-encoded where RFC 3986 requires (a prefix is sent, and signed, encoded)."""
    parts = urllib.parse.urlsplit(given_url if "://" in given_url else f"http://{given_url}")
    try:
        parts.port  # noqa: B018 - it checks the port
    except ValueError:
        parser.error(f"--url {given_url}: the port is not a number from 0 to 65535")
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        parser.error(f"--url {given_url}: give http(s)://HOST[:PORT][/PREFIX], without a query or fragment")
    return f"{parts.scheme}://{parts.netloc}{_rfc3986(parts.path, '/')}".rstrip("/")


def _target(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[str, str, str, str, str]:
    """(base URL, path, query, key, secret) of ``request`` and ``sign``: each given, else WALLETSVC_URL, _KEY
    and _SECRET, else the demo's, said on stderr (docs/reference.md, walletsvc request and walletsvc sign);
    the path starts with /, what RFC 3986 does not allow in a URL percent-encoded (what is sent is signed)."""
    given, fell_back = {}, []
    for name, variable, demo in (("url", "WALLETSVC_URL", DEMO_URL), ("key", "WALLETSVC_KEY", DEMO_KEY),
                                 ("secret", "WALLETSVC_SECRET", DEMO_SECRET)):
        given[name] = os.environ.get(variable, demo) if getattr(args, name) is None else getattr(args, name)
        if getattr(args, name) is None and variable not in os.environ:
            fell_back.append(variable)
    if fell_back:
        print(f"walletsvc: {', '.join(fell_back)} not set: the demo's {given['url']} with key {given['key']}"
              " (walletsvc serve --demo)", file=sys.stderr)
    if not given["key"] or not given["secret"]:
        parser.error("an API key and secret are needed: --key/--secret or WALLETSVC_KEY/WALLETSVC_SECRET")
    if not args.path.startswith("/"):
        parser.error(f"the path must start with / (e.g. /{args.path.lstrip('/')})")
    path, _, query = args.path.partition("?")
    return (_base_url(given["url"], parser), _rfc3986(path, "/"), _rfc3986(query, "/?=&"), given["key"],
            given["secret"])


def _request_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    url, path, query, key, secret = _target(args, parser)
    if args.method.upper() in ("POST", "PUT", "PATCH") and args.data is None:
        parser.error(f"{args.method.upper()} needs a JSON body: --data '{{...}}' (the exact bytes sent and"
                     " signed)")
    status, _, answer = Client(url, key, secret).send(args.method.upper(), path, query=query,
                                                      body=(args.data or "").encode("utf-8"))
    print(f"HTTP {status} {_STATUS_LINES.get(status, '').partition(' ')[2]}".rstrip(), file=sys.stderr)
    print(json.dumps(answer, indent=2, ensure_ascii=False))
    return 0 if answer.get("success") else 1


def _sign_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    url, path, query, key, secret = _target(args, parser)
    prefix = urllib.parse.urlsplit(url).path  # signed too: it is part of the path sent
    method, body = args.method.upper(), (args.data or "").encode("utf-8")
    try:  # at the server's clock, as every client walletsvc ships (docs/signing.md)
        stamp = server_time(url)
    except ConnectionError as exc:
        stamp = int(time.time())
        print(f"walletsvc: {exc}; signed at this machine's clock", file=sys.stderr)
    headers = sign_request(method, prefix + path, body, key, secret, timestamp=stamp)
    if args.format == "curl":  # a whole command, for every method: eval "$(walletsvc sign ... --format curl)"
        words = ["curl", "-s", "-X", method, url + path + (f"?{query}" if query else ""),
                 *(word for name, value in headers.items() for word in ("-H", f"{name}: {value}"))]
        if body:
            words += ["-H", "Content-Type: application/json", "--data-raw", args.data]  # (no @file reading)
        print(shlex.join(words))
    else:
        print("\n".join(f"{name}: {value}" for name, value in headers.items()))
    return 0


def _rfc3986(text: str, safe: str) -> str:
    """``text`` with what a URL cannot carry percent-encoded (existing escapes kept)."""
    return urllib.parse.quote(text, safe=safe + "%" + PCHAR_DELIMS)


class _OneLineParser(argparse.ArgumentParser):
    """argparse, saying a bad argument in one line (and where the help is), not under the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``walletsvc`` command line: serve, one verb per admin action, request, sign."""
    def global_options(parser: argparse.ArgumentParser, default: Any) -> argparse.ArgumentParser:
        parser.add_argument("--db", default=default(os.environ.get("WALLETSVC_DB", "walletsvc.db")),
                            help="SQLite database file (default $WALLETSVC_DB or walletsvc.db)")
        parser.add_argument("--table", action="store_true", default=default(False),
                            help="print a table instead of JSON")
        return parser

    # Before or after the subcommand: the subcommand's copy only overrides when given.
    common = global_options(_OneLineParser(add_help=False), lambda value: argparse.SUPPRESS)
    parser = global_options(_OneLineParser(prog="walletsvc", description=__doc__.splitlines()[0]),
                            lambda value: value)
    parser.add_argument("--version", action="version", version=f"walletsvc {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve_parser = commands.add_parser("serve", parents=[common], help="serve the API on waitress")
    add = serve_parser.add_argument
    add("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    add("--port", type=_whole_number(0, 65535, "a TCP port"), default=8080,
        help="port (default 8080; 0 picks one)")
    add("--workers", type=_whole_number(1, 64, "a worker count"), default=1,
        help="processes serving one socket and one database: one sandbox (default 1)")
    add("--threads", type=_whole_number(1, 256, "a thread count"), default=SERVE_THREADS,
        help=f"waitress worker threads (default {SERVE_THREADS}: the most requests a second on a few cores)")
    add("--ready-file", metavar="PATH",
        help="once serving, write the URL, port, admin token and the demo's keys and wallets to PATH as JSON")
    starts = serve_parser.add_mutually_exclusive_group()
    starts.add_argument("--demo", action="store_true", help="start from the built-in scenario once (alice,"
                                                             " bob, yen) and print its credentials")
    starts.add_argument("--scenario", metavar="FILE", help="start from this scenario (TOML, or JSON for"
                                                           " .json) once; docs/sandbox.md, Scenarios")
    add("--admin-token", default=os.environ.get("WALLETSVC_ADMIN_TOKEN") or None,
        help="enable /_admin/ with this bearer token (1 to 256 characters; $WALLETSVC_ADMIN_TOKEN, unless"
             " empty)")
    add("--set", action="append", type=_setting_pair, metavar="NAME=VALUE",
        help="a setting (docs/reference.md, Settings), e.g. busy_timeout=2; repeatable")
    serve_parser.set_defaults(run=_serve_command)

    def leaf(group: Any, name: str, help_text: str,
             action: Callable[[WalletService, argparse.Namespace], Any], *arguments: str) -> Any:
        parser = group.add_parser(name, parents=[common], help=help_text)
        for argument in arguments:
            parser.add_argument(argument)
        parser.set_defaults(run=functools.partial(_admin_command, action, name in ("list", "get")))
        return parser

    def verbs(name: str, help_text: str) -> Any:
        return commands.add_parser(name, help=help_text).add_subparsers(dest="verb", required=True)

    workspace = verbs("workspace", "create, list, delete workspaces")
    leaf(workspace, "create", "create a workspace", lambda svc, a: svc.create_workspace(a.name), "name")
    leaf(workspace, "list", "list workspaces", lambda svc, a: svc.list_workspaces())
    leaf(workspace, "delete", "delete a workspace (its keys answer GA2032)",
         lambda svc, a: svc.delete_workspace(a.workspace_id) or {"deleted": a.workspace_id}, "workspace_id")

    member = verbs("member", "add, remove, list members")
    leaf(member, "add", "add a member", lambda svc, a: svc.add_member(a.workspace_id, a.name),
         "workspace_id", "name")
    leaf(member, "remove", "remove a member (its keys answer GA2034)",
         lambda svc, a: svc.remove_member(a.workspace_id, a.member_id) or {"removed": a.member_id},
         "workspace_id", "member_id")
    leaf(member, "list", "list members", lambda svc, a: svc.list_members(a.workspace_id), "workspace_id")

    key = verbs("key", "create, list, disable, enable API keys")
    create_key = leaf(key, "create", "create a key (prints its secret once)",
                      lambda svc, a: svc.create_api_key(a.workspace_id, a.scope or SCOPES, member_id=a.member,
                                                        ip_whitelist=a.ip), "workspace_id")
    create_key.add_argument("--scope", action="append", choices=SCOPES, help="repeatable; default all")
    create_key.add_argument("--ip", action="append", help="whitelisted address or CIDR; repeatable")
    create_key.add_argument("--member", help="member id (default: the workspace owner)")
    leaf(key, "list", "list keys", lambda svc, a: svc.list_api_keys(a.workspace_id), "workspace_id")
    for verb, on in (("disable", False), ("enable", True)):
        leaf(key, verb, f"{verb} a key", lambda svc, a, on=on: svc.set_api_key_enabled(a.api_key, on),
             "api_key")

    wallet = verbs("wallet", "create, list, freeze, unfreeze, close wallets")
    leaf(wallet, "create", "create a wallet", lambda svc, a: svc.create_wallet(
        a.workspace_id, a.currency, name=a.name), "workspace_id", "currency").add_argument("--name")
    leaf(wallet, "list", "list a workspace's wallets", lambda svc, a: svc.get_workspace(a.workspace_id)
         and svc.list_wallets(a.workspace_id, {"size": 100}), "workspace_id")
    leaf(wallet, "get", "show a wallet", lambda svc, a: svc.get_wallet(a.wallet_id), "wallet_id")
    for verb, status in (("freeze", WalletStatus.FROZEN), ("unfreeze", WalletStatus.ACTIVE),
                         ("close", WalletStatus.CLOSED)):
        leaf(wallet, verb, f"set a wallet {status}",
             lambda svc, a, status=status: svc.set_wallet_status(a.wallet_id, status), "wallet_id")

    for verb, into in (("deposit", "into"), ("withdraw", "from")):
        leaf(commands, verb, f"{verb} money {into} a wallet",
             lambda svc, a, verb=verb: getattr(svc, verb)(a.wallet_id, a.amount), "wallet_id", "amount")

    transfer = verbs("transfer", "complete or fail PENDING transfer orders")
    for verb in ("complete", "fail"):
        leaf(transfer, verb, f"{verb} a PENDING order", lambda svc, a, verb=verb: getattr(
            svc, f"{verb}_transfer")(a.biz_id, workspace_id=a.workspace), "biz_id",
             ).add_argument("--workspace", help="workspace id, when the bizId is used in several")

    commands.add_parser("audit", parents=[common], help="check every ledger invariant; exit status 1 on a"
                        " violation").set_defaults(run=_audit_command)
    for name, help_text in (("backup", "copy the database to FILE, consistent while servers write to it"),
                            ("restore", ("make the served database what the backup FILE holds, in every"
                                         " process at once (docs/operations.md)"))):
        copying = commands.add_parser(name, parents=[common], help=help_text)
        copying.add_argument("file")
        copying.set_defaults(run=_copy_command)

    leaf(commands, "reset", "return the sandbox to its starting state (empty when none was saved), in one"
         " transaction", lambda svc, a: svc.reset() or {"reset": a.db}).add_argument(
        "--yes", action="store_true", required=True, help="confirm")

    for name, help_text, runner in (
            ("request", "sign and send a request; print the answer", _request_command),
            ("sign", "print the signature headers of a request", _sign_command)):
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("method")
        sub.add_argument("path", help="path, e.g. /api/v1/wallets (a query string is not signed)")
        sub.add_argument("--data", help="the exact JSON body")
        sub.add_argument("--key", help="the API key (WALLETSVC_KEY; the demo's if unset, said on stderr)")
        sub.add_argument("--secret", help="its secret (WALLETSVC_SECRET; the demo's if unset)")
        sub.add_argument("--url", help="the server (WALLETSVC_URL; the demo's if unset): signed at its clock,"
                                       " read from its /healthz; a path prefix in it is signed")
        if name == "sign":
            sub.add_argument("--format", choices=("headers", "curl"), default="headers",
                             help="headers, or a whole curl command")
        sub.set_defaults(run=lambda args, runner=runner, sub=sub: runner(args, sub))

    openapi = commands.add_parser("openapi", help="print the OpenAPI 3.1 document (API and admin)")
    openapi.add_argument("--url", default="http://127.0.0.1:8080", help="the server URL the document names")
    openapi.set_defaults(run=lambda args: print(json.dumps(openapi_document(
        [declaration for handlers in (WalletApi, AdminApi) for declaration, _ in declared(handlers)],
        args.url.rstrip("/")), indent=2)) or 0)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The ``walletsvc`` command; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except WalletError as exc:
        print(f"walletsvc: {exc.name} ({exc.code}): {exc.detail()}", file=sys.stderr)
        return 1
    except (sqlite3.Error, RuntimeError, ValueError, OSError, http.client.HTTPException) as exc:
        print(f"walletsvc: {exc}", file=sys.stderr)
        return 2


###############################################################################
# The console's page ###########################################################
###############################################################################

_CONSOLE_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 0; color: #1d2329; background: #f6f7f9; }
header { display: flex; flex-wrap: wrap; gap: .4em 1.2em; align-items: center; padding: .6em 1.2em;
  background: #1d2329; color: #fff; position: sticky; top: 0; z-index: 1; }
header a#faults-on { color: #ffb86b; font-weight: 600; } header nav { display: flex; gap: .9em; flex: 1; }
header a { color: #b9c6d3; text-decoration: none; }
header a.here { color: #fff; border-bottom: 2px solid #5fb3ff; } main { padding: 0 1.2em 2em; }
h1 { font-size: 1.3em; } h2 { font-size: 1.1em; margin-top: 1.4em; }
table { border-collapse: collapse; background: #fff; margin: .4em 0; }
th, td { border-bottom: 1px solid #e3e6ea; padding: .3em .7em; text-align: left; vertical-align: top; }
th { background: #eceff3; font-weight: 600; }
td.num { text-align: right; font-variant-numeric: tabular-nums; } tr.pick { cursor: pointer; }
tr.pick:hover, tr.picked { background: #eaf4ff; } tr.invalid td { color: #a4161a; }
.PENDING { color: #9a6700; } .FAILED { color: #a4161a; } .COMPLETED { color: #1a7f37; }
pre { background: #fff; border: 1px solid #e3e6ea; padding: .6em; white-space: pre-wrap;
  word-break: break-all; }
code { font: 12px ui-monospace, monospace; } .hint { color: #57606a; }
#message { margin: .5em 1.2em; min-height: 1.4em; } .bad { color: #a4161a; }
.diagnosis { font-weight: 600; color: #a4161a; }
form { background: #fff; padding: .8em; border: 1px solid #e3e6ea; display: inline-block; margin: .3em 0; }
form label { display: inline-block; margin: .2em .8em .2em 0; } textarea { width: 16em; height: 2.4em; }
button { cursor: pointer; } button.danger { color: #a4161a; }
"""

_CONSOLE_SCRIPT = r"""
"use strict";
const csrf = document.querySelector('meta[name="csrf"]').content;
const FAULT_ACTIONS = __FAULT_ACTIONS__;
const views = {wallets: showWallets, transfers: showTransfers, journal: showJournal, clock: showClock,
               faults: showFaults};
const id = encodeURIComponent;
const shown = {}, names = {};  // names: each wallet's name, by id, as the last lists of wallets said
const wallet = walletId => names[walletId] ? el("span", {title: walletId}, names[walletId]) : code(walletId);
let selectedWallet = null, openEntry = null, refreshing = false, failing = false;

function el(tag, attributes, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes || {})) {
    if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else if (value !== null && value !== undefined && value !== false) node.setAttribute(name, value);
  }
  for (const child of children.flat()) node.append(child instanceof Node ? child : String(child ?? ""));
  return node;  // text goes in as text: nothing a request carried can become markup
}
const cell = (value, kind) => el("td", kind ? {class: kind} : {}, value);
const code = (value) => value ? el("code", {}, value) : "-";
const table = (headings, rows) => el("table", {},
                                     el("thead", {}, el("tr", {}, headings.map(h => el("th", {}, h)))),
                                     el("tbody", {}, rows));
const fill = (selector, ...nodes) =>
  document.querySelector(selector).replaceChildren(...nodes.flat(Infinity));

function show(selector, data, build) {  // rebuilt only when its data changed: clicks and selections survive
  const key = JSON.stringify(data);
  if (shown[selector] !== key) fill(selector, build());
  shown[selector] = key;
}

const say = (text, bad) => Object.assign(document.getElementById("message"),
                                          {textContent: text, className: bad ? "bad" : ""});
const failed = error => say(error.message, true);

async function api(method, path, body) {
  const headers = {"X-Console-Csrf": csrf, ...body === undefined ? {} : {"Content-Type": "application/json"}};
  const reply = await fetch(path, {method, headers, body: JSON.stringify(body), credentials: "same-origin",
                                   cache: "no-store"});
  if (reply.status === 401) location.reload();  // the session ended: the login form
  const answer = await reply.json();
  if (!answer.success) throw new Error(`${answer.code} ${answer.message}: ${answer.detail}`);
  return answer.data;
}

async function act(method, path, body, done) {
  await api(method, path, body).then(() => say(done), failed);
  await refresh();
}

async function showWallets() {
  const workspaces = await api("GET", "workspaces");
  const list = (workspace, what) =>
    api("GET", `workspaces/${id(workspace.id)}/${what}?size=100&sort=createdAt,asc`);
  const pages = await Promise.all(workspaces.map(workspace => list(workspace, "wallets")));
  pages.forEach(page => page.content.forEach(w => { names[w.id] = w.name; }));
  const balances = await Promise.all(workspaces.map(async workspace => Object.fromEntries(
    (await list(workspace, "balances")).content.map(balance => [balance.walletId, balance]))));
  show("#wallets .data", [workspaces, pages, balances, selectedWallet], () => workspaces.length
    ? workspaces.map((workspace, n) => [el("h2", {}, workspace.name, " ", code(workspace.id)), table(
      ["Id", "Name", "Currency", "Status", "Balance", "Available", "Pending"],
      pages[n].content.map(w => el("tr", {class: w.id === selectedWallet ? "pick picked" : "pick",
                                          "data-wallet": w.id,
                                          onclick: () => { selectedWallet = w.id; refresh(); }},
        cell(code(w.id)), cell(w.name), cell(w.currency), cell(w.status, w.status),
        ...["balance", "available", "pending"].map(
          field => cell(balances[n][w.id] ? balances[n][w.id][field] : "-", "num"))))),
      pages[n].page.totalElements > pages[n].content.length
        ? el("p", {class: "hint"},
             `The first ${pages[n].content.length} of ${pages[n].page.totalElements} wallets.`) : ""])
    : el("p", {}, "No workspaces yet."));
  const flows = selectedWallet && await api("GET", `wallets/${id(selectedWallet)}/flows?size=100`);
  show("#flows", [selectedWallet, flows], () => flows
    ? [el("h2", {}, "Flows of ", wallet(selectedWallet), ", newest first"), table(
      ["At", "Type", "Direction", "Amount", "Balance after", "Counterparty", "bizId"],
      flows.content.map(f => el("tr", {}, cell(f.createdAt), cell(f.type), cell(f.direction),
                                cell(f.amount, "num"), cell(f.balanceAfter, "num"),
                                cell(wallet(f.counterpartyWalletId)), cell(f.bizId || "-"))))]
    : []);
}

async function showTransfers() {
  const orders = [];
  for (const workspace of await api("GET", "workspaces")) {
    const page = await api("GET", `workspaces/${id(workspace.id)}/transfers?size=100`);
    orders.push(...page.content.map(order => ({...order, workspaceId: workspace.id})));
    const wallets = await api("GET", `workspaces/${id(workspace.id)}/wallets?size=100&sort=createdAt,asc`);
    wallets.content.forEach(w => { names[w.id] = w.name; });
  }
  orders.sort((a, b) => b.createdAt.localeCompare(a.createdAt) || b.transferId.localeCompare(a.transferId));
  const decide = (order, verb, done) => /^\.\.?$/.test(order.bizId)  // browsers resolve it away in a URL
    ? el("button", {disabled: true,
                    title: `A browser cannot put the bizId "${order.bizId}" in a path: use the `
                           + "Python API or a client that sends the path as is"}, verb)
    : el("button", {onclick: () => act("POST", `transfers/${id(order.bizId)}/${verb.toLowerCase()}`,
                                       {workspaceId: order.workspaceId}, `${order.bizId}: ${done}.`)}, verb);
  show("#transfers .data", [orders, names], () => orders.length ? table(
    ["Created", "bizId", "From", "To", "Amount", "Status", ""],
    orders.map(o => el("tr", {"data-biz": o.bizId}, cell(o.createdAt), cell(o.bizId),
                              cell(wallet(o.sourceWalletId)), cell(wallet(o.targetWalletId)),
                              cell(`${o.amount} ${o.currency}`, "num"),
                              cell(o.status, o.status), cell(o.status === "PENDING"
                                ? [decide(o, "Complete", "completed"), " ", decide(o, "Fail", "failed")]
                                : ""))))
    : el("p", {}, "No transfer orders yet."));
}

let journal = [], journalPolls = 0;  // the newest 50 entries, newest first; polled for what is new only
async function showJournal() {
  const full = journalPolls++ % 10 === 0;  // now and then all 50 again: a reset or a DELETE removed some
  const since = full || !journal.length ? 0 : journal[0].seq;
  const fresh = (await api("GET", `journal?after=${since}&last=50&size=50`)).content.reverse();
  journal = full ? fresh : fresh.concat(journal).slice(0, 50);
  show("#journal .data", journal, () => journal.length ? table(
    ["At", "Method", "Path", "Status", "Code", "Verdict", "Elapsed ms"],
    journal.map(e => el("tr", {class: `pick ${e.signature}`, onclick: () => { openEntry = e; showEntry(); }},
      cell(e.at), cell(e.method), cell(code(e.path + (e.query ? "?" + e.query : ""))), cell(e.status),
      cell(e.code || "-"), cell(e.signature), cell(e.elapsedMs, "num"))))
    : el("p", {}, "No requests yet: every request to /api/ appears here."));
}

function showEntry() {
  const e = openEntry;
  if (!e) return fill("#entry");
  fill("#entry", el("h2", {}, `${e.method} ${e.path}: ${e.status} ${e.code || ""}`),
    e.diagnosis ? el("p", {class: "diagnosis"}, "Diagnosis: ", e.diagnosis) : "",
    el("h3", {}, "Canonical message the server computed"),
    el("pre", {class: "canonical"},
       e.canonicalMessage ?? "(none: the request did not reach the signature check)"),
    el("h3", {}, "Request headers"),
    table(["Header", "Value"],
          Object.entries(e.headers).map(([name, value]) => el("tr", {}, cell(name), cell(code(value))))),
    el("h3", {}, "Request body"), el("pre", {}, e.body || "(empty)"),
    el("h3", {}, "Response body"), el("pre", {}, e.responseBody));
}

async function showClock() {
  const clock = await api("GET", "clock");
  show("#clock .data", clock, () => [
    el("p", {}, "Service time: ", el("strong", {id: "clock-now"}, clock.now),
       clock.frozen ? " (frozen)" : " (running)"),
    clock.controllable ? "" : el("p", {class: "bad"}, "This service's clock is not controllable.")]);
}

async function showFaults() {
  const rules = await api("GET", "faults");
  const matchers = r =>
    ["query", "headers", "body"].filter(n => r[n]).map(n => `${n} ${JSON.stringify(r[n])}`).join("; ");
  show("#faults .data", rules, () => rules.length ? table(
    ["Id", "Action", "Method", "Path", "Code", "Status", "Latency s", "Times", "Fired", "Matchers", ""],
    rules.map(r => el("tr", {"data-fault": r.id}, cell(r.id), cell(r.action), cell(r.method),
      cell(code(r.path)), cell(r.code || "-"), cell(r.status ?? "-"), cell(r.latency, "num"),
      cell(r.times ?? "always"), cell(r.fired, "num"), cell(matchers(r) || "-"),
      cell(el("button", {onclick: () => act("DELETE", `faults/${id(r.id)}`, undefined, `${r.id} removed.`)},
              "Remove")))))
    : el("p", {}, "No fault rules."));
}

function faultBody(form) {
  const values = Object.fromEntries(new FormData(form));
  const body = {action: values.action, method: values.method || "*", path: values.path || "*"};
  if (values.code) body.code = values.code;
  for (const name of ["status", "times"]) if (values[name]) body[name] = parseInt(values[name], 10);
  if (values.latency) body.latency = parseFloat(values.latency);
  for (const name of ["query", "headers", "body"]) {
    if (!values[name]) continue;
    try { body[name] = JSON.parse(values[name]); }
    catch (error) { throw new Error(`${name} must be a JSON object: ${error.message}`); }
  }
  return body;
}

async function refresh() {
  const view = views[location.hash.slice(1)] ? location.hash.slice(1) : "wallets";
  for (const name of Object.keys(views)) document.getElementById(name).hidden = name !== view;
  for (const link of document.querySelectorAll("nav a"))
    link.classList.toggle("here", link.hash === "#" + view);
  try {
    const [clock, rules] = await Promise.all([api("GET", "clock"), api("GET", "faults")]);
    document.getElementById("now").textContent =
      `service time ${clock.now}${clock.frozen ? " (frozen)" : ""}`;
    const faultsOn = document.getElementById("faults-on");  // on every view: why requests may fail
    faultsOn.hidden = !rules.length;
    faultsOn.textContent = `${rules.length} fault rule${rules.length === 1 ? "" : "s"} active`;
    await views[view]();
    if (failing) say("");  // the server answers again
    failing = false;
  } catch (error) {
    failed(error);
    failing = true;
  }
}

for (const action of FAULT_ACTIONS)
  document.querySelector('#fault-form select[name="action"]').append(el("option", {}, action));
const on = (id, type, handler) => document.getElementById(id).addEventListener(type, handler);
const submit = (id, handle) => on(id, "submit", event => { event.preventDefault(); handle(event.target); });
submit("fault-form", form => {
  try { act("POST", "faults", faultBody(form), "Fault rule added."); } catch (error) { failed(error); }
});
on("clock-freeze", "click", () => act("POST", "clock", {freeze: true}, "Clock frozen."));
on("clock-unfreeze", "click", () => act("POST", "clock", {freeze: false}, "Clock running."));
submit("clock-advance", form => {
  const seconds = parseFloat(new FormData(form).get("advance"));
  act("POST", "clock", {advance: seconds}, `Clock advanced by ${seconds} s.`);
});
submit("clock-set", form => {
  const at = new FormData(form).get("at").trim();
  act("POST", "clock", {at}, `Clock set to ${at}.`);
});
on("reset", "click", () => {
  if (!confirm("Reset returns the sandbox to its starting state: what was made since, the journal and "
               + "the fault rules go. Reset?")) return;
  selectedWallet = openEntry = null; journal = []; journalPolls = 0;
  showEntry();
  act("POST", "reset", undefined, "Reset: the sandbox is back to its starting state.");
});
on("logout", "click", () => api("POST", "console/logout").then(() => location.reload(), failed));
window.addEventListener("hashchange", refresh);
setInterval(async () => {  // every view is live: the journal within a second of a request
  if (!refreshing) try { refreshing = true; await refresh(); } finally { refreshing = false; }
}, 1000);
refresh();
""".replace("__FAULT_ACTIONS__", json.dumps(list(FaultAction)))


def _page(title: str, head: str, body: str) -> str:
    """One of the console's two pages: its head (with ``head`` and the style), then ``body``."""
    return ('<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<meta name="viewport"'
            f' content="width=device-width, initial-scale=1">\n{head}<link rel="icon" href="data:,">\n'
            f"<title>{title}</title>\n<style>{_CONSOLE_STYLE}</style>\n</head>\n<body>\n{body}</body>\n</html>\n")


_CONSOLE_PAGE = _page("walletsvc console", '<meta name="csrf" content="__CSRF__">\n', """<header>
  <strong>walletsvc console</strong>
  <nav><a href="#wallets">Wallets</a> <a href="#transfers">Transfers</a> <a href="#journal">Journal</a>
    <a href="#clock">Clock</a> <a href="#faults">Faults</a></nav> <span id="now"></span>
  <a id="faults-on" href="#faults" hidden></a> <button id="reset" class="danger">Reset</button>
  <button id="logout">Log out</button>
</header>
<p id="message" role="status"></p>
<main>
<section id="wallets" hidden><h1>Wallets</h1><p class="hint">Every workspace's wallets. Click one for its
  flows.</p><div class="data"></div><div id="flows"></div></section>
<section id="transfers" hidden><h1>Transfers</h1><p class="hint">Transfer orders, newest first.</p>
  <div class="data"></div></section>
<section id="journal" hidden><h1>Journal</h1><p class="hint">Requests to /api/, newest first, live. Click one
  for its headers, body and signature check.</p><div class="data"></div><div id="entry"></div></section>
<section id="clock" hidden><h1>Clock</h1><div class="data"></div>
  <p><button id="clock-freeze">Freeze</button> <button id="clock-unfreeze">Unfreeze</button></p>
  <form id="clock-advance"><label>Advance by <input name="advance" type="number" step="any" value="3600">
    seconds</label> <button>Advance</button></form>
  <form id="clock-set"><label>Set to <input name="at" placeholder="2030-01-01T00:00:00Z" required></label>
    (RFC 3339: 2030-01-01T00:00:00Z, or a date) <button>Set</button></form></section>
<section id="faults" hidden><h1>Faults</h1><div class="data"></div><h2>Add a rule</h2>
  <form id="fault-form">
    <label>Action <select name="action"></select></label> <label>Method <input name="method" value="*"
      size="6"></label> <label>Path glob <input name="path" value="/api/v1/*"></label>
    <label>Code <input name="code" size="8" placeholder="T2001"></label>
    <label>Status <input name="status" type="number" size="4"></label>
    <label>Latency s <input name="latency" type="number" step="any" size="4"></label>
    <label>Times <input name="times" type="number" min="1" size="4" placeholder="always"></label><br>
    <label>Query <textarea name="query" placeholder='{"size": "5"}'></textarea></label>
    <label>Headers <textarea name="headers" placeholder='{"X-Locale": "zh-CN"}'></textarea></label>
    <label>Body fields <textarea name="body" placeholder='{"amount": "13.00"}'></textarea></label>
    <button>Add rule</button></form></section>
</main>
<script>""" + _CONSOLE_SCRIPT + "</script>\n")

_CONSOLE_LOGIN = _page("walletsvc console: log in", "", """<header><strong>walletsvc console</strong></header>
<main>
<h1>Log in</h1>
<form method="post" action="console">
  <label>Admin token <input name="token" type="password" autocomplete="current-password" required
    autofocus></label>
  <button>Log in</button>
</form>
<p class="bad">__MESSAGE__</p>
<p class="hint">The admin token is the one <code>walletsvc serve</code> printed, or the one you gave it
(<code>--admin-token</code>).</p>
</main>
""")


def _csp_source(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii") + "'"


# Only this page's own script and style run, it talks only to its own origin, and no
# other site may frame it (a Reset button under someone else's page).
_PAGE_HEADERS = tuple({
    "Content-Security-Policy": f"default-src 'none'; script-src {_csp_source(_CONSOLE_SCRIPT)}; "
                               f"style-src {_csp_source(_CONSOLE_STYLE)}; connect-src 'self'; img-src data:; "
                               "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer", "X-Content-Type-Options": "nosniff"}.items())

if __name__ == "__main__":  # last, so that a run as a script (python walletsvc.py) has every section defined
    sys.exit(main())
