"""What the router's HTTP and gRPC front ends share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pdserve.common.telemetry.metrics import RouterMetrics
from pdserve.services.router.backends import BackendPool
from pdserve.common.sampling_params import SamplingParams
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.engine_stream import EngineStream
from pdserve.services.router.errors import model_not_found
from pdserve.services.router.openai_format import TokenText


@dataclass(frozen=True)
class RouterState:
    config: RouterConfig
    tokenizer: object  # pdserve.common.tokenizer.Tokenizer (or a test stand-in)
    pool: BackendPool  # the instances that decode (unified ones when colocated)
    metrics: RouterMetrics
    disagg: object = None  # a DisaggRouter in disaggregated mode

    async def open_stream(self, request_id: str, prompt: list[int], params: SamplingParams,
                          cache_salt: Optional[str]):
        """One engine request's stream of Deltas: straight to a unified instance, or
        prefill + decode when disaggregated."""
        if self.disagg is not None:
            return await self.disagg.open(request_id, prompt, params, cache_salt)
        return await EngineStream.open(self.pool, request_id, prompt, params, cache_salt)

    @property
    def text_of(self) -> TokenText:
        return TokenText(self.tokenizer)

    def check_model(self, model) -> None:
        """Empty means the served model; anything else must name it."""
        if model and model not in (self.config.model_name, self.config.model):
            raise model_not_found(model)
