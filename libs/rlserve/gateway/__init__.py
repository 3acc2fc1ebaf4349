"""The public gRPC endpoint: authentication, roles, and forwarding to the services."""
