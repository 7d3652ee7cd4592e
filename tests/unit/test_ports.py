from pdserve.services.ports import _ephemeral_low, free_port


def test_free_ports_stay_out_of_the_ephemeral_range():
    low = _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(10000 <= p < low for p in ports) and len(ports) > 1
