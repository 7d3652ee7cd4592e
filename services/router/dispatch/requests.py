"""One engine request as the router dispatches it (one choice of a Job), and the messages
and block keys derived from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pdserve.common.kv.block_hash import chain_seed, hash_blocks
from pdserve.common.rpc import engine_pb2 as pb
from pdserve.common.sampling_params import SamplingParams
from pdserve.services.common.convert import params_to_proto


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt: list
    params: SamplingParams
    cache_salt: Optional[str] = None
    affinity: Optional[str] = None  # session key for sticky routing

    @property
    def params_proto(self) -> pb.SamplingParams:
        return params_to_proto(self.params)


def decode_request(r: EngineRequest, first_token_id: Optional[int] = None,
                   block_keys: tuple = ()) -> pb.DecodeRequest:
    """`first_token_id`: continue after a token a prefill instance sampled; `block_keys`:
    prompt blocks the KV store holds, for the instance to load."""
    return pb.DecodeRequest(request_id=r.request_id, prompt_token_ids=r.prompt,
                            params=r.params_proto, cache_salt=r.cache_salt,
                            first_token_id=first_token_id, block_keys=block_keys)


def block_keys(pool, prompt: list, salt: Optional[str]):
    """(the prompt's full-block keys, block size) as the engines compute them; (None, 0)
    while the instances' KV geometry is unknown (then nothing can be matched)."""
    geometry = pool.kv_geometry()
    if geometry is None:
        return None, 0
    fingerprint, block_size = geometry
    return hash_blocks(chain_seed(fingerprint, block_size, salt), prompt, block_size), \
        block_size
