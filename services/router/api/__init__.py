"""The router's edges: the OpenAI HTTP API, the gRPC Router API, and what a request says about itself."""
