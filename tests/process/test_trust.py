"""Authenticated by default: the per-user secret of a host (kvbridge.trust; issue 25, part 2)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge import trust
from kvbridge.config import Config
from kvbridge.control import ControlClient
from kvbridge.errors import ConfigError, PeerUnreachable
from kvbridge.host.files import UnsafePath
from kvbridge.messages import Codec, StatsQuery, StatsReply
from kvbridge.testing.agents import LocalAgent
from kvbridge.testing.handoffs import FAST

pytestmark = pytest.mark.timeout(60)

ROOT = os.geteuid() == 0


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_the_secret_is_created_once_private_and_reused(tmp_path: Path) -> None:
    path = tmp_path / "state" / "kvbridge" / "secret"
    secret, created = trust.user_secret(path)
    assert created and len(secret) == 64 and int(secret, 16) >= 0
    assert _mode(path) == 0o600 and _mode(path.parent) == 0o700
    again, created_again = trust.user_secret(path)
    assert again == secret and not created_again
    assert not [p for p in path.parent.iterdir() if p.name != "secret"]  # no temp left


def _make(path: str, q: mp.Queue[bytes]) -> None:
    q.put(trust.user_secret(Path(path))[0])


def test_processes_that_create_it_at_once_agree(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    q: mp.Queue[bytes] = ctx.Queue()
    path = str(tmp_path / "kv" / "secret")
    procs = [ctx.Process(target=_make, args=(path, q)) for _ in range(6)]
    for p in procs:
        p.start()
    got = {q.get(timeout=30) for _ in procs}
    for p in procs:
        p.join(10)
    assert len(got) == 1


@pytest.mark.parametrize("mode", [0o750, 0o707, 0o777])
def test_a_directory_others_may_enter_is_refused_naming_it(tmp_path: Path, mode: int) -> None:
    folder = tmp_path / "kv"
    folder.mkdir(mode=0o700)
    folder.chmod(mode)
    with pytest.raises(UnsafePath, match=str(folder)):
        trust.user_secret(folder / "secret")


def test_a_parent_others_may_write_is_refused(tmp_path: Path) -> None:
    parent = tmp_path / "open"
    parent.mkdir()
    parent.chmod(0o777)  # not sticky
    with pytest.raises(UnsafePath, match="may be written by other users"):
        trust.user_secret(parent / "kv" / "secret")
    assert not (parent / "kv").exists()  # nothing was created below it


@pytest.mark.skipif(not ROOT, reason="needs root to hand a directory to another user")
def test_a_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "kv"
    folder.mkdir(mode=0o700)
    os.chown(folder, 1000, 1000)
    with pytest.raises(UnsafePath, match="belongs to another user"):
        trust.user_secret(folder / "secret")


def test_a_secret_that_is_a_link_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "kv"
    folder.mkdir(mode=0o700)
    elsewhere = tmp_path / "planted"
    elsewhere.write_text("a" * 64)
    elsewhere.chmod(0o600)
    (folder / "secret").symlink_to(elsewhere)
    with pytest.raises(UnsafePath, match="link"):
        trust.user_secret(folder / "secret")


def test_a_readable_or_short_secret_file_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "kv"
    folder.mkdir(mode=0o700)
    secret = folder / "secret"
    secret.write_text("b" * 64)
    secret.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        trust.user_secret(secret)
    secret.chmod(0o600)
    secret.write_text("short")
    with pytest.raises(ConfigError, match="at least 16"):
        trust.user_secret(secret)


def test_resolve_precedence(tmp_path: Path) -> None:
    fleet = trust.resolve(Config.load({"secret": "s3cret"}, env={}))
    assert fleet.secret == b"s3cret" and "fleet secret" in fleet.describe()
    assert "s3cret" not in fleet.describe()
    insecure = trust.resolve(Config.load({"allow_insecure_control": True}, env={}))
    assert insecure.secret is None and not insecure.authenticated
    with pytest.raises(ConfigError, match="routable"):
        trust.resolve(Config.load({"side_channel_host": "10.1.2.3"}, env={}))
    with pytest.raises(ConfigError, match="advertise_host '10.1.2.3'.*routable"):
        trust.resolve(Config.load({"advertise_host": "10.1.2.3"}, env={}))
    path = tmp_path / "s" / "secret"
    user = trust.resolve(Config.load({}, env={"KVBRIDGE_SECRET_FILE": str(path)}))
    assert user.path == path and user.created and user.secret == path.read_bytes().strip()
    assert str(path) in user.describe() and user.secret.decode() not in user.describe()


def test_the_default_file_follows_xdg_then_home_then_tmp(tmp_path: Path) -> None:
    runtime = tmp_path / "run"
    runtime.mkdir()
    assert trust.default_secret_file({"XDG_RUNTIME_DIR": str(runtime)}) == \
        runtime / "kvbridge" / "secret"
    home = tmp_path / "home"
    home.mkdir()
    assert trust.default_secret_file({"HOME": str(home)}) == \
        home / ".local" / "state" / "kvbridge" / "secret"
    assert trust.default_secret_file({"XDG_RUNTIME_DIR": "/nonexistent/run"}) == \
        Path("/tmp") / f"kvbridge-{os.geteuid()}" / "secret"


def test_engines_with_no_secret_configured_authenticate_and_say_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "user" / "secret"
    caplog.set_level(logging.INFO, logger="kvbridge.loop")
    a = LocalAgent("a", extra={**FAST, "secret_file": str(path)})
    try:
        assert a.loop.codec.authenticated
        secret = path.read_bytes().strip()
        lines = [r.getMessage() for r in caplog.records if "control channel" in r.getMessage()]
        assert any(f"per-user secret {path}" in line for line in lines), lines
        assert not any(secret.decode() in line for line in lines)
        # a stranger (no secret) is never answered; the user's own tools are
        stranger = ControlClient(Codec(), 0.5)
        with pytest.raises(PeerUnreachable):
            stranger.request(a.address, StatsQuery())
        stranger.close()
        friend = ControlClient(Codec(secret), 5.0)
        assert isinstance(friend.request(a.address, StatsQuery()), StatsReply)
        friend.close()
    finally:
        a.close()


def test_kvbridge_stats_works_with_no_secret_configured(tmp_path: Path) -> None:
    """The README's `kvbridge stats` against an engine that set nothing up."""
    path = tmp_path / "user" / "secret"
    a = LocalAgent("stats-me", extra={**FAST, "secret_file": str(path)})
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVBRIDGE_")}
    env["KVBRIDGE_SECRET_FILE"] = str(path)
    try:
        out = subprocess.run([sys.executable, "-m", "kvbridge.tools.cli", "stats", a.address],
                             capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode == 0, out.stderr
        assert "stats-me" in out.stdout
    finally:
        a.close()
