"""The connector's settings and its ``kv_transfer_params``: parsing, defaults, refusals (no engine)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

# Not just "vllm": where vLLM is missing, this folder itself would import under that name.
pytest.importorskip("vllm.distributed.kv_transfer")

import hixl.vllm  # noqa: E402
from hixl.vllm import ConnectorConfig, LoadMode, Mode  # noqa: E402
from hixl.vllm._params import CPU_LAYOUT, Endpoint, KvSpec, RemotePrefill  # noqa: E402


def test_public_surface() -> None:
    assert sorted(hixl.vllm.__all__) == ["ConnectorConfig", "HixlConnector", "LoadMode", "Mode"]
    assert hixl.vllm.HixlConnector.__name__ == "HixlConnector"  # the name vLLM looks up in the module


def test_defaults_need_no_settings() -> None:
    a, b = ConnectorConfig.from_extra({}), ConnectorConfig.from_extra(None)
    assert (a.host, a.port, a.load_mode, a.transport, a.whole_below_bytes) == ("127.0.0.1", 0, LoadMode.LAYERWISE, "auto", 32 << 20)
    assert (a.mode, a.push_timeout) == (Mode.PULL, 30.0)  # push stays opt-in until it is measured better
    assert a.cluster_id > 0 and a.cluster_id != b.cluster_id  # random: two instances never share one


def test_settings_are_parsed_and_checked() -> None:
    config = ConnectorConfig.from_extra({"load_mode": "sync", "port": "5000", "lease_s": 2, "release_timeout": 3, "cluster_id": 9})
    assert (config.load_mode, config.port, config.lease_s, config.release_timeout, config.cluster_id) == (LoadMode.SYNC, 5000, 2.0, 3.0, 9)
    bad_ones = (
        {"load_mod": "sync"}, {"load_mode": "eager"}, {"port": 70000}, {"transfer_timeout": 0}, {"port": "x"},
        {"lease_s": 0}, {"lease_s": "nan"}, {"lease_s": 10, "release_timeout": 5}, {"release_timeout": 1e9}, {"whole_below_bytes": -1},
        {"mode": "both"}, {"push_timeout": 0}, {"push_timeout": "nan"},
    )
    for bad in bad_ones:
        with pytest.raises(ValueError):
            ConnectorConfig.from_extra(bad)


KV = KvSpec("tiny", "float32", 4, 2, 64, 32, CPU_LAYOUT, 2)


def test_transfer_params_are_plain_json_and_round_trip() -> None:
    ranks = (Endpoint("127.0.0.1:4242", 17, (0, 1)), Endpoint("127.0.0.1:4243", 18, (1, 2)))
    remote = RemotePrefill(ranks, KV, 3, [5, 9, 2], 70, "req-1", 30.0, 300.0)
    params = json.loads(json.dumps(remote.to_params()))
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_ranks"][1] == {"engine": "127.0.0.1:4243", "cluster_id": 18, "heads": [1, 2]}
    assert RemotePrefill.from_params(params) == remote
    del params["remote_kv"]  # no spec to check against: not a whole remote prefill
    assert RemotePrefill.from_params(params) is None


def test_kv_specs_name_every_difference_but_tp() -> None:
    assert KV.mismatches(replace(KV, tp_size=1)) == []
    assert KV.mismatches(replace(KV, block_size=64, dtype="float16")) == [
        "dtype: prefill 'float32', decode 'float16'",
        "block_size: prefill 32, decode 64",
    ]


@pytest.mark.parametrize(
    "lease", [{"remote_lease_s": 0}, {"remote_lease_s": "nan"}, {"remote_lease_s": 400.0}, {"remote_hold_cap_s": 1e9}]
)
def test_params_with_unreasonable_lease_figures_load_nothing(lease: dict) -> None:
    params = RemotePrefill((Endpoint("127.0.0.1:4242", 17, (0, 2)),), KV, 3, [5], 70, "req-1", 30.0, 300.0).to_params()
    assert RemotePrefill.from_params({**params, **lease}) is None


@pytest.mark.parametrize(
    "params",
    [None, {}, {"do_remote_decode": True}, {"do_remote_prefill": True}, {"do_remote_prefill": True, "remote_engine": "x"}],
)
def test_params_without_a_whole_remote_prefill_load_nothing(params: dict | None) -> None:
    assert RemotePrefill.from_params(params) is None
