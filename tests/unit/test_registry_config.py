"""Registry settings come from the engine service config (flags), never the environment."""

import pytest

from pdserve.services.registry.config import Registration, RegistryConfig


def test_registration_without_url_means_no_registry():
    assert Registration().registry_config() is None


def test_registration_flags_become_the_registry_config(monkeypatch):
    monkeypatch.setenv("PDSERVE_REGISTRY_URL", "redis://ignored:1/0")  # no longer read
    from pdserve.services.cli_serve import add_subcommands
    from pdserve.services.common.arg_files import cli_parser

    parser = cli_parser()
    add_subcommands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "decode", "--registry", "redis://r:6379/1",
                              "--advertise-address", "10.0.0.7:50061",
                              "--registry-interval", "0.5", "--registry-ttl", "2"])
    reg = Registration(args.registry, args.advertise_address, args.registry_interval,
                       args.registry_ttl)
    assert reg.registry_config() == RegistryConfig("redis://r:6379/1", ttl_s=2.0,
                                                   interval_s=0.5)
    plain = parser.parse_args(["serve", "decode"])
    assert Registration(plain.registry, plain.advertise_address, plain.registry_interval,
                        plain.registry_ttl) == Registration()


@pytest.mark.parametrize("kwargs", [dict(url="http://r:1/0"), dict(advertise_address="h"),
                                    dict(advertise_address="h:x"),
                                    dict(url="redis://r:1/0", interval_s=2.0, ttl_s=1.0)])
def test_bad_registration_is_refused(kwargs):
    with pytest.raises(ValueError):
        Registration(**kwargs)


def test_a_password_in_the_url_is_not_echoed_in_errors():
    with pytest.raises(ValueError) as info:
        RegistryConfig("http://:s3cret@r:1/0")
    assert "s3cret" not in str(info.value)
