"""The serving layer: PRR inside SGLang's server, and the harness that runs such a server.

The only part of the package that imports SGLang; it imports nothing of it on its own
(``import sglang_prr.serving`` is free), each module does where it needs to.
"""
