"""The connector's per-rank mode as a setting (ConnectorConfig.per_rank; docs/parallelism.md,
"Per-rank transfers"): off by default, its default kept in the config dataclasses alone (the
CLI flag passes a value only when given), refused with layer segments, and a connector
factory in the mode refuses an engine without per-rank transfers. The mode itself:
tests/integration/test_rank_kv_disagg.py."""

from types import SimpleNamespace

import pytest

from pdserve.cli import build_parser
from pdserve.connector.codec import BlockCodec
from pdserve.connector.rank_connector import RankKVConnector
from pdserve.connector.store import InMemoryBlockStore
from pdserve.connector.store_connector import ConnectorConfig
from pdserve.services.cli_serve import engine_service_config
from pdserve.services.engine_host.kv_connector_factory import KVStoreSettings, connector_factory


def _config(*flags):
    args = build_parser().parse_args(["serve", "prefill", "--kv-store", "127.0.0.1:1", *flags])
    return engine_service_config(args).kv_settings().connector_config()


def test_per_rank_is_off_unless_asked_and_the_flag_reaches_the_connector_config():
    assert ConnectorConfig().per_rank is False
    assert _config().per_rank is False
    assert _config("--kv-per-rank").per_rank is True
    assert _config("--no-kv-per-rank").per_rank is False


def test_per_rank_is_a_bool_and_excludes_layer_segments():
    with pytest.raises(ValueError):
        ConnectorConfig(per_rank=1)
    with pytest.raises(ValueError):
        ConnectorConfig(per_rank=True, layer_segments=2)
    with pytest.raises(ValueError):
        KVStoreSettings(master_addr="127.0.0.1:1", role="both", per_rank=True,
                        layer_segments=2)


def test_the_rank_connector_is_only_the_per_rank_mode():
    codec = BlockCodec("ab" * 32, 2, 16, 2, 8)
    with pytest.raises(ValueError, match="per_rank"):
        RankKVConnector(InMemoryBlockStore(), codec, ConnectorConfig(), link=None)


def test_a_per_rank_connector_factory_refuses_an_engine_without_per_rank_transfers():
    build = connector_factory(KVStoreSettings(master_addr="127.0.0.1:1", role="both",
                                              per_rank=True))
    with pytest.raises(ValueError, match="rank_kv"):
        build(SimpleNamespace(rank_kv=None))
