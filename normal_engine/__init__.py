"""The NORMAL role: whole requests (prefill and decode) in one engine."""
