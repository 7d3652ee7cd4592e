"""bench/llama_cpp_peer.py is an optional peer: without llama-cpp-python it says how to get it."""

from __future__ import annotations

import sys

import pytest

from pdserve.bench import llama_cpp_peer


def test_missing_package_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as if not installed
    monkeypatch.setattr(sys, "argv", ["peer", "--gguf", str(tmp_path / "m.gguf")])
    with pytest.raises(SystemExit, match="needs llama-cpp-python.*separate venv"):
        llama_cpp_peer.main()


def test_lengths_are_bounded(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", ["peer", "--gguf", str(tmp_path / "m.gguf"),
                                      "--input-len", "0"])
    with pytest.raises(SystemExit, match="--input-len must be in"):
        llama_cpp_peer.main()


def test_quantizer_without_the_package_is_a_clear_error(monkeypatch, tmp_path):
    from pdserve.bench import llama_cpp_quantize
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(SystemExit, match="needs llama-cpp-python.*separate venv"):
        llama_cpp_quantize.main(["--gguf", str(tmp_path / "f32.gguf"), "--mixes", "Q4_K_M"])


def test_quantizer_offers_only_the_checked_mixes(tmp_path):
    from pdserve.bench import llama_cpp_quantize
    with pytest.raises(SystemExit):  # argparse refuses a mix outside MIXES
        llama_cpp_quantize.main(["--gguf", str(tmp_path / "f32.gguf"), "--mixes", "IQ2_XXS"])
