"""The engine host: an EngineCore driven beside an asyncio gRPC server (engine processes only; imports torch)."""
