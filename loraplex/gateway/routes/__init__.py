"""The route modules of the gateway, one per concern; none imports another."""
