"""One router per resource; ``server.app`` includes them all."""
