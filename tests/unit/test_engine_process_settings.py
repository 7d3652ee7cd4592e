"""The engine process's settings: the GIL switch interval that keeps the engine thread from
waiting 5 ms on the event loop between two torch ops (docs/served-performance.md)."""

import sys

import pytest
import torch

from pdserve.services.engine_host.engine_server import apply_process_settings
from pdserve.services.engine_host.engine_service_config import EngineServiceConfig


def test_process_settings_set_the_switch_interval_and_threads():
    before, threads = sys.getswitchinterval(), torch.get_num_threads()
    try:
        apply_process_settings(EngineServiceConfig(model="tiny", gil_switch_interval_ms=0.25,
                                                   num_threads=1))
        assert sys.getswitchinterval() == pytest.approx(0.00025)
        assert torch.get_num_threads() == 1
    finally:
        sys.setswitchinterval(before)
        torch.set_num_threads(threads)


def test_default_switch_interval_is_below_pythons():
    assert EngineServiceConfig().gil_switch_interval_ms < 5.0


@pytest.mark.parametrize("ms", [0.0, -1.0, 1000.0])
def test_switch_interval_out_of_range_is_refused(ms):
    with pytest.raises(ValueError, match="gil_switch_interval_ms"):
        EngineServiceConfig(gil_switch_interval_ms=ms)
