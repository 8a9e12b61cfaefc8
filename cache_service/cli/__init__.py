"""`kvcache`: serve, demo, bench, info (see `cache_service.cli.main`)."""

from cache_service.cli.main import build_parser, main, service_config_from_args

__all__ = ["build_parser", "main", "service_config_from_args"]
