"""Tools and environments for agentic RL: what a model may call, and what answers it.

- :mod:`asyncrl.tools.calls`: tool calls as the policy writes them, and the parsers that
  read them out of generated text (Hermes-style ``<tool_call>{json}</tool_call>`` by
  default), with the system text that shows a model its tools when its chat template
  cannot.
"""
