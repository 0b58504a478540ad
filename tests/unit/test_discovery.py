"""Discovery's pure parts: the plan (desired vs current → changes), the file and DNS answers'
parsing against hostile input, and the settings. No socket, no process (tests/process has
discovery against a running proxy)."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvbridge.errors import ConfigError
from kvbridge.proxy.discovery import (
    MAX_ENGINES,
    MAX_FILE_BYTES,
    Action,
    Change,
    Current,
    DiscoveryError,
    DnsSource,
    FileSource,
    parse_engines,
    plan,
)
from kvbridge.proxy.members import Admission, Role
from kvbridge.proxy.settings import ProxySettings, parse_dns_target

P, D = Role.PREFILL, Role.DECODE
A, B, C = "http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"


def cur(url: str, role: Role = D, admission: Admission = Admission.ACTIVE,
        busy: bool = False) -> Current:
    return Current(url, role, admission, busy)


def changes(p: object) -> list[tuple[str, str]]:
    return [(a.change.value, a.url) for a in p.actions]  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------ plan


def test_new_urls_are_added_and_known_ones_left_alone() -> None:
    p = plan({D: frozenset({A, B})}, [cur(A)], owned={A}, drained=set())
    assert p.actions == [Action(Change.ADDED, D, B)]


def test_a_url_that_left_is_drained_then_removed_once_idle() -> None:
    owned = {A, B}
    assert changes(plan({D: frozenset({A})}, [cur(A), cur(B)], owned, set())) == [
        ("drained", B)]
    busy = [cur(A), cur(B, admission=Admission.DRAINING, busy=True)]
    assert plan({D: frozenset({A})}, busy, owned, {B}).actions == []  # never while it serves
    idle = [cur(A), cur(B, admission=Admission.DRAINING)]
    assert changes(plan({D: frozenset({A})}, idle, owned, {B})) == [("removed", B)]


def test_a_url_that_comes_back_before_removal_is_resumed_only_if_discovery_drained_it() -> None:
    draining = [cur(A, admission=Admission.DRAINING, busy=True)]
    assert changes(plan({D: frozenset({A})}, draining, {A}, {A})) == [("resumed", A)]
    # drained by an operator (/admin): discovery leaves it draining
    assert plan({D: frozenset({A})}, draining, {A}, set()).actions == []


def test_static_and_admin_engines_are_never_drained_or_removed() -> None:
    engines = [cur(A), cur(B, admission=Admission.DRAINING)]
    assert changes(plan({D: frozenset({C})}, engines, owned=set(), drained=set())) == [
        ("added", C)]


def test_empty_or_missing_answers_change_nothing() -> None:
    engines = [cur(A), cur(B, P)]
    assert plan({}, engines, {A, B}, set()).actions == []
    assert plan({D: frozenset(), P: frozenset()}, engines, {A, B}, set()).actions == []


def test_the_last_engine_of_a_role_is_kept() -> None:
    last = [cur(A, admission=Admission.DRAINING), cur(B, P)]
    p = plan({D: frozenset({C}), P: frozenset({B})}, last, {A, B}, {A})
    assert changes(p) == [("added", C), ("removed", A)]  # C counts: it is joining
    p = plan({D: frozenset({C})},
             [cur(A, admission=Admission.DRAINING), cur(C, admission=Admission.DRAINING)],
             {A, C}, {A, C})
    assert changes(p) == [("removed", A), ("resumed", C)]
    two_leaving = [cur(A, admission=Admission.DRAINING), cur(C, admission=Admission.DRAINING)]
    p = plan({D: frozenset({B})}, two_leaving + [cur(B, P)], {A, C}, {A, C})
    # B is a prefill engine: not added as a decode (the fleet refuses); one of A, C is kept
    assert changes(p) == [("removed", A)] and p.kept == [C]


def test_roles_are_planned_independently() -> None:
    engines = [cur(A, P), cur(B, D)]
    p = plan({P: frozenset({C})}, engines, {A, B}, set())
    assert changes(p) == [("added", C), ("drained", A)]


# ------------------------------------------------------------------------------ the file


def test_engines_file_parses_and_normalizes() -> None:
    got = parse_engines(json.dumps({"prefill": ["10.0.0.1:8000/"], "decode": [B, B]}).encode(),
                        "f")
    assert got == {P: frozenset({A}), D: frozenset({B})}
    assert parse_engines(b'{"decode": []}', "f") == {D: frozenset()}


@pytest.mark.parametrize(("content", "says"), [
    (b"", "not JSON"),
    (b"\xff\xfe", "not JSON"),
    (b"[" * 100000, "not JSON"),
    (b'["http://a:1"]', "JSON object"),
    (b'{"prefill": [], "decodes": [], "x": 1}', "unknown key(s) 'decodes', 'x'"),
    (b'{"prefill": "http://a:1"}', "'prefill' must be a list"),
    (b'{"decode": [1]}', "'decode[0]' must be an engine URL"),
    (b'{"decode": ["http://a:1", "http://evil@b:2"]}', "'decode[1]' must be http[s]://host:port"),
    (b'{"decode": ["file:///etc/passwd"]}', "'decode[0]'"),
    (b'{"decode": ["http://a:1/v1?x=1"]}', "'decode[0]'"),
    (b'{"decode": ["http://' + b"a" * 400 + b':1"]}', "at most 300"),
    (b'{"prefill": ["http://a:1"], "decode": ["http://a:1"]}', "listed as prefill and decode"),
    (json.dumps({"decode": [f"http://h{i}:1" for i in range(MAX_ENGINES + 1)]}).encode(),
     f"at most {MAX_ENGINES}"),
])
def test_a_malformed_or_forged_engines_file_is_refused_naming_the_fault(content: bytes,
                                                                       says: str) -> None:
    with pytest.raises(DiscoveryError) as err:
        parse_engines(content, "engines.json")
    assert says in str(err.value), err.value


def test_file_source_rereads_on_change_refuses_huge_and_special_files(tmp_path: Path) -> None:
    path = tmp_path / "engines.json"
    src = FileSource(str(path))

    with pytest.raises(DiscoveryError, match="cannot read"):
        asyncio.run(src.fetch())
    path.write_text(json.dumps({"decode": [A]}))
    assert asyncio.run(src.fetch()) == {D: frozenset({A})}
    path.write_text(json.dumps({"decode": [A, B]}))
    os.utime(path, ns=(1, 10**18))  # a change the next round sees whatever the clock
    assert asyncio.run(src.fetch()) == {D: frozenset({A, B})}
    path.write_bytes(b" " * (MAX_FILE_BYTES + 1))
    with pytest.raises(DiscoveryError, match="over 1048576 bytes"):
        asyncio.run(src.fetch())
    with pytest.raises(DiscoveryError, match="over 1048576 bytes"):  # unchanged: same answer
        asyncio.run(src.fetch())
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # reading it would block the proxy: refused without blocking
    with pytest.raises(DiscoveryError, match="not a regular file"):
        asyncio.run(FileSource(str(fifo)).fetch())


# ------------------------------------------------------------------------------ DNS answers


def dns(answer: object, timeout_s: float = 1.0) -> DnsSource:
    async def resolver(name: str, port: int) -> Sequence[str]:
        assert (name, port) == ("engines.local", 8100)
        if isinstance(answer, BaseException):
            raise answer
        if answer == "hang":
            await asyncio.sleep(3600)
        return answer  # type: ignore[return-value]

    return DnsSource(D, "engines.local:8100", "--decode-dns", timeout_s, resolver)


def test_dns_answers_become_urls_on_the_port() -> None:
    got = asyncio.run(dns(["10.0.0.1", "10.0.0.1", "fe80::1%eth0", "::1"]).fetch())
    assert got == {D: frozenset({"http://10.0.0.1:8100", "http://[fe80::1]:8100",
                                 "http://[::1]:8100"})}


@pytest.mark.parametrize(("answer", "says"), [
    (OSError("Name or service not known"), "Name or service not known"),
    (["10.0.0.1", "evil.example:80"], "is no IP address"),
    ([10], "is no IP address"),
    ("10.0.0.1", "not a list"),
    ([f"10.0.{i // 256}.{i % 256}" for i in range(MAX_ENGINES + 1)], f"over {MAX_ENGINES}"),
    ("hang", "took over 0.05 s"),
])
def test_a_failed_or_forged_dns_answer_is_an_error(answer: object, says: str) -> None:
    with pytest.raises(DiscoveryError) as err:
        asyncio.run(dns(answer, timeout_s=0.05).fetch())
    assert says in str(err.value)


# ------------------------------------------------------------------------------ settings


def test_settings_need_engines_from_somewhere_and_name_the_bad_flag() -> None:
    with pytest.raises(ConfigError, match="no decode engine: give --decode URL"):
        ProxySettings(prefill=[A], decode=[]).check()
    ProxySettings(prefill=[A], decode=[], decode_dns="kvbridge-decode:8000").check()
    ProxySettings(prefill=[], decode=[], engines_file="/etc/engines.json").check()
    with pytest.raises(ConfigError, match="--prefill-dns"):
        ProxySettings(prefill=[], decode=[B], prefill_dns="http://x:1").check()
    with pytest.raises(ConfigError, match="--discovery-interval"):
        ProxySettings(prefill=[A], decode=[B], discovery_interval_s=0).check()
    assert parse_dns_target("kvbridge-decode.ns.svc.cluster.local", "--x") == (
        "kvbridge-decode.ns.svc.cluster.local", 8000)
    with pytest.raises(ConfigError, match="1-65535"):
        parse_dns_target("a:70000", "--decode-dns")
