"""The tests' name for the gateway harness (it lives in the package so scripts can use it)."""

from tools.harness import ADMIN_KEY, GatewayProcess, free_port, wait_gone

__all__ = ["ADMIN_KEY", "GatewayProcess", "free_port", "wait_gone"]
