"""Code that runs inside vLLM's processes, where asyncrl is not installed: this folder is
put on the vLLM server's ``PYTHONPATH`` alone (see :mod:`asyncrl.engines.vllm`)."""
