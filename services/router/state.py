"""What the router's HTTP and gRPC front ends share."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.telemetry.metrics import RouterMetrics
from pdserve.services.router.backends import BackendPool
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.errors import model_not_found
from pdserve.services.router.openai_format import TokenText


@dataclass(frozen=True)
class RouterState:
    config: RouterConfig
    tokenizer: object  # pdserve.common.tokenizer.Tokenizer (or a test stand-in)
    pool: BackendPool
    metrics: RouterMetrics

    @property
    def text_of(self) -> TokenText:
        return TokenText(self.tokenizer)

    def check_model(self, model) -> None:
        """Empty means the served model; anything else must name it."""
        if model and model not in (self.config.model_name, self.config.model):
            raise model_not_found(model)
