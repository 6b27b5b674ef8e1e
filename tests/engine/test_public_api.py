"""The public surface: what ``import hixl`` exports is pinned here, and importing has no side effects."""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
import traceback
from pathlib import Path

import hixl
import hixl.testing
from hixl.testing import conformance, hosts

ROOT = Path(__file__).resolve().parents[2]

EXPORTED = [
    "DEFAULT_OPTIONS",
    "PAGE_SIZE",
    "AccessDenied",
    "AlreadyConnected",
    "AuthenticationFailed",
    "CheckedRows",
    "EncryptionMismatch",
    "Engine",
    "HixlError",
    "HixlTimeout",
    "IntegrityError",
    "MemDesc",
    "MemHandle",
    "MemType",
    "MemoryRangeError",
    "NetworkBackend",
    "NotConnected",
    "NotifyDesc",
    "Op",
    "ParamInvalid",
    "PeerDisconnected",
    "ProtocolError",
    "ResourceExhausted",
    "Status",
    "StoreUnavailable",
    "TcpBackend",
    "TransferCancelled",
    "TransferError",
    "TransferOpDesc",
    "TransferReq",
    "TransferStatus",
    "TransferTimeout",
    "Unsupported",
    "__version__",
    "empty",
]


def test_exported_members() -> None:
    """Adding or removing a public name is a decision: update this list with it."""
    assert hixl.__all__ == EXPORTED
    for name in EXPORTED:
        assert hasattr(hixl, name), name
    public = {n for n in dir(hixl) if not n.startswith("_")}
    submodules = {"engine", "datadist", "discovery", "testing", "transports", "demo", "bench", "cli", "proxy", "vllm", "weights"}
    assert public - submodules <= set(EXPORTED), "public names missing from __all__"


def test_exported_objects_belong_to_hixl() -> None:
    for name in EXPORTED:
        obj = getattr(hixl, name)
        module = getattr(obj, "__module__", None)
        if module is not None and isinstance(obj, type):
            assert module == "hixl" or module.startswith("hixl."), (name, module)


def test_default_options() -> None:
    assert hixl.DEFAULT_OPTIONS == {
        "transport": "auto",
        "connect_timeout": 5.0,
        "connect_fail_fast": False,
        "transfer_timeout": 30.0,
        "deregister_timeout": 5.0,
        "heartbeat_interval": 1.0,
        "heartbeat_misses": 5,
        "idle_ping_interval": 10.0,
        "hello_timeout": 1.0,
        "handshake_timeout": 5.0,
        "frame_timeout": 10.0,
        "max_notifies": 4096,
        "max_notify_bytes": 4 << 20,
        "max_notifies_per_connection": 1024,
        "max_notify_bytes_per_connection": 1 << 20,
        "max_registrations": 65536,
        "max_handshakes": 64,
        "max_handshakes_per_source": 8,
        "max_connections": 4096,
        "max_connections_per_peer": 64,
        "serve_threads": 4,
        "max_inflight": 4096,
        "copy_lanes": min(4, os.cpu_count() or 1),
        "busy_poll": 50e-6,
        "auth_secret": None,
        "allow_unauthenticated": False,
        "encrypt": False,
        "allowed_networks": None,
        "metadata_server": None,
        "lease_ttl": 10.0,
    }


def test_version_matches_the_package_metadata() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(r'^version = "([^"]+)"$', text, re.MULTILINE)  # (tomllib needs 3.11)
    assert match and hixl.__version__ == match.group(1)


def test_typed_marker() -> None:
    assert (Path(hixl.__file__).parent / "py.typed").is_file()


def test_testing_helpers() -> None:
    assert "TargetProcess" in hixl.testing.__all__
    assert conformance.__all__ == ["TransportConformance"]
    assert hosts.__all__ == ["Host", "Hosts", "HostsError", "hosts_fixture", "hosts_unavailable", "skip_unless_hosts"]


def test_import_has_no_side_effects() -> None:
    """No threads, no log handlers, no environment edits, torch not pulled in."""
    code = (
        "import os, sys, threading, logging\n"
        "before = dict(os.environ)\n"
        "import hixl, hixl.testing, hixl.testing.hosts, hixl.transports\n"
        "assert threading.active_count() == 1, threading.enumerate()\n"
        "assert not logging.getLogger('hixl').handlers\n"
        "assert not logging.getLogger().handlers\n"
        "assert dict(os.environ) == before\n"
        "assert 'torch' not in sys.modules\n"
        "assert 'etcd3gw' not in sys.modules\n"
        "assert 'pytest' not in sys.modules\n"  # hixl.testing.hosts imports it for its fixture only
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr


def test_errors_are_named_as_users_import_them() -> None:
    errors = [getattr(hixl, name) for name in hixl.__all__ if isinstance(getattr(hixl, name), type) and issubclass(getattr(hixl, name), hixl.HixlError)]
    assert hixl.NotConnected in errors and hixl.IntegrityError in errors
    for error in errors:
        assert error.__module__ == "hixl", error
        raised = error("why", hixl.Status.FAILED)
        again = pickle.loads(pickle.dumps(raised))
        assert type(again) is error and str(again) == str(raised) and str(again).startswith("why")
    try:
        raise hixl.NotConnected("nobody listens on 127.0.0.1:9")
    except hixl.NotConnected:
        shown = traceback.format_exc()
    assert shown.splitlines()[-1] == "hixl.NotConnected: nobody listens on 127.0.0.1:9"
    from hixl import datadist

    assert datadist.LLMException.__module__ == datadist.LLMStatusCode.__module__ == "hixl.datadist"
