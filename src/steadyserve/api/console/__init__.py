"""The web console: a live dashboard and a playground, served beside the API by the same HTTP server.

Mounted on the HTTP app by the server (api/server.py), so the API's own package never imports it.
"""

from .routes import mount_console

__all__ = ["mount_console"]
