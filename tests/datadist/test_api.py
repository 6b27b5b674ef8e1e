"""The DataDist surface in one process: names, value types, life cycle, registration checks.

Nothing here moves data between processes; those tests are in test_pull,
test_push, test_errors and test_links.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import hixl
import hixl.datadist
from hixl.datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)

from .helpers import allocate

DESC = CacheDesc(4, (8, 4, 16), DataType.DT_FLOAT16)


@pytest.fixture
def dd():
    with LLMDataDist(LLMRole.PROMPT, 1) as instance:
        instance.init(LLMConfig(listen_ip_info="127.0.0.1:0"))
        yield instance


def test_exported_names():
    assert hixl.datadist.__all__ == [
        "BlocksCacheKey",
        "Cache",
        "CacheDesc",
        "CacheKey",
        "CacheKeyByIdAndIndex",
        "CacheManager",
        "CacheTask",
        "ClusterEvent",
        "ClusterEventKind",
        "DataType",
        "LLMClusterInfo",
        "LLMConfig",
        "LLMDataDist",
        "LLMException",
        "LLMLinkError",
        "LLMRole",
        "LLMStatusCode",
        "LLMTimeout",
        "LayerSynchronizer",
        "Placement",
        "TransferConfig",
        "TransferDone",
    ]
    for name in hixl.datadist.__all__:
        assert getattr(hixl.datadist, name).__doc__, name


def test_llm_exception():
    exc = LLMException("no such cache", LLMStatusCode.KV_CACHE_NOT_EXIST)
    assert isinstance(exc, hixl.HixlError)
    assert str(exc) == "KV_CACHE_NOT_EXIST: no such cache"
    assert "status_code=KV_CACHE_NOT_EXIST" in repr(exc)
    # It crosses process boundaries (worker pools pickle exceptions) intact.
    again = pickle.loads(pickle.dumps(exc))
    assert type(again) is LLMException
    assert again.status_code is LLMStatusCode.KV_CACHE_NOT_EXIST and str(again) == str(exc)


@pytest.mark.parametrize(
    ("code", "status", "builtin"),
    [
        (LLMStatusCode.TIMEOUT, hixl.Status.TIMEOUT, TimeoutError),
        (LLMStatusCode.WAIT_PROCESS_TIMEOUT, hixl.Status.TIMEOUT, TimeoutError),
        (LLMStatusCode.NOT_YET_LINK, hixl.Status.NOT_CONNECTED, ConnectionError),
        (LLMStatusCode.LINK_FAILED, hixl.Status.NOT_CONNECTED, ConnectionError),
        (LLMStatusCode.PARAM_INVALID, hixl.Status.PARAM_INVALID, None),
        (LLMStatusCode.KV_CACHE_NOT_EXIST, hixl.Status.PARAM_INVALID, None),
        (LLMStatusCode.RESOURCE_EXHAUSTED, hixl.Status.RESOURCE_EXHAUSTED, None),
        (LLMStatusCode.ALREADY_LINK, hixl.Status.ALREADY_CONNECTED, None),
        (LLMStatusCode.CLUSTER_ID_CONFLICT, hixl.Status.ALREADY_CONNECTED, None),
        (LLMStatusCode.FAILED, hixl.Status.FAILED, None),
    ],
)
def test_llm_exception_stays_in_the_error_tree(code, status, builtin):
    exc = LLMException("what happened", code)
    assert exc.status is status and exc.status_code is code
    assert str(exc) == f"{code.name}: what happened" and exc.args == (str(exc),)
    if builtin is not None:
        assert isinstance(exc, builtin)
    else:
        assert not isinstance(exc, (TimeoutError, ConnectionError))
    again = pickle.loads(pickle.dumps(exc))
    assert type(again) is type(exc) and again.status is status and str(again) == str(exc)


def test_every_status_code_has_a_status():
    for code in LLMStatusCode:
        assert isinstance(LLMException("x", code).status, hixl.Status), code


# -- value types -------------------------------------------------------------------------------
def test_cache_desc_checks_its_fields():
    assert DESC.tensor_bytes == 8 * 4 * 16 * 2 and DESC.row_bytes == 4 * 16 * 2
    assert CacheDesc(1, [2, 3], DataType.DT_INT8).shape == (2, 3)
    for bad in (0, -1, "2", 2.0):
        with pytest.raises(ValueError):
            CacheDesc(bad, (2,), DataType.DT_FLOAT)
    for shape in ((), (0, 4), (4, -1)):
        with pytest.raises(ValueError):
            CacheDesc(2, shape, DataType.DT_FLOAT)
    with pytest.raises(TypeError):
        CacheDesc(2, (2,), "float32")
    with pytest.raises(TypeError):
        CacheDesc(2, (2,), DataType.DT_FLOAT, "HOST")


def test_data_type_of_arrays_and_tensors():
    for dtype, member in [(np.float16, DataType.DT_FLOAT16), (np.float32, DataType.DT_FLOAT), (np.int64, DataType.DT_INT64), (np.uint8, DataType.DT_UINT8)]:
        assert DataType.of(np.zeros(1, dtype)) is member
        assert member.itemsize == np.dtype(dtype).itemsize
    assert DataType.DT_BF16.itemsize == 2
    with pytest.raises(TypeError):
        DataType.of(np.zeros(1, np.complex64))
    with pytest.raises(TypeError):
        DataType.of([1.0])
    torch = pytest.importorskip("torch")
    assert DataType.of(torch.zeros(1, dtype=torch.bfloat16)) is DataType.DT_BF16
    assert DataType.of(torch.zeros(1, dtype=torch.float16)) is DataType.DT_FLOAT16


# -- life cycle --------------------------------------------------------------------------------
def test_constructor_checks():
    with pytest.raises(TypeError):
        LLMDataDist("PROMPT", 1)
    for bad in (-1, "1", 1.0):
        with pytest.raises(ValueError):
            LLMDataDist(LLMRole.PROMPT, bad)


def test_not_initialised():
    dd = LLMDataDist(LLMRole.DECODER, 3)
    for attribute in ("engine", "cache_manager", "local_ip_info"):
        with pytest.raises(LLMException) as info:
            getattr(dd, attribute)
        assert info.value.status_code is LLMStatusCode.NOT_INITIALIZED
    dd.finalize()  # harmless before init
    assert "uninitialised" in repr(dd)


@pytest.mark.parametrize(
    "config",
    [
        LLMConfig(transport="carrier-pigeon"),
        LLMConfig(engine_options={"no_such_option": 1}),
        LLMConfig(listen_ip_info="localhost:0"),  # a name, not an IP address
    ],
    ids=["transport", "engine-option", "listen-address"],
)
def test_bad_config_is_param_invalid(config):
    dd = LLMDataDist(LLMRole.DECODER, 3)
    with pytest.raises(LLMException) as info:
        dd.init(config)
    assert info.value.status_code is LLMStatusCode.PARAM_INVALID
    # A failed init leaves the instance uninitialised, and a good one still works.
    with pytest.raises(LLMException):
        _ = dd.engine
    dd.init(LLMConfig())
    dd.finalize()


def test_init(dd):
    with pytest.raises(TypeError):
        LLMDataDist(LLMRole.MIX, 2).init({"listen_ip_info": "127.0.0.1:0"})
    with pytest.raises(LLMException) as info:
        dd.init(LLMConfig())
    assert info.value.status_code is LLMStatusCode.PARAM_INVALID
    host, port = dd.local_ip_info.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    assert f"cluster=1 {dd.local_ip_info}" in repr(dd)
    with LLMDataDist(LLMRole.DECODER, 2) as client:
        client.init(LLMConfig())
        assert client.local_ip_info == "127.0.0.1"  # client-only: no port
        assert client.cache_manager.completed_requests() == [] and client.get_notifies() == []


def test_switch_role(dd):
    dd.switch_role(LLMRole.DECODER)
    assert dd.role is LLMRole.DECODER
    with pytest.raises(TypeError):
        dd.switch_role("MIX")


# -- registration ------------------------------------------------------------------------------
def _regions(dd: LLMDataDist) -> set[tuple[int, int]]:
    """The regions registered for caches: all but the ones a fresh instance starts with
    (its catalog generation word, and the words it reads peers' generations into)."""
    return {(m.addr, m.len) for m in dd.engine.local_mems()} - dd._bookkeeping_regions


@pytest.fixture(autouse=True)
def _note_bookkeeping(request):
    if "dd" in request.fixturenames:
        instance = request.getfixturevalue("dd")
        instance._bookkeeping_regions = {(m.addr, m.len) for m in instance.engine.local_mems()}


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_views_of_one_storage_are_registered_once(dd, lib):
    if lib == "torch":
        pytest.importorskip("torch")
    tensors, storage = allocate(DESC, "shared", lib)
    cache = dd.cache_manager.register_blocks_cache(DESC, tensors, BlocksCacheKey(1))
    addr = storage.data_ptr() if lib == "torch" else storage.ctypes.data
    assert _regions(dd) == {(addr, DESC.num_tensors * DESC.tensor_bytes)}
    assert cache.tensor_addrs == [addr + i * DESC.tensor_bytes for i in range(DESC.num_tensors)]
    dd.cache_manager.unregister_cache(cache.cache_id)
    assert _regions(dd) == set()


def test_separate_tensors_are_registered_each(dd):
    tensors, _ = allocate(DESC, "separate")
    cache = dd.cache_manager.register_blocks_cache(DESC, tensors)
    assert _regions(dd) == {(t.ctypes.data, DESC.tensor_bytes) for t in tensors}
    assert dd.cache_manager.caches() == [cache]
    dd.cache_manager.unregister_cache(cache.cache_id)
    assert _regions(dd) == set() and dd.cache_manager.caches() == []


def test_memory_shared_by_two_caches_stays_registered_for_the_other(dd):
    tensors, storage = allocate(DESC)
    first = dd.cache_manager.register_blocks_cache(DESC, tensors, BlocksCacheKey(1, 1))
    second = dd.cache_manager.register_blocks_cache(DESC, tensors, BlocksCacheKey(1, 2))
    span = {(storage.ctypes.data, storage.nbytes)}
    dd.cache_manager.unregister_cache(first.cache_id)
    assert _regions(dd) == span
    dd.cache_manager.unregister_cache(second.cache_id)
    assert _regions(dd) == set()


def test_raw_addresses_can_be_registered(dd):
    tensors, storage = allocate(DESC)
    addrs = [t.ctypes.data for t in tensors]
    cache = dd.cache_manager.register_blocks_cache(DESC, addrs)
    assert cache.tensor_addrs == addrs
    assert _regions(dd) == {(storage.ctypes.data, storage.nbytes)}
    with pytest.raises(ValueError):
        dd.cache_manager.register_blocks_cache(DESC, [0, *addrs[1:]])


def test_registration_checks(dd):
    manager = dd.cache_manager
    tensors, _ = allocate(DESC)
    with pytest.raises(ValueError, match="expected 4 tensors"):
        manager.register_blocks_cache(DESC, tensors[:3])
    with pytest.raises(ValueError, match="expected 4 tensors"):
        manager.register_blocks_cache(DESC, "abcd")
    with pytest.raises(ValueError, match="shape"):
        manager.register_blocks_cache(DESC, [t[:4] for t in tensors])
    with pytest.raises(TypeError, match="is DT_FLOAT, the CacheDesc says DT_FLOAT16"):
        manager.register_blocks_cache(DESC, [np.zeros(DESC.shape, np.float32) for _ in tensors])
    with pytest.raises(ValueError, match="contiguous"):
        manager.register_blocks_cache(CacheDesc(4, (8, 2, 16), DataType.DT_FLOAT16), [t[:, ::2] for t in tensors])
    with pytest.raises(TypeError):
        manager.register_blocks_cache((4, (8, 4, 16), DataType.DT_FLOAT16), tensors)
    with pytest.raises(LLMException) as info:
        manager.register_blocks_cache(CacheDesc(4, DESC.shape, DataType.DT_FLOAT16, Placement.DEVICE), tensors)
    assert info.value.status_code is LLMStatusCode.PARAM_INVALID
    with pytest.raises(TypeError):
        manager.register_blocks_cache(DESC, tensors, CacheKey(1, 1))
    with pytest.raises(TypeError):
        manager.register_cache(DESC, tensors, [BlocksCacheKey(1)])
    with pytest.raises(ValueError, match="9 cache keys"):
        manager.register_cache(DESC, tensors, [CacheKey(1, i) for i in range(9)])
    assert _regions(dd) == set() and manager.caches() == []  # nothing was half-registered
    manager.register_blocks_cache(DESC, tensors, BlocksCacheKey(1, 5))
    other, _ = allocate(DESC)
    with pytest.raises(ValueError, match="already registered"):
        manager.register_blocks_cache(DESC, other, BlocksCacheKey(1, 5))
    manager.register_cache(DESC, other, [CacheKey(1, 1)])
    with pytest.raises(ValueError, match="already registered"):
        manager.register_cache(DESC, allocate(DESC)[0], [CacheKey(1, 1)])
