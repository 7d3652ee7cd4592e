"""Code the gRPC services share: the asyncio wrapper around EngineCore, conversions, periodic tasks."""
