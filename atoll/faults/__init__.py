"""Fault injection: `atoll chaos` and WAN emulation."""
