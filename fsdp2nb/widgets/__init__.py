"""The dashboard: renders snapshot dataclasses, sends requests through an `Actions` object.

Imported only when a dashboard is shown, so `%load_ext fsdp2nb` stays light.
"""
